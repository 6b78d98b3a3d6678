"""The hang watchdog: a host thread that dumps every stack and exits 76 when no step completes in time."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback

from maxtrain import exit_codes
from maxtrain.config import ReliabilityConfig

log = logging.getLogger("maxtrain")

HANG_EXIT_CODE = exit_codes.HANG


class Watchdog:
    """Exits the process with HANG_EXIT_CODE, after dumping every thread's stack, when no step
    completes for `hang_timeout_s` (the first, compiling step gets `first_step_timeout_s`).

    `beat()` is called once per loop iteration; with async dispatch the loop itself blocks when the
    device stops making progress, so a hung collective stops the beats within a step or two."""

    def __init__(self, cfg: ReliabilityConfig, exit_fn=os._exit, stream=None):
        self.cfg, self._exit, self._stream = cfg, exit_fn, stream or sys.stderr
        self._last = time.monotonic()
        self._beats = 0
        self._long = 0  # inside long_work()
        self._phase: tuple[str, float] | None = None  # inside phase(): (what, its own limit)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maxtrain-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        if self.cfg.hang_timeout_s > 0 or self.cfg.restore_timeout_s > 0:
            self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()
        self._beats += 1

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def long_work(self):
        """Work between steps that may take longer than a step (compiling the replay or eval step,
        an evaluation, the final save): judged against `first_step_timeout_s`, as compiling the
        first step is; the step clock restarts when it ends."""
        self._long += 1
        self._last = time.monotonic()
        try:
            yield
        finally:
            self._long -= 1
            self._last = time.monotonic()

    @contextlib.contextmanager
    def phase(self, what: str, limit_s: float):
        """Work before the steps with a limit of its own (a checkpoint restore:
        `restore_timeout_s`; 0: none), reported by name when it passes."""
        self._phase, self._last = (what, limit_s), time.monotonic()
        try:
            yield
        finally:
            self._phase, self._last = None, time.monotonic()

    def _limit(self) -> tuple[float, str]:
        """(seconds, what did not happen in them); 0 seconds: no limit now."""
        if self._phase is not None:
            what, limit = self._phase
            return limit, f"{what} did not finish"
        if self.cfg.hang_timeout_s <= 0:
            return 0.0, ""
        long = self._beats < 2 or self._long > 0
        return (self.cfg.first_step_timeout_s if long else self.cfg.hang_timeout_s), "no step completed"

    def _run(self) -> None:
        limits = [t for t in (self.cfg.hang_timeout_s, self.cfg.restore_timeout_s) if t > 0]
        while not self._stop.wait(min([1.0] + [t / 4 for t in limits])):
            idle = time.monotonic() - self._last
            limit, what = self._limit()
            if limit > 0 and idle > limit:
                log.error("watchdog: %s in %.0fs (limit %.0fs); stacks of every thread follow, then exit %d so "
                          "the launcher restarts from the last checkpoint", what, idle, limit, HANG_EXIT_CODE)
                dump_stacks(self._stream)
                self._exit(HANG_EXIT_CODE)
                return


def dump_stacks(stream) -> None:
    """Every thread's Python stack, named, to `stream` (any text stream, unlike faulthandler)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        stream.write(f"\nThread {names.get(ident, ident)} (most recent call last):\n")
        stream.write("".join(traceback.format_stack(frame)))
    stream.flush()
