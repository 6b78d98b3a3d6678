"""Where a run starts: resumed from its own checkpoints (or the local tier's newer step, or
`checkpoint.resume_from=PATH`), params only from `checkpoint.init_from`, or freshly initialised.
`restore_or_init` says which as a typed `Origin` (its tier for goodput and the report), and
`check_start_source` refuses a checkpoint of another model before checkpoint.dir is claimed."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from maxtrain.checkpoint import Checkpointer, CorruptCheckpoint, open_path
from maxtrain.checkpoint.meta import step_dirs
from maxtrain.config import Config, ConfigError
from maxtrain.data import data_order, data_order_changes
from maxtrain.run.guard import fresh_guard
from maxtrain.step import (Setup, TrainState, at_step, init_state, precision_state, sharded_abstract_state,
                           with_saved_opt_state)

log = logging.getLogger("maxtrain")


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a run's starting state came from."""

    kind: str  # resumed | init_from | initialised
    tier: str  # where it was read: local | persistent | none (initialised)
    step: int  # the step it starts from (0 for init_from and a fresh state)
    source: str | None = None  # the directory it was read from

    def __str__(self) -> str:
        if self.kind == "resumed":
            return (f"resumed from the local tier ({self.source}) at step {self.step}" if self.tier == "local"
                    else f"resumed from {self.source}/{self.step}")
        return f"params from {self.source}, fresh optimizer" if self.kind == "init_from" else "initialised"


def resume_source(cfg: Config, ckpt: Checkpointer | None) -> tuple[Checkpointer | None, list[int] | None]:
    """Where `checkpoint.resume_from` points: (checkpointer, steps to try newest-first or None=all)."""
    where = cfg.checkpoint.resume_from
    if where == "none":
        return None, None
    if where == "latest":
        return ckpt, None
    src, steps = open_path(where, "checkpoint.resume_from", cfg.object_cache)
    if ckpt is not None and ckpt.directory == src.directory:
        src = ckpt  # the run's own directory: its retention must know what was restored
    elif ckpt is not None and ckpt.steps():
        # a restart of a run that began from PATH: its own checkpoints are newer ("run the same
        # command to resume" after a preemption); PATH only seeds a run with none yet
        log.info("checkpoint.dir %s holds this run's checkpoints (newest %d): resuming from them, not from "
                 "checkpoint.resume_from=%s", ckpt.directory, ckpt.steps()[-1], where)
        return ckpt, None
    return src, steps


# a shape mismatch with checkpoint.init_from: its model is the base, so the config set a shape key
INIT_FROM_FIX = ("leave out the model.* keys that change shapes (checkpoint.init_from's model is the base; the "
                 "warnings above name each key set to another value) or point checkpoint.init_from at a checkpoint "
                 "of this model")


def check_start_source(setup: Setup) -> None:
    """Before checkpoint.dir is claimed (created and locked): a `checkpoint.resume_from=PATH` or
    `checkpoint.init_from` checkpoint of another model is refused while nothing is written yet.
    A resume of the run's own directory is left to `restore_or_init` (that directory exists
    already), as is a step whose metadata is unreadable (it falls back to an older good step)."""
    cfg = setup.cfg
    where, own = cfg.checkpoint.resume_from, cfg.checkpoint.dir
    # a directory listing, not a Checkpointer: opening one is a collective of all processes, and a
    # process that found checkpoint.dir already created by a faster peer would open it alone
    if where != "none" and own and step_dirs(own):
        return  # resumes its own checkpoints
    if where not in ("latest", "none"):
        (src, steps), fix = open_path(where, "checkpoint.resume_from", cfg.object_cache), None
    elif cfg.checkpoint.init_from:
        (src, steps), fix = open_path(cfg.checkpoint.init_from, "checkpoint.init_from", cfg.object_cache), INIT_FROM_FIX
    else:
        return
    try:
        src.check_compatible(steps[-1], sharded_abstract_state(setup).params, fix=fix)
    except CorruptCheckpoint:
        return


def restore_or_init(setup: Setup, ckpt: Checkpointer | None, local=None) -> tuple[TrainState, Origin]:
    """The run's starting state: resumed (from the local tier when it holds a step newer than
    checkpoint.dir's newest), params-only from `init_from`, or freshly initialised."""
    cfg = setup.cfg
    abstract = sharded_abstract_state(setup)
    opt_at = saved_opt_state_at(setup)
    if local is not None and cfg.checkpoint.resume_from == "latest":
        got = local.restore(lambda s: {"params": abstract.params, "opt_state": opt_at(s)},
                            newer_than=max(ckpt.steps(), default=0) if ckpt is not None else 0)
        if got is not None:
            step, trees, meta = got
            check_data_order(cfg, meta, f"the local checkpoint of step {step}")
            step_arr = jax.device_put(jnp.asarray(step, jnp.int32), setup.state_shardings.step)
            state = with_saved_opt_state(step_arr, trees["params"], trees["opt_state"], fresh_guard(setup),
                                         abstract.precision is not None)
            return state, Origin("resumed", "local", step, local.dir)
    src, steps = resume_source(cfg, ckpt)
    if src is not None and (steps or src.steps()):
        r = src.restore_latest_good(abstract.params, opt_at, steps=steps)
        if r is None:
            raise ConfigError(f"no checkpoint under {src.directory} passes verification (each is named above); "
                              f"inspect with `maxtrain checkpoint verify {src.directory}` or set "
                              f"checkpoint.resume_from=none and a new checkpoint.dir to start over")
        refuse_overwrite(ckpt, after=r.step)
        check_data_order(cfg, r.meta, f"{src.directory}/{r.step}")
        step = jax.device_put(jnp.asarray(r.step, jnp.int32), setup.state_shardings.step)
        state = with_saved_opt_state(step, r.params, r.opt_state, fresh_guard(setup), abstract.precision is not None)
        return state, Origin("resumed", "persistent", r.step, src.directory)
    refuse_overwrite(ckpt, after=-1)
    if cfg.checkpoint.init_from:
        src, steps = open_path(cfg.checkpoint.init_from, "checkpoint.init_from", cfg.object_cache)
        r = src.restore_latest_good(abstract.params, None, steps=steps, fix=INIT_FROM_FIX)
        if r is None:
            raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from} holds no verified checkpoint")
        opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings.opt_state)(r.params)
        step0 = jax.device_put(jnp.zeros((), jnp.int32), setup.state_shardings.step)
        fresh = jax.jit(lambda: precision_state(cfg, setup.model), out_shardings=setup.state_shardings.precision)()
        return (TrainState(step0, r.params, opt_state, fresh_guard(setup), fresh),
                Origin("init_from", "persistent", 0, f"{src.directory}/{r.step}"))
    return init_state(setup, cfg.seed), Origin("initialised", "none", 0)


def saved_opt_state_at(setup: Setup):
    """step -> the abstract `opt_state` a checkpoint of that step holds: the optimizer's layout is
    the one of its step's phase (`at_step`: a frozen parameter group holds no moments)."""
    return lambda step: sharded_abstract_state(at_step(setup, step)).saved_opt_state


def refuse_overwrite(ckpt: Checkpointer | None, after: int) -> None:
    """A run must not write over another run's (or its own later) checkpoints in checkpoint.dir."""
    newer = [s for s in (ckpt.steps() if ckpt else []) if s > after]
    if newer:
        raise ConfigError(f"checkpoint.dir {ckpt.directory} already holds checkpoints at steps "
                          f"{', '.join(map(str, newer[-3:]))} after the starting step {max(after, 0)}; this run "
                          f"would overwrite them: use a new checkpoint.dir (or move them away)")


def check_data_order(cfg: Config, restored_meta: dict, where: str) -> None:
    """A resumed run continues the saved run's data stream only with the same `data_order`."""
    saved = restored_meta.get("data", {}).get("order")
    if saved is None:  # written before the order was recorded
        return
    changes = data_order_changes(saved, data_order(cfg))
    if not changes:
        return
    what = "; ".join(changes)
    if cfg.checkpoint.allow_data_change:
        log.warning("resuming from %s with other data settings (%s): the data position is step x batch of the "
                    "new stream, so examples are skipped or repeated (checkpoint.allow_data_change=true)", where, what)
        return
    raise ConfigError(f"checkpoint {where} was written with other data settings ({what}): resuming would skip or "
                      f"repeat training data; keep them, or set checkpoint.allow_data_change=true to accept that")
