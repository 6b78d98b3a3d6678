"""The deepseek family's KV-cached decoder (`maxtrain.models.registry.Decoder`): its layers
(`model.py`: multi-head latent attention, the dense first layers, the routed and shared experts)
rewritten for a cache. The cache is MLA's latent one: per layer and position the normed key/value
latent `c` (R = `kv_lora_rank` dims) and the rotated rope key shared by every head (P =
`qk_rope_head_dim`), `[N, B, S, R]` and `[N, B, S, P]`: R + P numbers a token per layer, not the
H x (N + P + A) of the keys and values the latent expands to.

Each layer writes its latents for positions `start .. start+T-1` and attends over the cache with the
causal (and sliding-window) mask of absolute positions. Prefill (T > 1) expands the cached latents
to per-head keys and values with `wkv_b` and attends as training does (`[nope, rope]` keys scaled
by `(N + P)^-1/2`); a decode step (T = 1) absorbs `wkv_b` instead: the query's nope part is taken
into the latent space (`q_nope wkv_b_k^T`, `[B, T, H, R]`), scored against the cached latents, and
the attention-weighted latent is expanded once to the values (`wkv_b_v`), so no step rebuilds every
position's keys and values (the same numbers in float32, up to rounding). Prefill and decode are the
same function. The MoE layers route each token as training does (`layers.moe.route`: sigmoid scores,
the balancing bias choosing experts, group-limited routing, `routed_scale`) and run every expert on
it, weighted by the routing, plus the shared experts (`_moe_mlp`); with `moe.capacity_factor > 0`
training drops over-capacity tokens, which the decoder never does. The multi-token prediction
modules (`params["mtp"]`) are training-only and not read. Its logits for the prompt equal the
training forward's, and greedy decoding equals `transformers`' (tests/test_deepseek_generate.py).

Shapes in names: B batch, T new tokens, S cache length, D model dim, H heads, R the latent rank,
Q the query's latent rank, N nope dims, P rope dims, A value dims (per head), E experts, F width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from maxtrain.config import ModelConfig
from maxtrain.layers import dots
from maxtrain.layers.moe import route
from maxtrain.layers.norms import rms_norm
from maxtrain.layers.rope import apply_rope, inv_frequencies


def init_cache(m: ModelConfig, batch: int, max_len: int, dtype) -> dict:
    """Every layer's (dense first, then MoE) normed latent `c` `[N, B, S, R]` and rotated rope key
    `k_rope` `[N, B, S, P]`, zeros."""
    a = m.mla
    return {"c": jnp.zeros((m.n_layers, batch, max_len, a.kv_lora_rank), dtype),
            "k_rope": jnp.zeros((m.n_layers, batch, max_len, a.qk_rope_head_dim), dtype)}


def _mask(pos_T, S: int, sliding_window: int | None):
    """`[T, S]`: key j counts for the query at `pos_T[t]` when j <= it (and within the window), so
    unwritten slots never do."""
    j = jnp.arange(S)
    mask = j[None, :] <= pos_T[:, None]
    if sliding_window is not None:
        mask = mask & (pos_T[:, None] - j[None, :] < sliding_window)
    return mask


def _softmax(scores_BHTS, mask_TS):
    return jax.nn.softmax(jnp.where(mask_TS[None, None], scores_BHTS, -jnp.inf), axis=-1)


def _attend_expanded(q_BTHK, c_BSR, k_rope_BSP, wkv_b_RHK, pos_T, m: ModelConfig):
    """Prefill: the cached latents expanded to every head's keys `[nope, rope]` and values, then
    attention as training computes it (one score product over N + P dims)."""
    a = m.mla
    N, K = a.qk_nope_head_dim, a.qk_nope_head_dim + a.qk_rope_head_dim
    B, S, _ = c_BSR.shape
    H = q_BTHK.shape[2]
    kv_BSHK = dots.einsum("bsr,rhk->bshk", c_BSR, wkv_b_RHK)
    k_BSHK = jnp.concatenate([kv_BSHK[..., :N], jnp.broadcast_to(k_rope_BSP[:, :, None, :], (B, S, H, K - N))], -1)
    scores = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BSHK, preferred_element_type=jnp.float32) * (K ** -0.5)
    v_BSHA = kv_BSHK[..., N:]
    probs = _softmax(scores, _mask(pos_T, S, m.sliding_window)).astype(v_BSHA.dtype)
    return jnp.einsum("bhts,bsha->btha", probs, v_BSHA, preferred_element_type=jnp.float32).astype(q_BTHK.dtype)


def _attend_absorbed(q_BTHK, c_BSR, k_rope_BSP, wkv_b_RHK, pos_T, m: ModelConfig):
    """Decode: `wkv_b` absorbed. Scores are `(q_nope wkv_b_k^T) . c + q_rope . k_rope` over the
    cache's latents, the output `(probs . c) wkv_b_v`; float32 throughout."""
    a = m.mla
    N, K = a.qk_nope_head_dim, a.qk_nope_head_dim + a.qk_rope_head_dim
    f32 = jnp.float32
    q_BTHK, c_BSR, k_rope_BSP, wkv_b_RHK = (x.astype(f32) for x in (q_BTHK, c_BSR, k_rope_BSP, wkv_b_RHK))
    q_lat_BTHR = jnp.einsum("bthn,rhn->bthr", q_BTHK[..., :N], wkv_b_RHK[..., :N])
    scores = (jnp.einsum("bthr,bsr->bhts", q_lat_BTHR, c_BSR)
              + jnp.einsum("bthp,bsp->bhts", q_BTHK[..., N:], k_rope_BSP)) * (K ** -0.5)
    probs = _softmax(scores, _mask(pos_T, c_BSR.shape[1], m.sliding_window))
    o_BTHR = jnp.einsum("bhts,bsr->bthr", probs, c_BSR)
    return jnp.einsum("bthr,rha->btha", o_BTHR, wkv_b_RHK[..., N:])


def _mla_cached(x_BTD, p: dict, c_BSR, k_rope_BSP, start, m: ModelConfig, inv_freq):
    """MLA's output projection `[B, T, D]` for T new positions from `start`, and this layer's new
    latents `[B, T, R]`, `[B, T, P]` (the caller writes them into the cache)."""
    a, eps = m.mla, m.norm_eps
    R, N = a.kv_lora_rank, a.qk_nope_head_dim
    B, T, _ = x_BTD.shape
    pos_T = start + jnp.arange(T)
    pos_BT = jnp.broadcast_to(pos_T[None], (B, T))
    h = rms_norm(x_BTD, p["attn_norm"], eps)
    if "wq" in p:
        q = dots.einsum("btd,dhk->bthk", h, p["wq"])
    else:
        cq = dots.einsum("btd,dq->btq", h, p["wq_a"])
        q = dots.einsum("btq,qhk->bthk", rms_norm(cq, p["q_norm"], eps), p["wq_b"])
    q = jnp.concatenate([q[..., :N], apply_rope(q[..., N:], pos_BT, inv_freq)], axis=-1)
    ckv = dots.einsum("btd,dr->btr", h, p["wkv_a"])
    c_BTR = rms_norm(ckv[..., :R], p["kv_norm"], eps).astype(c_BSR.dtype)
    k_rope_BTP = apply_rope(ckv[..., None, R:], pos_BT, inv_freq)[:, :, 0].astype(k_rope_BSP.dtype)
    c_BSR = lax.dynamic_update_slice(c_BSR, c_BTR, (0, start, 0))
    k_rope_BSP = lax.dynamic_update_slice(k_rope_BSP, k_rope_BTP, (0, start, 0))
    attend = _attend_absorbed if T == 1 else _attend_expanded
    o_BTHA = attend(q, c_BSR, k_rope_BSP, p["wkv_b"], pos_T, m).astype(x_BTD.dtype)
    return dots.einsum("btha,had->btd", o_BTHA, p["wo"]), c_BTR, k_rope_BTP


def _moe_mlp(h_BTD, e: dict, moe):
    """The routed experts for a few tokens, chosen and weighted exactly as training routes them
    (`layers.moe.route` with the balancing bias), every expert run on every token and its output
    weighted by the routing (zero for experts not chosen; `routed_scale` is in the weights), plus
    the shared experts: E/k times the work of a dispatch, no sort, no token dropped."""
    B, T, D = h_BTD.shape
    x = h_BTD.reshape(B * T, D)
    w_TK, e_TK, _ = route(x, e["router"], moe, e.get("bias"))
    weights_TE = jnp.zeros((B * T, moe.num_experts), jnp.float32).at[jnp.arange(B * T)[:, None], e_TK].add(w_TK)
    gate = jnp.einsum("td,edf->tef", x, e["w_gate"])
    up = jnp.einsum("td,edf->tef", x, e["w_up"])
    out_TED = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, e["w_down"])
    y = jnp.einsum("ted,te->td", out_TED, weights_TE.astype(out_TED.dtype)).reshape(B, T, D)
    if moe.shared_experts:
        y = y + _swiglu(h_BTD, e["shared_gate"], e["shared_up"], e["shared_down"])
    return y


def _swiglu(h_BTD, w_gate_DF, w_up_DF, w_down_FD):
    gate = dots.einsum("btd,df->btf", h_BTD, w_gate_DF)
    up = dots.einsum("btd,df->btf", h_BTD, w_up_DF)
    return dots.einsum("btf,fd->btd", jax.nn.silu(gate) * up, w_down_FD)


def _layer(x_BTD, p: dict, c_BSR, k_rope_BSP, start, m: ModelConfig, inv_freq, moe: bool):
    """One decoder layer (dense MLP, or with `moe` the experts) over T new positions; returns x and
    the layer's new latents."""
    o, c_BTR, k_rope_BTP = _mla_cached(x_BTD, p, c_BSR, k_rope_BSP, start, m, inv_freq)
    x_BTD = x_BTD + o
    h = rms_norm(x_BTD, p["mlp_norm"], m.norm_eps)
    y = _moe_mlp(h, p["moe"], m.moe) if moe else _swiglu(h, p["w_gate"], p["w_up"], p["w_down"])
    return x_BTD + y.astype(x_BTD.dtype), c_BTR, k_rope_BTP


def forward_cached(params: dict, tokens_BT, cache: dict, start, m: ModelConfig):
    """Logits `[B, T, V]` (float32) of T tokens at positions `start..`, and the cache with them in
    (layer i < `moe.first_dense` of `params["dense_layers"]`, the rest of `params["layers"]`)."""
    inv_freq = inv_frequencies(m.mla.qk_rope_head_dim, m.rope_theta, m.rope_scaling)
    x = jnp.take(params["embed"]["embedding"], tokens_BT, axis=0)
    k = m.moe.first_dense

    def stack(x, layers: dict, c_NBSR, k_rope_NBSP, moe: bool):
        def body(x, layer):
            p, c, k_rope = layer
            x, c_new, k_rope_new = _layer(x, p, c, k_rope, start, m, inv_freq, moe)
            return x, (c_new, k_rope_new)
        return lax.scan(body, x, (layers, c_NBSR, k_rope_NBSP))

    new_c, new_k_rope = [], []
    if k:
        x, (c, k_rope) = stack(x, params["dense_layers"], cache["c"][:k], cache["k_rope"][:k], False)
        new_c.append(c)
        new_k_rope.append(k_rope)
    x, (c, k_rope) = stack(x, params["layers"], cache["c"][k:], cache["k_rope"][k:], True)
    new_c.append(c)
    new_k_rope.append(k_rope)
    # only the T new positions of every layer come out of the layers: one write into the cache
    cache = {"c": lax.dynamic_update_slice(cache["c"], jnp.concatenate(new_c), (0, 0, start, 0)),
             "k_rope": lax.dynamic_update_slice(cache["k_rope"], jnp.concatenate(new_k_rope), (0, 0, start, 0))}
    h = rms_norm(x, params["final_norm"]["scale"], m.norm_eps)
    w_DV = params["embed"]["embedding"].T if m.tie_embeddings else params["lm_head"]["kernel"]
    logits = jnp.einsum("btd,dv->btv", h, w_DV, preferred_element_type=jnp.float32)
    return logits, cache
