"""Surviving long runs: numerical guards in the step, a hang watchdog, goodput accounting, the
persistent compilation cache (fault drills: maxtrain/drills.py).

Exit codes (also in docs/reliability.md), shared by the launchers:
  0 done · 1 crash (uncaught error) · 2 user error (config, data, environment) ·
  75 preempted, checkpoint saved (requeue) · 76 hang detected by the watchdog (restart) ·
  77 halted by a numerical guard (`reliability.nan_action` / `spike_action: halt`; look first).
"""

from __future__ import annotations

import json
import logging
import contextlib
import os
import sys
import threading
import time
import traceback

import jax
import jax.numpy as jnp

from maxtrain import exit_codes
from maxtrain.config import ReliabilityConfig

log = logging.getLogger("maxtrain")

HANG_EXIT_CODE = exit_codes.HANG
HALT_EXIT_CODE = exit_codes.HALT
EVENT_KINDS = ("nan", "loss_spike", "grad_spike")  # guard event codes 1, 2, 3


class Halted(RuntimeError):
    """A numerical guard with action `halt` fired: the run stops before the bad update spreads.
    `step`: the first step whose state must not survive in a checkpoint (None: no such step)."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


# ---------------------------------------------------------------- numerical guards (inside the step)


def init_guard() -> dict:
    """Running statistics the step keeps on device: mean/variance of loss and grad norm over
    accepted updates, how many updates it skipped, and the last event (kind code, step, value)."""
    names = ("count", "loss_mean", "loss_var", "gn_mean", "gn_var", "skipped", "events", "last_kind", "last_step",
             "last_value", "streak", "worst_streak")
    return {k: jnp.zeros((), jnp.float32) for k in names}  # distinct buffers: the state is donated


def _running(mean, var, x, count):
    """Mean and variance: exact over the first 100 accepted steps, then an EMA with weight 0.01."""
    w = jnp.maximum(1.0 / (count + 1.0), 0.01)
    delta = x - mean
    mean = mean + w * delta
    var = (1.0 - w) * (var + w * delta * delta)
    return mean, var


def _spike(x, mean, var, count, cfg: ReliabilityConfig):
    return (count >= cfg.spike_warmup) & (x - mean > cfg.spike_sigma * jnp.sqrt(jnp.maximum(var, 1e-12)))


def guards_on(cfg: ReliabilityConfig) -> bool:
    return not (cfg.nan_action == "none" and cfg.spike_action == "none")


def check_step(guard: dict, loss, grad_norm, step, cfg: ReliabilityConfig):
    """`(apply_update, new_guard)` for one step, all on device (no host sync).

    Non-finite loss or gradients always count as an event; loss or grad-norm spikes do when
    `spike_action` is not `none`. With action `skip` the update is dropped; with `halt` it is
    dropped too and the host stops when it next reads the guard (at the next logged step)."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    spikes = cfg.spike_action != "none"
    loss_spike = finite & spikes & _spike(loss, guard["loss_mean"], guard["loss_var"], guard["count"], cfg)
    gn_spike = finite & spikes & _spike(grad_norm, guard["gn_mean"], guard["gn_var"], guard["count"], cfg)
    event = ~finite | loss_spike | gn_spike
    kind = jnp.where(~finite, 1.0, jnp.where(loss_spike, 2.0, 3.0))
    value = jnp.where(~finite | loss_spike, loss, grad_norm)
    lm, lv = _running(guard["loss_mean"], guard["loss_var"], loss, guard["count"])
    gm, gv = _running(guard["gn_mean"], guard["gn_var"], grad_norm, guard["count"])
    keep = lambda new, old: jnp.where(event, old, new)  # noqa: E731  statistics only from good steps
    new = {
        "count": guard["count"] + jnp.where(event, 0.0, 1.0),
        "loss_mean": keep(lm, guard["loss_mean"]), "loss_var": keep(lv, guard["loss_var"]),
        "gn_mean": keep(gm, guard["gn_mean"]), "gn_var": keep(gv, guard["gn_var"]),
        "skipped": guard["skipped"] + event.astype(jnp.float32),
        "events": guard["events"] + event.astype(jnp.float32),
        "last_kind": jnp.where(event, kind, guard["last_kind"]),
        "last_step": jnp.where(event, step.astype(jnp.float32) + 1.0, guard["last_step"]),
        "last_value": jnp.where(event, value, guard["last_value"]),
        "streak": jnp.where(event, guard["streak"] + 1.0, 0.0),  # updates skipped in a row
    }
    new["worst_streak"] = jnp.maximum(guard["worst_streak"], new["streak"])
    return ~event, new


def report_events(guard: dict, seen: int, cfg: ReliabilityConfig) -> tuple[int, int | None]:
    """Logs guard events the host has not seen yet (host values); raises `Halted` per config.
    Returns the new count of events seen, and the event's step when its action is `rollback`."""
    events = int(guard["events"])
    if events <= seen:
        return seen, None
    kind = EVENT_KINDS[int(guard["last_kind"]) - 1]
    action = cfg.nan_action if kind == "nan" else cfg.spike_action
    step = int(guard["last_step"])
    log.warning("guard: %d new event(s); last: %s at step %d (value %.6g); action: %s (update skipped)",
                events - seen, kind, step, float(guard["last_value"]), action)
    first = step - int(guard["streak"]) + 1 if int(guard["streak"]) else step  # the streak's first event
    if action == "halt":
        raise Halted(f"{kind} at step {step} (value {float(guard['last_value']):.6g}) and "
                     f"reliability.{'nan' if kind == 'nan' else 'spike'}_action=halt; the update was not applied "
                     f"and no checkpoint of step {min(first, step)} or later is kept", step=min(first, step))
    worst = int(guard["worst_streak"])
    if cfg.max_consecutive_skips and worst >= cfg.max_consecutive_skips:
        raise Halted(f"{worst} updates in a row were skipped (last: {kind} at step {step}, value "
                     f"{float(guard['last_value']):.6g}): the run is not training (reliability.max_consecutive_skips="
                     f"{cfg.max_consecutive_skips}); no checkpoint of step {first} or later is kept", step=first)
    return events, (step if action == "rollback" else None)


# ---------------------------------------------------------------- hang watchdog (host thread)


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


# ---------------------------------------------------------------- compilation cache


def enable_compilation_cache(path: str | None) -> str | None:
    """JAX's persistent compilation cache, so a restarted job skips recompiling its step."""
    if not path:
        return None
    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


# ---------------------------------------------------------------- goodput


class Goodput:
    """Wall time of one run split into its parts; `summary()` makes them add up to the wall time.

    Productive step time is what is left after start-up, compilation, data waits, checkpoint
    blocking and evaluation; `lost` is the part of it that redid steps an earlier attempt had
    already done (it crashed after them, before their checkpoint), and `restart_downtime` the gap
    between the previous attempt's end and this one's start (from run_dir/goodput.json)."""

    PARTS = ("startup", "compile", "data_wait", "ckpt_block", "eval")

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, "goodput.json")
        self.t0 = time.time()
        self.first_step = 0
        self.parts = {p: 0.0 for p in self.PARTS}
        self.previous = _read_json(self.path)

    def start(self, first_step: int, startup_s: float) -> None:
        """The step the run starts from, and the seconds it took to get there (setup, restore)."""
        self.first_step = first_step
        self.parts["startup"] = startup_s

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] += seconds

    def summary(self, last_step: int) -> dict:
        wall = time.time() - self.t0
        steps = max(last_step - self.first_step, 0)
        productive = max(wall - sum(self.parts.values()), 0.0)
        prev = self.previous or {}
        # steps done before by any earlier attempt (not only the last: it may have crashed sooner)
        reached = max([prev.get("last_step", 0)] + [a.get("last_step", 0) for a in prev.get("attempts", [])])
        redone = max(min(reached, last_step) - self.first_step, 0) if prev else 0
        lost = productive * redone / steps if steps else 0.0
        attempts = prev.get("attempts", []) + [{
            "start": self.t0, "end": self.t0 + wall, "first_step": self.first_step, "last_step": last_step,
            "wall_s": wall, **{f"{k}_s": v for k, v in self.parts.items()},
            "productive_s": productive - lost, "lost_s": lost, "steps_redone": redone,
            "restart_downtime_s": max(self.t0 - prev["end"], 0.0) if prev.get("end") else 0.0,
        }]
        total = {k: sum(a[k] for a in attempts) for k in attempts[-1] if k.endswith("_s")}
        total["goodput"] = total["productive_s"] / max(total["wall_s"] + total["restart_downtime_s"], 1e-9)
        return {"last_step": last_step, "end": self.t0 + wall, "attempts": attempts, "total": total}

    def write(self, last_step: int, final: bool = True) -> dict:
        """Writes goodput.json (atomically). The loop also calls it at every logged step
        (`final=False`), so an attempt that crashes or hangs still leaves its account."""
        s = self.summary(last_step)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(s, f, indent=1)
        os.replace(tmp, self.path)
        if not final:
            return s
        t = s["total"]
        log.info("goodput %.1f%%: productive %.1fs, compile %.1fs, start-up %.1fs, data wait %.1fs, checkpoint %.1fs, "
                 "eval %.1fs, lost %.1fs, restart downtime %.1fs (%d attempt%s)", 100 * t["goodput"],
                 t["productive_s"], t["compile_s"], t["startup_s"], t["data_wait_s"], t["ckpt_block_s"], t["eval_s"],
                 t["lost_s"], t["restart_downtime_s"], len(s["attempts"]), "" if len(s["attempts"]) == 1 else "s")
        return s


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- silent corruption (replica fingerprints)


def _bits_sum(x):
    """Sum of the bit patterns of `x` as uint32 (wrapping): any flipped bit changes it."""
    bits = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]
    return jnp.sum(jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32), dtype=jnp.uint32)


def make_fingerprint(mesh, param_shardings):
    """Jitted `params -> uint32[mesh shape]`: one fingerprint per device of the shards it holds."""
    from jax.sharding import PartitionSpec as P
    specs = jax.tree.map(lambda s: s.spec, param_shardings)

    def local(params):
        total = sum(_bits_sum(x) for x in jax.tree.leaves(params))
        return jnp.reshape(total, (1,) * len(mesh.axis_names))

    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=P(*mesh.axis_names), check_vma=False)
    return jax.jit(fn)


def replica_axes(param_shardings, mesh) -> tuple[str, ...]:
    """Mesh axes no parameter is sharded over: devices that differ only along them must hold
    bit-identical parameters (the data-parallel replicas)."""
    used = set()
    for s in jax.tree.leaves(param_shardings):
        for dim in s.spec:
            used.update(dim if isinstance(dim, tuple) else (dim,) if dim else ())
    return tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)


def mismatched_devices(fingerprints, mesh, axes: tuple[str, ...]) -> list:
    """Devices whose fingerprint differs from the majority of their replica group (every device of
    a group without a strict majority)."""
    import numpy as np
    fp = np.asarray(fingerprints)
    devices = np.asarray(mesh.devices)
    idx = [mesh.axis_names.index(a) for a in axes]
    rest = [i for i in range(fp.ndim) if i not in idx]
    fp_g = np.transpose(fp, rest + idx).reshape(-1, int(np.prod([fp.shape[i] for i in idx] or [1])))
    dev_g = np.transpose(devices, rest + idx).reshape(fp_g.shape)
    bad = []
    for values, devs in zip(fp_g, dev_g):
        uniq, counts = np.unique(values, return_counts=True)
        if len(uniq) > 1:
            if counts.max() * 2 > len(values):  # a strict majority: the others are wrong
                majority = uniq[np.argmax(counts)]
                bad += [d for v, d in zip(values, devs) if v != majority]
            else:  # e.g. two replicas: which one is wrong cannot be told; name them all
                bad += list(devs)
    return bad


class Corrupted(Halted):
    """Replicas that should be identical are not: stop before the difference reaches a checkpoint."""


def check_replicas(fingerprint_fn, params, mesh, axes, step: int) -> None:
    if not axes:
        return
    fp = fingerprint_fn(params)
    if not fp.is_fully_addressable:  # multi-process: every process gets every device's fingerprint
        from jax.experimental import multihost_utils
        fp = multihost_utils.process_allgather(fp, tiled=True)
    bad = mismatched_devices(jax.device_get(fp), mesh, axes)
    if bad:
        names = ", ".join(f"{d} (process {d.process_index})" for d in bad)
        raise Corrupted(f"silent corruption at step {step}: parameters on {names} differ from their data-parallel "
                        f"replicas (mesh axes {', '.join(axes)}); no checkpoint was written after it — restart "
                        f"from the last checkpoint and drain that host")


# ---------------------------------------------------------------- slow processes (stragglers)


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


# ---------------------------------------------------------------- deterministic replay


class Nondeterministic(Corrupted):
    """The same step on the same batch gave different results: a faulty device or a
    nondeterministic kernel; either way the run's numbers can no longer be trusted bit for bit."""


def check_replay(first: dict, second: dict, step: int) -> None:
    """Loss and gradient norm of two runs of one step on one batch must agree bit for bit."""
    import numpy as np
    for key in ("loss", "grad_norm"):
        a, b = np.asarray(first[key]), np.asarray(second[key])
        if a.tobytes() != b.tobytes():
            raise Nondeterministic(f"step {step} recomputed on the same batch gave {key} {float(a)!r} then "
                                   f"{float(b)!r}; a device computes wrongly or a kernel is nondeterministic "
                                   f"(reliability.replay_every checks this)")
