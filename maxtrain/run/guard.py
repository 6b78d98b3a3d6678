"""The host side of the numerical guard (`reliability.*_action`): the device skips a bad update by
itself; here the guard's event counters are read (at logged steps and before saves), a halt
deletes the checkpoints it condemns, and a rollback restores the newest verified checkpoint
before the event. One `GuardMonitor` per run does all three; it is also the callback that
performs a pending rollback, right after the metrics read that saw the event."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from maxtrain import reliability
from maxtrain.checkpoint import Checkpointer
from maxtrain.run.context import Callback, Run, StepInfo
from maxtrain.step import Setup, TrainState, at_step, conform_state, sharded_abstract_state, with_saved_opt_state

log = logging.getLogger("maxtrain")


class GuardMonitor(Callback):
    """Reads the guard's counters (`read`), halts (deleting the checkpoints at or after the halting
    event), and performs a rollback an event asked for (`after_step`: at most `max_rollbacks`)."""

    def __init__(self):
        self.seen = 0  # guard events the host has reported
        self.rollback_to: int | None = None  # the step of an event whose rollback is pending
        self.rollbacks = 0

    def read(self, run: Run, guard_host: dict) -> None:
        """`reliability.report_events` on the guard's host values (may raise `Halted`)."""
        try:
            self.seen, event_step = reliability.report_events(guard_host, self.seen, run.cfg.reliability)
        except reliability.Halted as e:
            discard_condemned(run.ckpt, e.step)
            raise
        if event_step is not None:
            self.rollback_to = event_step

    def after_step(self, run, info: StepInfo):
        if self.rollback_to is None:
            return None
        event = self.rollback_to
        state = rollback(run.setup, run.ckpt, event, info.step, self.rollbacks, info.state)
        if run.local is not None:  # local steps at or after the event hold the history being undone
            run.local.discard_after(event - 1)
        self.rollbacks += 1
        self.rollback_to = None
        return state


def discard_condemned(ckpt: Checkpointer | None, step: int | None) -> None:
    """Before a halt propagates: the checkpoints saved at or after the halting event's step are
    deleted, so none of them survives it."""
    if ckpt is None or step is None:
        return
    ckpt.wait(retention=False)
    undone = ckpt.discard_from(step)
    if undone:
        log.warning("halt: deleted the checkpoints of steps %s, saved at or after step %d", undone, step)


def fresh_guard(setup: Setup, carry=None):
    """Guard statistics start over after a restore (they re-warm within `spike_warmup` steps);
    `carry`: a guard whose event counters (events, skipped updates, the last event) carry over."""
    if not reliability.guards_on(setup.cfg.reliability):
        return None
    guard = reliability.init_guard()
    if carry is not None:
        kept = jax.device_get({k: carry[k] for k in ("skipped", "events", "last_kind", "last_step", "last_value")})
        guard.update({k: jnp.asarray(v, jnp.float32) for k, v in kept.items()})
    return jax.device_put(guard, setup.state_shardings.guard)


def rollback(setup: Setup, ckpt: Checkpointer | None, event_step: int, now: int, rollbacks: int,
             state: TrainState) -> TrainState:
    """`reliability.*_action: rollback`: the params and moments of the newest verified checkpoint
    before `event_step`, continuing at data position `now` (the batches in between are skipped;
    the step counter, and so the lr schedule, follows the data position). The guard's event
    counters carry over (the host's count of events seen must stay in step with them); its
    statistics re-warm. `state`'s arrays are freed before the restore, so the state is never
    held twice."""
    r = setup.cfg.reliability
    if ckpt is None:
        raise reliability.Halted(f"guard event at step {event_step} asks for a rollback but checkpoint.dir is not set")
    if rollbacks >= r.max_rollbacks:
        raise reliability.Halted(f"guard event at step {event_step} after {rollbacks} rollbacks "
                                 f"(reliability.max_rollbacks={r.max_rollbacks})")
    ckpt.wait(retention=False)  # retention could drop the only checkpoint before the event for a later one
    steps = [s for s in ckpt.steps() if s < event_step]
    if not steps:
        raise reliability.Halted(f"guard event at step {event_step}: no checkpoint before it to roll back to")
    guard = fresh_guard(setup, carry=state.guard)
    jax.tree.map(lambda x: x.delete(), (state.params, state.opt_state, state.precision))
    abstract = sharded_abstract_state(setup)
    restored = (ckpt.restore_latest_good(abstract.params, lambda s: sharded_abstract_state(at_step(setup, s))
                                         .saved_opt_state, steps=steps) if steps else None)
    if restored is None:
        raise reliability.Halted(f"guard event at step {event_step}: no verified checkpoint before it to roll back to")
    log.warning("rollback: restored the checkpoint of step %d after the event at step %d; continuing at step %d, "
                "skipping the batches in between", restored.step, event_step, now)
    undone = ckpt.discard_from(event_step)  # saved after the event: a restart must not resume from them
    if undone:
        log.warning("rollback: deleted the checkpoints of steps %s, saved after the event", undone)
    step = jax.device_put(jnp.asarray(now, jnp.int32), setup.state_shardings.step)
    # `setup` is the one of step `now`: a checkpoint of an earlier phase takes its layout
    return conform_state(setup, with_saved_opt_state(step, restored.params, restored.opt_state, guard,
                                                     abstract.precision is not None))
