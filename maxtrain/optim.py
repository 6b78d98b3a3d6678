"""Optimizers and learning-rate schedules (optax)."""

from __future__ import annotations

import jax
import optax

from maxtrain.config import OptimConfig


def make_schedule(o: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine/linear decay to `lr * min_lr_ratio`, or constant."""
    decay_steps = o.decay_steps or total_steps
    end = o.lr * o.min_lr_ratio
    warmup = optax.linear_schedule(0.0, o.lr, max(o.warmup_steps, 1))
    if o.schedule == "constant":
        after = optax.constant_schedule(o.lr)
    else:
        n = max(decay_steps - o.warmup_steps, 1)
        after = (optax.cosine_decay_schedule(o.lr, n, alpha=o.min_lr_ratio) if o.schedule == "cosine"
                 else optax.linear_schedule(o.lr, end, n))
    if o.warmup_steps == 0:
        return after
    return optax.join_schedules([warmup, after], [o.warmup_steps])


def weight_decay_mask(logical_axes):
    """Decay matrices and embeddings, not norm scales (any leaf with a `norm` axis)."""
    return jax.tree.map(lambda axes: "norm" not in axes, logical_axes,
                        is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(o: OptimConfig, schedule: optax.Schedule, logical_axes) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay (masked) after global-norm clipping."""
    parts = []
    if o.clip_norm:
        parts.append(optax.clip_by_global_norm(o.clip_norm))
    parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                             mask=weight_decay_mask(logical_axes)))
    return optax.chain(*parts)
