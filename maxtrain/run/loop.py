"""The training loop: a short loop over ordered callbacks.

`train(cfg)` claims the run directory, builds the setup, restores or initialises the state,
compiles the step and then, for each step, takes the next batch, runs the step and hands a small
immutable `StepInfo` to each callback in turn. Every concern of a long run (metrics, evaluation,
checkpoints, the guard, replica checks, replay, stragglers, drills) is one `Callback` in its own
module of this package; `default_callbacks` lists them in the one order that matters. A library
user adds their own with `maxtrain.train(cfg, callbacks=[...])`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Sequence

import jax

from maxtrain import reliability
from maxtrain.checkpoint import Checkpointer
from maxtrain.checkpoint.local import LocalTier, check_dir
from maxtrain.config import Config, pipeline_microbatches
from maxtrain.data import Loader, data_order, last_step, make_eval_source, make_source
from maxtrain.data.tokens import Mixture
from maxtrain.generate import Sampler, check_supported
from maxtrain.mesh import use_mesh
from maxtrain.reliability import preflight
from maxtrain.metrics import ProfileWindow, StepClock, write_hlo
from maxtrain.run.checkpoints import Checkpoints, LocalCheckpoints
from maxtrain.run.checks import Drills, Integrity, Replay, Stragglers
from maxtrain.run.context import Callback, Run, StepInfo
from maxtrain.run.directory import RunDirUpload, claim_run_dir, write_run_dir
from maxtrain.run.guard import GuardMonitor
from maxtrain.run.preemption import PreemptionFlag
from maxtrain.run.records import Evaluation, LogNow, Metrics
from maxtrain.run.resume import check_start_source, restore_or_init
from maxtrain.step import (Setup, TrainState, at_step, check_state_fits, compile_train_step, conform_state, host_rows,
                           make_setup, pipeline_summary, put_batch)

log = logging.getLogger("maxtrain")


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    history: list[dict]  # every logged metrics record
    compile_s: float
    wall_s: float
    start_step: int = 0
    preempted: bool = False  # stopped early by a signal
    checkpoint_saved: bool = False  # the final step is in checkpoint.dir
    evicted: preflight.Unhealthy | None = None  # the straggler watch condemned a process: stopped early


def default_callbacks(run: Run, eval_source) -> list[Callback]:
    """The built-in callbacks, in the order their work must happen after each step:
    the late metrics read first (it may see a guard event), then the rollback it asks for (the
    run's `GuardMonitor`);
    stragglers; the replica check before any save (a diverged replica is never written); the
    save (after reading the guard); the metrics of this step last, so their read never waits
    on a save. Drills and the replay check run before the step."""
    stragglers = Stragglers(run.cfg)
    evaluation = Evaluation(run, eval_source) if eval_source is not None else None
    sampler = None
    if run.cfg.train.sample_every:
        sampler = Sampler(run.cfg)
    metrics = Metrics(run, stragglers, evaluation, sampler)
    callbacks = [Drills(), Replay(), metrics, run.guard, stragglers, Integrity(run)]
    if run.local is not None:
        callbacks.append(LocalCheckpoints())
    if run.ckpt is not None:
        callbacks.append(Checkpoints())
    return callbacks + [LogNow(metrics)]


# ---------------------------------------------------------------- the loop


def train(cfg: Config, devices=None, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Runs the training loop of `cfg` (the same loop as `maxtrain train`) with the built-in
    callbacks, then `callbacks`: more `maxtrain.run.Callback`s."""
    t_start = time.perf_counter()
    if cfg.checkpoint.local.dir:  # an unusable local tier is refused before anything is written
        check_dir(cfg.checkpoint.local.dir)
    local_key = cfg.checkpoint.dir or cfg.run_dir  # before run_dir's placeholders are filled in: stable over attempts
    cfg, run_record = claim_run_dir(cfg)  # another run's directory is refused before anything is written
    log.info("run %s in %s", run_record["run_id"], run_record.get("url") or cfg.run_dir)
    url = run_record.get("url")  # a bucket run_dir: written through cfg.run_dir, a node-local mirror
    upload = RunDirUpload(cfg.run_dir, url).start() if url and jax.process_index() == 0 else None
    try:
        return _train(cfg, devices, callbacks, t_start, run_record, local_key)
    finally:
        if upload is not None:  # after everything is written, goodput.json included
            upload.close()


def _train(cfg: Config, devices, callbacks, t_start: float, run_record: dict, local_key: str) -> TrainResult:
    """`train` once its run_dir is claimed (`cfg.run_dir`: where its files go, on this node)."""
    goodput = reliability.Goodput(cfg.run_dir)
    reliability.enable_compilation_cache(cfg.reliability.compilation_cache)
    watchdog = reliability.Watchdog(cfg.reliability).start()  # from here on no read may hang the start-up
    ckpt, run, cbs, window, info, failed = None, None, [], None, None, False
    try:
        with watchdog.phase("start-up (devices, data sources)", cfg.reliability.first_step_timeout_s):
            setup, source, eval_source = _checked_setup(cfg, devices)
            last = last_step(cfg, source)  # train.steps, or where a `repeat: false` source runs out
        # owns checkpoint.dir from here on (a second run on it is refused before writing anything)
        ckpt = (Checkpointer(cfg.checkpoint.dir, cfg.checkpoint, run_dir=run_record.get("url") or cfg.run_dir)
                if cfg.checkpoint.dir else None)
        local = LocalTier(cfg.checkpoint.local, local_key, setup.mesh) if cfg.checkpoint.local.dir else None
        _announce(cfg, setup)
        _preflight(cfg, setup, watchdog)
        with use_mesh(setup.mesh), PreemptionFlag() as stop:
            state, first = _restore(setup, ckpt, local, stop, watchdog, goodput)
            setup = at_step(setup, first)  # the optimizer of the next update (optim.groups' phase)
            write_run_dir(cfg, run_record)  # run.json and config.yaml, once the start-up checks and restore passed
            goodput.start(first, startup_s=time.perf_counter() - t_start)
            compiled = _compile(cfg, setup, goodput)
            rows = host_rows(setup.batch_sharding, (cfg.train.batch_size, cfg.train.seq_len))
            run = Run(cfg, setup, ckpt, first, StepClock(first), goodput, watchdog, GuardMonitor(),
                      data_order(cfg) if ckpt or local else None, rows, run_id=run_record["run_id"], local=local,
                      mixture=source if isinstance(source, Mixture) else None, last=last)
            cbs = default_callbacks(run, eval_source) + list(callbacks)
            for cb in cbs:
                cb.on_start(run)
            window = ProfileWindow(cfg.profile, cfg.run_dir, enabled=run.is_main)
            loader = Loader(source, cfg, first, last, *rows)
            info = StepInfo(first, state, {}, False, first >= last)
            for step in range(first + 1, last + 1):
                info = _one_step(run, cbs, loader, window, compiled, info.state, step, stop)
                info, compiled = _next_phase(run, info, compiled)
                for cb in cbs:
                    info = dataclasses.replace(info, state=cb.after_step(run, info) or info.state,
                                               stopping=info.stopping or run.evicted is not None)
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


def _preflight(cfg: Config, setup: Setup, watchdog) -> None:
    """`reliability.preflight`: every device, link and disk measured on every process before the
    restore (checkpoint.dir is this run's by now: its Checkpointer holds the lock); a condemned node
    raises `preflight.Unhealthy` (the job exits 78)."""
    mode = preflight.resolve_mode(cfg.reliability.preflight, jax.process_count())
    if mode == "off":
        return
    with watchdog.phase(f"preflight ({mode})", cfg.reliability.first_step_timeout_s):
        preflight.check(cfg, setup.mesh, mode, os.path.join(cfg.run_dir, "preflight.json"))


def _checked_setup(cfg: Config, devices):
    """The setup and the data sources, every start-up check passed and nothing written yet."""
    if cfg.train.sample_every:  # before anything compiles: not every family decodes
        check_supported(cfg.model)
    setup = make_setup(cfg, devices)
    check_state_fits(setup)
    check_start_source(setup)  # a checkpoint of another model is refused before checkpoint.dir exists
    return setup, make_source(cfg), make_eval_source(cfg)


def _restore(setup: Setup, ckpt: Checkpointer | None, local, stop: PreemptionFlag, watchdog,
             goodput: reliability.Goodput) -> tuple[TrainState, int]:
    """The starting state (`restore_or_init`) under the watchdog, a signal exiting at once (a hung
    read cannot stop it otherwise), and the step it starts from; goodput notes the restore."""
    with (watchdog.phase("checkpoint restore (or initialisation)", setup.cfg.reliability.restore_timeout_s),
          stop.exits_at_once("checkpoint restore (or initialisation)")):
        t_restore = time.perf_counter()
        state, origin = restore_or_init(setup, ckpt, local)
        goodput.note(restore_s=time.perf_counter() - t_restore, restore_tier=origin.tier)
    first = int(jax.device_get(state.step))
    log.info("state %s at step %d", origin, first)
    if local is not None:  # newer local steps belong to a history this run does not continue
        local.discard_after(first)
    return state, first


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
    return StepInfo(step, state, metrics, stop.agreed(), step == run.last, t1 - t_iter, wait)


def _next_phase(run: Run, info: StepInfo, compiled):
    """After a step where `optim.groups` change phase (a frozen group starts learning, a row mask
    ends): the optimizer of the next update, the state in its layout (a group that starts learning
    gets its moments now, so a checkpoint of this step holds them) and its compiled step."""
    setup = at_step(run.setup, info.step)
    if setup is run.setup:
        return info, compiled
    run.setup = setup
    info = dataclasses.replace(info, state=conform_state(setup, info.state))
    frozen, masked = setup.phase
    log.info("step %d: optim.groups change phase: %s frozen, %s with masked rows", info.step,
             ", ".join(f"groups[{i}]" for i in frozen) or "none", ", ".join(f"groups[{i}]" for i in masked) or "none")
    if info.final or info.stopping:  # no further step: nothing to compile
        return info, None
    with run.watchdog.long_work():
        return info, _compile(run.cfg, setup, run.goodput)


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
    preempted = info.stopping and info.step < run.last and run.evicted is None
    wall = time.perf_counter() - t_start
    if run.is_main:
        run.goodput.write(info.step)
    if run.history:
        log.info("%s: steps %d-%d in %.1fs, loss %.4f -> %.4f",
                 "evicted" if run.evicted is not None else "preempted" if preempted else "done",
                 run.first + 1, info.step, wall, run.history[0]["loss"], run.history[-1]["loss"])
    saved = any(cb.saved for cb in cbs if isinstance(cb, Checkpoints))
    compile_s = run.goodput.parts["compile"]
    return TrainResult(info.state, run.history, compile_s, wall, run.first, preempted, saved, run.evicted)
