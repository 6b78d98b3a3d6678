"""Slow processes in a running job: host step work compared across processes (reported), and a
matmul probe of every device (a process that stays slow is evicted: exit 78, like preflight)."""

from __future__ import annotations

import logging

import numpy as np

from maxtrain.config import ReliabilityConfig
from maxtrain.reliability import preflight

log = logging.getLogger("maxtrain")

PROBE = "matmul_tflops"
COLUMNS = (PROBE, "host_s", "data_wait_s")  # the gathered table's columns, per process


class StragglerWatch:
    """Every `straggler_every` steps, the processes' figures are all-gathered (a few floats) and
    judged the same way on every process:

    - host step work: the seconds per step each process spends in work the devices do not wait for
      in a healthy run (data loading, batch assembly, anything injected). With synchronous
      collectives every process's wall step time equals the slowest one's, so wall time cannot tell
      who is slow, but this part can. A process above `straggler_factor` x the others' median (and
      10 ms above it) is logged by name; a slow data loader is reported, never evicted.
    - device compute: a process's share of a synchronous step cannot be timed either (it waits in
      the collectives for the slowest), so each process times the preflight's matmul probe on its
      devices (in turns where processes share a CPU host). A process below
      (1 - `preflight_compute_slack`) x the others' median of its device kind, or below the device
      table's `preflight_peak_fraction`, in `straggler_evict_after` comparisons in a row is
      condemned: `condemned` holds the report, the run saves its last step and exits 78.
    """

    def __init__(self, cfg: ReliabilityConfig, drill_factor: float = 1.0, drill_process: int = 0):
        self.every, self.factor = cfg.straggler_every, cfg.straggler_factor
        self.evict_after = cfg.straggler_evict_after
        self.thresholds = preflight.Thresholds(compute_slack=cfg.preflight_compute_slack,
                                               peak_fraction=cfg.preflight_peak_fraction)
        self.drill_factor, self.drill_process = drill_factor, drill_process
        self.busy = self.wait = 0.0
        self.steps = 0
        self.last: list[int] = []  # slow in host work at the latest comparison
        self.slow_compute: list[int] = []  # slow in the matmul probe at the latest comparison
        self.streak: dict[int, int] = {}  # process -> comparisons in a row with a slow probe
        self.condemned: preflight.Report | None = None
        self.hosts: list[str] = []
        self.kinds: list[str] = []
        if self.every:
            import jax

            self.hosts, self.kinds = preflight.gather_strings(preflight.node_name(), jax.local_devices()[0].device_kind)

    def add(self, busy_s: float, wait_s: float) -> None:
        self.busy += busy_s
        self.wait += wait_s
        self.steps += 1

    def check(self, step: int) -> list[int] | None:
        """At multiples of `straggler_every`: the processes slow in host work (also logged), else
        None. Sets `condemned` when a process's probe has been slow long enough."""
        if not self.every or step % self.every or not self.steps:
            return None
        probe = self._probe() if len(self.hosts) > 1 else float("nan")
        mine = [probe, self.busy / self.steps, self.wait / self.steps]
        self.busy = self.wait = 0.0
        self.steps = 0
        table = preflight.gather_floats(mine)
        self.last = slow_processes(table[:, 1], self.factor)
        for p in self.last:
            log.warning("straggler: process %d (%s) spends %.3fs per step on host work (data wait %.3fs) against a "
                        "median of %.3fs for the others, at step %d", p, self._host(p), table[p, 1], table[p, 2],
                        preflight.others_median(table[:, 1], p), step)
        self._judge_compute(table, step)
        return self.last

    def _probe(self) -> float:
        """This process's slowest local device's matmul TFLOP/s (in turns with processes on the
        same CPU host: they share its cores)."""
        import jax

        from maxtrain.reliability.drills import first_attempt

        cpu = jax.devices()[0].platform == "cpu"
        sizes = preflight.SIZES[("cpu" if cpu else "gpu", "quick")]
        me = jax.process_index()
        stretch = self.drill_factor if self.drill_process == me and first_attempt() else 1.0
        shared = cpu and len(set(self.hosts)) < len(self.hosts)  # job-wide: every process makes the same calls
        got = preflight.in_turns(shared, lambda: {PROBE: min(preflight.matmul_tflops(d, sizes, stretch)
                                                            for d in preflight.timed_devices())})
        return got[PROBE]

    def _judge_compute(self, table: np.ndarray, step: int) -> None:
        if len(self.hosts) < 2:
            return
        found = preflight.judge([PROBE], table[:, :1], self.kinds, {}, preflight.table_peaks(self.kinds),
                                self.thresholds)
        self.streak = {p: self.streak.get(p, 0) + 1 for p in found}
        self.slow_compute = sorted(found)
        for p, why in sorted(found.items()):
            log.warning("straggler: process %d (%s) is slow in device compute at step %d: %s (%d comparison(s) in a "
                        "row%s)", p, self._host(p), step, "; ".join(why.values()), self.streak[p],
                        f", evicted at {self.evict_after}" if self.evict_after else "; straggler_evict_after=0: "
                        "reported only")
        evicted = {p: why for p, why in found.items() if self.evict_after and self.streak[p] >= self.evict_after}
        if evicted:
            self.condemned = preflight.Report(
                f"in-run, step {step}", self.hosts, self.kinds, list(COLUMNS), table.tolist(), {},
                {p: [f"{r} in {self.streak[p]} comparisons in a row" for r in why.values()]
                 for p, why in evicted.items()}, checks={p: list(why) for p, why in evicted.items()})

    def _host(self, p: int) -> str:
        return self.hosts[p] if p < len(self.hosts) else "?"


def slow_processes(busy_s, factor: float, floor_s: float = 0.01) -> list[int]:
    """Indices above `factor` x the median of the *other* processes and `floor_s` above it (the
    others, so that with two processes the slow one is compared with the fast one)."""
    busy = np.asarray(busy_s, np.float64)
    if busy.size < 2:
        return []
    ref = np.asarray([np.median(np.delete(busy, i)) for i in range(busy.size)])
    return [int(i) for i in np.flatnonzero((busy > factor * ref) & (busy > ref + floor_s))]
