"""Preflight: every device, link and disk of the allocation measured before training, and the
sick node named (docs/reliability.md#preflight).

Every process, at the same time, measures:

- each local device's matmul rate (bf16; FP8 too on a GPU when the run trains in FP8), its memory
  bandwidth (an element-wise pass over a large array), and the host-to-device copy rate;
- collective bandwidth over each axis of the run's mesh larger than 1 (all-gather, reduce-scatter,
  all-reduce; all-to-all over `expert`; send/receive between neighbours over `pipeline`);
- a ring of pairwise exchanges between processes (k with k+1, in two or three rounds in which each
  process has one partner), so a slow **link** is told from a slow host: a host whose links to both
  of its ring neighbours are slow is condemned itself; a single slow link condemns its two ends;
- write and read rates of `checkpoint.dir`, `checkpoint.local.dir` (a private subdirectory,
  removed afterwards; a directory another run holds is skipped) and the read rate of the data.

Every figure is a best of `repeats` (noise only ever slows a measurement), gathered to every
process, and judged the same way everywhere: against the median of the *other* processes with the
same device kind (a heterogeneous cluster is not condemned for its slower parts), and, for the
matmul rate, against the device table (`maxtrain.devices`; a CPU has no entry). Collectives over a
mesh axis are synchronous, so everyone waits for the slowest: their figures are reported against
the table, never used to condemn a process; the ring is what names it.

The verdict: `Report.condemned` (rank -> the figures that condemned it). `maxtrain train` exits
`exit_codes.UNHEALTHY` on it after writing `run_dir/preflight.json`; the launchers leave those
hosts out of the next attempt.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import socket
import time
from typing import Callable

import numpy as np

log = logging.getLogger("maxtrain")

MODES = ("auto", "quick", "full", "off")


@dataclasses.dataclass(frozen=True)
class Sizes:
    matmul_n: int  # square matmul side
    matmul_iters: int  # matmuls chained in one timed program
    hbm_bytes: int  # array streamed by the bandwidth pass
    h2d_bytes: int  # host buffer copied to each device
    collective_bytes: int  # per device, per collective
    ring_bytes: int  # per device, each way, per exchange
    storage_bytes: int  # probe file written and read back
    repeats: int  # best of this many timings
    rounds: int = 1  # processes sharing a CPU host measure devices and storage in turns, this many times round


SIZES = {
    ("gpu", "quick"): Sizes(4096, 8, 256 << 20, 64 << 20, 32 << 20, 32 << 20, 16 << 20, 3),
    ("gpu", "full"): Sizes(8192, 16, 1 << 30, 256 << 20, 256 << 20, 256 << 20, 256 << 20, 5),
    ("cpu", "quick"): Sizes(256, 2, 32 << 20, 8 << 20, 1 << 20, 8 << 20, 4 << 20, 5, 2),
    ("cpu", "full"): Sizes(256, 4, 32 << 20, 32 << 20, 2 << 20, 2 << 20, 32 << 20, 5, 5),
}


@dataclasses.dataclass(frozen=True)
class Thresholds:
    compute_slack: float = 0.10  # a device figure this far below the others' median condemns its process
    link_slack: float = 0.40  # a ring link this far below the other links' median is slow
    storage_slack: float = 0.50  # a storage figure this far below the others' median condemns
    peak_fraction: float = 0.30  # a matmul rate below this fraction of the device table's peak condemns


@dataclasses.dataclass(frozen=True)
class Drill:
    """A fault injected into one process's measurements (`drills.preflight_slow`): the named check's
    timed work stretched to `factor` x its time."""
    check: str | None = None  # matmul | collective | link | storage
    factor: float = 1.0
    process: int = 0


DRILL_CHECKS = ("matmul", "collective", "link", "storage")


# ---------------------------------------------------------------- timing


MIN_TIMING_S = 0.005  # a timing repeats the work until it lasts this long (timer and scheduler jitter)


def best_time(fn: Callable[[], object], repeats: int, stretch: float = 1.0, late: bool = False,
              collective: bool = False) -> float:
    """The best of `repeats` wall times of `fn()` (which blocks until its work is done), each timing
    repeating `fn` until it lasts `MIN_TIMING_S`, per call (a `collective` is called exactly once per
    timing: every process must make the same calls). A drill's `stretch` > 1 sleeps
    (stretch - 1) x fn's own time: inside each timing (the work is slow), or before it when `late`
    (this process enters a collective late: its partners wait for it)."""
    fn()  # compile and warm up, untimed
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t0)
    base = float(np.median(warm))
    calls = 1 if collective else max(1, int(np.ceil(MIN_TIMING_S / max(base, 1e-6))))
    best = float("inf")
    for _ in range(repeats):
        if late and stretch > 1:
            time.sleep((stretch - 1) * base * calls)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if not late and stretch > 1:
            time.sleep((stretch - 1) * (time.perf_counter() - t0))
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _block(x):
    import jax

    return jax.block_until_ready(x)


# ---------------------------------------------------------------- per device


def timed_devices() -> list:
    """The local devices whose rates are measured: all of them, or one of a CPU's fake devices
    (they share its cores)."""
    import jax

    local = jax.local_devices()
    return local if local[0].platform != "cpu" else local[:1]


def matmul_tflops(device, sizes: Sizes, stretch: float = 1.0) -> float:
    """bf16 TFLOP/s of `device` on a chain of `sizes.matmul_iters` square matmuls (best of
    `sizes.repeats`)."""
    import jax
    import jax.numpy as jnp

    n, iters = sizes.matmul_n, sizes.matmul_iters
    with jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("probe",))):  # not a run's mesh (the in-run probe)
        a = jax.device_put(np.full((n, n), 0.01, jnp.bfloat16), device)
        f = _matmul_chain(iters)
        return 2 * n ** 3 * iters / best_time(lambda: _block(f(a, a)), sizes.repeats, stretch) / 1e12


def warm_up(sizes: Sizes) -> None:
    """Compiles the device probes (cached per process) without timing anything."""
    import jax
    import jax.numpy as jnp

    d = timed_devices()[0]
    a = jax.device_put(np.full((sizes.matmul_n,) * 2, 0.01, jnp.bfloat16), d)
    _block(_matmul_chain(sizes.matmul_iters)(a, a))
    _block(_stream()(jax.device_put(np.zeros(sizes.hbm_bytes // 4, np.float32), d)))


def memory_gb_s(device, nbytes: int, repeats: int) -> float:
    """`device`'s memory bandwidth: one read and one write of every element of an `nbytes` array,
    in place (the buffer donated: no allocation timed)."""
    import jax

    x = [jax.device_put(np.zeros(nbytes // 4, np.float32), device)]
    g = _stream()

    def once():
        x[0] = g(x[0])
        return _block(x[0])

    return 2 * nbytes / best_time(once, repeats) / 1e9


@functools.lru_cache(maxsize=None)
def _stream():
    """The memory-bandwidth pass, jitted once, its input donated."""
    import jax

    return jax.jit(lambda x: x * 1.0001 + 1.0, donate_argnums=0)


@functools.lru_cache(maxsize=None)
def _matmul_chain(iters: int):
    """`iters` chained matmuls, jitted once per process (the in-run probe reuses the executable)."""
    import jax
    import jax.numpy as jnp

    def chain(a, b):
        for _ in range(iters):
            a = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
        return a

    return jax.jit(chain)


def device_figures(sizes: Sizes, fp8: bool, stretch: float = 1.0) -> dict[str, float]:
    """This process's worst local device: matmul TFLOP/s (bf16, and FP8 when asked), memory GB/s,
    host-to-device GB/s, with the local index of the device each came from."""
    import jax
    import jax.numpy as jnp

    n = sizes.matmul_n
    mm, mm8, hbm, h2d = [], [], [], []
    for d in timed_devices():
        mm.append(matmul_tflops(d, sizes, stretch))
        if fp8:
            a = jax.device_put(np.full((n, n), 0.01, jnp.bfloat16), d)
            a8 = a.astype(jnp.float8_e4m3fn)
            f8 = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
            mm8.append(2 * n ** 3 / best_time(lambda: _block(f8(a8, a8)), sizes.repeats) / 1e12)
        hbm.append(memory_gb_s(d, sizes.hbm_bytes, sizes.repeats))
        if d.platform == "cpu":  # a CPU device's memory is the host's: nothing is copied (NaN: not measured)
            h2d.append(float("nan"))
            continue
        host = np.ones(sizes.h2d_bytes // 4, np.float32)
        h2d.append(sizes.h2d_bytes / best_time(lambda: _block(jax.device_put(host, d)), sizes.repeats) / 1e9)
    out = {"matmul_tflops": min(mm), "matmul_device": float(int(np.argmin(mm))),
           "hbm_gb_s": min(hbm), "hbm_device": float(int(np.argmin(hbm))),
           "h2d_gb_s": float(np.min(h2d)), "h2d_device": float(int(np.argmin(h2d)))}
    if fp8:
        out.update({"fp8_matmul_tflops": min(mm8), "fp8_matmul_device": float(int(np.argmin(mm8)))})
    return out


# ---------------------------------------------------------------- collectives over the mesh


def collective_ops(axis: str, quick: bool) -> list[str]:
    """The collectives measured over a mesh axis (quick: the three together, one program)."""
    if quick:
        return ["collectives"]
    ops = ["all_gather", "reduce_scatter", "all_reduce"]
    if axis == "expert":
        ops.append("all_to_all")
    if axis == "pipeline":
        ops.append("send_recv")
    return ops


def _collective(op: str, axis: str, n: int):
    """Inside shard_map over `axis` (of size n): one collective of a per-device buffer."""
    import jax

    def run(x):
        if op == "all_gather":
            return jax.lax.all_gather(x, axis, tiled=True)[: x.shape[0]]
        if op == "reduce_scatter":
            return jax.lax.psum_scatter(x, axis, tiled=True)
        if op == "all_reduce":
            return jax.lax.psum(x, axis)
        if op == "all_to_all":
            return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
        if op == "send_recv":
            return jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])
        ag = jax.lax.all_gather(x, axis, tiled=True)[: x.shape[0]]  # "collectives": the three at once
        return jax.lax.psum(ag, axis) + jax.lax.psum_scatter(x, axis, tiled=True).sum()
    return run


BUS_FACTOR = {  # bytes over the wire per device, as a multiple of the buffer (NCCL's bus bandwidth)
    "all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0,
    "collectives": lambda n: 4 * (n - 1) / n,
}


def collective_figures(mesh, sizes: Sizes, quick: bool, late: float = 1.0) -> dict[str, float]:
    """Bus GB/s of each collective over each mesh axis larger than 1, as this process timed it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    out = {}
    for axis, n in mesh.shape.items():
        if n < 2:
            continue
        per = max(n, sizes.collective_bytes // 4 // n * n)  # elements per device, divisible by n
        for op in collective_ops(axis, quick):
            fn = jax.jit(jax.shard_map(_collective(op, axis, n), mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                                       check_vma=False))
            x = jax.jit(lambda: jnp.ones(per * n, jnp.float32),
                        out_shardings=NamedSharding(mesh, P(axis)))()
            t = best_time(lambda: _block(fn(x)), sizes.repeats, late, late=True, collective=True)
            out[f"{axis}_{op}_gb_s"] = BUS_FACTOR[op](n) * per * 4 / t / 1e9
    return out


# ---------------------------------------------------------------- the ring of process pairs


def ring_links(n_processes: int) -> list[tuple[int, int]]:
    """Each process with the next, around the ring (one link for two processes)."""
    if n_processes < 2:
        return []
    if n_processes == 2:
        return [(0, 1)]
    return [(k, (k + 1) % n_processes) for k in range(n_processes)]


def ring_rounds(links: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The links in rounds in which no process has two partners (greedy: two rounds for an even ring,
    three for an odd one)."""
    rounds: list[list[tuple[int, int]]] = []
    for link in links:
        for r in rounds:
            if not {p for pair in r for p in pair} & set(link):
                r.append(link)
                break
        else:
            rounds.append([link])
    return rounds


def ring_times(sizes: Sizes, rounds, late_for: Callable[[tuple[int, int]], float]) -> list[float]:
    """This process's exchange time in each round (NaN in a round where it has no partner);
    `late_for(pair)`: a drill's stretch for this process's exchange with its partner."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("ring",))
    by_process: dict[int, list[int]] = {}
    for i, d in enumerate(devices):
        by_process.setdefault(d.process_index, []).append(i)
    per = sizes.ring_bytes // 4
    x = jax.jit(lambda: jnp.ones(per * len(devices), jnp.float32), out_shardings=NamedSharding(mesh, P("ring")))()
    me = jax.process_index()
    fns = []
    for pairs in rounds:
        perm = []
        for a, b in pairs:
            for i, j in zip(by_process[a], by_process[b]):
                perm += [(i, j), (j, i)]
        fns.append(jax.jit(jax.shard_map(lambda v, perm=perm: jax.lax.ppermute(v, "ring", perm), mesh=mesh,
                                         in_specs=P("ring"), out_specs=P("ring"), check_vma=False)))
    times = np.full(len(rounds), np.inf)
    for _ in range(sizes.rounds + 1):  # the whole ring again: each link's samples spread over time
        for r, (pairs, fn) in enumerate(zip(rounds, fns)):
            mine = next((pair for pair in pairs if me in pair), None)
            t = best_time(lambda fn=fn: _block(fn(x)), sizes.repeats, late_for(mine) if mine else 1.0, late=True,
                          collective=True)
            times[r] = min(times[r], t) if mine is not None else float("nan")
    return times.tolist()


# ---------------------------------------------------------------- storage


def _private_dir(base: str) -> str:
    return f"{base.rstrip('/')}/.maxtrain-preflight/{socket.gethostname()}-{os.getpid()}"


def storage_figures(targets: dict[str, str], data_file: str | None, nbytes: int, repeats: int = 3,
                    stretch: float = 1.0) -> dict[str, float]:
    """MB/s writing (and syncing) and reading `nbytes` under each target directory (a private
    subdirectory, then removed), and reading the first `nbytes` of `data_file`: each the best of
    `repeats`."""
    from maxtrain import storage

    out = {}
    payload = os.urandom(nbytes)
    for name, base in targets.items():
        probe = _private_dir(base)
        if storage.is_url(base):
            url = storage.join(probe, "probe")
            try:
                out[f"{name}_write_mb_s"] = max(_timed_rate(nbytes, lambda: storage.write_bytes(url, payload), stretch)
                                                for _ in range(repeats))
                out[f"{name}_read_mb_s"] = max(_timed_rate(nbytes, lambda: storage.read_bytes(url))
                                               for _ in range(repeats))
            finally:
                storage.delete_prefix(probe)
            continue
        path = os.path.join(probe, "probe")
        os.makedirs(probe, exist_ok=True)
        try:
            out[f"{name}_write_mb_s"] = max(_timed_rate(nbytes, lambda: _write_synced(path, payload), stretch)
                                            for _ in range(repeats))
            out[f"{name}_read_mb_s"] = max(_read_rate(path, nbytes) for _ in range(repeats))
        finally:
            import shutil

            shutil.rmtree(probe, ignore_errors=True)
            try:
                os.rmdir(os.path.dirname(probe))  # the shared parent, once the last probe is gone
            except OSError:
                pass
    if data_file:
        out["data_read_mb_s"] = max(_read_rate(data_file, nbytes) for _ in range(repeats))
    return out


def _write_synced(path: str, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def _timed_rate(nbytes: int, fn: Callable[[], object], stretch: float = 1.0) -> float:
    t0 = time.perf_counter()
    fn()
    return _rate(nbytes, t0, stretch)


def _rate(nbytes: int, t0: float, stretch: float = 1.0) -> float:
    elapsed = time.perf_counter() - t0
    if stretch > 1:
        time.sleep((stretch - 1) * elapsed)
        elapsed *= stretch
    return nbytes / max(elapsed, 1e-9) / 1e6


def _read_rate(path: str, nbytes: int) -> float:
    """MB/s reading up to `nbytes` of a local file, its cached pages dropped first where the OS
    allows (else the figure is the page cache's)."""
    from maxtrain import storage

    if storage.is_url(path):
        t0 = time.perf_counter()
        got = len(storage.read_range(path, 0, nbytes))
        return _rate(max(got, 1), t0)
    with open(path, "rb") as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        got = len(f.read(nbytes))
    return _rate(max(got, 1), t0)


# ---------------------------------------------------------------- judging


def others_median(values: np.ndarray, i: int, group: np.ndarray | None = None) -> float:
    """The median of the other entries (of the same group), NaN when there are none."""
    mask = np.ones(len(values), bool)
    mask[i] = False
    if group is not None:
        mask &= group == group[i]
    rest = values[mask & np.isfinite(values)]
    return float(np.median(rest)) if rest.size else float("nan")


def link_reference(link: tuple[int, int], rates: dict[tuple[int, int], float]) -> float:
    """What a link is compared with: the median of the links that share neither of its ends (a slow
    host drags down both of its links, which must not set each other's bar); in a ring too small
    for that (three processes), the fastest other link."""
    apart = [r for other, r in rates.items() if not set(other) & set(link)]
    if apart:
        return float(np.median(apart))
    others = [r for other, r in rates.items() if other != link]
    return float(max(others)) if others else float("nan")


def table_peaks(kinds: list[str]) -> dict[str, float | None]:
    """The device table's bf16 matmul peak (TFLOP/s) of each device kind; None where it has no entry."""
    from maxtrain.devices import device_figures

    return {k: (e.peak_bf16_tflops if (e := device_figures(k)) else None) for k in set(kinds)}


def judge(names: list[str], table: np.ndarray, kinds: list[str], link_rates: dict[tuple[int, int], float],
          peaks: dict[str, float | None], th: Thresholds) -> dict[int, dict[str, str]]:
    """rank -> {figure or link: why} for each condemned process. `table[p, j]`: figure `names[j]` of process p (higher is
    better); `kinds[p]`: its device kind; `peaks`: the table's matmul peak per kind (TFLOP/s)."""
    condemned: dict[int, dict[str, str]] = {}
    group = np.asarray(kinds)
    for j, name in enumerate(names):
        slack = (th.compute_slack if name in ("matmul_tflops", "fp8_matmul_tflops", "hbm_gb_s", "h2d_gb_s")
                 else th.storage_slack if name.endswith("_mb_s") else None)
        if slack is None:
            continue  # collectives: everyone waits for the slowest; reported, never condemning
        for p in range(table.shape[0]):
            if name == "hbm_gb_s" and kinds[p] == "cpu":
                continue  # a CPU device's memory is its host's, shared with every process there: reported only
            ref = others_median(table[:, j], p, group)
            v = table[p, j]
            if np.isfinite(v) and np.isfinite(ref) and v < (1 - slack) * ref:
                condemned.setdefault(p, {})[name] = f"{name} {v:.4g} < {1 - slack:.2f} x the others' median {ref:.4g}"
    if "matmul_tflops" in names:
        j = names.index("matmul_tflops")
        for p, kind in enumerate(kinds):
            peak = peaks.get(kind)
            if peak and table[p, j] < th.peak_fraction * peak:
                condemned.setdefault(p, {})["matmul_peak"] = (
                    f"matmul_tflops {table[p, j]:.4g} < {th.peak_fraction:.2f} x the device table's {peak:g}")
    slow = []
    for link, rate in link_rates.items():
        ref = link_reference(link, link_rates)
        if np.isfinite(ref) and rate < (1 - th.link_slack) * ref:
            slow.append((link, rate, ref))
    counts: dict[int, int] = {}
    for (a, b), _, _ in slow:
        counts[a] = counts.get(a, 0) + 1
        counts[b] = counts.get(b, 0) + 1
    for (a, b), rate, ref in slow:
        why = f"link {a}<->{b} {rate:.4g} GB/s < {1 - th.link_slack:.2f} x the other links' {ref:.4g}"
        ends = [p for p in (a, b) if counts[p] > 1] or [a, b]  # a host on two slow links is the cause
        for p in ends:
            condemned.setdefault(p, {})[f"link {a}<->{b}"] = why
    return condemned


def confirmed(found: dict[int, dict[str, str]], again: dict[int, dict[str, str]]) -> dict[int, dict[str, str]]:
    """What a re-measurement confirms of `found`: each process's device and storage figures that
    `again` condemns too, with its reasons; and `again`'s links as they are: `run` judges them on
    each link's best rate over every measurement so far, so a link stays slow only if it was slow
    each time, and the ends named are those of the links still slow (noise that slowed a healthy
    link once, making one end look like a slow host, does not decide who is named)."""
    out = {}
    for p in sorted(set(found) | set(again)):
        now = {k: r for k, r in again.get(p, {}).items() if k.startswith("link ") or k in found.get(p, {})}
        if now:
            out[p] = now
    return out


def rejudge(found: dict[int, dict[str, str]], best: tuple, more: tuple, names: list[str], kinds: list[str],
            peaks: dict[str, float | None], th: Thresholds) -> tuple[dict[int, dict[str, str]], tuple]:
    """A re-measurement `more` = (table, links) folded into `best` (each figure's and each link's
    best value so far: noise only ever slows a measurement), judged, and `confirmed` against
    `found`: (what stays condemned, the new best)."""
    table = np.fmax(best[0], more[0])
    links = {k: max(v, more[1][k]) for k, v in best[1].items()}
    return confirmed(found, judge(names, table, kinds, links, peaks, th)), (table, links)


# ---------------------------------------------------------------- the whole check


@dataclasses.dataclass
class Report:
    mode: str
    hosts: list[str]
    kinds: list[str]
    names: list[str]  # figure names, the table's columns
    table: list[list[float]]  # [process][figure]
    links: dict[str, float]  # "a<->b": GB/s
    condemned: dict[int, list[str]]  # rank -> reasons
    seconds: float = 0.0
    checks: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # rank -> the figures condemning it
    skipped: list[str] = dataclasses.field(default_factory=list)

    def medians(self) -> list[float]:
        t = np.asarray(self.table, np.float64)
        return [float(np.nanmedian(t[:, j])) if np.isfinite(t[:, j]).any() else float("nan")
                for j in range(t.shape[1])]

    def condemned_hosts(self) -> list[str]:
        return sorted({self.hosts[p] for p in self.condemned})

    def to_json(self) -> dict:
        nan_free = [[None if not np.isfinite(v) else v for v in row] for row in self.table]
        return {"mode": self.mode, "seconds": self.seconds, "healthy": not self.condemned,
                "processes": [{"rank": p, "host": h, "device_kind": k, **dict(zip(self.names, row))}
                              for p, (h, k, row) in enumerate(zip(self.hosts, self.kinds, nan_free))],
                "median": dict(zip(self.names, [None if not np.isfinite(v) else v for v in self.medians()])),
                "links_gb_s": self.links, "skipped": self.skipped,
                "condemned": [{"rank": p, "host": self.hosts[p], "checks": self.checks.get(p, []), "reasons": r}
                              for p, r in sorted(self.condemned.items())],
                "condemned_hosts": self.condemned_hosts()}

    def lines(self) -> list[str]:
        """The table: a row per process, the job median, a verdict per row; then the links."""
        shown = [n for n in self.names if not n.endswith("_device")]
        cols = [self.names.index(n) for n in shown]
        head = ["host", "rank"] + [_short(n) for n in shown] + ["verdict"]
        rows = [[h, str(p)] + [_fmt(self.table[p][j]) for j in cols]
                + ["CONDEMNED: " + "; ".join(self.condemned[p]) if p in self.condemned else "ok"]
                for p, h in enumerate(self.hosts)]
        med = self.medians()
        rows.append(["median", ""] + [_fmt(med[j]) for j in cols] + [""])
        widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head) - 1)]
        out = ["  ".join(c.rjust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in [head] + rows]
        if self.links:
            out.append("links (GB/s): " + ", ".join(f"{k} {v:.3g}" for k, v in self.links.items()))
        out += [f"skipped: {s}" for s in self.skipped]
        return out


def _short(name: str) -> str:
    return name.replace("_gb_s", " GB/s").replace("_mb_s", " MB/s").replace("_tflops", " TFLOP/s")


def _fmt(v: float) -> str:
    return "-" if not np.isfinite(v) else f"{v:.4g}"


def figure_names(mesh_shape: dict, targets: list[str], data: bool, fp8: bool, quick: bool) -> list[str]:
    """The figures every process reports, in one fixed order (the all-gathered table's columns)."""
    names = ["matmul_tflops", "matmul_device", "hbm_gb_s", "hbm_device", "h2d_gb_s", "h2d_device"]
    if fp8:
        names += ["fp8_matmul_tflops", "fp8_matmul_device"]
    names += [f"{axis}_{op}_gb_s" for axis, n in mesh_shape.items() if n > 1 for op in collective_ops(axis, quick)]
    names += [f"{t}_{rw}_mb_s" for t in targets for rw in ("write", "read")]
    return names + (["data_read_mb_s"] if data else [])


def node_name() -> str:
    """This process's node as its scheduler names it, which is what an exclusion must name:
    `MAXTRAIN_NODE_NAME` (the Kubernetes manifest sets it to the pod's spec.nodeName), Slurm's
    `SLURMD_NODENAME`, else the host name."""
    return os.environ.get("MAXTRAIN_NODE_NAME") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def gather_strings(*values: str, width: int = 64) -> list[str] | list[list[str]]:
    """Every process's `values` (each cut to `width` bytes) through one all-gather: one string per
    process for one value, else one list per value."""
    from jax.experimental import multihost_utils

    raw = b"".join(v.encode()[:width].ljust(width, b"\0") for v in values)
    rows = np.asarray(multihost_utils.process_allgather(np.frombuffer(raw, np.uint8))).reshape(-1, len(values), width)
    got = [[bytes(r[i]).rstrip(b"\0").decode(errors="replace") for r in rows] for i in range(len(values))]
    return got[0] if len(values) == 1 else got


def gather_floats(values: list[float]) -> np.ndarray:
    from jax.experimental import multihost_utils

    mine = np.asarray(values, np.float64)
    return np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)


def in_turns(same_host: bool, fn: Callable[[], dict], first: int = 0, rounds: int = 1) -> dict:
    """`fn()` on every process at once, or, for processes sharing a host's CPU or disk, one after
    another from process `first` on (else each would measure the others' load), `rounds` times
    round the processes: each rate is the best of its rounds (a shared host's slow spells, seconds
    long, then fall on every process's turns alike)."""
    import jax
    from jax.experimental import multihost_utils

    if not same_host:
        return fn()
    got = []
    n = jax.process_count()
    for r in range(rounds):
        for turn in range(n):
            multihost_utils.sync_global_devices(f"maxtrain preflight round {r} turn {turn}")
            if (first + turn) % n == jax.process_index():
                got.append(fn())
    multihost_utils.sync_global_devices("maxtrain preflight turns done")
    return best_of_rounds(got)


def best_of_rounds(results: list[dict[str, float]]) -> dict[str, float]:
    """Each rate's best over `results` (NaN where never measured); a `*_device` index comes from
    the round its figure's best came from."""
    out = dict(results[0])
    for key in out:
        if key.endswith("_device"):
            continue
        vals = np.asarray([r[key] for r in results], np.float64)
        if np.isfinite(vals).any():
            best = int(np.nanargmax(vals))
            out[key] = float(vals[best])
            index = key.replace("_gb_s", "").replace("_tflops", "") + "_device"
            if index in out:
                out[index] = results[best][index]
    return out


CONFIRMATIONS = 3  # a condemnation stands only if every re-measurement repeats it (noise does not persist);
# they cost nothing in a healthy job (none runs unless something was found)


def run(mesh, mode: str, *, targets: dict[str, str] | None = None, data_file: str | None = None,
        fp8: bool = False, thresholds: Thresholds = Thresholds(), drill: Drill = Drill()) -> Report:
    """Every check on every process (all call this together); the same Report everywhere. A
    process found slow is measured again, `CONFIRMATIONS` times; each time every figure and link is
    judged on its best value over the measurements so far, and a process stays condemned only for
    the figures every judgement condemned (`confirmed`)."""
    import jax

    t0 = time.perf_counter()
    platform = jax.devices()[0].platform
    sizes = SIZES[("cpu" if platform == "cpu" else "gpu", "quick" if mode == "quick" else "full")]
    fp8 = fp8 and platform != "cpu"
    targets = dict(targets or {})
    hosts, kinds = gather_strings(node_name(), jax.local_devices()[0].device_kind)
    names = figure_names(dict(mesh.shape), list(targets), data_file is not None, fp8, mode == "quick")
    peaks = table_peaks(kinds)
    table, links = _measure(mesh, mode == "quick", sizes, names, hosts, targets, data_file, fp8, drill, 0)
    found = judge(names, table, kinds, links, peaks, thresholds)
    for turn in range(1, 1 + (CONFIRMATIONS if found else 0)):  # each in another turn order
        more = _measure(mesh, mode == "quick", sizes, names, hosts, targets, data_file, fp8, drill, turn)
        found, (table, links) = rejudge(found, (table, links), more, names, kinds, peaks, thresholds)
        if not found:
            break
    return Report(mode, hosts, kinds, names, table.tolist(), {f"{a}<->{b}": v for (a, b), v in links.items()},
                  {p: list(why.values()) for p, why in found.items()}, time.perf_counter() - t0,
                  checks={p: list(why) for p, why in found.items()})


def _measure(mesh, quick: bool, sizes: Sizes, names: list[str], hosts: list[str], targets: dict[str, str],
             data_file: str | None, fp8: bool, drill: Drill,
             first: int = 0) -> tuple[np.ndarray, dict[tuple[int, int], float]]:
    """One measurement of everything: the all-gathered table [process, figure] and the ring's links
    (processes sharing a host take turns from process `first` on)."""
    import jax

    me = jax.process_index()
    shared = len(set(hosts)) < len(hosts)  # job-wide (some host runs several processes): the same calls everywhere
    drilled = drill.check if drill.check and drill.process == me else None
    stretch = lambda check: drill.factor if drilled == check else 1.0  # noqa: E731
    cpu = jax.devices()[0].platform == "cpu"
    if shared and cpu:  # compiled by all at once, before the turns (only the runs are timed)
        warm_up(sizes)
    mine = in_turns(shared and cpu, lambda: device_figures(sizes, fp8, stretch("matmul")), first, sizes.rounds)
    mine.update(collective_figures(mesh, sizes, quick, stretch("collective")))
    rounds = ring_rounds(ring_links(len(hosts)))
    nxt = (me, (me + 1) % len(hosts))
    times = ring_times(sizes, rounds, lambda pair: max(stretch("collective"), stretch("link") if pair == nxt else 1.0))
    mine.update(in_turns(shared, lambda: storage_figures(targets, data_file, sizes.storage_bytes, sizes.repeats,
                                                                 stretch("storage")), first, sizes.rounds))
    table = gather_floats([mine.get(n, float("nan")) for n in names])
    all_times = gather_floats(times) if rounds else np.zeros((len(hosts), 0))
    links = {(a, b): float(2 * sizes.ring_bytes / max(all_times[a, r], all_times[b, r]) / 1e9)
             for r, pairs in enumerate(rounds) for a, b in pairs}
    return table, links


# ---------------------------------------------------------------- from a config


class Unhealthy(RuntimeError):
    """Condemned processes (by the preflight or the in-run straggler watch): the job exits
    `exit_codes.UNHEALTHY` (78); `path` holds the report."""

    def __init__(self, report: Report, by: str = "preflight", path: str | None = None):
        self.report, self.by, self.path = report, by, path
        reasons = "; ".join(f"rank {p} ({report.hosts[p]}): {', '.join(r)}" for p, r in sorted(report.condemned.items()))
        super().__init__(f"{by} condemned {len(report.condemned)} of {len(report.hosts)} processes: {reasons}")


def publish(report: Report, out_path: str | None, by: str = "preflight") -> None:
    """Process 0 writes the report to `out_path` and, when it condemns anyone and the launcher asked
    (`MAXTRAIN_CONDEMNED_FILE`), the condemned ranks and hosts there: `maxtrain launch local`
    names them, launch/slurm/train.sbatch excludes the hosts from the requeued job."""
    import jax

    if jax.process_index() != 0:
        return
    if out_path:
        _write_json(out_path, report.to_json())
    if report.condemned and os.environ.get("MAXTRAIN_CONDEMNED_FILE"):
        _write_json(os.environ["MAXTRAIN_CONDEMNED_FILE"], {"by": by, "condemned": report.to_json()["condemned"]})


def _write_json(path: str, value: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=2)
    os.replace(path + ".tmp", path)


def resolve_mode(mode: str | bool, n_processes: int) -> str:
    """`auto` (or true): quick on a multi-process job (where one sick node costs everyone), off on one
    process; false (YAML's bare `off`) is off."""
    if mode is False:
        return "off"
    return ("quick" if n_processes > 1 else "off") if mode in ("auto", True) else mode


def thresholds_of(r) -> Thresholds:
    return Thresholds(r.preflight_compute_slack, r.preflight_link_slack, r.preflight_storage_slack,
                      r.preflight_peak_fraction)


def drill_of(d) -> Drill:
    """The config's preflight drill; like every drill, only in a job's first attempt."""
    from maxtrain.reliability.drills import first_attempt

    if d.preflight_slow is None or not first_attempt():
        return Drill()
    return Drill(d.preflight_slow, d.preflight_factor, d.process)


def data_probe_file(cfg) -> str | None:
    """A file of the training data to time reading: the first train shard of prepared tokens, or the
    first text file; None for synthetic data or what cannot be found cheaply."""
    from maxtrain import storage

    path = cfg.data.path
    if isinstance(path, list):
        path = path[0] if path else None
        path = path.get("path") if isinstance(path, dict) else path
    if not isinstance(path, str) or cfg.data.kind == "synthetic" or path == "stdlib":
        return None
    try:
        if cfg.data.kind == "tokens":
            if storage.is_url(path):
                manifest = json.loads(storage.read_bytes(storage.join(path, "manifest.json")))
                return storage.join(path, manifest["splits"]["train"]["shards"][0]["file"])
            with open(os.path.join(path, "manifest.json")) as f:
                return os.path.join(path, json.load(f)["splits"]["train"]["shards"][0]["file"])
        if os.path.isfile(path):
            return path
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return None


def storage_targets(cfg, checkpoint_dir_busy: str | None = None) -> tuple[dict[str, str], list[str]]:
    """The directories to probe, and what was skipped and why (`checkpoint_dir_busy`: why
    checkpoint.dir may not be written into, e.g. another run holds its lock)."""
    targets, skipped = {}, []
    if cfg.checkpoint.dir:
        if checkpoint_dir_busy:
            skipped.append(f"checkpoint.dir {cfg.checkpoint.dir}: {checkpoint_dir_busy}")
        else:
            targets["checkpoint"] = cfg.checkpoint.dir
    if cfg.checkpoint.local.dir:
        targets["local"] = cfg.checkpoint.local.dir
    return targets, skipped


def check(cfg, mesh, mode: str, out_path: str | None, checkpoint_dir_busy: str | None = None) -> Report:
    """The preflight of `cfg`'s run on `mesh` (every process together): the table logged and
    written to `out_path` by process 0; raises `Unhealthy` when a process is condemned. The caller
    holds checkpoint.dir (train: its Checkpointer's lock), or says why it may not be probed."""
    import jax

    targets, skipped = storage_targets(cfg, checkpoint_dir_busy)
    if cfg.checkpoint.local.dir:
        os.makedirs(cfg.checkpoint.local.dir, exist_ok=True)
    report = run(mesh, mode, targets=targets, data_file=data_probe_file(cfg), fp8=cfg.train.fp8.recipe != "none",
                 thresholds=thresholds_of(cfg.reliability), drill=drill_of(cfg.drills))
    report.skipped = skipped
    if jax.process_index() == 0:
        log.info("preflight (%s, %.1fs):\n%s", mode, report.seconds, "\n".join(report.lines()))
    publish(report, out_path)
    if report.condemned:
        raise Unhealthy(report, "preflight", out_path)
    return report
