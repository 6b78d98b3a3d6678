"""Hugging Face interchange for the deepseek family: DeepSeek-V3 checkpoints (`model_type:
deepseek_v3`, `DeepseekV3ForCausalLM`) <-> maxtrain params (`model.name: deepseek`).

`maxtrain.convert` dispatches here (`CONVERSION`) on config.json's `model_type` and on `model.name`,
and its writers (outputs built in a sibling) serve every family; the readers (safetensors headers
checked against the files) are `maxtrain.models.hf_common`. Tensor layouts,
HF `[out, in]` -> maxtrain `[in, ...]`:

- attention: `q_proj` (no query latent) or `q_a_proj` / `q_a_layernorm` / `q_b_proj` ->
  `wq` or `wq_a` / `q_norm` / `wq_b` `[D, (Q,) H, N + P]`; `kv_a_proj_with_mqa` -> `wkv_a`
  `[D, R + P]`, `kv_a_layernorm` -> `kv_norm`, `kv_b_proj` -> `wkv_b` `[R, H, N + A]`, `o_proj`
  -> `wo` `[H, A, D]`.
- the first `first_k_dense_replace` layers -> `dense_layers` (their `mlp.gate_proj` etc. ->
  `w_gate` ...), the rest -> `layers` with `layers.moe`: `mlp.gate.weight` -> `router` `[D, E]`,
  `mlp.gate.e_score_correction_bias` -> `bias`, `mlp.experts.{j}.gate_proj` ... -> `w_gate`
  `[E, D, F]` ..., `mlp.shared_experts.*` -> `shared_gate` ... The experts are per-expert tensors on
  disk, as in the hub checkpoints; transformers 5 fuses them on load (`gate_up_proj`) and splits
  them again in `save_pretrained`, so both directions use the per-expert names.
- RoPE: DeepSeek-V3 with `rope_interleave: true` (its default, and every published checkpoint)
  rotates interleaved pairs `(x0, x1), (x2, x3), ...` of the P rotary dims; maxtrain rotates
  halves `(x_i, x_{i + P/2})`. On import the rotary output columns (the last P of each head's
  N + P in `q_b_proj` / `q_proj`, the last P rows of `kv_a_proj_with_mqa`) are permuted from
  `[x0, x1, x2, x3, ...]` to `[x0, x2, ..., x1, x3, ...]`; q and k move alike, so every score is
  the same, and export applies the inverse and writes `rope_interleave: true`. With
  `rope_interleave: false` nothing is permuted.
- Multi-token prediction: transformers has no MTP modules (it ignores the hub's layer 61). On
  import the tensors of a layer past `num_hidden_layers` that is an MTP module (it has `eh_proj`)
  are skipped and the config gets `model.mtp: null`; exporting a model with `model.mtp` drops the
  `mtp` params with a logged warning and writes `num_nextn_predict_layers: 0`.

Choices on import (config.json does not say; set the model section of a config to change them
after conversion): `moe.capacity_factor: 0` (dropless, as transformers), `moe.every: 1`,
`moe.bias_update_rate: 0.001` (the paper's rate; it makes the `bias` param exist, so the
checkpoint's `e_score_correction_bias` is imported and keeps balancing when trained),
`moe.aux_loss_coef: 0.0001`, `moe.z_loss_coef: 0`, `model.mtp: null`. Keys config.json lacks take
transformers' `DeepseekV3Config` defaults, as `from_pretrained` would.

Refused, one line naming the config.json field: RoPE scaling other than none/default (YaRN, which
the published DeepSeek-V3 uses for its 128K context, is not implemented in maxtrain), a
`quantization_config` (FP8 checkpoints: dequantize to bf16 first), `attention_bias: true`,
`hidden_act` other than silu, `num_key_value_heads` != `num_attention_heads`, `scoring_func` other
than sigmoid (transformers' DeepSeek-V3 router is sigmoid only), `n_routed_experts` not divisible
by `n_group`, `moe_layer_freq` other than 1, and `topk_method` other than `noaux_tc`. Transformers
ignores `topk_method`: it always adds the correction bias to choose experts and always limits a
token to the best `topk_group` groups. `greedy` and `group_limited_greedy` (DeepSeek's code: no
bias; no group limit, or groups ranked by their best score) therefore mean the same routing only
when `topk_group == n_group`; they are read then, with a zero bias where the checkpoint has
none, and refused otherwise.
"""

from __future__ import annotations

import logging
import math
import os
import re

import numpy as np

from maxtrain.config import ConfigError, ModelConfig, MoEConfig
from maxtrain.models.deepseek.config import DeepSeekConfig, MLAConfig
from maxtrain.models.registry import HFConversion
from maxtrain.models.hf_common import INV_FREQ, hf_tensors, more, read_json, rope_fields, section

log = logging.getLogger("maxtrain")

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")
FLOAT32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # kept in float32 (transformers does too)
IMPORT_CHOICES = dict(capacity_factor=0.0, every=1, bias_update_rate=0.001, aux_loss_coef=0.0001, z_loss_coef=0.0)


# ---------------------------------------------------------------- config.json

_REQUIRED = object()


def _value(hf: dict, key: str, default):
    if key not in hf:
        if default is _REQUIRED:
            raise ConfigError(f"config.json has no {key}; a DeepSeek-V3 config.json gives it")
        return default
    return hf[key]


def _int(hf: dict, key: str, default=_REQUIRED, minimum: int = 1) -> int:
    v = _value(hf, key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"config.json {key}={v!r} is not valid; give {what}")
    return v


def _float(hf: dict, key: str, default=_REQUIRED, where: str = "") -> float:
    v = _value(hf, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise ConfigError(f"config.json {where}{key}={v!r} is not valid; give a positive number")
    return float(v)


def _bool(hf: dict, key: str, default: bool) -> bool:
    v = _value(hf, key, default)
    if not isinstance(v, bool):
        raise ConfigError(f"config.json {key}={v!r} is not valid; give true or false")
    return v


def _rope_theta(hf: dict) -> float:
    """RoPE's base; anything but plain RoPE refused (maxtrain's deepseek has no YaRN)."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = section(hf, key)
        field = "rope_type" if "rope_type" in rope else "type"
        kind = rope.get(field)
        if kind not in (None, "default"):
            raise ConfigError(f"config.json {key}.{field}={kind!r} is not supported: maxtrain's deepseek implements "
                              f"plain RoPE only{' (not YaRN)' if kind == 'yarn' else ''}; remove the scaling to "
                              f"convert the model at its original context length")
    theta = section(hf, "rope_parameters").get("rope_theta")
    if theta is not None:
        return _float({"rope_theta": theta}, "rope_theta", where="rope_parameters.")
    return _float(hf, "rope_theta", 10000.0)


def _routing(hf: dict, experts: int) -> tuple[int, int, bool]:
    """(n_group, topk_group, whether config.json's topk_method needs the correction bias)."""
    groups, topk_groups = _int(hf, "n_group", 8), _int(hf, "topk_group", 4)
    if experts % groups:
        raise ConfigError(f"config.json n_routed_experts={experts} is not divisible by n_group={groups}")
    if experts // groups < 2:
        raise ConfigError(f"config.json n_group={groups} leaves fewer than 2 of n_routed_experts={experts} per "
                          f"group; a group is ranked by its two best experts")
    if topk_groups > groups:
        raise ConfigError(f"config.json topk_group={topk_groups} is more than n_group={groups}")
    method = _value(hf, "topk_method", "noaux_tc")
    if method not in TOPK_METHODS:
        raise ConfigError(f"config.json topk_method={method!r} is not supported; DeepSeek-V3 routes by noaux_tc")
    if method != "noaux_tc" and topk_groups != groups:
        raise ConfigError(f"config.json topk_method={method!r} with topk_group={topk_groups} < n_group={groups} is "
                          f"not supported: transformers' DeepSeek-V3 router limits each token to its best topk_group "
                          f"groups (ranked by their two best scores) whatever topk_method says, DeepSeek's {method} "
                          f"does not; use noaux_tc, or topk_group equal to n_group")
    return groups, topk_groups, method == "noaux_tc"


def model_config_from_hf(hf: dict) -> ModelConfig:
    """A `model.name: deepseek` ModelConfig from a DeepSeek-V3 `config.json` dict."""
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"config.json {key}=true is not supported (DeepSeek-V3 has no biases)")
    if hf.get("quantization_config") is not None:
        raise ConfigError("config.json quantization_config is set (an FP8 checkpoint, as published) and is not "
                          "supported; dequantize the weights to bf16 first")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r} is not supported; only silu (SwiGLU)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"config.json scoring_func={hf['scoring_func']!r} is not supported; transformers' "
                          f"DeepSeek-V3 routes by sigmoid scores only")
    if hf.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"config.json moe_layer_freq={hf['moe_layer_freq']!r} is not supported; DeepSeek-V3 "
                          f"routes every layer after first_k_dense_replace (moe_layer_freq 1)")
    d_model, n_heads, n_layers = _int(hf, "hidden_size"), _int(hf, "num_attention_heads"), _int(hf, "num_hidden_layers")
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and _int(hf, "num_key_value_heads") != n_heads:
        raise ConfigError(f"config.json num_key_value_heads={kv_heads} is not num_attention_heads={n_heads}; "
                          f"multi-head latent attention has a key and value per head")
    if "q_lora_rank" not in hf:
        raise ConfigError("config.json has no q_lora_rank; give the query's latent rank, or null for none")
    q_rank = None if hf["q_lora_rank"] is None else _int(hf, "q_lora_rank")
    rope_dim = _int(hf, "qk_rope_head_dim")
    if rope_dim % 2:
        raise ConfigError(f"config.json qk_rope_head_dim={rope_dim} is not valid; rotary dims come in pairs")
    mla = MLAConfig(q_lora_rank=q_rank, kv_lora_rank=_int(hf, "kv_lora_rank"),
                    qk_nope_head_dim=_int(hf, "qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
                    v_head_dim=_int(hf, "v_head_dim"))
    experts, k = _int(hf, "n_routed_experts"), _int(hf, "num_experts_per_tok")
    groups, topk_groups, _ = _routing(hf, experts)
    if k > topk_groups * (experts // groups):
        raise ConfigError(f"config.json num_experts_per_tok={k} is more than the topk_group={topk_groups} groups "
                          f"of {experts // groups} experts a token may use")
    first_dense = _int(hf, "first_k_dense_replace", 3, minimum=0)
    if first_dense >= n_layers:
        raise ConfigError(f"config.json first_k_dense_replace={first_dense} leaves no MoE layer of "
                          f"num_hidden_layers={n_layers}; maxtrain's deepseek needs at least one")
    moe = MoEConfig(num_experts=experts, top_k=k, shared_experts=_int(hf, "n_shared_experts", 1),
                    d_ff=_int(hf, "moe_intermediate_size"), router="sigmoid", first_dense=first_dense,
                    norm_topk=_bool(hf, "norm_topk_prob", True),
                    routed_scale=_float(hf, "routed_scaling_factor", 2.5), groups=groups, topk_groups=topk_groups,
                    **IMPORT_CHOICES)
    tie = _bool(hf, "tie_word_embeddings", False)
    _bool(hf, "rope_interleave", True)  # checked here, applied to the weights (rope_interleave)
    return DeepSeekConfig(
        name="deepseek", vocab_size=_int(hf, "vocab_size"), d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_heads, head_dim=None if d_model % n_heads == 0 else rope_dim,  # unused by deepseek
        d_ff=_int(hf, "intermediate_size"), rope_theta=_rope_theta(hf), rope_scaling=None,
        norm_eps=_float(hf, "rms_norm_eps", 1e-6), tie_embeddings=tie, moe=moe, mla=mla, mtp=None)


def rope_interleave(hf: dict) -> bool:
    """Whether the checkpoint's rotary dims are interleaved pairs (`rope_interleave`, default true)."""
    return _bool(hf, "rope_interleave", True)


def bias_required(hf: dict) -> bool:
    """Whether every MoE layer must have `e_score_correction_bias` (noaux_tc; others: zero if absent)."""
    experts = _int(hf, "n_routed_experts")
    return _routing(hf, experts)[2]


def hf_config_from_model(m: ModelConfig, *, rope_format: str = "legacy", dtype: str = "float32",
                         max_position: int = 8192) -> dict:
    """A DeepSeek-V3 `config.json` dict; `rope_format` "legacy" (rope_theta/rope_scaling) or "parameters"."""
    _check_exportable(m)
    a, e = m.mla, m.moe
    out = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
        "moe_intermediate_size": e.d_ff or m.d_ff, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_heads,
        "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim, "rope_interleave": True,
        "n_routed_experts": e.num_experts, "num_experts_per_tok": e.top_k, "n_shared_experts": e.shared_experts,
        "first_k_dense_replace": e.first_dense, "moe_layer_freq": 1, "routed_scaling_factor": e.routed_scale,
        "n_group": e.groups, "topk_group": e.topk_groups,
        "norm_topk_prob": e.norm_topk if e.norm_topk is not None else e.top_k > 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "max_position_embeddings": max_position,
        "torch_dtype": dtype,
    }
    return {**out, **rope_fields(m.rope_theta, None, rope_format)}


def _check_exportable(m: ModelConfig) -> None:
    e = m.moe
    if e.router != "sigmoid":
        raise ConfigError(f"model.moe.router={e.router!r} has no DeepSeek-V3 form: transformers' DeepSeek-V3 routes "
                          f"by sigmoid scores only")
    if not e.shared_experts:
        raise ConfigError("model.moe.shared_experts=0 has no DeepSeek-V3 form: transformers' DeepSeek-V3 layers "
                          "always have shared experts")
    if m.rope_scaling is not None:
        raise ConfigError("model.rope_scaling (Llama-3 scaling) with model.name=deepseek has no DeepSeek-V3 form "
                          "maxtrain converts back; export a model with plain RoPE")


# ---------------------------------------------------------------- weights

DENSE_MLP = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
SHARED_MLP = (("shared_gate", "gate_proj"), ("shared_up", "up_proj"), ("shared_down", "down_proj"))


def _rope_order(P: int, to_half: bool) -> np.ndarray:
    """The permutation of P rotary columns from interleaved pairs to halves (or back)."""
    half = np.concatenate([np.arange(0, P, 2), np.arange(1, P, 2)])
    return half if to_half else np.argsort(half)


def _permute_rope(x: np.ndarray, P: int, to_half: bool) -> np.ndarray:
    """`x` with its last P columns (the rotary ones) permuted; the others untouched."""
    return np.concatenate([x[..., :-P], x[..., -P:][..., _rope_order(P, to_half)]], axis=-1)


def _layers(m: ModelConfig) -> tuple[range, range]:
    """(HF indices of the dense layers, of the MoE layers)."""
    return range(m.moe.first_dense), range(m.moe.first_dense, m.n_layers)


def params_to_hf(params: dict, m: ModelConfig, *, rope_interleave: bool = True) -> dict[str, np.ndarray]:
    """maxtrain deepseek params (numpy) -> DeepSeek-V3 state dict names and `[out, in]` layouts
    (rotary columns interleaved unless `rope_interleave` is false). `mtp` params are dropped."""
    _check_exportable(m)
    if "mtp" in params:
        log.warning("the %d multi-token prediction module(s) (params 'mtp') are not exported: transformers' "
                    "DeepSeek-V3 has none; the Hugging Face model predicts the next token only",
                    m.mtp.depth if m.mtp is not None else len(next(iter(params["mtp"].values()))))
    a, D, H = m.mla, m.d_model, m.n_heads
    R, P, N, A = a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim
    K = N + P

    def rope(x):
        return _permute_rope(x, P, to_half=False) if rope_interleave else x

    out = {"model.embed_tokens.weight": params["embed"]["embedding"],
           "model.norm.weight": params["final_norm"]["scale"]}
    if not m.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]["kernel"].T
    dense, routed = _layers(m)
    for stack, indices in (("dense_layers", dense), ("layers", routed)):
        for j, i in enumerate(indices):
            p, L = f"model.layers.{i}.", params[stack]
            at = {k: v[j] for k, v in L.items() if k not in ("moe", "fp8")}
            out[p + "input_layernorm.weight"] = at["attn_norm"]
            out[p + "post_attention_layernorm.weight"] = at["mlp_norm"]
            if a.q_lora_rank is None:
                out[p + "self_attn.q_proj.weight"] = rope(at["wq"]).reshape(D, H * K).T
            else:
                out[p + "self_attn.q_a_proj.weight"] = at["wq_a"].T
                out[p + "self_attn.q_a_layernorm.weight"] = at["q_norm"]
                out[p + "self_attn.q_b_proj.weight"] = rope(at["wq_b"]).reshape(a.q_lora_rank, H * K).T
            out[p + "self_attn.kv_a_proj_with_mqa.weight"] = rope(at["wkv_a"]).T
            out[p + "self_attn.kv_a_layernorm.weight"] = at["kv_norm"]
            out[p + "self_attn.kv_b_proj.weight"] = at["wkv_b"].reshape(R, H * (N + A)).T
            out[p + "self_attn.o_proj.weight"] = at["wo"].reshape(H * A, D).T
            if stack == "dense_layers":
                for ours, theirs in DENSE_MLP:
                    out[f"{p}mlp.{theirs}.weight"] = at[ours].T
                continue
            e = L["moe"]
            out[p + "mlp.gate.weight"] = e["router"][j].T
            out[p + "mlp.gate.e_score_correction_bias"] = (
                e["bias"][j] if "bias" in e else np.zeros(m.moe.num_experts, np.float32))
            for x in range(m.moe.num_experts):
                for ours, theirs in DENSE_MLP:
                    out[f"{p}mlp.experts.{x}.{theirs}.weight"] = e[ours][j, x].T
            for ours, theirs in SHARED_MLP:
                out[f"{p}mlp.shared_experts.{theirs}.weight"] = e[ours][j].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def params_from_hf(get, m: ModelConfig, *, rope_interleave: bool = True, has=None) -> dict:
    """DeepSeek-V3 tensors (`get(name) -> numpy array`) -> maxtrain deepseek params (numpy, stacked
    layers). `has(name)` says whether an optional tensor (a correction bias `topk_method` does not
    require) is there; one that is not is read as zeros."""
    a, D, H = m.mla, m.d_model, m.n_heads
    R, P, N, A = a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim
    K = N + P

    def rope(x):
        return _permute_rope(x, P, to_half=True) if rope_interleave else x

    attn = {"attn_norm": lambda p: get(p + "input_layernorm.weight"),
            "wkv_a": lambda p: rope(get(p + "self_attn.kv_a_proj_with_mqa.weight").T),
            "kv_norm": lambda p: get(p + "self_attn.kv_a_layernorm.weight"),
            "wkv_b": lambda p: get(p + "self_attn.kv_b_proj.weight").T.reshape(R, H, N + A),
            "wo": lambda p: get(p + "self_attn.o_proj.weight").T.reshape(H, A, D),
            "mlp_norm": lambda p: get(p + "post_attention_layernorm.weight")}
    if a.q_lora_rank is None:
        attn["wq"] = lambda p: rope(get(p + "self_attn.q_proj.weight").T.reshape(D, H, K))
    else:
        attn.update(wq_a=lambda p: get(p + "self_attn.q_a_proj.weight").T,
                    q_norm=lambda p: get(p + "self_attn.q_a_layernorm.weight"),
                    wq_b=lambda p: rope(get(p + "self_attn.q_b_proj.weight").T.reshape(a.q_lora_rank, H, K)))

    def stack(fn, layers):
        return np.stack([fn(f"model.layers.{i}.") for i in layers])

    def bias(p):
        name = p + "mlp.gate.e_score_correction_bias"
        return get(name) if has is None or has(name) else np.zeros(m.moe.num_experts, np.float32)

    dense, routed = _layers(m)
    moe = {"router": lambda p: get(p + "mlp.gate.weight").T}
    if m.moe.bias_update_rate > 0:
        moe["bias"] = bias
    for ours, theirs in DENSE_MLP:
        moe[ours] = lambda p, theirs=theirs: np.stack(
            [get(f"{p}mlp.experts.{x}.{theirs}.weight").T for x in range(m.moe.num_experts)])
    for ours, theirs in SHARED_MLP:
        moe[ours] = lambda p, theirs=theirs: get(f"{p}mlp.shared_experts.{theirs}.weight").T
    params = {"embed": {"embedding": get("model.embed_tokens.weight")},
              "layers": {**{k: stack(fn, routed) for k, fn in attn.items()},
                         "moe": {k: stack(fn, routed) for k, fn in moe.items()}},
              "final_norm": {"scale": get("model.norm.weight")}}
    if dense:
        mlp = {ours: (lambda p, theirs=theirs: get(f"{p}mlp.{theirs}.weight").T) for ours, theirs in DENSE_MLP}
        params["dense_layers"] = {k: stack(fn, dense) for k, fn in {**attn, **mlp}.items()}
    if not m.tie_embeddings:
        params["lm_head"] = {"kernel": get("lm_head.weight").T}
    return params


def hf_shapes(m: ModelConfig, *, bias: bool | None = None):
    """Yields (name, shape) for every tensor a DeepSeek-V3 checkpoint of `m` holds, as config.json
    implies (the correction biases when `bias`, by default when `m` has the param)."""
    a, D, H, E = m.mla, m.d_model, m.n_heads, m.moe.num_experts
    R, P, N, A = a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim
    F, FE = m.d_ff, m.moe.d_ff or m.d_ff
    FS = m.moe.shared_experts * FE
    bias = m.moe.bias_update_rate > 0 if bias is None else bias
    yield "model.embed_tokens.weight", (m.vocab_size, D)
    yield "model.norm.weight", (D,)
    if not m.tie_embeddings:
        yield "lm_head.weight", (m.vocab_size, D)
    for i in range(m.n_layers):
        p = f"model.layers.{i}."
        yield from {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                    p + "self_attn.kv_a_proj_with_mqa.weight": (R + P, D), p + "self_attn.kv_a_layernorm.weight": (R,),
                    p + "self_attn.kv_b_proj.weight": (H * (N + A), R),
                    p + "self_attn.o_proj.weight": (D, H * A)}.items()
        if a.q_lora_rank is None:
            yield p + "self_attn.q_proj.weight", (H * (N + P), D)
        else:
            Q = a.q_lora_rank
            yield from {p + "self_attn.q_a_proj.weight": (Q, D), p + "self_attn.q_a_layernorm.weight": (Q,),
                        p + "self_attn.q_b_proj.weight": (H * (N + P), Q)}.items()
        if i < m.moe.first_dense:
            yield from {p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                        p + "mlp.down_proj.weight": (D, F)}.items()
            continue
        yield p + "mlp.gate.weight", (E, D)
        if bias:
            yield p + "mlp.gate.e_score_correction_bias", (E,)
        for x in range(E):
            q = f"{p}mlp.experts.{x}."
            yield from {q + "gate_proj.weight": (FE, D), q + "up_proj.weight": (FE, D),
                        q + "down_proj.weight": (D, FE)}.items()
        q = p + "mlp.shared_experts."
        yield from {q + "gate_proj.weight": (FS, D), q + "up_proj.weight": (FS, D),
                    q + "down_proj.weight": (D, FS)}.items()


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _mtp_layers(found: dict, m: ModelConfig) -> set[str]:
    """The `model.layers.{i}.` prefixes past num_hidden_layers that are MTP modules (they have `eh_proj`)."""
    prefixes = set()
    for name in found:
        hit = _LAYER.match(name)
        if hit and int(hit.group(1)) >= m.n_layers and f"{hit.group(0)}eh_proj.weight" in found:
            prefixes.add(hit.group(0))
    return prefixes


def check_tensors(found: dict[str, tuple[str, tuple[int, ...]]], m: ModelConfig, hf_dir: str, *,
                  bias_required: bool = True) -> None:
    """Raises ConfigError unless `found` (name -> (file, shape)) holds exactly the tensors of `m`,
    besides MTP layers (skipped) and, unless `bias_required`, correction biases that may be absent."""
    want, optional = {}, {}
    for name, shape in hf_shapes(m, bias=bias_required and m.moe.bias_update_rate > 0):
        if name not in found:
            raise ConfigError(f"{hf_dir}: tensor {name} missing; is this a DeepSeek-V3 checkpoint matching "
                              f"config.json?")
        want[name] = shape
    if not bias_required:  # read where they are, zeros where not
        optional = {f"model.layers.{i}.mlp.gate.e_score_correction_bias": (m.moe.num_experts,)
                    for i in _layers(m)[1]}
    if m.tie_embeddings:  # a tied checkpoint's copy of the embedding: not read, but its shape checked
        want["lm_head.weight"] = want["model.embed_tokens.weight"]
    want.update(optional)
    wrong = [k for k in want if k in found and found[k][1] != want[k]]
    if wrong:
        path, shape = found[wrong[0]]
        raise ConfigError(f"{path}: tensor {wrong[0]} has shape {shape} but config.json implies {want[wrong[0]]}"
                          f"{more(wrong)}; the weights do not match config.json")
    mtp = _mtp_layers(found, m)
    extra = [k for k in found if k not in want and not k.endswith(INV_FREQ)
             and not any(k.startswith(p) for p in mtp)]
    if extra:
        raise ConfigError(f"{found[extra[0]][0]}: unexpected tensor {extra[0]}{more(extra)}; config.json "
                          f"describes a DeepSeek-V3 model with num_hidden_layers={m.n_layers}, which has no such "
                          f"tensor")
    if mtp:
        log.info("skipping %d multi-token prediction layer(s) (%s): maxtrain imports the model without them "
                 "(model.mtp: null)", len(mtp), ", ".join(sorted(p.rstrip(".") for p in mtp)))


def read_hf_params(hf_dir: str, m: ModelConfig, param_dtype: str = "float32") -> dict:
    """numpy params of `m` from a DeepSeek-V3 directory, every tensor checked against `m` first."""
    from safetensors import safe_open

    hf = read_json(os.path.join(hf_dir, "config.json"), "give a Hugging Face model directory")
    try:  # what the weights' layout depends on beyond `m` (read_hf_config checked the rest)
        if not isinstance(hf, dict):
            raise ConfigError(f"config.json is not a JSON object (found {type(hf).__name__})")
        interleave, required = rope_interleave(hf), bias_required(hf)
    except ConfigError as e:
        raise ConfigError(f"{hf_dir}: {e}") from None
    found = hf_tensors(hf_dir)
    check_tensors(found, m, hf_dir, bias_required=required)
    handles = {path: safe_open(path, framework="flax") for path in sorted({f for f, _ in found.values()})}
    return params_from_hf(lambda name: np.asarray(handles[found[name][0]].get_tensor(name).astype(param_dtype)), m,
                          rope_interleave=interleave, has=lambda name: name in found)


def tensor_dtype(name: str, dtype: str) -> str:
    """The dtype a tensor is written in: the router and its correction bias stay float32 (a bias
    moved 0.001 a step would not move in bf16; transformers keeps both in float32)."""
    return "float32" if name.endswith(FLOAT32) else dtype


CONVERSION = HFConversion((MODEL_TYPE,), model_config_from_hf, hf_config_from_model, hf_shapes, check_tensors,
                          params_from_hf, params_to_hf, read_params=read_hf_params, tensor_dtype=tensor_dtype)
