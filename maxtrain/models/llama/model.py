"""Decoder-only transformer of the Llama 2 / Llama 3 / Mistral family, as pure functions.

Shapes in names: B batch, L length, D model dim, H query heads, G kv heads, K head dim, F MLP
dim, V vocab, N layers. Layers are stacked along a leading `layers` axis and run with `lax.scan`,
so compile time does not grow with depth.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from maxtrain.config import ModelConfig
from maxtrain.layers import dots
from maxtrain.layers.attention import attention, kv_gathered
from maxtrain.layers.embedding import lookup
from maxtrain.layers.fp8 import meta_spec_shapes, project
from maxtrain.layers.mlp import swiglu
from maxtrain.layers.moe import moe_loss, moe_mlp
from maxtrain.layers.norms import fused_add_rms_norm, rms_norm
from maxtrain.layers.rope import apply_rope, inv_frequencies
from maxtrain.models.specs import ParamSpec, normal, ones, zeros
from maxtrain.models.stack import Runtime
from jax.sharding import PartitionSpec as P

from maxtrain.sharding import constrain, constrain_spec, logical_to_spec


def param_specs(m: ModelConfig, rt: Runtime | None = None) -> dict:
    D, H, G, K, F, V, N = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size, m.n_layers
    w = normal(m.init_std)
    w_out = normal(m.init_std / math.sqrt(2 * N))  # residual-branch outputs scaled by depth
    a = PROJ_AXES
    specs = {
        "embed": {"embedding": ParamSpec((V, D), ("vocab", "embed"), w)},
        "layers": {
            "attn_norm": ParamSpec((N, D), ("layers", "norm"), ones),
            "wq": ParamSpec((N, D, H, K), ("layers",) + a["wq"], w),
            "wk": ParamSpec((N, D, G, K), ("layers",) + a["wk"], w),
            "wv": ParamSpec((N, D, G, K), ("layers",) + a["wv"], w),
            "wo": ParamSpec((N, H, K, D), ("layers",) + a["wo"], w_out),
            "mlp_norm": ParamSpec((N, D), ("layers", "norm"), ones),
            "w_gate": ParamSpec((N, D, F), ("layers",) + a["w_gate"], w),
            "w_up": ParamSpec((N, D, F), ("layers",) + a["w_up"], w),
            "w_down": ParamSpec((N, F, D), ("layers",) + a["w_down"], w_out),
        },
        "final_norm": {"scale": ParamSpec((D,), ("norm",), ones)},
    }
    if m.qk_norm:
        specs["layers"]["q_norm"] = ParamSpec((N, K), ("layers", "norm"), ones)
        specs["layers"]["k_norm"] = ParamSpec((N, K), ("layers", "norm"), ones)
    if not m.tie_embeddings:
        specs["lm_head"] = {"kernel": ParamSpec((D, V), ("embed", "vocab"), w)}
    if m.moe is not None:
        specs["layers"] = _moe_block_specs(m, specs["layers"], w, w_out)
    if rt is not None and rt.fp8 is not None:
        specs["layers"]["fp8"] = _fp8_meta_specs(specs["layers"], rt.fp8)
    return specs


ATTN_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "q_norm", "k_norm")  # the last two: model.qk_norm
DENSE_KEYS = ("w_gate", "w_up", "w_down")
# the projections (FP8 under `train.fp8`): their logical axes past the stacking, and how many of
# their leading dims the input contracts with
PROJ_AXES = {"wq": ("embed", "heads", "head_dim"), "wk": ("embed", "kv_heads", "head_dim"),
             "wv": ("embed", "kv_heads", "head_dim"), "wo": ("heads", "head_dim", "embed"),
             "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}
CONTRACTS = {"wo": 2}  # the others contract one


def _fp8_meta_specs(layers: dict, fp8) -> dict:
    """The FP8 meta of every projection in `layers` (dense layers, or MoE blocks' attention and
    dense MLPs: the experts stay in the compute dtype), stacked like its weight."""
    def meta(key: str, spec: ParamSpec) -> dict:
        lead = spec.shape[:len(spec.shape) - len(PROJ_AXES[key])]
        axes = spec.axes[:len(lead)]
        return {name: ParamSpec(shape, axes + (None,) * (len(shape) - len(lead)), zeros)
                for name, shape in meta_spec_shapes(lead, fp8.recipe, fp8.amax_history).items()}

    out = {}
    for key in PROJ_AXES:
        if key in layers:
            out[key] = meta(key, layers[key])
    if "dense" in layers:
        out["dense"] = _fp8_meta_specs(layers["dense"], fp8)
    return out


def _dot(name: str, eq: str, x, w, p: dict, rt):
    """A projection `einsum(eq, x, w)` of weight `name`; in FP8 under `train.fp8` (its meta from the
    layer's `fp8` params, the weight's stored layout for the FP8 all-gather)."""
    if rt is None or rt.fp8 is None:
        return dots.einsum(eq, x, w)
    spec = logical_to_spec(PROJ_AXES[name], rt.param_rules)
    return project(x, w, CONTRACTS.get(name, 1), rt.fp8, p.get("fp8", {}).get(name), spec)


def _moe_block_specs(m: ModelConfig, dense: dict, w, w_out) -> dict:
    """Layers grouped in blocks of `moe.every`: every sublayer has attention, the last a MoE MLP."""
    e = m.moe
    NB, S = m.n_layers // e.every, e.every
    D, E, F = m.d_model, e.num_experts, e.d_ff or m.d_ff

    def regroup(spec: ParamSpec, n: int) -> ParamSpec:
        return ParamSpec((NB, n) + spec.shape[1:], ("layers", None) + spec.axes[1:], spec.init)

    block = {k: regroup(dense[k], S) for k in ATTN_KEYS if k in dense}
    if S > 1:
        block["dense"] = {k: regroup(dense[k], S - 1) for k in DENSE_KEYS}
    block["moe"] = {
        "router": ParamSpec((NB, D, E), ("layers", "embed", None), w),
        "w_gate": ParamSpec((NB, E, D, F), ("layers", "experts", "embed", "expert_mlp"), w),
        "w_up": ParamSpec((NB, E, D, F), ("layers", "experts", "embed", "expert_mlp"), w),
        "w_down": ParamSpec((NB, E, F, D), ("layers", "experts", "expert_mlp", "embed"), w_out),
    }
    if e.shared_experts:
        FS = e.shared_experts * F
        block["moe"].update({
            "shared_gate": ParamSpec((NB, D, FS), ("layers", "embed", "mlp"), w),
            "shared_up": ParamSpec((NB, D, FS), ("layers", "embed", "mlp"), w),
            "shared_down": ParamSpec((NB, FS, D), ("layers", "mlp", "embed"), w_out),
        })
    return block


def _normed(x_BLD, scale, eps: float, rules):
    """The norm of the residual stream, pinned to the residual's layout: a block's gather then moves
    it in the compute dtype, not the norm's float32."""
    return constrain(rms_norm(x_BLD, scale, eps), ("batch", "length", "embed"), rules)


def _block_input(x_BLD, scale, eps: float, rules):
    """The normed input of a block as the block's inside wants it (`_enter_block`), and its layout.
    With `length: [sequence, tensor]` (Megatron sequence parallelism) this is the all-gather over
    tensor, and leaving the block after its row-parallel matmul is the reduce-scatter back."""
    return _enter_block(_normed(x_BLD, scale, eps, rules), rules)


def _gathers_length(rules) -> bool:
    """Whether a block's inside is split along length other than the residual stream (Megatron
    sequence parallelism: `length: [sequence, tensor]`, `block_length: sequence`), so that entering
    a block all-gathers along length and leaving it reduce-scatters."""
    return logical_to_spec(("length",), rules) != logical_to_spec(("block_length",), rules)


def _enter_block(h_BLD, rules):
    """`h` laid out along length as a block's inside wants it (`block_length`), and the letters of
    its layout: "bld", or "lbd" where the block gathers along length. There the residual's shard is
    transposed to `[L, B, D]` before the gather, so the gather concatenates whole leading slabs:
    gathered along the middle dimension of `[B, L, D]`, XLA copied every gathered activation
    through a transpose on the way in and another on the way out (Megatron keeps its residual
    stream `[L, B, D]` for this reason). The transpose here moves one shard, 1/n of the bytes."""
    if not _gathers_length(rules):
        return constrain(h_BLD, ("batch", "block_length", "embed"), rules), "bld"
    h_LBD = constrain(jnp.swapaxes(h_BLD, 0, 1), ("length", "batch", "embed"), rules)
    return constrain(h_LBD, ("block_length", "batch", "embed"), rules), "lbd"


def _leave_block(y, layout: str, rules):
    """A block's row-parallel output (laid out as `layout`) in the residual's `[B, L, D]`: from
    `[L, B, D]` it is reduce-scattered along the leading length, then its shard transposed."""
    if layout == "bld":
        return y
    return jnp.swapaxes(constrain(y, ("length", "batch", "embed"), rules), 0, 1)


def _to_bl(y, layout: str):
    """A block's `[L, B, ...]` (layout "lbd") or `[B, L, ...]` projection as `[B, L, ...]`."""
    return y if layout == "bld" else jnp.swapaxes(y, 0, 1)


def _attention_out(x_BLD, p, m: ModelConfig, rules: dict, *, positions_BL, segment_ids_BL, inv_freq, rt=None):
    """The attention block's output projection `[B, L, D]` (before the residual add)."""
    h, lay = _block_input(x_BLD, p["attn_norm"], m.norm_eps, rules)
    positions_BL = constrain(positions_BL, ("batch", "block_length"), rules)  # RoPE angles made where used
    q = _to_bl(_dot("wq", f"{lay},dhk->{lay[:2]}hk", h, p["wq"], p, rt), lay)
    k = _to_bl(_dot("wk", f"{lay},dgk->{lay[:2]}gk", h, p["wk"], p, rt), lay)
    v = _to_bl(_dot("wv", f"{lay},dgk->{lay[:2]}gk", h, p["wv"], p, rt), lay)
    if "q_norm" in p:  # model.qk_norm (Qwen3): each head's query and key RMS-normed before RoPE
        q, k = rms_norm(q, p["q_norm"], m.norm_eps), rms_norm(k, p["k_norm"], m.norm_eps)
    q = constrain(apply_rope(q, positions_BL, inv_freq), ("batch", "block_length", "heads", "head_dim"), rules)
    kv_len = "kv_length" if kv_gathered(m.attention) else "block_length"  # ring: K/V stay sharded
    k = constrain(apply_rope(k, positions_BL, inv_freq), ("batch", kv_len, "kv_heads", "head_dim"), rules)
    v = constrain(v, ("batch", kv_len, "kv_heads", "head_dim"), rules)
    kv_seg = None if segment_ids_BL is None else constrain(segment_ids_BL, ("batch", kv_len), rules)
    q_seg = None if segment_ids_BL is None else constrain(segment_ids_BL, ("batch", "block_length"), rules)
    o = attention(q, k, v, impl=m.attention, segment_ids=q_seg, kv_segment_ids=kv_seg,
                  causal=True, sliding_window=m.sliding_window, rules=rules, ring_layout=m.ring_layout)
    o = _to_bl(constrain(o, ("batch", "block_length", "heads", "head_dim"), rules), lay)
    return _leave_block(_dot("wo", f"{lay[:2]}hk,hkd->{lay}", o, p["wo"], p, rt), lay, rules)


def _attention(x_BLD, p, m: ModelConfig, rules: dict, **ctx):
    """The residual stream after the attention block."""
    return constrain(x_BLD + _attention_out(x_BLD, p, m, rules, **ctx), ("batch", "length", "embed"), rules)


def _dense_layer(x_BLD, p, m: ModelConfig, rules: dict, **ctx):
    """One dense decoder layer: attention, then the SwiGLU MLP."""
    if m.fused_norm:  # the residual add and the MLP's norm in one kernel
        o = constrain(_attention_out(x_BLD, p, m, rules, **ctx), ("batch", "length", "embed"), rules)
        h, x_BLD = fused_add_rms_norm(o, x_BLD, p["mlp_norm"], m.norm_eps, rules)
        h, lay = _enter_block(h, rules)
    else:
        x_BLD = _attention(x_BLD, p, m, rules, **ctx)
        h, lay = _block_input(x_BLD, p["mlp_norm"], m.norm_eps, rules)
    dot = functools.partial(_dot, p=p, rt=ctx.get("rt"))
    x_BLD = x_BLD + _leave_block(swiglu(h, p["w_gate"], p["w_up"], p["w_down"], rules, lay, dot), lay, rules)
    return constrain(x_BLD, ("batch", "length", "embed"), rules)


def sublayer(p: dict, i: int, every: int) -> dict:
    """Layer i of a MoE block's params (`_moe_block_specs`): its attention and norms, and its dense
    MLP unless it is the block's last, whose MLP is the experts (`p["moe"]`)."""
    sub = {k: p[k][i] for k in ATTN_KEYS if k in p}
    if i < every - 1:
        sub.update({k: p["dense"][k][i] for k in DENSE_KEYS})
    return sub


def _moe_block(x_BLD, p, m: ModelConfig, rules: dict, **ctx):
    """`moe.every` layers: dense ones, then one whose MLP is the mixture of experts."""
    S = m.moe.every
    meta = p.get("fp8")
    for i in range(S):
        sub = sublayer(p, i, S)
        if meta is not None:
            sub["fp8"] = {k: jax.tree.map(lambda a: a[i], v) for k, v in meta.items() if k != "dense"}
        if i < S - 1:
            if meta is not None:
                sub["fp8"].update({k: jax.tree.map(lambda a: a[i], meta["dense"][k]) for k in DENSE_KEYS})
            x_BLD = _dense_layer(x_BLD, sub, m, rules, **ctx)
            continue
        x_BLD = _attention(x_BLD, sub, m, rules, **ctx)
        y, stats = moe_mlp(rms_norm(x_BLD, sub["mlp_norm"], m.norm_eps), p["moe"], m.moe, rules)
        x_BLD = constrain(x_BLD + y, ("batch", "length", "embed"), rules)
    return x_BLD, stats


def embed(params: dict, batch: dict, m: ModelConfig, rt: Runtime) -> tuple[jax.Array, dict]:
    """Token embeddings `[B, L, D]` for `batch["inputs"]`, and the rows every layer reads
    (positions: given or 0..L-1; segment ids: given or None)."""
    rules = rt.rules
    tokens_BL = batch["inputs"]
    B, L = tokens_BL.shape
    positions_BL = batch.get("positions")
    if positions_BL is None:
        positions_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None, :], (B, L))
    segment_ids_BL = batch.get("segment_ids")
    if segment_ids_BL is not None:
        segment_ids_BL = constrain(segment_ids_BL, ("batch", "length"), rules)
    x_BLD = constrain(_embedding_lookup(params["embed"]["embedding"], tokens_BL, rt), ("batch", "length", "embed"),
                      rules)
    return x_BLD, dict(positions_BL=positions_BL, segment_ids_BL=segment_ids_BL)


def _embedding_lookup(table_VD, tokens_BL, rt: Runtime):
    """`table[tokens]` read where the table is stored. The table stays split as stored (vocab,
    and its embed dim over FSDP); the token ids (a few KB) are gathered over the axes that split
    the embed dim, each device reads its slice of D for all of them, and XLA moves the result to
    the activation layout. The gradient is then scatter-added (in float32: in bf16 a frequent
    token's row stops growing) into each device's own `[V, D/n]` shard: no device ever holds a
    whole `[V, D]` table or its float32 gradient (the comparator's 32000 x 512: 64 MiB each)."""
    stored = logical_to_spec(("vocab", "embed"), rt.param_rules)
    embed_axes = set(_spec_axes(stored[1]))
    batch = tuple(a for a in _spec_axes(logical_to_spec(("batch",), rt.rules)[0]) if a not in embed_axes)
    row_spec = P(batch or None, None)
    table_VD = constrain_spec(table_VD, stored)
    tokens_BL = constrain_spec(tokens_BL, row_spec)
    x_BLD = lookup(table_VD, tokens_BL, stored)
    return constrain_spec(x_BLD, P(batch or None, None, stored[1]))


def _spec_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def layer(x_BLD, p: dict, rows: dict, m: ModelConfig, rt: Runtime):
    """One element of the stack: a dense decoder layer, or a block of `moe.every` layers whose
    last MLP is the mixture of experts (returning its routing statistics)."""
    inv_freq = inv_frequencies(m.head_dim, m.rope_theta, m.rope_scaling)
    if m.moe is not None:
        return _moe_block(x_BLD, p, m, rt.rules, inv_freq=inv_freq, rt=rt, **rows)
    return _dense_layer(x_BLD, p, m, rt.rules, inv_freq=inv_freq, rt=rt, **rows), None


def final(params: dict, x_BLD, stats, m: ModelConfig, rt: Runtime) -> tuple[jax.Array, dict]:
    """The final-normed hidden states `[B, L, D]`, and the MoE loss and statistics (averaged over
    the MoE layers)."""
    aux = {}
    if m.moe is not None:
        aux = {"loss": moe_loss(stats, m.moe), "metrics": stats}
    h = _normed(x_BLD, params["final_norm"]["scale"], m.norm_eps, rt.rules)  # the head is a block too, [B, L, D]
    return constrain(h, ("batch", "block_length", "embed"), rt.rules), aux


def head(params: dict, m: ModelConfig, rt: Runtime) -> jax.Array:
    """The output projection `[D, V]` (the embedding, transposed, when tied)."""
    if m.tie_embeddings:
        return params["embed"]["embedding"].T
    return params["lm_head"]["kernel"]


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), not counting remat recompute.

    - 6 x the matmul weights of the layers (q, k, v, o projections and the SwiGLU MLP): each weight
      does one multiply-add (2 FLOPs) per token forward, twice that backward;
    - 6 x D x V for the output projection (tied or not); the embedding lookup is a gather, 0 FLOPs;
    - attention scores and values: 2 matmuls x 2 FLOPs x H x K per attended key, forward; a causal
      query attends (L + 1) / 2 keys on average (or the sliding window): x3 for training.
    Norms, RoPE and softmax are elementwise and left out, as in the usual MFU convention.
    """
    D, H, G, K, F, V, N = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size, m.n_layers
    layer_weights = D * H * K * 2 + D * G * K * 2 + 3 * D * F
    dense_mlp = 3 * D * F
    if m.moe is not None:  # a MoE layer's active weights: router, top_k routed and the shared experts
        e = m.moe
        FE = e.d_ff or F
        moe_mlp_w = D * e.num_experts + 3 * D * FE * (e.top_k + e.shared_experts)
        layer_weights += (moe_mlp_w - dense_mlp) / e.every
    attended = (seq_len + 1) / 2
    if m.sliding_window is not None and m.sliding_window < seq_len:
        w = m.sliding_window
        attended = (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
    attn = 3 * N * 4 * H * K * attended
    return 6.0 * N * layer_weights + 6.0 * D * V + attn
