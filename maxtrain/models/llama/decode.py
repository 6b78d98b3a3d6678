"""The llama family's KV-cached decoder (`maxtrain.models.registry.Decoder`): its layer
(`model.py`: RMSNorm, RoPE on absolute positions, grouped-query attention, SwiGLU) rewritten for a
cache. Each layer writes its keys and values for positions `start .. start+T-1` into `[B, S, G, K]`
buffers and attends over the cache with the causal (and sliding-window) mask of absolute positions.
Prefill (T = the prompt's length) and decode (T = 1) are the same function. MoE models (Mixtral,
Qwen3-MoE) route each token as training does and run every expert on it, weighted by the routing
(`_moe_mlp`). Its logits for the prompt equal the training forward's, and greedy decoding equals
`transformers`' (tests/test_generate.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from maxtrain.config import ModelConfig
from maxtrain.layers.moe import route
from maxtrain.layers.norms import rms_norm
from maxtrain.layers.rope import apply_rope, inv_frequencies
from maxtrain.models.llama.model import sublayer


def init_cache(m: ModelConfig, batch: int, max_len: int, dtype) -> dict:
    """Keys and values of every layer: `[N, B, S, G, K]` each, zeros."""
    shape = (m.n_layers, batch, max_len, m.n_kv_heads, m.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def attend_cached(q_BTHK, k_BSGK, v_BSGK, pos_T, sliding_window: int | None):
    """Attention of T queries at absolute positions `pos_T` over the whole cache; a key at position
    j counts when j <= the query's position (and within the window): unwritten slots never do."""
    B, T, H, K = q_BTHK.shape
    G = k_BSGK.shape[2]
    q = q_BTHK.reshape(B, T, G, H // G, K)
    scores = jnp.einsum("btgrk,bsgk->bgrts", q, k_BSGK, preferred_element_type=jnp.float32) / math.sqrt(K)
    j = jnp.arange(k_BSGK.shape[1])
    mask = j[None, :] <= pos_T[:, None]
    if sliding_window is not None:
        mask = mask & (pos_T[:, None] - j[None, :] < sliding_window)
    scores = jnp.where(mask[None, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSGK.dtype)
    return jnp.einsum("bgrts,bsgk->btgrk", probs, v_BSGK).reshape(B, T, H, K)


def _moe_mlp(h_BTD, e: dict, moe):
    """The mixture of experts for a few tokens, exactly as training routes them (`layers.moe.route`),
    every expert run on every token and the outputs weighted by the routing (zero for experts not
    chosen): E/k times the work of a dispatch, no sort, no token dropped."""
    B, T, D = h_BTD.shape
    x = h_BTD.reshape(B * T, D)
    w_TK, e_TK, _ = route(x, e["router"], moe)
    weights_TE = jnp.zeros((B * T, moe.num_experts), jnp.float32).at[jnp.arange(B * T)[:, None], e_TK].add(w_TK)
    gate = jnp.einsum("td,edf->tef", x, e["w_gate"])
    up = jnp.einsum("td,edf->tef", x, e["w_up"])
    y = jnp.einsum("tef,efd,te->td", jax.nn.silu(gate) * up, e["w_down"], weights_TE.astype(x.dtype))
    if moe.shared_experts:
        y = y + _swiglu(x, e["shared_gate"], e["shared_up"], e["shared_down"])
    return y.reshape(B, T, D)


def _swiglu(h, w_gate, w_up, w_down):
    return (jax.nn.silu(h @ w_gate) * (h @ w_up)) @ w_down


def _layer(x_BTD, p: dict, k_BSGK, v_BSGK, start, m: ModelConfig, inv_freq, moe_params=None):
    """One decoder layer over T new positions from `start`; returns x and the updated cache. With
    `moe_params` its MLP is the mixture of experts."""
    B, T, _ = x_BTD.shape
    pos_T = start + jnp.arange(T)
    pos_BT = jnp.broadcast_to(pos_T[None], (B, T))
    h = rms_norm(x_BTD, p["attn_norm"], m.norm_eps)
    q, k = jnp.einsum("btd,dhk->bthk", h, p["wq"]), jnp.einsum("btd,dgk->btgk", h, p["wk"])
    if "q_norm" in p:  # model.qk_norm
        q, k = rms_norm(q, p["q_norm"], m.norm_eps), rms_norm(k, p["k_norm"], m.norm_eps)
    q, k = apply_rope(q, pos_BT, inv_freq), apply_rope(k, pos_BT, inv_freq)
    v = jnp.einsum("btd,dgk->btgk", h, p["wv"])
    k_BSGK = lax.dynamic_update_slice(k_BSGK, k.astype(k_BSGK.dtype), (0, start, 0, 0))
    v_BSGK = lax.dynamic_update_slice(v_BSGK, v.astype(v_BSGK.dtype), (0, start, 0, 0))
    o = attend_cached(q, k_BSGK, v_BSGK, pos_T, m.sliding_window)
    x_BTD = x_BTD + jnp.einsum("bthk,hkd->btd", o, p["wo"])
    h = rms_norm(x_BTD, p["mlp_norm"], m.norm_eps)
    if moe_params is not None:
        return x_BTD + _moe_mlp(h, moe_params, m.moe).astype(x_BTD.dtype), k_BSGK, v_BSGK
    x_BTD = x_BTD + _swiglu(h, p["w_gate"], p["w_up"], p["w_down"])
    return x_BTD, k_BSGK, v_BSGK


def forward_cached(params: dict, tokens_BT, cache: dict, start, m: ModelConfig):
    """Logits `[B, T, V]` (float32) of T tokens at positions `start..`, and the cache with them in."""
    inv_freq = inv_frequencies(m.head_dim, m.rope_theta, m.rope_scaling)
    x = jnp.take(params["embed"]["embedding"], tokens_BT, axis=0)

    def body(x, layer):
        p, k, v = layer
        x, k, v = _layer(x, p, k, v, start, m, inv_freq)
        return x, (k, v)

    def block(x, layer):  # MoE models: `moe.every` layers, the last one's MLP the experts
        p, k, v = layer
        S = m.moe.every
        ks, vs = [], []
        for j in range(S):
            x, kj, vj = _layer(x, sublayer(p, j, S), k[j], v[j], start, m, inv_freq, p["moe"] if j == S - 1 else None)
            ks.append(kj)
            vs.append(vj)
        return x, (jnp.stack(ks), jnp.stack(vs))

    if m.moe is None:
        x, (ks, vs) = lax.scan(body, x, (params["layers"], cache["k"], cache["v"]))
    else:
        blocks = lambda c: c.reshape(m.n_layers // m.moe.every, m.moe.every, *c.shape[1:])  # noqa: E731
        x, (ks, vs) = lax.scan(block, x, (params["layers"], blocks(cache["k"]), blocks(cache["v"])))
        ks, vs = ks.reshape(cache["k"].shape), vs.reshape(cache["v"].shape)
    h = rms_norm(x, params["final_norm"]["scale"], m.norm_eps)
    w_DV = params["embed"]["embedding"].T if m.tie_embeddings else params["lm_head"]["kernel"]
    logits = jnp.einsum("btd,dv->btv", h, w_DV, preferred_element_type=jnp.float32)
    return logits, {"k": ks, "v": vs}
