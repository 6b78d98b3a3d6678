"""Slow processes: per-process host step work compared across processes."""

from __future__ import annotations

import logging

from maxtrain.config import ReliabilityConfig

log = logging.getLogger("maxtrain")


class StragglerWatch:
    """Names processes whose host-side step work is much slower than the others'.

    Each process adds the seconds of every step it spends in host work that the device does not
    wait for in a healthy run (data loading, batch assembly, anything injected): with synchronous
    collectives every process's wall step time equals the slowest one's, so wall time cannot tell
    who is slow, but this part can. Every `straggler_every` steps the per-process figures are
    all-gathered (a few floats) and any process above `straggler_factor` x the others' median (and
    at least 10 ms above it) is logged by name, with its host and figures."""

    def __init__(self, cfg: ReliabilityConfig):
        self.every, self.factor = cfg.straggler_every, cfg.straggler_factor
        self.busy = self.wait = 0.0
        self.steps = 0
        self.last: list[int] = []
        self.hosts = _all_hostnames() if self.every else []

    def add(self, busy_s: float, wait_s: float) -> None:
        self.busy += busy_s
        self.wait += wait_s
        self.steps += 1

    def check(self, step: int) -> list[int] | None:
        """At multiples of `straggler_every`: the slow process ids (also logged), else None."""
        if not self.every or step % self.every or not self.steps:
            return None
        from jax.experimental import multihost_utils
        import numpy as np
        mine = np.asarray([self.busy / self.steps, self.wait / self.steps], np.float64)
        self.busy = self.wait = 0.0
        self.steps = 0
        table = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
        self.last = slow_processes(table[:, 0], self.factor)
        for p in self.last:
            others = float(np.median(np.delete(table[:, 0], p)))
            log.warning("straggler: process %d (%s) spends %.3fs per step on host work (data wait %.3fs) against a "
                        "median of %.3fs for the others, at step %d", p, self.hosts[p] if p < len(self.hosts) else "?",
                        table[p, 0], table[p, 1], others, step)
        return self.last


def slow_processes(busy_s, factor: float, floor_s: float = 0.01) -> list[int]:
    """Indices above `factor` x the median of the *other* processes and `floor_s` above it (the
    others, so that with two processes the slow one is compared with the fast one)."""
    import numpy as np
    busy = np.asarray(busy_s, np.float64)
    if busy.size < 2:
        return []
    ref = np.asarray([np.median(np.delete(busy, i)) for i in range(busy.size)])
    return [int(i) for i in np.flatnonzero((busy > factor * ref) & (busy > ref + floor_s))]


def _all_hostnames() -> list[str]:
    """Every process's host name (fixed-width bytes through one all-gather)."""
    import socket
    import numpy as np
    from jax.experimental import multihost_utils
    name = socket.gethostname().encode()[:64].ljust(64, b"\0")
    rows = np.asarray(multihost_utils.process_allgather(np.frombuffer(name, np.uint8))).reshape(-1, 64)
    return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in rows]
