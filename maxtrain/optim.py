"""Optimizers and learning-rate schedules (optax): AdamW, and Muon (`optim.name: muon`) for the
layers' weight matrices with AdamW for the rest."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import optax
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers, scale_by_muon
from optax.contrib._muon import scale_by_shape

from maxtrain.config import OptimConfig
from maxtrain.sharding import entry_axes, logical_to_spec


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


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
    return jax.tree.map(lambda axes: "norm" not in axes, logical_axes, is_leaf=_is_axes)


def _adamw(o: OptimConfig, schedule: optax.Schedule, logical_axes) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay, masked off norm scales."""
    return optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=weight_decay_mask(logical_axes))


# Axes a weight is stacked along (each slice its own matrix): the layer stack, pipeline stages,
# experts, and unnamed axes (a MoE block's inner layers, a router's experts).
STACK_AXES = (None, "layers", "repeats", "stages", "experts")
# The axis a matrix's rows run along: the model dim, or a latent (multi-head latent attention's
# up-projections `[rank, heads, head_dim]`)
ROW_AXES = ("embed", "q_lora", "kv_lora")


def muon_dims(path: str, axes: tuple, keep_adamw=()) -> MuonDimensionNumbers | None:
    """How Muon sees a parameter: a stack of matrices whose rows are the `embed` axis (or a latent
    rank, `ROW_AXES`) and whose columns are its other named axes (q/k/v/o: heads x head_dim; MLPs:
    mlp), each slice along `STACK_AXES` orthogonalised on its own, input axes first (`x @ W`). None (AdamW) for
    embeddings and the head (a `vocab` axis), norms and biases, anything without a row axis and one
    other named axis (routers), and paths containing one of `keep_adamw`."""
    if any(k in path for k in keep_adamw) or "vocab" in axes or "norm" in axes:
        return None
    matrix = [i for i, a in enumerate(axes) if a not in STACK_AXES]
    rows = [i for i in matrix if axes[i] in ROW_AXES]
    if len(matrix) < 2 or not rows:
        return None
    e = rows[0]
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


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def whole_matrix_specs(axes: tuple, shape: tuple, rules: dict, sizes: dict) -> list[PartitionSpec]:
    """Where a stack of matrices is best orthogonalised: each device holding whole matrices, the
    mesh axes that split the matrices (FSDP's `embed`, tensor's heads or mlp) moved onto a stacking
    axis they divide (the layers), so the Newton-Schulz products need no collectives. With all of
    them moved no device repeats another's work; axes that do not divide the stack are dropped
    (the matrices gathered over them, their work repeated there). Returned as the steps from the
    stored layout, one mesh axis moved at a time (each an all-to-all: XLA turns a move of several
    at once into gathers); empty when no stacking axis divides by any (the matrices stay as stored
    and XLA partitions the products)."""
    spec = list(logical_to_spec(axes, rules))
    stack = [d for d, a in enumerate(axes) if a in STACK_AXES]
    moving = tuple(a for d, e in enumerate(spec) if d not in stack for a in entry_axes(e) if sizes.get(a, 1) > 1)
    for d in stack:
        held = entry_axes(spec[d])
        for group in [moving] + [(a,) for a in moving]:
            if shape[d] % math.prod(sizes[a] for a in held + group):
                continue
            steps, current = [], list(spec)
            for a in group:  # move one mesh axis onto the stack
                current = [_entry(tuple(x for x in entry_axes(e) if x != a)) if i != d else e
                           for i, e in enumerate(current)]
                current[d] = _entry(entry_axes(current[d]) + (a,))
                steps.append(PartitionSpec(*current))
            whole = [e if i in stack else None for i, e in enumerate(current)]  # then gather what is left
            if whole != current:
                steps.append(PartitionSpec(*whole))
            return steps
    return []


def _resharded(logical_axes, rules: dict, whole: bool) -> optax.GradientTransformation:
    """Constrains the updates to the whole-matrix layout (`whole`) or back to the parameters' own,
    a mesh axis at a time (`whole_matrix_specs`)."""
    def update(updates, state, params=None):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.size == 1:
            return updates, state
        sizes = dict(mesh.shape)

        def one(u, axes):
            if isinstance(u, optax.MaskedNode):
                return u
            steps = whole_matrix_specs(axes, u.shape, rules, sizes)
            if not steps:
                return u
            path = steps if whole else steps[-2::-1] + [logical_to_spec(axes, rules)]
            for spec in path:
                u = jax.lax.with_sharding_constraint(u, spec)
            return u

        return jax.tree.map(one, updates, logical_axes, is_leaf=lambda x: isinstance(x, optax.MaskedNode)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _muon(o: OptimConfig, schedule: optax.Schedule, logical_axes, rules: dict | None,
          present=None) -> optax.GradientTransformation:
    """Muon for the layers' matrices (`muon_layout`), AdamW for the rest; one learning rate and
    weight decay for both (`optim.muon.rms_scale` matches Muon's update RMS to AdamW's). With
    sharding `rules`, the momentum is orthogonalised in `whole_matrix_specs`' layout. `present`: a
    tree like the params of whether this optimizer sees each (under an `optax.partition`, the
    others arrive masked: Muon must not expect a matrix there); None: all."""
    m = o.muon
    dims = muon_layout(logical_axes, m.adamw)
    if present is not None:
        dims = jax.tree.map(lambda d, here: d if here else None, dims, present,
                            is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    labels = jax.tree.map(lambda d: "adamw" if d is None else "muon", dims,
                          is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    muon_only = jax.tree.map(lambda d: d if d is not None else optax.MaskedNode(), dims,
                             is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    muon_axes = jax.tree.map(lambda d, axes: axes if d is not None else optax.MaskedNode(), dims, logical_axes,
                             is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    reshard = (lambda whole: _resharded(muon_axes, rules, whole)) if rules is not None else (
        lambda whole: optax.identity())
    muon = optax.chain(
        reshard(True),
        scale_by_muon(ns_steps=m.ns_steps, beta=m.beta, eps=o.eps, nesterov=m.nesterov,
                      weight_dimension_numbers=muon_only),
        reshard(False),
        scale_by_shape(weight_dimension_numbers=muon_only, consistent_rms=m.rms_scale or None),
        optax.add_decayed_weights(o.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
    return optax.partition({"muon": muon, "adamw": _adamw(o, schedule, logical_axes)}, labels)


# ---------------------------------------------------------------- parameter groups


def group_index(path: str, groups) -> int:
    """The index of the first of `optim.groups` whose `params` regex `path` matches (re.search), else -1."""
    import re

    return next((i for i, g in enumerate(groups) if re.search(str(g["params"]), path)), -1)


def param_groups(groups, logical_axes):
    """A tree like the params of each parameter's group index (-1: none), checking that a group with
    `rows_from` only takes parameters with a `vocab` axis."""
    from maxtrain.config import ConfigError

    def one(p, axes):
        i = group_index(_path(p), groups)
        if i >= 0 and "rows_from" in groups[i] and "vocab" not in axes:
            raise ConfigError(f"optim.groups: {_path(p)} matches params {groups[i]['params']!r}, whose rows_from "
                              "needs a parameter with a vocab axis (embed/embedding, lm_head/kernel); narrow the regex")
        return i

    return jax.tree_util.tree_map_with_path(one, logical_axes, is_leaf=_is_axes)


def phase(groups, step: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What `optim.groups` hold back for the update of step `step` (counted from 0, like the train
    state's step before it): (the groups still frozen, the groups whose rows are still masked).
    The optimizer is built for one phase (`make_optimizer(step=)`); the run changes it when the
    phase of its step changes, so a phase follows the data position, skipped steps included."""
    frozen = tuple(i for i, g in enumerate(groups) if int(g.get("frozen_until", 0)) > step)
    masked = tuple(i for i, g in enumerate(groups) if "rows_from" in g and step < int(g.get("rows_until", 2**62)))
    return frozen, masked


class GroupState(NamedTuple):
    count: jax.Array  # updates applied so far (the phase is the optimizer's build; kept: the checkpoint layout)


def group_scales(groups, logical_axes, step: int = 0) -> optax.GradientTransformation:
    """Each parameter's update times its group's `lr_scale` and, for a group whose rows are masked
    at `step` (`phase`), zero outside rows `rows_from`.. of its `vocab` axis: masked entries get
    exactly zero updates (weight decay included). The phase is the optimizer's build; the state
    keeps a count of updates only so that checkpoints keep their layout."""
    import jax.numpy as jnp

    index = param_groups(groups, logical_axes)
    masked = set(phase(groups, step)[1])

    def update(updates, state, params=None):
        def one(u, i, axes):
            if i < 0 or isinstance(u, optax.MaskedNode):
                return u
            g = groups[i]
            u = u * jnp.asarray(float(g.get("lr_scale", 1.0)), u.dtype)
            if i in masked:
                rows = jax.lax.broadcasted_iota(jnp.int32, u.shape, axes.index("vocab")) >= int(g["rows_from"])
                u = jnp.where(rows, u, jnp.zeros_like(u))  # zero even where u is not finite
            return u

        out = jax.tree.map(one, updates, index, logical_axes, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
        return out, GroupState(state.count + 1)

    return optax.GradientTransformation(lambda params: GroupState(jnp.zeros([], jnp.int32)), update)


def frozen_starts(groups, logical_axes):
    """A tree like the params of the step each parameter starts learning at (its group's
    `frozen_until`, else 0), or None when no group freezes anything."""
    if not any(g.get("frozen_until") for g in groups):
        return None
    return jax.tree.map(lambda i: int(groups[i].get("frozen_until", 0)) if i >= 0 else 0,
                        param_groups(groups, logical_axes))


def carry_over(old, new):
    """`new` (an optimizer state of the next phase, freshly initialised) with every leaf that `old`
    (the last phase's) holds at the same path and shape: the moments and counts of parameters that
    learned before carry on; a parameter that starts learning begins with zero moments and its own
    count (Adam's bias correction starts afresh, as for a new parameter)."""
    have = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(old)[0]}

    def pick(path, leaf):
        o = have.get(jax.tree_util.keystr(path))
        return o if o is not None and o.shape == leaf.shape and o.dtype == leaf.dtype else leaf

    return jax.tree_util.tree_map_with_path(pick, new)


def _decay_of(o: OptimConfig, groups, logical_axes):
    """Each parameter's weight decay: its group's, else `optim.weight_decay`."""
    return jax.tree.map(lambda i: float(groups[i].get("weight_decay", o.weight_decay)) if i >= 0 else
                        float(o.weight_decay), param_groups(groups, logical_axes))


def make_optimizer(o: OptimConfig, schedule: optax.Schedule, logical_axes,
                   rules: dict | None = None, learned=None, step: int = 0) -> optax.GradientTransformation:
    """`optim.name` (AdamW with decoupled, masked weight decay, or Muon) after global-norm clipping;
    `rules`: the parameters' sharding rules (Muon's whole-matrix layout is derived from them);
    `learned`: a tree like the params of whether to update each (False: the model's own state,
    e.g. a router's balancing bias, left alone: no update, no moments); None: all. `step`: the
    update the optimizer is built for (`phase`): a parameter whose group is frozen at that step
    gets no update and holds no moments, and its gradient is left out of the clipping norm; from its
    `frozen_until` on it learns under its own optimizer state (`carry_over` starts it at zero)."""
    if learned is not None and not all(jax.tree.leaves(learned)):
        labels = jax.tree.map(lambda on: "learned" if on else "fixed", learned)
        return optax.partition({"learned": make_optimizer(o, schedule, logical_axes, rules, step=step),
                                "fixed": optax.set_to_zero()}, labels)
    starts = frozen_starts(o.groups, logical_axes)
    parts = []
    if starts is not None:  # before clipping: a frozen parameter's gradient is not in the norm
        parts.append(optax.masked(optax.set_to_zero(), jax.tree.map(lambda k: k > step, starts)))
    if o.clip_norm:
        parts.append(optax.clip_by_global_norm(o.clip_norm))
    if starts is None:
        parts.append(_update_rule(o, schedule, logical_axes, rules))
    else:
        labels = jax.tree.map(lambda k: "frozen" if k > step else f"from_{k}", starts)
        rule = {label: optax.set_to_zero() if label == "frozen" else
                _update_rule(o, _starting_at(schedule, int(label[5:])), logical_axes, rules,
                             jax.tree.map(lambda k, label=label: label == f"from_{k}", starts))
                for label in set(jax.tree.leaves(labels))}
        parts.append(optax.partition(rule, labels))
    if o.groups:
        parts.append(group_scales(o.groups, logical_axes, step))
    return optax.chain(*parts)


def _starting_at(schedule: optax.Schedule, k: int) -> optax.Schedule:
    """The schedule of an optimizer state that starts at update `k` (its count from 0 there)."""
    return schedule if k == 0 else (lambda count: schedule(count + k))


def _update_rule(o: OptimConfig, schedule: optax.Schedule, logical_axes, rules: dict | None, present=None):
    """AdamW (one per weight decay when `optim.groups` set their own) or Muon, after clipping;
    `present`: which parameters it sees (`_muon`)."""
    decay = _decay_of(o, o.groups, logical_axes) if o.groups else None
    decays = sorted(set(jax.tree.leaves(decay))) if decay is not None else []
    if decays and decays != [float(o.weight_decay)]:  # groups with their own weight decay: an AdamW each
        if o.name == "muon":
            from maxtrain.config import ConfigError

            raise ConfigError("optim.groups weight_decay needs optim.name=adamw (Muon takes one weight decay)")
        labels = jax.tree.map(lambda d: f"decay{decays.index(d)}", decay)
        return optax.partition({f"decay{k}": _adamw(dataclasses.replace(o, weight_decay=d), schedule, logical_axes)
                                for k, d in enumerate(decays)}, labels)
    if o.name == "muon":
        return _muon(o, schedule, logical_axes, rules, present)
    return _adamw(o, schedule, logical_axes)
