"""Optimizers and learning-rate schedules (optax): AdamW, and Muon (`optim.name: muon`) for the
layers' weight matrices with AdamW for the rest."""

from __future__ import annotations

import jax
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon
from optax.contrib._muon import scale_by_shape

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


# Axes a weight is stacked along (each slice its own matrix): the layer stack, pipeline stages,
# experts, and unnamed axes (a MoE block's inner layers, a router's experts).
STACK_AXES = (None, "layers", "repeats", "stages", "experts")


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


def muon_dims(path: str, axes: tuple, keep_adamw=()) -> MuonDimensionNumbers | None:
    """How Muon sees a parameter: a stack of matrices whose rows are the `embed` axis and whose
    columns are its other named axes (q/k/v/o: heads x head_dim; MLPs: mlp), each slice along
    `STACK_AXES` orthogonalised on its own, input axes first (`x @ W`). None (AdamW) for
    embeddings and the head (a `vocab` axis), norms and biases, anything without `embed` and one
    other named axis (routers), and paths containing one of `keep_adamw`."""
    if any(k in path for k in keep_adamw) or "vocab" in axes or "norm" in axes:
        return None
    matrix = [i for i, a in enumerate(axes) if a not in STACK_AXES]
    if len(matrix) < 2 or "embed" not in [axes[i] for i in matrix]:
        return None
    e = axes.index("embed")
    rest = tuple(i for i in matrix if i != e)
    if matrix[0] == e:
        return MuonDimensionNumbers(reduction_axis=(e,), output_axis=rest)
    return MuonDimensionNumbers(reduction_axis=rest, output_axis=(e,))


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def muon_layout(logical_axes, keep_adamw=()):
    """`muon_dims` for every parameter: a tree like the params of MuonDimensionNumbers or None."""
    return jax.tree_util.tree_map_with_path(lambda p, axes: muon_dims(_path(p), axes, tuple(keep_adamw)),
                                            logical_axes, is_leaf=_is_axes)


def _muon(o: OptimConfig, schedule: optax.Schedule, logical_axes) -> optax.GradientTransformation:
    """Muon for the layers' matrices (`muon_layout`), AdamW for the rest; one learning rate and
    weight decay for both (`optim.muon.rms_scale` matches Muon's update RMS to AdamW's)."""
    m = o.muon
    dims = muon_layout(logical_axes, m.adamw)
    labels = jax.tree.map(lambda d: "adamw" if d is None else "muon", dims,
                          is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    muon_only = jax.tree.map(lambda d: d if d is not None else optax.MaskedNode(), dims,
                             is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    muon = optax.chain(
        scale_by_muon(ns_steps=m.ns_steps, beta=m.beta, eps=o.eps, nesterov=m.nesterov,
                      weight_dimension_numbers=muon_only),
        scale_by_shape(weight_dimension_numbers=muon_only, consistent_rms=m.rms_scale or None),
        optax.add_decayed_weights(o.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
    adamw = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                        mask=weight_decay_mask(logical_axes))
    return optax.partition({"muon": muon, "adamw": adamw}, labels)


def make_optimizer(o: OptimConfig, schedule: optax.Schedule, logical_axes) -> optax.GradientTransformation:
    """`optim.name` (AdamW with decoupled, masked weight decay, or Muon) after global-norm clipping."""
    parts = []
    if o.clip_norm:
        parts.append(optax.clip_by_global_norm(o.clip_norm))
    if o.name == "muon":
        parts.append(_muon(o, schedule, logical_axes))
    else:
        parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                                 mask=weight_decay_mask(logical_axes)))
    return optax.chain(*parts)
