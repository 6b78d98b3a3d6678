"""What a run's parts share: the immutable `StepInfo` each callback gets after a step, the
`Run` they all read, the `Callback` hooks, and when each cadence falls (one predicate each)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from maxtrain import reliability
from maxtrain.checkpoint import Checkpointer
from maxtrain.config import Config
from maxtrain.metrics import StepClock
from maxtrain.step import Setup, TrainState


# ---------------------------------------------------------------- what callbacks see


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One finished step, as the callbacks see it (immutable; a callback that replaces the state
    returns the new one and the next callback gets a copy with it)."""

    step: int  # optimizer steps done, from 1
    state: TrainState  # after the step (its arrays may still be computing: async dispatch)
    metrics: dict  # the step's metrics, on device: read them late, never block on them here
    stopping: bool  # every process agreed to stop after this step (SIGTERM/SIGINT, or the straggler watch's eviction)
    final: bool  # the run's last step (train.steps, or where a `repeat: false` data source runs out: `Run.last`)
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
    guard: Any  # the host side of the numerical guard: maxtrain.run.guard.GuardMonitor
    order: dict | None  # the data order saved with each checkpoint
    rows: tuple[int, int]  # this process's batch rows
    history: list[dict] = dataclasses.field(default_factory=list)  # every metrics record
    run_id: str | None = None  # run_dir/run.json's (maxtrain.rundir)
    local: Any = None  # the local checkpoint tier (maxtrain.checkpoint.local.LocalTier) or None
    mixture: Any = None  # a weighted data.path (`maxtrain.data.tokens.Mixture`): tokens per source are logged
    evicted: Any = None  # a `preflight.Unhealthy` from the straggler watch: the callbacks after it see `stopping`
    last: int | None = None  # the step the run ends at: train.steps (None), or where a `repeat: false` source runs out

    def __post_init__(self):
        if self.last is None:
            self.last = self.cfg.train.steps

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
