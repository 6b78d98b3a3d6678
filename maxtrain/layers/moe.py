"""Mixture-of-experts SwiGLU MLP: router, top-k, load-balancing and z losses, dropless or capacity.

Shapes: T tokens (B*L flattened), D model dim, E experts, K top-k, F expert width, C capacity.
- dropless (`capacity_factor` 0): the T*K assignments are sorted by expert and run through
  `lax.ragged_dot` over the stacked expert weights; no token is dropped.
- capacity: each expert takes at most C = ceil(capacity_factor * T*K / E) assignments, top-1
  choices before top-2 (GShard priority); the rest are dropped (their weight contributes nothing).
  Buffers `[E, C, D]` are constrained along `experts`, so with `mesh.expert > 1` XLA's partitioner
  moves tokens to the devices holding their experts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from maxtrain.config import MoEConfig
from maxtrain.layers.mlp import swiglu
from maxtrain.sharding import Rules, constrain


def route(x_TD, w_router_DE, moe: MoEConfig):
    """Top-k expert ids and renormalised weights per token, plus the router losses and statistics."""
    E, K = moe.num_experts, moe.top_k
    logits_TE = jnp.einsum("td,de->te", x_TD, w_router_DE, preferred_element_type=jnp.float32)
    scores = jax.nn.softmax(logits_TE, axis=-1) if moe.router == "softmax" else jax.nn.sigmoid(logits_TE)
    weights_TK, experts_TK = jax.lax.top_k(scores, K)
    weights_TK = weights_TK / jnp.maximum(jnp.sum(weights_TK, axis=-1, keepdims=True), 1e-9)
    # Switch-style balance: fraction of assignments f_e (no gradient) x mean routing probability p_e
    load_E = jnp.sum(jax.nn.one_hot(experts_TK, E, dtype=jnp.float32), axis=(0, 1)) / (experts_TK.size)
    probs = scores / jnp.maximum(jnp.sum(scores, axis=-1, keepdims=True), 1e-9)
    aux = E * jnp.sum(jax.lax.stop_gradient(load_E) * jnp.mean(probs, axis=0))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))
    stats = {"moe_aux_loss": aux, "moe_z_loss": z, "moe_imbalance": E * jnp.max(load_E)}
    return weights_TK, experts_TK, stats


def _dropless(x_TD, w_TK, e_TK, p, dtype):
    T, K = e_TK.shape
    E = p["w_gate"].shape[0]
    flat_e = e_TK.reshape(-1)
    flat_t = jnp.repeat(jnp.arange(T), K)
    order = jnp.argsort(flat_e, stable=True)
    tokens = flat_t[order]
    xs = jnp.take(x_TD, tokens, axis=0)
    sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    gate = jax.lax.ragged_dot(xs, p["w_gate"], sizes)
    up = jax.lax.ragged_dot(xs, p["w_up"], sizes)
    ys = jax.lax.ragged_dot((jax.nn.silu(gate) * up).astype(dtype), p["w_down"], sizes)
    ys = ys * w_TK.reshape(-1)[order][:, None].astype(ys.dtype)
    return jnp.zeros_like(x_TD).at[tokens].add(ys.astype(x_TD.dtype)), jnp.ones((), jnp.float32)


def _capacity(x_TD, w_TK, e_TK, p, capacity: int, rules: Rules):
    T, K = e_TK.shape
    E = p["w_gate"].shape[0]
    e_A = e_TK.T.reshape(-1)  # assignments k-major: every token's first choice before any second
    t_A = jnp.tile(jnp.arange(T), K)
    w_A = w_TK.T.reshape(-1)
    onehot = jax.nn.one_hot(e_A, E, dtype=jnp.int32)
    pos_A = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    keep_A = pos_A < capacity
    slot = jnp.where(keep_A, pos_A, capacity)  # dropped ones land in a spill slot that is discarded
    buf = jnp.zeros((E, capacity + 1, x_TD.shape[-1]), x_TD.dtype).at[e_A, slot].add(jnp.take(x_TD, t_A, axis=0))
    buf = constrain(buf[:, :capacity], ("experts", None, "embed"), rules)
    gate = jnp.einsum("ecd,edf->ecf", buf, p["w_gate"])
    up = jnp.einsum("ecd,edf->ecf", buf, p["w_up"])
    out = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, p["w_down"])
    out = constrain(out, ("experts", None, "embed"), rules)
    out = jnp.concatenate([out, jnp.zeros_like(out[:, :1])], axis=1)
    y_A = out[e_A, slot] * (w_A * keep_A)[:, None].astype(out.dtype)
    y_TD = jnp.zeros_like(x_TD).at[t_A].add(y_A)
    return y_TD, jnp.mean(keep_A.astype(jnp.float32))


def moe_mlp(x_BLD, p, moe: MoEConfig, rules: Rules):
    """`(y_BLD, stats)`; stats hold the router losses, the kept fraction and the load imbalance."""
    B, L, D = x_BLD.shape
    x_TD = x_BLD.reshape(B * L, D)
    w_TK, e_TK, stats = route(x_TD, p["router"], moe)
    if moe.capacity_factor > 0:
        capacity = max(1, math.ceil(moe.capacity_factor * e_TK.size / moe.num_experts))
        y_TD, kept = _capacity(x_TD, w_TK, e_TK, p, capacity, rules)
    else:
        y_TD, kept = _dropless(x_TD, w_TK, e_TK, p, x_BLD.dtype)
    y_BLD = y_TD.reshape(B, L, D)
    if moe.shared_experts:
        y_BLD = y_BLD + swiglu(x_BLD, p["shared_gate"], p["shared_up"], p["shared_down"], rules)
    stats["moe_dropped_frac"] = 1.0 - kept
    return constrain(y_BLD, ("batch", "length", "embed"), rules), stats


def moe_loss(stats: dict, moe: MoEConfig) -> jax.Array:
    return moe.aux_loss_coef * stats["moe_aux_loss"] + moe.z_loss_coef * stats["moe_z_loss"]
