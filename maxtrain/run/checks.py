"""The run's checks around its steps: fault drills before a step, the deterministic-replay check
(a step run twice must agree bitwise), replica fingerprints (silent corruption), and stragglers."""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

from maxtrain import reliability
from maxtrain.config import Config
from maxtrain.reliability import drills, preflight
from maxtrain.run.context import Callback, Run, saves_after
from maxtrain.step import Setup, TrainState, make_train_step

log = logging.getLogger("maxtrain")


class Drills(Callback):
    """Host-side fault drills (`drills.*`): hang, crash, SIGTERM or sleep before a step."""

    def before_step(self, run, step):
        drills.host_faults(run.cfg.drills, step - 1)


class Replay(Callback):
    """Every `replay_every` steps the step is first run twice more on the same state and batch."""

    def __init__(self):
        self.fn = None  # the non-donating replay step, compiled at the first check
        self.setup = None  # the setup it was compiled for (an optim.groups phase change brings another)

    def before_dispatch(self, run, step, state, batch):
        if run.cfg.reliability.replay_every and step % run.cfg.reliability.replay_every == 0:
            with run.watchdog.long_work():  # the first check compiles the replay step
                self.check(run.setup, state, batch, step)

    def check(self, setup: Setup, state: TrainState, batch: dict, step: int) -> None:
        """Runs step `step` twice on the same state and batch (not donated, result dropped) and
        requires bitwise-equal loss and gradient norm (`reliability.Nondeterministic` otherwise)."""
        if self.fn is None or self.setup is not setup:
            self.setup = setup
            step_fn = make_train_step(setup.cfg, setup.model, setup.tx, setup.schedule)
            self.fn = jax.jit(lambda s, b: {k: v for k, v in step_fn(s, b)[1].items() if k in ("loss", "grad_norm")},
                              in_shardings=(setup.state_shardings, setup.batch_sharding))
        reliability.check_replay(jax.device_get(self.fn(state, batch)), jax.device_get(self.fn(state, batch)), step)


class Stragglers(Callback):
    """Every `straggler_every` steps, names processes whose host step work is slow, and evicts one
    whose devices stay slow: its report is written to run_dir/stragglers.json, `run.evicted` is set
    and the loop stops after this step (saved like a preemption); `maxtrain train` exits 78."""

    def __init__(self, cfg: Config):
        self.watch = reliability.StragglerWatch(cfg.reliability, cfg.drills.straggler_factor, cfg.drills.process)

    def after_step(self, run, info):
        self.watch.add(info.host_s, info.data_wait_s)  # host work before dispatch: not hidden by a slower peer
        self.watch.check(info.step)
        report = self.watch.condemned
        if report is not None and run.evicted is None and not info.final:  # a finished run is not requeued
            path = os.path.join(run.cfg.run_dir, "stragglers.json")
            if run.is_main:
                log.error("straggler watch at step %d:\n%s", info.step, "\n".join(report.lines()))
            preflight.publish(report, path, by="the straggler watch")
            run.evicted = preflight.Unhealthy(report, "the straggler watch", path)


class Integrity(Callback):
    """Replica fingerprints every `fingerprint_every` steps and before every save while the check is
    on (a diverged replica is never written: `reliability.Corrupted`); the bit-flip drill strikes
    here too."""

    def __init__(self, run: Run):
        self.fingerprint = reliability.make_fingerprint(run.setup.mesh, run.setup.state_shardings.params)

    def after_step(self, run, info):
        cfg, state = run.cfg, info.state
        d = cfg.drills
        if d.bitflip_step is not None and info.step == d.bitflip_step + 1 and drills.first_attempt():
            state = dataclasses.replace(state, params=drills.flip_a_bit(state.params))
        every = cfg.reliability.fingerprint_every
        if every and (saves_after(cfg, info) or info.step % every == 0):
            reliability.check_replicas(self.fingerprint, state.params, run.setup.mesh,
                                       reliability.replica_axes(run.setup.state_shardings.params, run.setup.mesh),
                                       info.step)
        return state
