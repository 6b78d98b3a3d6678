"""Numerical guards inside the jitted step: a non-finite or spiking update is skipped; the host
reads the events late and halts or asks for a rollback per config."""

from __future__ import annotations

import logging

import jax.numpy as jnp

from maxtrain.config import ReliabilityConfig

log = logging.getLogger("maxtrain")

EVENT_KINDS = ("nan", "loss_spike", "grad_spike")  # guard event codes 1, 2, 3


class Halted(RuntimeError):
    """A numerical guard with action `halt` fired: the run stops before the bad update spreads.
    `step`: the first step whose state must not survive in a checkpoint (None: no such step)."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


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
