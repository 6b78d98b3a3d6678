"""Mixture-of-experts SwiGLU MLP: router, top-k, load-balancing and z losses, dropless or capacity.

Shapes: T tokens (B*L flattened), D model dim, E experts, K top-k, F expert width, C capacity.
- dropless (`capacity_factor` 0): the T*K assignments are sorted by expert and run through
  `lax.ragged_dot` over the stacked expert weights; no token is dropped.
- capacity: each expert takes at most C = ceil(capacity_factor * T*K / E) assignments, top-1
  choices before top-2 (GShard priority); the rest are dropped (their weight contributes nothing).
- expert parallelism (`mesh.expert > 1`): each device routes its own tokens (capacity is per
  device, as in GShard), and the dispatch and combine are explicit collectives in a `shard_map`:
  all-to-all over `expert` for the capacity path, all-gather + reduce-scatter for dropless.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxtrain.config import MoEConfig
from maxtrain.layers import dots
from maxtrain.layers.mlp import swiglu
from maxtrain.sharding import Rules, constrain, logical_to_spec


def route(x_TD, w_router_DE, moe: MoEConfig, bias_E=None):
    """Top-k expert ids and their weights per token (renormalised over the k chosen; for k = 1 the
    router's score itself, as in Switch), plus the router losses and statistics."""
    weights_TK, experts_TK, parts = _route(x_TD, w_router_DE, moe, bias_E)
    return weights_TK, experts_TK, router_stats(parts, moe)


def _group_limited(choice_TE, moe: MoEConfig):
    """`choice` with the experts outside each token's `topk_groups` best groups (a group ranked by
    the sum of its two best scores: DeepSeek-V3's node-limited routing) set to -inf."""
    T, E = choice_TE.shape
    G = moe.groups
    grouped = choice_TE.reshape(T, G, E // G)
    group_TG = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best = jax.lax.top_k(group_TG, moe.topk_groups)
    keep_TG = jnp.sum(jax.nn.one_hot(best, G, dtype=jnp.int32), axis=1) > 0
    return jnp.where(keep_TG[:, :, None], grouped, -jnp.inf).reshape(T, E)


def _route(x_TD, w_router_DE, moe: MoEConfig, bias_E=None):
    """Top-k routing and the per-token means the router statistics are made of (see `router_stats`):
    means over tokens, so shards of equal size combine by averaging them.

    DeepSeek-V3's choices (`moe.groups`, a balancing `bias_E`) pick the experts from the scores
    plus the bias, within the best groups; the weights are the scores of those picked, renormalised
    when `moe.norm_topk` says so, times `moe.routed_scale`."""
    E, K = moe.num_experts, moe.top_k
    logits_TE = jnp.einsum("td,de->te", x_TD, w_router_DE, preferred_element_type=jnp.float32)
    scores = jax.nn.softmax(logits_TE, axis=-1) if moe.router == "softmax" else jax.nn.sigmoid(logits_TE)
    if bias_E is None and moe.groups == 1:
        weights_TK, experts_TK = jax.lax.top_k(scores, K)
    else:
        choice = scores if bias_E is None else scores + jax.lax.stop_gradient(bias_E.astype(jnp.float32))[None, :]
        if moe.groups > 1:
            choice = _group_limited(choice, moe)
        experts_TK = jax.lax.top_k(choice, K)[1]
        weights_TK = jnp.take_along_axis(scores, experts_TK, axis=-1)
    if moe.norm_topk if moe.norm_topk is not None else K > 1:
        # by default renormalised over two or more chosen experts; top-1 keeps the raw score (Switch),
        # else the weight would be 1 whatever the router says and the router would get no gradient
        weights_TK = weights_TK / jnp.maximum(jnp.sum(weights_TK, axis=-1, keepdims=True), 1e-9)
    if moe.routed_scale != 1.0:
        weights_TK = weights_TK * moe.routed_scale
    load_E = jnp.sum(jax.nn.one_hot(experts_TK, E, dtype=jnp.float32), axis=(0, 1)) / (experts_TK.size)
    probs = scores / jnp.maximum(jnp.sum(scores, axis=-1, keepdims=True), 1e-9)
    parts = {"load": load_E, "prob": jnp.mean(probs, axis=0),
             "z": jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))}
    return weights_TK, experts_TK, parts


def router_stats(parts: dict, moe: MoEConfig) -> dict:
    """Switch-style balance loss E * sum_e f_e * p_e (f_e: fraction of assignments, no gradient; p_e:
    mean routing probability), the router z-loss, and the load imbalance (max load / mean load);
    with aux-loss-free balancing (`moe.bias_update_rate`) also the load `[E]` itself (`moe_load`)."""
    E = moe.num_experts
    aux = E * jnp.sum(jax.lax.stop_gradient(parts["load"]) * parts["prob"])
    stats = {"moe_aux_loss": aux, "moe_z_loss": parts["z"], "moe_imbalance": E * jnp.max(parts["load"])}
    if moe.bias_update_rate > 0:
        stats["moe_load"] = jax.lax.stop_gradient(parts["load"])
    return stats


def _ragged_swiglu(rows, p, sizes, dtype):
    """SwiGLU experts on rows sorted by expert: group e is the next `sizes[e]` rows (rows past the
    groups, if any, give zeros)."""
    gate = dots.ragged_dot(rows, p["w_gate"], sizes)
    up = dots.ragged_dot(rows, p["w_up"], sizes)
    return dots.ragged_dot((jax.nn.silu(gate) * up).astype(dtype), p["w_down"], sizes)


def _dropless(x_TD, w_TK, e_TK, p, dtype):
    T, K = e_TK.shape
    E = p["w_gate"].shape[0]
    flat_e = e_TK.reshape(-1)
    flat_t = jnp.repeat(jnp.arange(T), K)
    order = jnp.argsort(flat_e, stable=True)
    tokens = flat_t[order]
    xs = jnp.take(x_TD, tokens, axis=0)
    sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    ys = _ragged_swiglu(xs, p, sizes, dtype)
    ys = ys * w_TK.reshape(-1)[order][:, None].astype(ys.dtype)
    return jnp.zeros_like(x_TD).at[tokens].add(ys.astype(x_TD.dtype)), jnp.ones((), jnp.float32)


def _capacity_slots(e_TK, num_experts: int, capacity: int):
    """Assignments k-major (every token's first choice before any second: GShard priority) with
    their slot in their expert's buffer; slot `capacity` is the spill slot of dropped ones."""
    T, K = e_TK.shape
    e_A = e_TK.T.reshape(-1)
    t_A = jnp.tile(jnp.arange(T), K)
    onehot = jax.nn.one_hot(e_A, num_experts, dtype=jnp.int32)
    pos_A = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    keep_A = pos_A < capacity
    return e_A, t_A, jnp.where(keep_A, pos_A, capacity), keep_A


def _expert_ffn(buf_ECD, p):
    gate = dots.einsum("ecd,edf->ecf", buf_ECD, p["w_gate"])
    up = dots.einsum("ecd,edf->ecf", buf_ECD, p["w_up"])
    return dots.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, p["w_down"])


def _capacity(x_TD, w_TK, e_TK, p, capacity: int, rules: Rules, expert_ffn=None):
    """Token dispatch into `[E, C, D]` buffers, the experts, and the weighted combine.

    `expert_ffn` maps the dispatched buffer to the experts' outputs; the default runs every
    expert here, the expert-parallel path puts all-to-alls around its local experts."""
    E = p["router"].shape[-1]
    e_A, t_A, slot, keep_A = _capacity_slots(e_TK, E, capacity)
    w_A = w_TK.T.reshape(-1)
    buf = jnp.zeros((E, capacity + 1, x_TD.shape[-1]), x_TD.dtype).at[e_A, slot].add(jnp.take(x_TD, t_A, axis=0))
    if expert_ffn is None:
        buf = constrain(buf[:, :capacity], ("experts", None, "embed"), rules)
        out = constrain(_expert_ffn(buf, p), ("experts", None, "embed"), rules)
    else:
        out = expert_ffn(buf[:, :capacity])
    out = jnp.concatenate([out, jnp.zeros_like(out[:, :1])], axis=1)
    y_A = out[e_A, slot] * (w_A * keep_A)[:, None].astype(out.dtype)
    y_TD = jnp.zeros_like(x_TD).at[t_A].add(y_A)
    return y_TD, jnp.mean(keep_A.astype(jnp.float32))


# ---------------------------------------------------------------- expert parallelism (mesh.expert > 1)


def _token_axes(rules: Rules) -> tuple[tuple[str, ...], tuple]:
    """(mesh axes that shard tokens, the `[batch, length]` spec)."""
    spec = logical_to_spec(("batch", "length"), rules)
    return tuple(a for dim in spec if dim is not None for a in (dim if isinstance(dim, tuple) else (dim,))), spec


def _ep_axes(rules: Rules, mesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(mesh axes that shard tokens, of which `expert` must be one when it has more than one
    device) for the local-routing region."""
    token_axes, spec = _token_axes(rules)
    if mesh.shape.get("expert", 1) > 1 and "expert" not in token_axes:
        raise ValueError("expert parallelism needs the tokens sharded over `expert`: "
                         "include expert in sharding.activations.batch")
    return token_axes, spec


def _ep_capacity_ffn(p_local, n_e: int):
    """Experts of this device on the tokens all devices of the `expert` axis sent them.

    `[E, C, D]` (this device's tokens, by global expert) --all-to-all--> `[n_e, E/n_e, C, D]`
    (every device's tokens for my experts) -> local experts -> all-to-all back -> `[E, C, D]`."""
    def ffn(buf_ECD):
        E, C, D = buf_ECD.shape
        recv = jax.lax.all_to_all(buf_ECD, "expert", split_axis=0, concat_axis=0, tiled=True)
        recv = recv.reshape(n_e, E // n_e, C, D).transpose(1, 0, 2, 3).reshape(E // n_e, n_e * C, D)
        out = _expert_ffn(recv, p_local)
        out = out.reshape(E // n_e, n_e, C, D).transpose(1, 0, 2, 3).reshape(E, C, D)
        return jax.lax.all_to_all(out, "expert", split_axis=0, concat_axis=0, tiled=True)
    return ffn


def _ep_dropless(x_TD, w_TK, e_TK, p_local, n_e: int, dtype):
    """Dropless expert parallelism by all-gather dispatch: every device of the `expert` axis sees the
    group's tokens, runs its own experts on the assignments routed to them (sorted, ragged matmuls),
    and the outputs are summed back to their owners by a reduce-scatter. XLA:CPU has no ragged
    all-to-all, and a fixed-size all-to-all would have to be sized for the worst case."""
    E_loc = p_local["w_gate"].shape[0]
    first = jax.lax.axis_index("expert") * E_loc
    xs = jax.lax.all_gather(x_TD, "expert", tiled=True)
    e_all = jax.lax.all_gather(e_TK, "expert", tiled=True)
    w_all = jax.lax.all_gather(w_TK, "expert", tiled=True)
    T, K = e_all.shape
    local_e = e_all.reshape(-1) - first
    mine = (local_e >= 0) & (local_e < E_loc)
    key = jnp.where(mine, local_e, E_loc)  # others sort last, outside every group
    order = jnp.argsort(key, stable=True)
    tokens = jnp.repeat(jnp.arange(T), K)[order]
    sizes = jnp.bincount(jnp.where(mine, local_e, 0), weights=mine.astype(jnp.int32), length=E_loc).astype(jnp.int32)
    ys = _ragged_swiglu(jnp.take(xs, tokens, axis=0), p_local, sizes, dtype)
    weight = jnp.where(mine, w_all.reshape(-1), 0.0)[order]
    ys = ys * weight[:, None].astype(ys.dtype)
    y_all = jnp.zeros_like(xs).at[tokens].add(ys.astype(xs.dtype))
    return jax.lax.psum_scatter(y_all, "expert", scatter_dimension=0, tiled=True)


def _expert_parallel(x_BLD, p, moe: MoEConfig, rules: Rules, mesh):
    """The routed experts in a `shard_map` that is manual over the axes that shard tokens: each
    device routes, sorts and dispatches its own tokens (capacity is per device), so nothing of
    the routing grows with the global batch. With `expert` > 1 the experts are split over it and
    explicit collectives move the tokens; with one, every device runs all experts on its tokens.
    `tensor` stays automatic, so expert weights split along `expert_mlp` keep their Megatron
    partitioning inside."""
    token_axes, spec = _ep_axes(rules, mesh)
    n_e = mesh.shape.get("expert", 1)
    x_spec = P(*spec, None)
    w_spec = P("expert") if n_e > 1 else P()
    routed = {k: p[k] for k in ("router", "w_gate", "w_up", "w_down", "bias") if k in p}
    p_specs = {"router": P(), "w_gate": w_spec, "w_up": w_spec, "w_down": w_spec, "bias": P()}
    p_specs = {k: v for k, v in p_specs.items() if k in routed}

    def local(x_BLD, p):
        B, L, D = x_BLD.shape
        x_TD = x_BLD.reshape(B * L, D)
        w_TK, e_TK, parts = _route(x_TD, p["router"], moe, p.get("bias"))
        parts = jax.lax.pmean(parts, token_axes)
        if moe.capacity_factor > 0:
            capacity = max(1, math.ceil(moe.capacity_factor * e_TK.size / moe.num_experts))
            ffn = _ep_capacity_ffn(p, n_e) if n_e > 1 else functools.partial(_expert_ffn, p=p)
            y_TD, kept = _capacity(x_TD, w_TK, e_TK, p, capacity, rules, expert_ffn=ffn)
        elif n_e > 1:
            y_TD, kept = _ep_dropless(x_TD, w_TK, e_TK, p, n_e, x_BLD.dtype), jnp.ones((), jnp.float32)
        else:
            y_TD, kept = _dropless(x_TD, w_TK, e_TK, p, x_BLD.dtype)
        stats = router_stats(parts, moe)
        stats["moe_dropped_frac"] = 1.0 - jax.lax.pmean(kept, token_axes)
        return y_TD.reshape(B, L, D), stats

    stat_specs = {k: P() for k in ("moe_aux_loss", "moe_z_loss", "moe_imbalance", "moe_dropped_frac")
                  + (("moe_load",) if moe.bias_update_rate > 0 else ())}
    fn = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, p_specs), out_specs=(x_spec, stat_specs),
                       axis_names=frozenset(token_axes))
    return fn(x_BLD, routed)


def moe_mlp(x_BLD, p, moe: MoEConfig, rules: Rules):
    """`(y_BLD, stats)`; stats hold the router losses, the dropped fraction and the load imbalance.

    With tokens sharded over the mesh the routing runs per device (`_expert_parallel`; with
    `mesh.expert > 1` expert-parallel with explicit collectives): left to XLA, the global sort
    and cumsum of the dispatch would gather every device's assignments. On one device, or with
    no token sharding, it runs here."""
    B, L, D = x_BLD.shape
    mesh = jax.sharding.get_abstract_mesh()
    sharded = not mesh.empty and math.prod(mesh.shape[a] for a in _token_axes(rules)[0]) > 1
    if sharded or (not mesh.empty and mesh.shape.get("expert", 1) > 1):
        y_BLD, stats = _expert_parallel(x_BLD, p, moe, rules, mesh)
    else:
        x_TD = x_BLD.reshape(B * L, D)
        w_TK, e_TK, stats = route(x_TD, p["router"], moe, p.get("bias"))
        if moe.capacity_factor > 0:
            capacity = max(1, math.ceil(moe.capacity_factor * e_TK.size / moe.num_experts))
            y_TD, kept = _capacity(x_TD, w_TK, e_TK, p, capacity, rules)
        else:
            y_TD, kept = _dropless(x_TD, w_TK, e_TK, p, x_BLD.dtype)
        y_BLD = y_TD.reshape(B, L, D)
        stats["moe_dropped_frac"] = 1.0 - kept
    if moe.shared_experts:
        y_BLD = y_BLD + swiglu(x_BLD, p["shared_gate"], p["shared_up"], p["shared_down"], rules)
    return constrain(y_BLD, ("batch", "length", "embed"), rules), stats


def moe_loss(stats: dict, moe: MoEConfig) -> jax.Array:
    return moe.aux_loss_coef * stats["moe_aux_loss"] + moe.z_loss_coef * stats["moe_z_loss"]
