"""The training loop: a short loop over ordered callbacks.

`train_loop(cfg)` makes the state, compiles the step and then, for each step, takes the next batch, runs
the step and hands a small immutable `StepInfo` to each callback in turn. Every concern of a long
run (metrics, evaluation, checkpoints, rollback, replica checks, replay, stragglers, the watchdog,
goodput) is one `Callback` with its own cadence; `default_callbacks` lists them in the one order
that matters. A library user adds their own with `maxtrain.train(cfg, callbacks=[...])`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

import jax
import numpy as np

from maxtrain import reliability
from maxtrain.reliability import drills
from maxtrain.checkpoint import Checkpointer
from maxtrain.local_checkpoint import LocalTier, check_dir
from maxtrain.config import Config, pipeline_microbatches, to_dict
from maxtrain.data import Loader, data_order, make_eval_source, make_source
from maxtrain.metrics import (MetricsSink, ProfileWindow, Progress, StepClock, TimeBreakdown, format_line,
                              peak_tflops, throughput, write_hlo)
from maxtrain.mesh import use_mesh
from maxtrain.train import (PreemptionFlag, Setup, TrainResult, TrainState, _checkpoint_meta, _final_save,
                            _pipeline_bubble, _read_guard, pipeline_summary, _replay_check, _replica_check, _rollback,
                            check_start_source, check_state_fits, claim_run_dir, compile_train_step, evaluate, host_rows, make_eval_step,
                            make_setup, put_batch, restore_or_init, write_run_dir)

log = logging.getLogger("maxtrain")


def _number_or_list(v):
    """A metric for metrics.jsonl: a float, or a list of floats for a per-layer vector."""
    a = np.asarray(v)
    return float(a) if a.ndim == 0 else [round(float(x), 6) for x in a.reshape(-1)]


# ---------------------------------------------------------------- what callbacks see


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One finished step, as the callbacks see it (immutable; a callback that replaces the state
    returns the new one and the next callback gets a copy with it)."""

    step: int  # optimizer steps done, from 1
    state: TrainState  # after the step (its arrays may still be computing: async dispatch)
    metrics: dict  # the step's metrics, on device: read them late, never block on them here
    stopping: bool  # every process agreed to stop after this step (SIGTERM/SIGINT)
    final: bool  # the run's last step (train.steps)
    host_s: float = 0.0  # host work before the step was dispatched (data wait included)
    data_wait_s: float = 0.0  # of which waiting for the batch


@dataclasses.dataclass
class Run:
    """What the callbacks share for one run: built once by `run`, read by all."""

    cfg: Config
    setup: Setup
    ckpt: Checkpointer | None
    first: int  # the step the run starts from (0, or the restored step)
    clock: StepClock  # host time between records: data wait, dispatch, checkpoint blocking, host work
    goodput: reliability.Goodput
    watchdog: reliability.Watchdog
    guard: "GuardEvents"
    order: dict | None  # the data order saved with each checkpoint
    rows: tuple[int, int]  # this process's batch rows
    history: list[dict] = dataclasses.field(default_factory=list)  # every metrics record
    run_id: str | None = None  # run_dir/run.json's (maxtrain.rundir)
    local: Any = None  # the local checkpoint tier (maxtrain.local_checkpoint.LocalTier) or None

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0


class Callback:
    """One concern of the loop. Hooks do nothing by default; `after_step` may return a new state."""

    def on_start(self, run: Run) -> None:
        pass

    def before_step(self, run: Run, step: int) -> None:
        """Before step `step` (1-based) reads its batch."""

    def before_dispatch(self, run: Run, step: int, state: TrainState, batch: dict) -> None:
        """Just before the jitted step runs on `batch` (the state is donated to it)."""

    def after_step(self, run: Run, info: StepInfo) -> TrainState | None:
        return None

    def on_end(self, run: Run, info: StepInfo) -> None:
        """After the last step (finished, or stopped by a signal)."""

    def close(self, run: Run, failed: bool) -> None:
        """Always, last: also when the run ends on an error (`failed`: maybe on this process only)."""


# ---------------------------------------------------------------- when


def is_checkpoint_step(cfg: Config, step: int) -> bool:
    return bool(cfg.checkpoint.dir) and cfg.checkpoint.every > 0 and step % cfg.checkpoint.every == 0


def is_eval_step(cfg: Config, step: int) -> bool:
    return cfg.train.eval_every > 0 and (step % cfg.train.eval_every == 0 or step == cfg.train.steps)


def is_sample_step(cfg: Config, step: int) -> bool:
    return cfg.train.sample_every > 0 and step % cfg.train.sample_every == 0


def is_log_step(cfg: Config, info: StepInfo, first: int) -> bool:
    """The first step of the run, every `log_every`, the last, evaluations, samples and a stop."""
    return (info.step % cfg.train.log_every == 0 or info.step == first + 1 or info.final or info.stopping
            or is_eval_step(cfg, info.step) or is_sample_step(cfg, info.step))


def saves_after(cfg: Config, info: StepInfo) -> bool:
    """A checkpoint of this step is written now or by the final save."""
    return bool(cfg.checkpoint.dir) and (info.stopping or info.final or is_checkpoint_step(cfg, info.step))


# ---------------------------------------------------------------- shared: guard events


class GuardEvents:
    """The host's view of the guard's event counters: read at logged steps and before saves;
    a rollback asked for by an event waits here until the `Rollback` callback performs it."""

    def __init__(self):
        self.seen = 0
        self.rollback_to: int | None = None

    def read(self, run: Run, guard_host: dict) -> None:
        self.seen, event_step = _read_guard(run.cfg, run.ckpt, guard_host, self.seen)  # may halt
        if event_step is not None:
            self.rollback_to = event_step


# ---------------------------------------------------------------- callbacks


class Drills(Callback):
    """Host-side fault drills (`drills.*`): hang, crash, SIGTERM or sleep before a step."""

    def before_step(self, run, step):
        drills.host_faults(run.cfg.drills, step - 1)


class Replay(Callback):
    """Every `replay_every` steps the step is first run twice more on the same state and batch."""

    def __init__(self):
        self.fn = None  # the non-donating replay step, compiled at the first check

    def before_dispatch(self, run, step, state, batch):
        if run.cfg.reliability.replay_every and step % run.cfg.reliability.replay_every == 0:
            with run.watchdog.long_work():  # the first check compiles the replay step
                self.fn = _replay_check(run.setup, self.fn, state, batch, step)


class Metrics(Callback):
    """Metric records: read one step late (the host never waits on the device), written to
    metrics.jsonl, TensorBoard/W&B, the log line and the progress bar; evaluations and stops
    are read at once, with nothing to overlap."""

    def __init__(self, run: Run, stragglers: "Stragglers", evaluation: "Evaluation | None", sampler=None):
        cfg = run.cfg
        self.stragglers, self.evaluation, self.sampler = stragglers, evaluation, sampler
        self.peak = peak_tflops(jax.devices()[0].device_kind, cfg.train.peak_tflops)
        self.bubble = _pipeline_bubble(cfg)
        lg = cfg.logging
        self.sink = MetricsSink(cfg.run_dir, lg.tensorboard, lg.wandb, lg.wandb_project, to_dict(cfg),
                                run_id=run.run_id) if run.is_main else None
        self.progress = Progress(cfg.train.steps) if run.is_main else None
        self.breakdown = TimeBreakdown(run.first, lg.breakdown_every)
        self.late: tuple[int, dict] | None = None

    def after_step(self, run, info):
        if self.late is not None:  # the previous logged step, read now that this one is queued behind it
            self.record(run, *self.late)
            self.late = None
        return None

    def log_now_or_late(self, run: Run, info: StepInfo) -> None:
        """The second half of a step's metrics work, after the saves (see `default_callbacks`)."""
        if not is_log_step(run.cfg, info, run.first):
            return
        evaluate_now = self.evaluation is not None and is_eval_step(run.cfg, info.step)
        sample_now = self.sampler is not None and is_sample_step(run.cfg, info.step)
        if evaluate_now or sample_now or info.stopping or info.final:  # these read this step's params
            self.record(run, info.step, info.metrics, info.state.params if evaluate_now or sample_now else None)
        else:
            self.late = (info.step, _copy_to_host_async(info.metrics))

    def on_end(self, run, info):
        if self.late is not None:
            self.record(run, *self.late)
            self.late = None

    def record(self, run: Run, step: int, metrics: dict, params=None) -> None:
        """Reads step `step`'s metrics (waiting for the device to finish it) and writes its record."""
        cfg, setup, clock = run.cfg, run.setup, run.clock
        jax.block_until_ready(metrics)  # time waited here is the jitted step, not host overhead
        now = time.perf_counter()
        metrics = jax.device_get(metrics)
        guard = metrics.pop("guard", None)  # None: no guard is on
        if guard is not None:
            run.guard.read(run, guard)  # may halt
        timing = clock.interval(step, now)
        record = {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                  "lr": float(metrics["lr"]),
                  **throughput(timing.pop("step_time_s"), setup.tokens_per_step, setup.flops_per_step,
                               setup.mesh.size, self.peak), **timing}
        host = time.perf_counter() - now
        if guard is not None and guard["skipped"]:
            record["skipped_updates"] = float(guard["skipped"])
        if self.stragglers.watch.last:  # from the latest cross-process comparison
            record["stragglers"] = list(self.stragglers.watch.last)
        if params is not None and self.evaluation is not None and is_eval_step(cfg, step):
            record.update(self.evaluation.run(run, params))
        if params is not None and self.sampler is not None and is_sample_step(cfg, step):
            record["sample"] = self._sample(run, step, params)
        if cfg.train.z_loss:
            record["z_loss"] = float(metrics["z_loss"])
        record.update({k: _number_or_list(v) for k, v in metrics.items() if k.startswith(("moe_", "mtp_", "fp8_"))})
        if self.bubble is not None:
            record["pipeline_bubble"] = self.bubble
        if not np.isfinite(record["loss"]):
            log.warning("loss is %s at step %d", record["loss"], step)
        run.history.append(record)
        t_write = time.perf_counter()
        if self.sink:
            run.goodput.write(step, final=False)  # an attempt that dies later still leaves its account
            self.sink.write(record)
            self.progress.clear()
            times = self.breakdown.add(record)
            log.info(format_line(record, cfg.train.steps) + (f" | {times}" if times else ""))
            self.progress.update(step, record["loss"])
        clock.host += host + time.perf_counter() - t_write  # counts in the next record's interval

    def _sample(self, run: Run, step: int, params) -> str:
        """`train.sample_every`'s text, timed as evaluation (not step time)."""
        t0 = time.perf_counter()
        with run.watchdog.long_work():  # the first sample compiles the decoder
            text = self.sampler.run(params)
        run.goodput.add("eval", time.perf_counter() - t0)
        run.clock.restart()
        if run.is_main:
            log.info("sample at step %d: %r", step, text)
        return text

    def close(self, run, failed):
        if self.sink:
            self.sink.close()
            self.progress.close()


class LogNow(Callback):
    """The metrics callback's place after the saves: what it logs must not wait on a save."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def after_step(self, run, info):
        self.metrics.log_now_or_late(run, info)


class Evaluation:
    """Mean loss over `train.eval_steps` batches of the eval data, at `is_eval_step` steps (run
    from the metrics record of that step, so it lands in the same record)."""

    def __init__(self, run: Run, source):
        self.source, self.fn = source, make_eval_step(run.setup)

    def run(self, run: Run, params) -> dict:
        t_eval = time.perf_counter()
        with run.watchdog.long_work():  # the first evaluation also compiles its step
            out = evaluate(run.setup, self.fn, params, self.source, *run.rows)
        run.goodput.add("eval", time.perf_counter() - t_eval)
        run.clock.restart()  # evaluation time is not training step time
        return out


class Rollback(Callback):
    """`*_action: rollback`: right after the late metrics read that saw the event, the newest
    verified checkpoint before it is restored (at most `max_rollbacks` times)."""

    def __init__(self):
        self.count = 0

    def after_step(self, run, info):
        if run.guard.rollback_to is None:
            return None
        event = run.guard.rollback_to
        state = _rollback(run.setup, run.ckpt, event, info.step, self.count, info.state)
        if run.local is not None:  # local steps at or after the event hold the history being undone
            run.local.discard_after(event - 1)
        self.count += 1
        run.guard.rollback_to = None
        return state


class Stragglers(Callback):
    """Every `straggler_every` steps, names processes whose host step work is slow."""

    def __init__(self, cfg: Config):
        self.watch = reliability.StragglerWatch(cfg.reliability)

    def after_step(self, run, info):
        self.watch.add(info.host_s, info.data_wait_s)  # host work before dispatch: not hidden by a slower peer
        self.watch.check(info.step)


class Integrity(Callback):
    """Replica fingerprints every `fingerprint_every` steps and before every save (a diverged
    replica is never written); the bit-flip drill strikes here too."""

    def __init__(self, run: Run):
        self.fingerprint = reliability.make_fingerprint(run.setup.mesh, run.setup.state_shardings.params)

    def after_step(self, run, info):
        return _replica_check(run.cfg, run.setup, info.state, info.step, self.fingerprint,
                              before_save=saves_after(run.cfg, info))


class Checkpoints(Callback):
    """Periodic saves (after reading the guard: no step at or after an event is saved), and the
    final or preemption save at the end."""

    def __init__(self):
        self.saved = False  # the run's last step is in checkpoint.dir

    def after_step(self, run, info):
        cfg = run.cfg
        if saves_after(cfg, info) and reliability.guards_on(cfg.reliability):  # an event halts or rolls back first
            run.guard.read(run, jax.device_get(info.state.guard))
        if is_checkpoint_step(cfg, info.step) and not info.stopping and run.guard.rollback_to is None:
            with run.watchdog.long_work():  # a synchronous save (or a slow copy off the devices) is no hang
                secs = run.ckpt.save(info.step, info.state.params, info.state.saved_opt_state,
                                     _checkpoint_meta(cfg, info.step, run.order))
            run.clock.ckpt += secs
            run.goodput.add("ckpt_block", secs)
            run.goodput.saved(info.step, "periodic", secs)

    def on_end(self, run, info):
        if run.guard.rollback_to is not None:  # an event at the last step: its state is not saved
            log.warning("the run ended with a rollback pending (event at step %d): no final checkpoint",
                        run.guard.rollback_to)
            return
        with run.watchdog.long_work():  # the final (or preemption) save may outlast a step
            kind = "preemption" if info.stopping and info.step < run.cfg.train.steps else "final"
            self.saved = _final_save(run.cfg, run.ckpt, info.state, info.step, run.first, run.order, run.goodput,
                                     kind)


class LocalCheckpoints(Callback):
    """The local tier (`checkpoint.local`): every `every` steps that are not persistent checkpoint
    steps, each process's shards and its predecessor's to node-local storage; the step waits for
    the device-to-host copy only."""

    def after_step(self, run, info):
        lc = run.cfg.checkpoint.local
        if info.step % lc.every or info.stopping or is_checkpoint_step(run.cfg, info.step):
            return
        if reliability.guards_on(run.cfg.reliability):  # a step with a guard event is not saved
            run.guard.read(run, jax.device_get(info.state.guard))
        if run.guard.rollback_to is not None:
            return
        with run.watchdog.long_work():  # the first save compiles the permute; a slow write may be waited for
            secs = run.local.save(info.step, {"params": info.state.params, "opt_state": info.state.saved_opt_state},
                                  _checkpoint_meta(run.cfg, info.step, run.order))
        run.clock.ckpt += secs
        run.goodput.add("ckpt_block", secs)
        run.goodput.saved(info.step, "local", secs)

    def close(self, run, failed):
        if run is not None and run.local is not None:
            run.local.close()


def default_callbacks(run: Run, eval_source) -> list[Callback]:
    """The built-in callbacks, in the order their work must happen after each step:
    the late metrics read first (it may see a guard event), then the rollback it asks for;
    stragglers; the replica check before any save (a diverged replica is never written); the
    save (after reading the guard); the metrics of this step last, so their read never waits
    on a save. Drills and the replay check run before the step."""
    stragglers = Stragglers(run.cfg)
    evaluation = Evaluation(run, eval_source) if eval_source is not None else None
    sampler = None
    if run.cfg.train.sample_every:
        from maxtrain.generate import Sampler

        sampler = Sampler(run.cfg)
    metrics = Metrics(run, stragglers, evaluation, sampler)
    callbacks = [Drills(), Replay(), metrics, Rollback(), stragglers, Integrity(run)]
    if run.local is not None:
        callbacks.append(LocalCheckpoints())
    if run.ckpt is not None:
        callbacks.append(Checkpoints())
    return callbacks + [LogNow(metrics)]


# ---------------------------------------------------------------- the loop


def train_loop(cfg: Config, devices=None, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Runs the training loop of `cfg` with the built-in callbacks, then `callbacks`."""
    t_start = time.perf_counter()
    if cfg.checkpoint.local.dir:  # an unusable local tier is refused before anything is written
        check_dir(cfg.checkpoint.local.dir)
    local_key = cfg.checkpoint.dir or cfg.run_dir  # before run_dir's placeholders are filled in: stable over attempts
    cfg, run_record = claim_run_dir(cfg)  # another run's directory is refused before anything is written
    log.info("run %s in %s", run_record["run_id"], cfg.run_dir)
    goodput = reliability.Goodput(cfg.run_dir)
    reliability.enable_compilation_cache(cfg.reliability.compilation_cache)
    watchdog = reliability.Watchdog(cfg.reliability).start()  # from here on no read may hang the start-up
    ckpt, run, cbs, window, info, failed = None, None, [], None, None, False
    try:
        with watchdog.phase("start-up (devices, data sources)", cfg.reliability.first_step_timeout_s):
            setup = make_setup(cfg, devices)
            check_state_fits(setup)
            check_start_source(setup)  # a checkpoint of another model is refused before checkpoint.dir exists
            source, eval_source = make_source(cfg), make_eval_source(cfg)
        # owns checkpoint.dir from here on (a second run on it is refused before writing anything)
        ckpt = Checkpointer(cfg.checkpoint.dir, cfg.checkpoint, run_dir=cfg.run_dir) if cfg.checkpoint.dir else None
        local = LocalTier(cfg.checkpoint.local, local_key, setup.mesh) if cfg.checkpoint.local.dir else None
        _announce(cfg, setup)
        with use_mesh(setup.mesh), PreemptionFlag() as stop:
            with (watchdog.phase("checkpoint restore (or initialisation)", cfg.reliability.restore_timeout_s),
                  stop.exits_at_once("checkpoint restore (or initialisation)")):  # a hung read cannot stop it
                t_restore = time.perf_counter()
                state, origin = restore_or_init(setup, ckpt, local)
                goodput.note(restore_s=time.perf_counter() - t_restore, restore_tier=_tier(origin))
            write_run_dir(cfg, run_record)  # run.json and config.yaml, once the start-up checks and restore passed
            first = int(jax.device_get(state.step))
            log.info("state %s at step %d", origin, first)
            if local is not None:  # newer local steps belong to a history this run does not continue
                local.discard_after(first)
            goodput.start(first, startup_s=time.perf_counter() - t_start)
            compiled = _compile(cfg, setup, goodput)
            rows = host_rows(setup.batch_sharding, (cfg.train.batch_size, cfg.train.seq_len))
            run = Run(cfg, setup, ckpt, first, StepClock(first), goodput, watchdog, GuardEvents(),
                      data_order(cfg) if ckpt or local else None, rows, run_id=run_record["run_id"], local=local)
            cbs = default_callbacks(run, eval_source) + list(callbacks)
            for cb in cbs:
                cb.on_start(run)
            window = ProfileWindow(cfg.profile, cfg.run_dir, enabled=run.is_main)
            loader = Loader(source, cfg, first, cfg.train.steps, *rows)
            info = StepInfo(first, state, {}, False, first == cfg.train.steps)
            for step in range(first + 1, cfg.train.steps + 1):
                info = _one_step(run, cbs, loader, window, compiled, info.state, step, stop)
                for cb in cbs:
                    info = dataclasses.replace(info, state=cb.after_step(run, info) or info.state)
                if info.stopping:
                    break
            for cb in cbs:
                cb.on_end(run, info)
    except BaseException as e:
        failed = True  # maybe on this process alone: the clean-up below must not wait for the others
        if info is not None:  # in the loop (an error before it, e.g. a config error, is its own one line)
            log.error("training stopped at step %d by %s", info.step, type(e).__name__)
        raise
    finally:
        _close(run, cbs, window, ckpt, watchdog, failed)
    return _result(run, info, cbs, t_start)


def _one_step(run: Run, cbs: list[Callback], loader: Loader, window: ProfileWindow, compiled, state: TrainState,
              step: int, stop: PreemptionFlag) -> StepInfo:
    """The next batch, the jitted step (dispatched, not waited for) and the step's timing."""
    t_iter = time.perf_counter()
    for cb in cbs:
        cb.before_step(run, step)
    t0 = time.perf_counter()
    local, wait = loader.next()
    run.clock.data += wait
    run.goodput.add("data_wait", wait)
    batch = put_batch(local, run.setup.batch_sharding, run.cfg.train.batch_size)
    t1 = time.perf_counter()
    for cb in cbs:
        cb.before_dispatch(run, step, state, batch)
    state, metrics = window.run(step, compiled, state, batch)  # traced inside profile.*
    run.clock.dispatch += time.perf_counter() - t1
    run.clock.host += t1 - t0 - wait
    run.watchdog.beat()
    return StepInfo(step, state, metrics, stop.agreed(), step == run.cfg.train.steps, t1 - t_iter, wait)


def _announce(cfg: Config, setup: Setup) -> None:
    """The log lines that say what is about to run."""
    n_params = sum(x.size for x in jax.tree.leaves(setup.abstract_state.params))
    log.info("model %s: %.2fM params | mesh %s | %d devices (%s) | %.3g TFLOP/step",
             cfg.model.name, n_params / 1e6, dict(setup.mesh.shape), setup.mesh.size,
             jax.devices()[0].device_kind, setup.flops_per_step / 1e12)
    if cfg.mesh.fsdp == -1 and setup.mesh.shape["fsdp"] > 1:
        log.info("mesh: fsdp takes the devices no other axis sizes (parameters, gradients and optimizer state "
                 "sharded %d ways); mesh.data=-1 for pure data parallelism", setup.mesh.shape["fsdp"])
    pipe = pipeline_summary(cfg)
    if pipe is not None:
        log.info("pipeline: %s schedule, %d stages x %d repeats, %d microbatches: bubble %.1f%% of stage time, "
                 "at most %s (microbatch, chunk) activations alive per stage", pipe["schedule"], cfg.mesh.pipeline,
                 cfg.train.pipeline_repeats, pipeline_microbatches(cfg), 100 * pipe["bubble"],
                 pipe["peak_activations"])


def _tier(origin: str) -> str:
    """Where `restore_or_init` found the state (its description): local | persistent | none."""
    return "local" if "local tier" in origin else "persistent" if origin.startswith(("resumed", "params")) else "none"


class _CacheEvents:
    """Counts JAX's persistent compilation cache hits and misses (jax.monitoring events)."""

    def __init__(self):
        self.hits = self.misses = 0
        jax.monitoring.register_event_listener(self._event)

    def _event(self, name: str, **_):
        if name == "/jax/compilation_cache/cache_hits":
            self.hits += 1
        elif name == "/jax/compilation_cache/cache_misses":
            self.misses += 1


_CACHE_EVENTS: list = []  # one listener per process, registered on the first compile


def _compile(cfg: Config, setup: Setup, goodput: reliability.Goodput):
    if not _CACHE_EVENTS:
        _CACHE_EVENTS.append(_CacheEvents())
    events = _CACHE_EVENTS[0]
    hits, misses = events.hits, events.misses
    compiled, compile_s = compile_train_step(setup)
    goodput.add("compile", compile_s)
    goodput.note(compile_cache="hit" if events.hits > hits and events.misses == misses else
                 "miss" if events.misses > misses else "off")
    log.info("compiled train step in %.1fs", compile_s)
    if jax.process_index() == 0 and cfg.profile.dump_hlo:
        log.info("optimized HLO of the train step: %s", write_hlo(compiled, cfg.run_dir))
    return compiled


def _close(run: Run | None, cbs: list[Callback], window, ckpt: Checkpointer | None, watchdog, failed: bool) -> None:
    """Clean-up in the order that keeps errors visible: the profiler, the callbacks, the checkpoints
    (an in-flight save still commits), then the watchdog (a close that hangs still gets reported)."""
    if window is not None:
        window.close()
    for cb in cbs:
        cb.close(run, failed)
    if ckpt is not None:  # also on errors: an in-flight save still commits, checkpoint.dir is released
        ckpt.close(failed=failed)
    watchdog.stop()


def _result(run: Run, info: StepInfo, cbs: list[Callback], t_start: float) -> TrainResult:
    cfg = run.cfg
    preempted = info.stopping and info.step < cfg.train.steps
    wall = time.perf_counter() - t_start
    if run.is_main:
        run.goodput.write(info.step)
    if run.history:
        log.info("%s: steps %d-%d in %.1fs, loss %.4f -> %.4f", "preempted" if preempted else "done",
                 run.first + 1, info.step, wall, run.history[0]["loss"], run.history[-1]["loss"])
    saved = any(cb.saved for cb in cbs if isinstance(cb, Checkpoints))
    compile_s = run.goodput.parts["compile"]
    return TrainResult(info.state, run.history, compile_s, wall, run.first, preempted, saved)


def _copy_to_host_async(metrics: dict) -> dict:
    """Starts each metric's device-to-host copy, to happen as soon as the step produces it."""
    for x in jax.tree.leaves(metrics):
        x.copy_to_host_async()
    return metrics
