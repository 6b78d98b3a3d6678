"""SIGTERM and SIGINT during a run: a flag the loop polls (every process stops after the same
step, which is then saved), and work that exits at once when signalled (a restore)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

import jax
import numpy as np

from maxtrain.checkpoint import PREEMPTED_EXIT_CODE

log = logging.getLogger("maxtrain")


class PreemptionFlag:
    """SIGTERM/SIGINT set a flag the loop polls; a second signal while stopping changes nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._old = {}
        self._at_once: str | None = None  # inside exits_at_once(): what is being done

    @contextlib.contextmanager
    def exits_at_once(self, what: str):
        """Work that may block in a read and leaves nothing to save (a restore): a signal exits
        with PREEMPTED_EXIT_CODE there and then (the checkpoints on disk are untouched)."""
        self._at_once = what
        try:
            if self.signum is not None:
                self._exit_now(self.signum)
            yield
        finally:
            self._at_once = None

    def _exit_now(self, signum) -> None:
        log.warning("received %s during %s: nothing to save, exiting %d (restart to resume)",
                    signal.Signals(signum).name, self._at_once, PREEMPTED_EXIT_CODE)
        logging.shutdown()
        os._exit(PREEMPTED_EXIT_CODE)

    def _handle(self, signum, frame):
        if self._at_once is not None:
            self._exit_now(signum)
        if self.signum is None:
            log.warning("received %s: saving a checkpoint and stopping", signal.Signals(signum).name)
        else:
            log.warning("received %s again: still saving, please wait", signal.Signals(signum).name)
        self.signum = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)

    @property
    def set(self) -> bool:
        return self.signum is not None

    def agreed(self) -> bool:
        """Whether any process got a signal: all processes stop after the same step."""
        if jax.process_count() == 1:
            return self.set
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(self.set))))
