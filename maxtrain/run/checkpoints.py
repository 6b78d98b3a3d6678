"""The run's saves: periodic checkpoints to checkpoint.dir (after the guard was read: no step at
or after a guard event is written), the local tier's steps in between, and the final or
preemption save at the end. Each save is recorded in goodput.json."""

from __future__ import annotations

import logging
import os

import jax

from maxtrain import reliability
from maxtrain.checkpoint import Checkpointer
from maxtrain.config import Config, to_dict
from maxtrain.run.context import Callback, is_checkpoint_step, saves_after
from maxtrain.step import TrainState

log = logging.getLogger("maxtrain")


def checkpoint_meta(cfg: Config, next_step: int, order: dict) -> dict:
    """What each checkpoint records beside its arrays (the on-disk keys stay as they are).
    The data sources are pure functions of (seed, step): the step is the iterator state, valid
    for a run with the same `data_order`; `cwd`: where the config's relative paths (init_from,
    data.path) pointed, for tools run elsewhere."""
    return {"seed": cfg.seed, "data": {"kind": cfg.data.kind, "next_step": next_step, "order": order},
            "config": to_dict(cfg), "cwd": os.getcwd()}


def final_save(cfg: Config, ckpt: Checkpointer, state: TrainState, done: int, first: int, order: dict,
               goodput: reliability.Goodput, kind: str = "final") -> bool:
    """After the loop (finished or preempted): the newest background save commits, then the last
    step is saved synchronously unless it already is. Whether `done` is now checkpointed."""
    ckpt.wait()
    if done > first and done not in ckpt.steps():
        secs = ckpt.save(done, state.params, state.saved_opt_state, checkpoint_meta(cfg, done, order), wait=True)
        goodput.add("ckpt_block", secs)
        if done in ckpt.steps():
            goodput.saved(done, kind, secs)
            log.info("checkpoint of step %d saved in %.2fs", done, secs)
    saved = done in ckpt.steps()
    if done > first and not saved:
        good = ckpt.steps()
        log.warning("the checkpoint of step %d could not be saved (see above); %s", done,
                    f"the newest good checkpoint is step {good[-1]}: {ckpt.directory}/{good[-1]}" if good
                    else f"{ckpt.directory} holds no complete checkpoint")
    return saved


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
                                     checkpoint_meta(cfg, info.step, run.order))
            run.clock.ckpt += secs
            run.goodput.add("ckpt_block", secs)
            run.goodput.saved(info.step, "periodic", secs)

    def on_end(self, run, info):
        if run.guard.rollback_to is not None:  # an event at the last step: its state is not saved
            log.warning("the run ended with a rollback pending (event at step %d): no final checkpoint",
                        run.guard.rollback_to)
            return
        with run.watchdog.long_work():  # the final (or preemption) save may outlast a step
            kind = ("eviction" if run.evicted is not None else
                    "preemption" if info.stopping and info.step < run.last else "final")
            self.saved = final_save(run.cfg, run.ckpt, info.state, info.step, run.first, run.order, run.goodput,
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
                                  checkpoint_meta(run.cfg, info.step, run.order))
        run.clock.ckpt += secs
        run.goodput.add("ckpt_block", secs)
        run.goodput.saved(info.step, "local", secs)

    def close(self, run, failed):
        if run is not None and run.local is not None:
            run.local.close()
