"""DeepSeek-V3-style decoder (`model.name: deepseek`) as a layered family: multi-head latent
attention, the first `moe.first_dense` layers dense and the rest fine-grained MoE with shared
experts, sigmoid routing with auxiliary-loss-free balancing and group-limited routing, and
multi-token prediction.

Shapes in names: B batch, L length, D model dim, H heads, R the keys' latent rank (`kv_lora_rank`),
Q the query's (`q_lora_rank`), N nope dims, P rope dims, A value dims (per head), E experts.

- Attention (MLA): the query from `D -> Q -> H x (N + P)` (or `D -> H x (N + P)` without a query
  latent), keys and values from a normed latent `D -> R -> H x (N + A)`, and one rotary key of P
  dims shared by every head, also from `D`. Keys are `[nope, rope]`, scaled by `(N + P)^-1/2`. The
  values are zero-padded to the keys' N + P dims for the attention implementations (one head dim
  for q, k and v: flash, ring, cuDNN and XLA alike) and the padding sliced off the output. The
  flash kernels take N + P of 64 or 128; other sizes (V3's 192) run XLA's attention, with a warning
  when the config is read (`config.mla_attention_impl`).
- The layer stack (`layers`) holds the MoE layers; the dense layers before them (`dense_layers`)
  run in `embed`, before the stack (with `mesh.pipeline > 1`, on every stage: they are few).
- Aux-loss-free balancing: `layers.moe.bias` `[layers, E]` is added to the routing scores to choose
  experts, never to weight them; it is not learned (`ParamSpec(learned=False)`: the optimizer
  leaves it alone) but moved after every step by `moe.bias_update_rate` times sign(mean load - load)
  of its layer (`balance`), and checkpointed with the params.
- Multi-token prediction (`model.mtp`): module k (from 1) takes the previous module's (or the
  stack's) hidden state at t and the embedding of token t + k, RMS-normed and concatenated, projects
  them to D, runs one more layer and predicts token t + k + 1 with the shared head; the modules'
  mean cross-entropy times `mtp.loss_weight` is added to the objective (`mtp_loss` in the metrics).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from maxtrain.config import ModelConfig
from maxtrain.layers import dots
from maxtrain.layers.attention import attention, kv_gathered
from maxtrain.layers.mlp import swiglu
from maxtrain.layers.moe import moe_loss, moe_mlp
from maxtrain.layers.norms import rms_norm
from maxtrain.layers.rope import apply_rope, inv_frequencies
from maxtrain.loss import token_losses
from maxtrain.models.deepseek.config import mla_attention_impl
from maxtrain.models.llama import model as llama
from maxtrain.models.specs import ParamSpec, normal, ones, zeros
from maxtrain.models.stack import Runtime, remat
from maxtrain.sharding import constrain

RESIDUAL = ("batch", "length", "embed")


def _qk_dim(m: ModelConfig) -> int:
    return m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim


def _attention_specs(m: ModelConfig, n: int, w, w_out) -> dict:
    """MLA's params and the two norms of `n` stacked layers."""
    a, D, H = m.mla, m.d_model, m.n_heads
    R, P, N, A = a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim
    specs = {
        "attn_norm": ParamSpec((n, D), ("layers", "norm"), ones),
        "wkv_a": ParamSpec((n, D, R + P), ("layers", "embed", "kv_lora"), w),
        "kv_norm": ParamSpec((n, R), ("layers", "norm"), ones),
        "wkv_b": ParamSpec((n, R, H, N + A), ("layers", "kv_lora", "heads", "head_dim"), w),
        "wo": ParamSpec((n, H, A, D), ("layers", "heads", "head_dim", "embed"), w_out),
        "mlp_norm": ParamSpec((n, D), ("layers", "norm"), ones),
    }
    if a.q_lora_rank is None:
        specs["wq"] = ParamSpec((n, D, H, N + P), ("layers", "embed", "heads", "head_dim"), w)
    else:
        Q = a.q_lora_rank
        specs.update(wq_a=ParamSpec((n, D, Q), ("layers", "embed", "q_lora"), w),
                     q_norm=ParamSpec((n, Q), ("layers", "norm"), ones),
                     wq_b=ParamSpec((n, Q, H, N + P), ("layers", "q_lora", "heads", "head_dim"), w))
    return specs


def _moe_specs(m: ModelConfig, n: int, w, w_out, bias: bool) -> dict:
    e, D = m.moe, m.d_model
    E, F = e.num_experts, e.d_ff or m.d_ff
    specs = {
        "router": ParamSpec((n, D, E), ("layers", "embed", None), w),
        "w_gate": ParamSpec((n, E, D, F), ("layers", "experts", "embed", "expert_mlp"), w),
        "w_up": ParamSpec((n, E, D, F), ("layers", "experts", "embed", "expert_mlp"), w),
        "w_down": ParamSpec((n, E, F, D), ("layers", "experts", "expert_mlp", "embed"), w_out),
    }
    if bias:
        specs["bias"] = ParamSpec((n, E), ("layers", None), zeros, learned=False)
    if e.shared_experts:
        FS = e.shared_experts * F
        specs.update(shared_gate=ParamSpec((n, D, FS), ("layers", "embed", "mlp"), w),
                     shared_up=ParamSpec((n, D, FS), ("layers", "embed", "mlp"), w),
                     shared_down=ParamSpec((n, FS, D), ("layers", "mlp", "embed"), w_out))
    return specs


def param_specs(m: ModelConfig, rt: Runtime | None = None) -> dict:
    D, V, N, F = m.d_model, m.vocab_size, m.n_layers, m.d_ff
    k = m.moe.first_dense
    w = normal(m.init_std)
    w_out = normal(m.init_std / math.sqrt(2 * N))
    specs = {
        "embed": {"embedding": ParamSpec((V, D), ("vocab", "embed"), w)},
        "layers": {**_attention_specs(m, N - k, w, w_out),
                   "moe": _moe_specs(m, N - k, w, w_out, bias=m.moe.bias_update_rate > 0)},
        "final_norm": {"scale": ParamSpec((D,), ("norm",), ones)},
    }
    if k:
        specs["dense_layers"] = {**_attention_specs(m, k, w, w_out),
                                 "w_gate": ParamSpec((k, D, F), ("layers", "embed", "mlp"), w),
                                 "w_up": ParamSpec((k, D, F), ("layers", "embed", "mlp"), w),
                                 "w_down": ParamSpec((k, F, D), ("layers", "mlp", "embed"), w_out)}
    if not m.tie_embeddings:
        specs["lm_head"] = {"kernel": ParamSpec((D, V), ("embed", "vocab"), w)}
    if m.mtp is not None:
        n = m.mtp.depth
        specs["mtp"] = {**_attention_specs(m, n, w, w_out), "moe": _moe_specs(m, n, w, w_out, bias=False),
                        "enorm": ParamSpec((n, D), ("layers", "norm"), ones),
                        "hnorm": ParamSpec((n, D), ("layers", "norm"), ones),
                        # [embedding half, hidden half] of DeepSeek's eh_proj `[2D, D]`
                        "proj": ParamSpec((n, 2, D, D), ("layers", None, "embed", "mlp"), w),
                        "final_norm": ParamSpec((n, D), ("layers", "norm"), ones)}
    return specs


def _gathered(w_DR, rules: dict):
    """A small projection (a latent down-projection `[D, rank]`, an MTP input projection) whole on
    every device that uses it (FSDP's all-gather, said explicitly): left to choose, XLA re-split it
    over devices with collective-permutes, which inside a pipeline stage wait for the devices of the
    other stages (XLA:CPU hangs)."""
    return constrain(w_DR, (None, None), rules)


def mla_out(x_BLD, p, m: ModelConfig, rules: dict, *, positions_BL, segment_ids_BL, inv_freq):
    """Multi-head latent attention's output projection `[B, L, D]` (before the residual add)."""
    a, eps = m.mla, m.norm_eps
    N, A, K = a.qk_nope_head_dim, a.v_head_dim, _qk_dim(m)
    h = constrain(rms_norm(x_BLD, p["attn_norm"], eps), ("batch", "block_length", "embed"), rules)
    positions_BL = constrain(positions_BL, ("batch", "block_length"), rules)
    if "wq" in p:
        q = dots.einsum("bld,dhk->blhk", h, p["wq"])
    else:
        cq = dots.einsum("bld,dq->blq", h, _gathered(p["wq_a"], rules))
        q = dots.einsum("blq,qhk->blhk", rms_norm(cq, p["q_norm"], eps), p["wq_b"])
    ckv = dots.einsum("bld,dr->blr", h, _gathered(p["wkv_a"], rules))
    c, k_rope = ckv[..., :a.kv_lora_rank], ckv[..., a.kv_lora_rank:]
    kv = dots.einsum("blr,rhk->blhk", rms_norm(c, p["kv_norm"], eps), p["wkv_b"])
    k_nope, v = kv[..., :N], kv[..., N:]
    q = jnp.concatenate([q[..., :N], apply_rope(q[..., N:], positions_BL, inv_freq)], axis=-1)
    k_rope = jnp.broadcast_to(apply_rope(k_rope[:, :, None, :], positions_BL, inv_freq), k_nope.shape[:3] + (K - N,))
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, K - A)))  # one head dim for every implementation
    q = constrain(q, ("batch", "block_length", "heads", "head_dim"), rules)
    kv_len = "kv_length" if kv_gathered(m.attention) else "block_length"  # ring: K/V stay sharded
    k = constrain(k, ("batch", kv_len, "kv_heads", "head_dim"), rules)
    v = constrain(v, ("batch", kv_len, "kv_heads", "head_dim"), rules)
    kv_seg = None if segment_ids_BL is None else constrain(segment_ids_BL, ("batch", kv_len), rules)
    q_seg = None if segment_ids_BL is None else constrain(segment_ids_BL, ("batch", "block_length"), rules)
    o = attention(q, k, v, impl=mla_attention_impl(m), segment_ids=q_seg, kv_segment_ids=kv_seg, causal=True,
                  sliding_window=m.sliding_window, rules=rules, ring_layout=m.ring_layout)
    o = constrain(o[..., :A], ("batch", "block_length", "heads", "head_dim"), rules)
    return dots.einsum("blhk,hkd->bld", o, p["wo"])


def _attend(x_BLD, p, m: ModelConfig, rules: dict, ctx: dict):
    return constrain(x_BLD + mla_out(x_BLD, p, m, rules, **ctx), RESIDUAL, rules)


def dense_layer(x_BLD, p, m: ModelConfig, rules: dict, ctx: dict):
    """One of the first `moe.first_dense` layers: MLA, then a SwiGLU MLP of `model.d_ff`."""
    x_BLD = _attend(x_BLD, p, m, rules, ctx)
    h = constrain(rms_norm(x_BLD, p["mlp_norm"], m.norm_eps), ("batch", "block_length", "embed"), rules)
    return constrain(x_BLD + swiglu(h, p["w_gate"], p["w_up"], p["w_down"], rules), RESIDUAL, rules)


def moe_layer(x_BLD, p, m: ModelConfig, rules: dict, ctx: dict):
    """MLA, then the routed and shared experts; `(x, routing statistics)`."""
    x_BLD = _attend(x_BLD, p, m, rules, ctx)
    y, stats = moe_mlp(rms_norm(x_BLD, p["mlp_norm"], m.norm_eps), p["moe"], m.moe, rules)
    return constrain(x_BLD + y, RESIDUAL, rules), stats


def _context(rows: dict, m: ModelConfig) -> dict:
    return dict(rows, inv_freq=inv_frequencies(m.mla.qk_rope_head_dim, m.rope_theta, m.rope_scaling))


def embed(params: dict, batch: dict, m: ModelConfig, rt: Runtime):
    """Token embeddings run through the dense layers (`dense_layers`, a scan under `model.remat`)."""
    x_BLD, rows = llama.embed(params, batch, m, rt)
    if "dense_layers" in params:
        ctx = _context(rows, m)
        body = remat(lambda x, p: (dense_layer(x, p, m, rt.rules, ctx), None), m.remat)
        x_BLD, _ = jax.lax.scan(body, x_BLD, params["dense_layers"])
    return x_BLD, rows


def layer(x_BLD, p: dict, rows: dict, m: ModelConfig, rt: Runtime):
    return moe_layer(x_BLD, p, m, rt.rules, _context(rows, m))


def final(params: dict, x_BLD, stats, m: ModelConfig, rt: Runtime, batch: dict | None = None):
    """The final-normed hidden states, the MoE losses, and (with `model.mtp` and a batch with
    targets) the multi-token prediction loss."""
    h, aux = llama.final(params, x_BLD, stats, m, rt)
    if m.mtp is not None and batch is not None and "targets" in batch:
        loss, mtp_stats = mtp_loss(params, x_BLD, batch, m, rt)
        aux = {"loss": aux["loss"] + m.mtp.loss_weight * loss + moe_loss(mtp_stats, m.moe),
               "metrics": {**aux["metrics"], "mtp_loss": loss}}
    return h, aux


def _shift(x_BL, k: int, fill=0):
    """`x[:, t + k]` at t (`fill` past the end)."""
    if k == 0:
        return x_BL
    return jnp.concatenate([x_BL[:, k:], jnp.full((x_BL.shape[0], k), fill, x_BL.dtype)], axis=1)


def mtp_positions(loss_mask_BL, segment_ids_BL, depth: int):
    """Where module `depth` (from 1) is scored: its target `targets[t + depth]` counts
    (`loss_mask`, which packing clears where a target is in the next document) and token t + depth is
    in t's document (so is the target then, documents being contiguous)."""
    valid = _shift(loss_mask_BL, depth, 0).astype(jnp.float32)
    if segment_ids_BL is not None:
        valid = valid * (_shift(segment_ids_BL, depth, -1) == segment_ids_BL)
    return valid


def mtp_loss(params: dict, x_BLD, batch: dict, m: ModelConfig, rt: Runtime):
    """The mean over `mtp.depth` modules of their masked mean cross-entropy, and the modules' MoE
    statistics (averaged). Module k (from 1) predicts token t + k + 1, `targets[t + k]`; a
    position counts where that target does (`loss_mask`) and lies in t's document (`segment_ids`)."""
    rules, eps = rt.rules, m.norm_eps
    targets, mask, seg = batch["targets"], batch["loss_mask"], batch.get("segment_ids")
    B, L = targets.shape
    positions = batch.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None, :], (B, L))
    ctx = _context(dict(positions_BL=positions, segment_ids_BL=seg), m)
    head = llama.head(params, m, rt)
    h_BLD, losses, stats = x_BLD, [], []
    for k in range(m.mtp.depth):
        p = jax.tree.map(lambda a: a[k], params["mtp"])
        e_BLD = constrain(llama._embedding_lookup(params["embed"]["embedding"], _shift(targets, k), rt), RESIDUAL,
                          rules)
        # the projection of [norm(e), norm(h)] as two matmuls summed: the concatenation along D
        # (split over tensor by the weight) would move its halves between devices
        h_BLD = (dots.einsum("bld,de->ble", rms_norm(e_BLD, p["enorm"], eps), p["proj"][0])
                 + dots.einsum("bld,de->ble", rms_norm(h_BLD, p["hnorm"], eps), p["proj"][1]))
        h_BLD = constrain(h_BLD, RESIDUAL, rules)
        h_BLD, s = moe_layer(h_BLD, p, m, rules, ctx)
        stats.append(s)
        out = constrain(rms_norm(h_BLD, p["final_norm"], eps), ("batch", "block_length", "embed"), rules)
        logits = constrain(jnp.einsum("bld,dv->blv", out, head, preferred_element_type=jnp.float32),
                           ("batch", "block_length", "vocab"), rules)
        nll, _ = token_losses(logits, _shift(targets, k + 1))
        valid = mtp_positions(mask, seg, k + 1)
        losses.append(jnp.sum(nll * valid) / jnp.maximum(jnp.sum(valid), 1.0))
    return sum(losses) / len(losses), jax.tree.map(lambda *v: sum(v) / len(v), *stats)


def head(params: dict, m: ModelConfig, rt: Runtime):
    return llama.head(params, m, rt)


def balance(params: dict, load_NE, m: ModelConfig) -> dict:
    """Aux-loss-free balancing: each MoE layer's bias moved by `moe.bias_update_rate` towards its
    mean load, `bias += rate * sign(1/E - load)` (`load_NE`: each layer's share of the step's
    assignments per expert). Runs after the optimizer, outside the gradient."""
    moe = params["layers"]["moe"]
    bias = moe["bias"]
    step = m.moe.bias_update_rate * jnp.sign(1.0 / m.moe.num_experts - load_NE)
    new = (bias.astype(jnp.float32) + step.reshape(bias.shape)).astype(bias.dtype)
    return {**params, "layers": {**params["layers"], "moe": {**moe, "bias": new}}}


def _attention_weights(m: ModelConfig) -> int:
    a, D, H = m.mla, m.d_model, m.n_heads
    q = D * H * _qk_dim(m) if a.q_lora_rank is None else a.q_lora_rank * (D + H * _qk_dim(m))
    kv = D * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + H * a.v_head_dim * D


def active_params(m: ModelConfig) -> tuple[int, int]:
    """(matmul weights a token passes through per layer in a dense layer, in a MoE layer)."""
    e, D = m.moe, m.d_model
    F = e.d_ff or m.d_ff
    attn = _attention_weights(m)
    return attn + 3 * D * m.d_ff, attn + D * e.num_experts + 3 * D * F * (e.top_k + e.shared_experts)


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (3 x forward): 6 x the matmul weights a token passes through (MLA's
    projections, the dense MLPs, the router and its top-k routed plus shared experts, each MTP
    module's projection, layer and head), 6 x D x V for the head, and the attention's scores
    (over N + P dims) and values (A dims) over the (L + 1) / 2 keys a causal query sees."""
    a, D, V, H = m.mla, m.d_model, m.vocab_size, m.n_heads
    dense, routed = active_params(m)
    k = m.moe.first_dense
    attended = (seq_len + 1) / 2
    per_layer_attn = 2 * H * (_qk_dim(m) + a.v_head_dim) * attended  # forward
    weights = k * dense + (m.n_layers - k) * routed
    layers = m.n_layers
    head_flops = 6.0 * D * V
    if m.mtp is not None:
        weights += m.mtp.depth * (2 * D * D + routed)
        layers += m.mtp.depth
        head_flops *= 1 + m.mtp.depth
    return 6.0 * weights + head_flops + 3 * layers * per_layer_attn
