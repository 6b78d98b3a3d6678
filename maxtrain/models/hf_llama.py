"""Hugging Face interchange for the Llama family: `config.json` + safetensors <-> maxtrain params.
DeepSeek-V3 checkpoints (`model.name: deepseek`) go through the same functions, which hand them
to `maxtrain.models.hf_deepseek`; reading config.json and safetensors files, which both need, is
`maxtrain.models.hf_common`.

HF stores each projection as `[out, in]`; maxtrain as `[in, (heads, head_dim)]` with layers
stacked. Both use the rotate-half RoPE layout, so q/k need no permutation. `config.json` is read in
both the older (`rope_theta` + `rope_scaling`) and the newer (`rope_parameters`) form.

Inputs are untrusted: config.json values, the shard index and every safetensors header are checked
(shapes against config.json) before any tensor is read. Outputs are written to a temporary sibling
and renamed into place, and never replace anything the user has.

What the weights need to be used comes along both ways: a converted checkpoint keeps its source's
special-token ids, `max_position_embeddings` and `generation_config.json` (in its meta) and tokenizer
files (in `hf_source/` beside the step directories); an export writes them back, with the tokenizer
the model was trained with (`export_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil

import numpy as np

from maxtrain.config import Config, ConfigError, ModelConfig, MoEConfig, RopeScaling
from maxtrain.models.hf_common import (INV_FREQ, hf_tensors, more, read_json, rope_fields,  # noqa: F401
                                        safetensors_header, section)  # (safetensors_header: public here too)
from maxtrain.outputs import building

SHARD_BYTES = 5 * 2**30  # safetensors file size, as HF's save_pretrained

log = logging.getLogger("maxtrain")


# ---------------------------------------------------------------- config.json


_REQUIRED = object()


def _absent(key: str, default, where: str):
    if default is _REQUIRED:
        raise ConfigError(f"config.json has no {where}{key}; a Llama config.json gives it")
    return default


def _pos_int(hf: dict, key: str, default=_REQUIRED, where: str = "") -> int | None:
    v = hf.get(key)
    if v is None:  # HF writes absent optional keys as null
        return _absent(key, default, where)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"config.json {where}{key}={v!r} is not valid; give a positive integer")
    return v


def _pos_float(hf: dict, key: str, default=_REQUIRED, where: str = "") -> float | None:
    v = hf.get(key)
    if v is None:
        return _absent(key, default, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise ConfigError(f"config.json {where}{key}={v!r} is not valid; give a positive number")
    return float(v)


def _rope_scaling(hf: dict) -> RopeScaling | None:
    rope = section(hf, "rope_parameters")  # newer form: theta and scaling together
    where, scaling = "rope_parameters.", rope
    if rope.get("rope_type", rope.get("type")) in (None, "default"):
        where, scaling = "rope_scaling.", section(hf, "rope_scaling")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ConfigError(f"config.json rope scaling type {kind!r} is not supported; only llama3")
    return RopeScaling(
        factor=_pos_float(scaling, "factor", where=where),
        low_freq_factor=_pos_float(scaling, "low_freq_factor", where=where),
        high_freq_factor=_pos_float(scaling, "high_freq_factor", where=where),
        original_max_position=_pos_int(scaling, "original_max_position_embeddings", where=where))


# config.json model_type values read (and written back), with the architecture each names;
# deepseek_v3 (model.name: deepseek) is converted by maxtrain.models.hf_deepseek
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
FAMILIES = tuple(ARCHITECTURES)
MODEL_NAMES = ("llama", "deepseek")  # the model.name values that convert


def _deepseek():
    from maxtrain.models import hf_deepseek  # imports this module: loaded when first needed

    return hf_deepseek


def model_config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from an HF `config.json` dict of one of `FAMILIES`."""
    if not isinstance(hf, dict):
        raise ConfigError(f"config.json is not a JSON object (found {type(hf).__name__})")
    kind = hf.get("model_type", "llama")
    if kind not in FAMILIES:
        raise ConfigError(f"config.json model_type={kind!r} is not supported; convert {', '.join(FAMILIES)} models")
    if kind == "deepseek_v3":
        return _deepseek().model_config_from_hf(hf)
    if kind in ("qwen3", "qwen3_moe") and (hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or [])):
        raise ConfigError("config.json use_sliding_window=true (Qwen3 with sliding-window layers) is not supported; "
                          "maxtrain's Qwen3 attends to every earlier position")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"config.json {key}=true is not supported (Llama models have no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r} is not supported; only silu (SwiGLU)")
    tie = hf.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"config.json tie_word_embeddings={tie!r} is not valid; give true or false")
    d_model, n_heads = _pos_int(hf, "hidden_size"), _pos_int(hf, "num_attention_heads")
    if hf.get("head_dim") is None and d_model % n_heads:
        raise ConfigError(f"config.json hidden_size={d_model} is not divisible by num_attention_heads={n_heads}; "
                          "give head_dim")
    theta = (_pos_float(section(hf, "rope_parameters"), "rope_theta", None, "rope_parameters.")
             or _pos_float(hf, "rope_theta", 10000.0))
    return ModelConfig(
        name="llama", vocab_size=_pos_int(hf, "vocab_size"), d_model=d_model,
        n_layers=_pos_int(hf, "num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=_pos_int(hf, "num_key_value_heads", n_heads),
        head_dim=_pos_int(hf, "head_dim", d_model // n_heads), d_ff=_pos_int(hf, "intermediate_size"),
        rope_theta=theta, rope_scaling=_rope_scaling(hf),
        norm_eps=_pos_float(hf, "rms_norm_eps", 1e-5), tie_embeddings=tie,
        sliding_window=_pos_int(hf, "sliding_window", None) if kind in ("mistral", "mixtral") else None,
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        moe=_mixtral_moe(hf) if kind == "mixtral" else _qwen3_moe(hf, _pos_int(hf, "num_hidden_layers"))
        if kind == "qwen3_moe" else None,
    )


def _qwen3_moe(hf: dict, n_layers: int) -> MoEConfig:
    """Qwen3-MoE's experts: every `decoder_sparse_step`-th layer routed (the others dense, of
    `intermediate_size`), `moe_intermediate_size` wide, softmax top-k renormalised
    (`norm_topk_prob`; without it only top-1, whose raw score maxtrain keeps too)."""
    # the hub's configs say num_experts, transformers 5 writes num_local_experts
    experts = _pos_int(hf, "num_experts" if "num_experts" in hf else "num_local_experts")
    k, step = _pos_int(hf, "num_experts_per_tok"), _pos_int(hf, "decoder_sparse_step", 1)
    if k > experts:
        raise ConfigError(f"config.json num_experts_per_tok={k} is more than num_experts={experts}")
    if hf.get("mlp_only_layers"):
        raise ConfigError(f"config.json mlp_only_layers={hf['mlp_only_layers']} is not supported: maxtrain routes "
                          f"every decoder_sparse_step-th layer")
    if n_layers % step:
        raise ConfigError(f"config.json num_hidden_layers={n_layers} is not a multiple of decoder_sparse_step={step}")
    if bool(hf.get("norm_topk_prob", False)) != (k > 1):
        raise ConfigError(f"config.json norm_topk_prob={hf.get('norm_topk_prob', False)} with num_experts_per_tok={k} "
                          f"is not supported: maxtrain renormalises the weights of two or more experts, not of one")
    return MoEConfig(num_experts=experts, top_k=k, capacity_factor=0.0, every=step, router="softmax",
                     d_ff=_pos_int(hf, "moe_intermediate_size"), aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0))


def _mixtral_moe(hf: dict) -> MoEConfig:
    """Mixtral's experts: every layer's MLP a softmax-routed top-k of `num_local_experts`, weights
    renormalised over the k chosen, no token dropped (maxtrain's dropless MoE)."""
    experts, k = _pos_int(hf, "num_local_experts", 8), _pos_int(hf, "num_experts_per_tok", 2)
    if k > experts:
        raise ConfigError(f"config.json num_experts_per_tok={k} is more than num_local_experts={experts}")
    if k == 1:  # Mixtral renormalises a lone expert's weight to 1; maxtrain keeps its score (Switch)
        raise ConfigError("config.json num_experts_per_tok=1 is not supported: Mixtral would weight every token's "
                          "expert by 1, maxtrain's top-1 router by its score; use 2 or more")
    return MoEConfig(num_experts=experts, top_k=k, capacity_factor=0.0, every=1, router="softmax",
                     aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0))


def hf_config_from_model(m: ModelConfig, *, rope_format: str = "legacy", dtype: str = "float32",
                         max_position: int = 8192) -> dict:
    """An HF `config.json` dict; `rope_format` "legacy" (rope_theta/rope_scaling) or "parameters"."""
    if m.name == "deepseek":
        return _deepseek().hf_config_from_model(m, rope_format=rope_format, dtype=dtype, max_position=max_position)
    scaling = None
    if m.rope_scaling is not None:
        s = m.rope_scaling
        scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                   "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position}
    mistral = m.sliding_window is not None
    if m.qk_norm and mistral:
        raise ConfigError("model.qk_norm with model.sliding_window has no Hugging Face family to export to "
                          "(Qwen3 is qk_norm, Mistral sliding_window)")
    kind = (_moe_family(m) if m.moe is not None else "qwen3" if m.qk_norm else "mistral" if mistral else "llama")
    out = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "max_position_embeddings": max_position, "torch_dtype": dtype,
    }
    if mistral or kind == "mixtral":
        out["sliding_window"] = m.sliding_window
    if kind == "mixtral":
        out.update(num_local_experts=m.moe.num_experts, num_experts_per_tok=m.moe.top_k,
                   router_aux_loss_coef=m.moe.aux_loss_coef, output_router_logits=False,
                   intermediate_size=m.moe.d_ff or m.d_ff)
    if kind == "qwen3_moe":
        out.update(num_experts=m.moe.num_experts, num_experts_per_tok=m.moe.top_k, decoder_sparse_step=m.moe.every,
                   moe_intermediate_size=m.moe.d_ff or m.d_ff, norm_topk_prob=m.moe.top_k > 1, mlp_only_layers=[],
                   router_aux_loss_coef=m.moe.aux_loss_coef, output_router_logits=False, use_sliding_window=False)
    return {**out, **rope_fields(m.rope_theta, scaling, rope_format)}


# ---------------------------------------------------------------- weights


# A routed layer's tensor names (router, experts' gate / up / down) by family.
EXPERT_NAMES = {"mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{j}.", ("w1", "w3", "w2")),
                "qwen3_moe": ("mlp.gate", "mlp.experts.{j}.", ("gate_proj", "up_proj", "down_proj"))}
DENSE_MLP = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))


def _moe_family(m: ModelConfig) -> str:
    """The Hugging Face family a MoE model exports as: Qwen3-MoE with QK-norm, else Mixtral (every
    layer routed); routing by softmax without shared experts either way."""
    e = m.moe
    family = "qwen3_moe" if m.qk_norm else "mixtral"
    if e.shared_experts or e.router != "softmax" or (family == "mixtral" and e.every != 1):
        raise ConfigError(f"model.moe (every={e.every}, shared_experts={e.shared_experts}, router={e.router}) has no "
                          f"Hugging Face family to export to; Mixtral needs every=1, Qwen3-MoE model.qk_norm, and "
                          f"both shared_experts=0, router=softmax")
    return family


def _where(i: int, m: ModelConfig) -> tuple[int, int, bool]:
    """Layer i's place in maxtrain's stack: (block, sublayer, routed). Dense models: (i, 0, False);
    MoE models group `moe.every` layers in a block, the last routed (HF: layer i with (i + 1) a
    multiple of decoder_sparse_step)."""
    if m.moe is None:
        return i, 0, False
    k = m.moe.every
    return i // k, i % k, i % k == k - 1


def params_to_hf(params: dict, m: ModelConfig) -> dict[str, np.ndarray]:
    """maxtrain params (numpy) -> HF state dict names and `[out, in]` layouts."""
    if m.name == "deepseek":
        return _deepseek().params_to_hf(params, m)
    D, H, G, K = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    family = _moe_family(m) if m.moe is not None else None
    L = params["layers"]
    out = {"model.embed_tokens.weight": params["embed"]["embedding"], "model.norm.weight": params["final_norm"]["scale"]}
    if not m.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]["kernel"].T
    for i in range(m.n_layers):
        p = f"model.layers.{i}."
        b, j, routed = _where(i, m)
        a = {k: (v[b, j] if m.moe is not None else v[b]) for k, v in L.items() if k not in ("moe", "dense", "fp8")}
        out[p + "input_layernorm.weight"] = a["attn_norm"]
        out[p + "post_attention_layernorm.weight"] = a["mlp_norm"]
        out[p + "self_attn.q_proj.weight"] = a["wq"].reshape(D, H * K).T
        out[p + "self_attn.k_proj.weight"] = a["wk"].reshape(D, G * K).T
        out[p + "self_attn.v_proj.weight"] = a["wv"].reshape(D, G * K).T
        out[p + "self_attn.o_proj.weight"] = a["wo"].reshape(H * K, D).T
        if m.qk_norm:
            out[p + "self_attn.q_norm.weight"] = a["q_norm"]
            out[p + "self_attn.k_norm.weight"] = a["k_norm"]
        if routed:
            router, expert, names = EXPERT_NAMES[family]
            e = L["moe"]
            out[f"{p}{router}.weight"] = e["router"][b].T
            for x in range(m.moe.num_experts):
                for ours, theirs in zip(("w_gate", "w_up", "w_down"), names):
                    out[f"{p}{expert.format(j=x)}{theirs}.weight"] = e[ours][b, x].T
            continue
        dense = L["dense"] if m.moe is not None else L
        for ours, theirs in DENSE_MLP:
            out[f"{p}mlp.{theirs}.weight"] = (dense[ours][b, j] if m.moe is not None else dense[ours][b]).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def params_from_hf(get, m: ModelConfig) -> dict:
    """HF tensors (`get(name) -> numpy array`) -> maxtrain params (numpy, stacked layers; MoE
    models in blocks of `moe.every` layers, `_where`)."""
    if m.name == "deepseek":
        return _deepseek().params_from_hf(get, m)
    D, H, G, K = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    attn = {"attn_norm": lambda p: get(p + "input_layernorm.weight"),
            "wq": lambda p: get(p + "self_attn.q_proj.weight").T.reshape(D, H, K),
            "wk": lambda p: get(p + "self_attn.k_proj.weight").T.reshape(D, G, K),
            "wv": lambda p: get(p + "self_attn.v_proj.weight").T.reshape(D, G, K),
            "wo": lambda p: get(p + "self_attn.o_proj.weight").T.reshape(H, K, D),
            "mlp_norm": lambda p: get(p + "post_attention_layernorm.weight")}
    if m.qk_norm:
        attn["q_norm"] = lambda p: get(p + "self_attn.q_norm.weight")
        attn["k_norm"] = lambda p: get(p + "self_attn.k_norm.weight")
    dense = {ours: (lambda p, theirs=theirs: get(f"{p}mlp.{theirs}.weight").T) for ours, theirs in DENSE_MLP}

    def stack(fn, layers):
        return np.stack([fn(f"model.layers.{i}.") for i in layers])

    if m.moe is None:
        layers = {k: stack(fn, range(m.n_layers)) for k, fn in {**attn, **dense}.items()}
    else:
        k, NB = m.moe.every, m.n_layers // m.moe.every
        blocks = [[b * k + j for b in range(NB)] for j in range(k)]  # sublayer j of every block
        layers = {name: np.stack([stack(fn, blocks[j]) for j in range(k)], axis=1) for name, fn in attn.items()}
        if k > 1:
            layers["dense"] = {name: np.stack([stack(fn, blocks[j]) for j in range(k - 1)], axis=1)
                               for name, fn in dense.items()}
        router, expert, names = EXPERT_NAMES[_moe_family(m)]
        routed = blocks[k - 1]
        layers["moe"] = {"router": stack(lambda p: get(f"{p}{router}.weight").T, routed)}
        for ours, theirs in zip(("w_gate", "w_up", "w_down"), names):
            layers["moe"][ours] = stack(lambda p, theirs=theirs: np.stack(
                [get(f"{p}{expert.format(j=x)}{theirs}.weight").T for x in range(m.moe.num_experts)]), routed)
    params = {"embed": {"embedding": get("model.embed_tokens.weight")}, "layers": layers,
              "final_norm": {"scale": get("model.norm.weight")}}
    if not m.tie_embeddings:
        params["lm_head"] = {"kernel": get("lm_head.weight").T}
    return params


def hf_shapes(m: ModelConfig):
    """Yields (name, shape) for every tensor an HF checkpoint of `m` holds, as `config.json` implies."""
    if m.name == "deepseek":
        yield from _deepseek().hf_shapes(m)
        return
    D, F, H, G, K = m.d_model, m.d_ff, m.n_heads, m.n_kv_heads, m.head_dim
    yield "model.embed_tokens.weight", (m.vocab_size, D)
    yield "model.norm.weight", (D,)
    if not m.tie_embeddings:
        yield "lm_head.weight", (m.vocab_size, D)
    for i in range(m.n_layers):
        p = f"model.layers.{i}."
        yield from {
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (H * K, D), p + "self_attn.k_proj.weight": (G * K, D),
            p + "self_attn.v_proj.weight": (G * K, D), p + "self_attn.o_proj.weight": (D, H * K),
        }.items()
        if _where(i, m)[2]:
            FE = m.moe.d_ff or m.d_ff
            router, expert, names = EXPERT_NAMES[_moe_family(m)]
            yield f"{p}{router}.weight", (m.moe.num_experts, D)
            for x in range(m.moe.num_experts):
                q = p + expert.format(j=x)
                yield from {q + names[0] + ".weight": (FE, D), q + names[1] + ".weight": (FE, D),
                            q + names[2] + ".weight": (D, FE)}.items()
        else:
            yield from {p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                        p + "mlp.down_proj.weight": (D, F)}.items()
        if m.qk_norm:
            yield p + "self_attn.q_norm.weight", (K,)
            yield p + "self_attn.k_norm.weight", (K,)


def check_tensors(found: dict[str, tuple[str, tuple[int, ...]]], m: ModelConfig, hf_dir: str) -> None:
    """Raises ConfigError unless `found` (name -> (file, shape)) holds exactly the tensors of `m`."""
    if m.name == "deepseek":
        return _deepseek().check_tensors(found, m, hf_dir)
    want = {}
    for name, shape in hf_shapes(m):  # lazily: a huge num_hidden_layers stops at the first layer the files lack
        if name not in found:
            raise ConfigError(f"{hf_dir}: tensor {name} missing; is this a Llama checkpoint matching config.json?")
        want[name] = shape
    if m.tie_embeddings:  # some tied checkpoints keep a copy of the embedding: not read, but its shape checked
        want["lm_head.weight"] = want["model.embed_tokens.weight"]
    wrong = [k for k in want if k in found and found[k][1] != want[k]]
    if wrong:
        path, shape = found[wrong[0]]
        raise ConfigError(f"{path}: tensor {wrong[0]} has shape {shape} but config.json implies {want[wrong[0]]}"
                          f"{more(wrong)}; the weights do not match config.json")
    extra = [k for k in found if k not in want and not k.endswith(INV_FREQ)]
    if extra:
        raise ConfigError(f"{found[extra[0]][0]}: unexpected tensor {extra[0]}{more(extra)}; config.json describes "
                          f"a Llama model with num_hidden_layers={m.n_layers}, which has no such tensor")


# ---------------------------------------------------------------- files


def read_hf_config(hf_dir: str) -> ModelConfig:
    """The ModelConfig of an HF model directory's `config.json`."""
    path = os.path.join(hf_dir, "config.json")
    hf = read_json(path, "give a Hugging Face model directory")
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} is not a JSON object (found {type(hf).__name__}); give a model's config.json")
    try:
        return model_config_from_hf(hf)
    except ConfigError as e:
        raise ConfigError(f"{hf_dir}: {e}") from None


def read_hf_params(hf_dir: str, m: ModelConfig, param_dtype: str = "float32") -> dict:
    """numpy params of `m` from an HF directory's safetensors, every tensor checked against `m` first."""
    from safetensors import safe_open

    if m.name == "deepseek":  # its layout also depends on config.json's rope_interleave and topk_method
        return _deepseek().read_hf_params(hf_dir, m, param_dtype)

    found = hf_tensors(hf_dir)
    check_tensors(found, m, hf_dir)
    handles = {path: safe_open(path, framework="flax") for path in sorted({f for f, _ in found.values()})}
    return params_from_hf(lambda name: np.asarray(handles[found[name][0]].get_tensor(name).astype(param_dtype)), m)


def read_hf(hf_dir: str, param_dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(ModelConfig, numpy params) from an HF model directory (safetensors, bf16/f16/f32)."""
    m = read_hf_config(hf_dir)
    return m, read_hf_params(hf_dir, m, param_dtype)


# ---------------------------------------------------------------- output


def check_output_dir(out_dir: str) -> None:
    """Refuses an output that exists as anything but an empty directory (nothing of the user's is replaced)."""
    if not out_dir:
        raise ConfigError("the output path is empty; give a new directory")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"output {out_dir} exists and is not a directory; choose a new directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"output {out_dir} is not empty; choose a new directory")


def output_dir(out_dir: str):
    """`maxtrain.outputs.building` a new or empty `out_dir` (checked first)."""
    check_output_dir(out_dir)
    return building(out_dir)


def write_hf(out_dir: str, params: dict, m: ModelConfig, *, dtype: str = "float32",
             rope_format: str = "legacy", fields: dict | None = None) -> list[str]:
    """Writes `config.json` and safetensors (sharded past 5 GiB, with an index) as a new directory `out_dir`."""
    with output_dir(out_dir) as tmp:
        return _write_hf_files(tmp, params, m, dtype=dtype, rope_format=rope_format, fields=fields)


def _write_hf_files(out_dir: str, params: dict, m: ModelConfig, *, dtype: str, rope_format: str,
                    fields: dict | None = None) -> list[str]:
    """The safetensors and `config.json`: the model's keys, then `fields` (special-token ids,
    `max_position_embeddings`) over them."""
    import jax.numpy as jnp
    from safetensors.flax import save_file

    kept = _deepseek().tensor_dtype if m.name == "deepseek" else (lambda name, dtype: dtype)
    tensors = {k: jnp.asarray(v, dtype=kept(k, dtype)) for k, v in params_to_hf(params, m).items()}
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        if current and size + t.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.nbytes
    shards.append(current)
    files = []
    if len(shards) == 1:
        files.append("model.safetensors")
        save_file(shards[0], os.path.join(out_dir, files[0]), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            files.append(name)
        total = sum(t.nbytes for t in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**hf_config_from_model(m, rope_format=rope_format, dtype=dtype), **(fields or {})}, f, indent=2)
    return files


def config_with_model(base: Config, m: ModelConfig) -> Config:
    """`base` with its model section replaced by the converted one (keeping attention and remat)."""
    return dataclasses.replace(base, model=dataclasses.replace(
        m, attention=base.model.attention, remat=base.model.remat, init_std=base.model.init_std))


# ---------------------------------------------------------------- what comes with the weights
# A model is usable in transformers with its tokenizer, its end-of-text id (generation stops there)
# and its context length. hf-to-maxtrain keeps the source's; maxtrain-to-hf writes them back, with
# the tokenizer the model was trained with when that is another.

HF_META = "hf"  # a converted step's meta key: what config.json says beyond the model (`source_settings`)
SOURCE_DIR = "hf_source"  # beside a converted checkpoint's step directories: the source's tokenizer files
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
BYTE_EOS_TOKEN = "<|endoftext|>"  # the byte tokenizer's EOS (id 256) in the exported tokenizer.json
DEFAULT_MAX_POSITION = 8192  # config.json's max_position_embeddings when nothing says otherwise
NO_TOKENIZER_NOTE = "README.md"  # written into an export that has no tokenizer, saying why


def _token_ids(v) -> bool:
    """An id (int >= 0) or a non-empty list of ids, as config.json's special-token keys hold."""
    ids = v if isinstance(v, list) and v else [v]
    return all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)


EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # what maxtrain-to-hf writes weights in


def export_dtype(requested: str | None, source: "Source | None") -> str:
    """The weights' dtype of an export: `--dtype`, else the dtype of the HF model the checkpoint was
    converted from (its config.json's `torch_dtype`), else float32 (what training keeps)."""
    if requested is not None:
        return requested
    return ((source.settings.get("config") or {}).get("torch_dtype") if source else None) or "float32"


def source_settings(hf_dir: str) -> dict:
    """What a conversion keeps of its source beyond the model: config.json's special-token ids and
    `max_position_embeddings`, and `generation_config.json` (None when absent)."""
    hf = read_json(os.path.join(hf_dir, "config.json"), "give a Hugging Face model directory")
    kept = {k: hf[k] for k in SPECIAL_IDS if hf.get(k) is not None and _token_ids(hf[k])}
    try:
        n = _pos_int(hf, "max_position_embeddings", None)
    except ConfigError as e:
        raise ConfigError(f"{hf_dir}: {e}") from None
    if n is not None:
        kept["max_position_embeddings"] = n
    dtype = hf.get("torch_dtype", hf.get("dtype"))  # transformers 5 writes `dtype`
    if dtype in EXPORT_DTYPES:
        kept["torch_dtype"] = dtype
    path = os.path.join(hf_dir, "generation_config.json")
    generation = read_json(path, "give the model's generation_config.json") if os.path.isfile(path) else None
    if generation is not None and not isinstance(generation, dict):
        raise ConfigError(f"{path} is not a JSON object; give the model's generation_config.json or remove it")
    return {"config": kept, "generation_config": generation}


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copies the HF tokenizer files (`TOKENIZER_FILES`) `src_dir` holds into `dst_dir`; their names."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src_dir, n))]
    if names:
        os.makedirs(dst_dir, exist_ok=True)
    for name in names:  # copyfile follows links (the HF hub cache links files to blobs)
        shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    return names


@dataclasses.dataclass(frozen=True)
class Source:
    """The Hugging Face model a checkpoint was converted from, as the conversion kept it."""
    settings: dict  # `source_settings`
    files_dir: str | None  # its tokenizer files, when it had any and they are still here
    converted: bool  # the checkpoint is the conversion itself (not trained since)


def _newest_meta(path: str) -> tuple[str, dict]:
    """(the checkpoint directory, the meta of its newest step that reads) of a checkpoint or step path."""
    from maxtrain.checkpoint import CorruptCheckpoint, open_path

    ckpt, steps = open_path(path, "checkpoint")
    for step in reversed(steps):
        try:
            return ckpt.directory, ckpt.read_meta(step)
        except CorruptCheckpoint:
            continue
    return ckpt.directory, {}


def conversion_source(path: str, max_hops: int = 16) -> Source | None:
    """The HF source of the checkpoint at `path`: its own conversion, or the one it was trained from
    through `checkpoint.init_from` (followed back run by run); None when there is none or it is gone."""
    for hop in range(max_hops):
        root, meta = _newest_meta(path)
        if HF_META in meta or "source" in meta:  # "source" alone: converted before conversions kept settings
            return _kept_source(root, meta, converted=hop == 0)
        init = ((meta.get("config") or {}).get("checkpoint") or {}).get("init_from")
        if not init:
            return None
        if not os.path.isabs(init) and isinstance(meta.get("cwd"), str):  # relative to where training ran
            init = os.path.join(meta["cwd"], init)
        if not os.path.isdir(init):
            log.warning("%s was trained from checkpoint.init_from=%s, which is not here: its tokenizer, special "
                        "tokens and max_position_embeddings are unknown to the export (give --tokenizer)", path, init)
            return None
        path = init
    return None


def _kept_source(root: str, meta: dict, converted: bool) -> Source | None:
    files = os.path.join(root, SOURCE_DIR)
    files = files if os.path.isdir(files) else None
    settings = meta.get(HF_META)
    if settings is None:  # an older conversion: its source directory, if still where it was
        src = meta.get("source")
        if not (isinstance(src, str) and os.path.isfile(os.path.join(src, "config.json"))):
            return None
        settings = source_settings(src)
        files = src if any(os.path.isfile(os.path.join(src, n)) for n in TOKENIZER_FILES) else None
    return Source(settings, files, converted)


@dataclasses.dataclass(frozen=True)
class ExportTokenizer:
    """The tokenizer an export carries: the source's files, an HF model directory's files, one
    tokenizer.json or SentencePiece `.model`, or maxtrain's bytes (`kind`: source | dir | hf |
    sentencepiece | byte)."""
    kind: str
    path: str | None  # the directory or file it is copied from (None: byte)
    eos_id: int | None  # None for the source's (its config.json and generation_config.json say)


def export_tokenizer(cfg: Config, spec: str | None, source: Source | None, checkpoint: str) -> ExportTokenizer | None:
    """`spec` (`--tokenizer`; "none" for none), else the training data's tokenizer (of a trained
    `checkpoint`: the copy kept with it, else the data's manifest), else the source's. The training
    data's is the source's when its file is the same."""
    from maxtrain.generate import tokenizer_for

    if spec == "none":
        return None
    trained = source is None or not source.converted
    tok = tokenizer_for(cfg, spec, checkpoint) if spec or trained else None  # None: synthetic data
    if tok is None or _same_file(tok.spec, source):
        return ExportTokenizer("source", source.files_dir, None) if source and source.files_dir else None
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer {tok.spec} has {tok.vocab_size} tokens, more than the model's "
                          f"model.vocab_size={cfg.model.vocab_size}; give the model's own with --tokenizer")
    if tok.kind == "byte":
        return ExportTokenizer("byte", None, tok.eos_id)
    folder = os.path.dirname(tok.spec)
    if os.path.basename(tok.spec) in TOKENIZER_FILES and os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return ExportTokenizer("dir", folder, tok.eos_id)  # an HF model's: all its files
    return ExportTokenizer(tok.kind, tok.spec, tok.eos_id)


def _same_file(path: str, source: Source | None) -> bool:
    """Whether tokenizer file `path` has the bytes of the source's file of its kind."""
    if source is None or source.files_dir is None or path == "byte":
        return False
    theirs = os.path.join(source.files_dir, "tokenizer.model" if path.endswith(".model") else "tokenizer.json")
    if not os.path.isfile(theirs) or os.path.getsize(theirs) != os.path.getsize(path):
        return False
    with open(path, "rb") as a, open(theirs, "rb") as b:
        return a.read() == b.read()


def export_fields(source: Source | None, tok: ExportTokenizer | None, seq_len: int | None) -> tuple[dict, dict]:
    """(config.json keys, generation_config.json) beyond the model: the special-token ids (the
    source's with its tokenizer, else the exported tokenizer's EOS) and `max_position_embeddings`:
    the source's, or the trained `seq_len` when longer (`seq_len` None: not trained)."""
    kept = dict(source.settings["config"]) if source else {}
    lengths = [n for n in (kept.pop("max_position_embeddings", None), seq_len) if n]
    fields = {"max_position_embeddings": max(lengths) if lengths else DEFAULT_MAX_POSITION}
    if tok is not None and tok.kind != "source":
        ids = {"bos_token_id": None, "eos_token_id": tok.eos_id, "pad_token_id": None}
        generation = None
    else:
        ids = {k: kept.get(k) for k in SPECIAL_IDS}
        generation = source.settings.get("generation_config") if source else None
    generation = {**{k: v for k, v in ids.items() if v is not None}, **(generation or {})}
    return {**ids, **fields}, generation


def _no_tokenizer(spec: str | None, cfg: Config, source: Source | None) -> str:
    """Why an export has no tokenizer (when `export_tokenizer` found none)."""
    if spec == "none":
        return "--tokenizer none"
    if source is not None and source.converted:
        return "the Hugging Face model it was converted from had no tokenizer files"
    return (f"its training data names none (data.kind={cfg.data.kind})" +
            ("" if source is None else ", and the Hugging Face model it started from left no tokenizer files"))


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet (`tokenizers`' ByteLevel): the character standing for each byte,
    printable bytes as themselves and the others as code points from 256 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    out, others = [], 0
    for b in range(256):
        out.append(chr(b) if b in printable else chr(256 + others))
        others += b not in printable
    return out


def _write_byte_tokenizer(out_dir: str) -> None:
    """maxtrain's byte tokenizer as a `tokenizer.json`: each byte's id its value, EOS 256."""
    from maxtrain.config import require_module

    tk = require_module("tokenizers", "tokenizers", "exporting the byte tokenizer as tokenizer.json", "data")
    tok = tk.Tokenizer(tk.models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens([tk.AddedToken(BYTE_EOS_TOKEN, special=True)])
    tok.save(os.path.join(out_dir, "tokenizer.json"))


def _token_name(tok: ExportTokenizer, i: int) -> str:
    if tok.kind == "sentencepiece":
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=tok.path).id_to_piece(i)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tok.path).id_to_token(i)


def write_tokenizer(out_dir: str, tok: ExportTokenizer | None, max_position: int, why: str) -> str | None:
    """Writes `tok`'s files into `out_dir` (a note instead when there is none; `why` says why); the
    problem, when no tokenizer was written."""
    if tok is not None and tok.kind in ("source", "dir"):
        copy_tokenizer_files(tok.path, out_dir)
        return None
    problem = why
    if tok is not None:
        try:
            if tok.kind == "byte":
                _write_byte_tokenizer(out_dir)
                eos = BYTE_EOS_TOKEN
            else:
                name = "tokenizer.model" if tok.kind == "sentencepiece" else "tokenizer.json"
                shutil.copyfile(tok.path, os.path.join(out_dir, name))
                eos = _token_name(tok, tok.eos_id)
            settings = {"tokenizer_class": "LlamaTokenizer" if tok.kind == "sentencepiece" else
                        "PreTrainedTokenizerFast", "eos_token": eos, "model_max_length": max_position,
                        "clean_up_tokenization_spaces": False}
            if tok.kind == "sentencepiece":  # maxtrain's data has no BOS: neither added here
                settings.update(add_bos_token=False, add_eos_token=False)
            with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
                json.dump(settings, f, indent=2)
            return None
        except ConfigError as e:  # the package that writes it is missing
            problem = str(e)
    with open(os.path.join(out_dir, NO_TOKENIZER_NOTE), "w") as f:
        f.write(f"# No tokenizer\n\nThis model was exported by `maxtrain convert maxtrain-to-hf` without a tokenizer: "
                f"{problem}.\n\nCopy the tokenizer files of the tokenizer it was trained with into this directory "
                f"(tokenizer.json and tokenizer_config.json, or tokenizer.model), or export again with "
                f"`--tokenizer PATH`.\n")
    return problem


# ---------------------------------------------------------------- commands


def hf_to_maxtrain(hf_dir: str, out_dir: str, base: Config) -> str:
    """Converts an HF model directory into a params-only maxtrain checkpoint; returns its step dir.
    The source's tokenizer files go to `SOURCE_DIR` beside the step, its other settings into the meta."""
    from maxtrain.checkpoint import Checkpointer
    from maxtrain.config import CheckpointConfig, to_dict, validate

    cfg = config_with_model(base, read_hf_config(hf_dir))
    validate(cfg)
    settings = source_settings(hf_dir)
    check_output_dir(out_dir)  # before reading gigabytes of weights
    params = read_hf_params(hf_dir, cfg.model, cfg.train.param_dtype)
    with output_dir(out_dir) as tmp:
        copy_tokenizer_files(hf_dir, os.path.join(tmp, SOURCE_DIR))
        meta = {"seed": cfg.seed, "config": to_dict(cfg), "source": os.path.abspath(hf_dir), HF_META: settings}
        kept = source_tokenizer_record(tmp)
        if kept is not None:  # generate and eval on the converted checkpoint read it without --tokenizer
            meta["tokenizer"] = kept
        ckpt = Checkpointer(tmp, CheckpointConfig(dir=tmp, async_=False, keep=1))
        try:
            ckpt.save(0, params, None, meta, wait=True)
            saved = ckpt.steps() == [0]  # a failed save is logged, not raised
        finally:
            ckpt.close()
        if not saved:
            raise ConfigError(f"writing the checkpoint {out_dir} failed (the error is logged above); nothing written")
    return os.path.join(os.path.abspath(out_dir), "0")


def source_tokenizer_record(ckpt_dir: str) -> dict | None:
    """The checkpoint meta's `tokenizer` record (as `checkpoint.keep_tokenizer` writes it) for the
    source tokenizer copied into `ckpt_dir/SOURCE_DIR`: its tokenizer.json, else its SentencePiece
    tokenizer.model; None when the source had neither."""
    from maxtrain.data.manifest import sha256_file

    for name, kind in (("tokenizer.json", "hf"), ("tokenizer.model", "sentencepiece")):
        path = os.path.join(ckpt_dir, SOURCE_DIR, name)
        if os.path.isfile(path):
            return {"kind": kind, "file": f"{SOURCE_DIR}/{name}", "sha256": sha256_file(path)}
    return None


def maxtrain_to_hf(ckpt_path: str, out_dir: str, *, dtype: str | None = None, rope_format: str = "legacy",
                   tokenizer: str | None = None) -> list[str]:
    """Writes the params of a maxtrain checkpoint (latest good step, or a step dir) as an HF model,
    with its tokenizer (`export_tokenizer`; `tokenizer` is `--tokenizer`), special-token ids and
    context length (`export_fields`), in `dtype` (None: `export_dtype`'s default); returns the names
    of the files written."""
    import jax

    from maxtrain.checkpoint import load_checkpoint, saved_config
    from maxtrain.config import unpipelined

    check_output_dir(out_dir)  # before loading the checkpoint
    # a pipelined run's layer stacks are [repeats, stages, ...]: read them back in the flat layout
    saved = unpipelined(saved_config(ckpt_path))
    if saved.model.name not in MODEL_NAMES:
        raise ConfigError(f"model.name={saved.model.name!r}: only the {' and '.join(MODEL_NAMES)} families convert "
                          f"to Hugging Face")
    source = conversion_source(ckpt_path)
    dtype = export_dtype(dtype, source)
    log.info("weights in %s%s", dtype, " (the source model's; --dtype to change)" if source and
             (source.settings.get("config") or {}).get("torch_dtype") == dtype else "")
    tok = export_tokenizer(saved, tokenizer, source, ckpt_path)  # a bad --tokenizer before the weights load
    fields, generation = export_fields(source, tok, None if source and source.converted else saved.train.seq_len)
    cfg, params = load_checkpoint(ckpt_path, saved)
    with output_dir(out_dir) as tmp:
        _write_hf_files(tmp, jax.device_get(params), cfg.model, dtype=dtype, rope_format=rope_format, fields=fields)
        if generation:
            with open(os.path.join(tmp, "generation_config.json"), "w") as f:
                json.dump(generation, f, indent=2)
        problem = write_tokenizer(tmp, tok, fields["max_position_embeddings"], _no_tokenizer(tokenizer, saved, source))
        names = sorted(os.listdir(tmp))
    if tok is not None and problem is None:
        log.info("tokenizer: %s", "maxtrain's bytes, written as tokenizer.json" if tok.kind == "byte" else
                 f"the files of {tok.path}" if tok.kind in ("source", "dir") else tok.path)
    if problem is not None:
        log.warning("the export %s has no tokenizer: %s (see %s there; --tokenizer names one)", out_dir, problem,
                    NO_TOKENIZER_NOTE)
    return names
