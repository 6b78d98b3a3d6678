"""Hugging Face interchange for the llama family: `config.json` and tensor names of Llama, Mistral,
Qwen3, Mixtral and Qwen3-MoE <-> `model.name: llama` and its params (host-side numpy). The files
(safetensors readers and writers, the tokenizer, the checkpoint) are `maxtrain.convert`'s, shared by
every family; this module says only what this family's names and layouts are (`CONVERSION`).

HF stores each projection as `[out, in]`; maxtrain as `[in, (heads, head_dim)]` with layers
stacked. Both use the rotate-half RoPE layout, so q/k need no permutation. `config.json` is read in
both the older (`rope_theta` + `rope_scaling`) and the newer (`rope_parameters`) form.
"""

from __future__ import annotations

import numpy as np

from maxtrain.config import ConfigError, MoEConfig, RopeScaling
from maxtrain.models.registry import HFConversion
from maxtrain.models.hf_common import INV_FREQ, more, positive_float, positive_int, rope_fields, section
from maxtrain.models.llama import NAME
from maxtrain.models.llama.config import LlamaConfig


# config.json model_type values read (and written back), with the architecture each names
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


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
        factor=positive_float(scaling, "factor", where=where),
        low_freq_factor=positive_float(scaling, "low_freq_factor", where=where),
        high_freq_factor=positive_float(scaling, "high_freq_factor", where=where),
        original_max_position=positive_int(scaling, "original_max_position_embeddings", where=where))


def model_config_from_hf(hf: dict) -> LlamaConfig:
    """The model config of an HF `config.json` dict of one of `ARCHITECTURES`' model types."""
    kind = hf.get("model_type") or "llama"
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
    d_model, n_heads = positive_int(hf, "hidden_size"), positive_int(hf, "num_attention_heads")
    if hf.get("head_dim") is None and d_model % n_heads:
        raise ConfigError(f"config.json hidden_size={d_model} is not divisible by num_attention_heads={n_heads}; "
                          "give head_dim")
    theta = (positive_float(section(hf, "rope_parameters"), "rope_theta", None, "rope_parameters.")
             or positive_float(hf, "rope_theta", 10000.0))
    return LlamaConfig(
        name=NAME, vocab_size=positive_int(hf, "vocab_size"), d_model=d_model,
        n_layers=positive_int(hf, "num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=positive_int(hf, "num_key_value_heads", n_heads),
        head_dim=positive_int(hf, "head_dim", d_model // n_heads), d_ff=positive_int(hf, "intermediate_size"),
        rope_theta=theta, rope_scaling=_rope_scaling(hf),
        norm_eps=positive_float(hf, "rms_norm_eps", 1e-5), tie_embeddings=tie,
        sliding_window=positive_int(hf, "sliding_window", None) if kind in ("mistral", "mixtral") else None,
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        moe=_mixtral_moe(hf) if kind == "mixtral" else _qwen3_moe(hf, positive_int(hf, "num_hidden_layers"))
        if kind == "qwen3_moe" else None,
    )


def _qwen3_moe(hf: dict, n_layers: int) -> MoEConfig:
    """Qwen3-MoE's experts: every `decoder_sparse_step`-th layer routed (the others dense, of
    `intermediate_size`), `moe_intermediate_size` wide, softmax top-k renormalised
    (`norm_topk_prob`; without it only top-1, whose raw score maxtrain keeps too)."""
    # the hub's configs say num_experts, transformers 5 writes num_local_experts
    experts = positive_int(hf, "num_experts" if "num_experts" in hf else "num_local_experts")
    k, step = positive_int(hf, "num_experts_per_tok"), positive_int(hf, "decoder_sparse_step", 1)
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
                     d_ff=positive_int(hf, "moe_intermediate_size"), aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0))


def _mixtral_moe(hf: dict) -> MoEConfig:
    """Mixtral's experts: every layer's MLP a softmax-routed top-k of `num_local_experts`, weights
    renormalised over the k chosen, no token dropped (maxtrain's dropless MoE)."""
    experts, k = positive_int(hf, "num_local_experts", 8), positive_int(hf, "num_experts_per_tok", 2)
    if k > experts:
        raise ConfigError(f"config.json num_experts_per_tok={k} is more than num_local_experts={experts}")
    if k == 1:  # Mixtral renormalises a lone expert's weight to 1; maxtrain keeps its score (Switch)
        raise ConfigError("config.json num_experts_per_tok=1 is not supported: Mixtral would weight every token's "
                          "expert by 1, maxtrain's top-1 router by its score; use 2 or more")
    return MoEConfig(num_experts=experts, top_k=k, capacity_factor=0.0, every=1, router="softmax",
                     aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0))


def hf_config_from_model(m: LlamaConfig, *, rope_format: str = "legacy", dtype: str = "float32",
                         max_position: int = 8192) -> dict:
    """An HF `config.json` dict; `rope_format` "legacy" (rope_theta/rope_scaling) or "parameters"."""
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


def _moe_family(m: LlamaConfig) -> str:
    """The Hugging Face family a MoE model exports as: Qwen3-MoE with QK-norm, else Mixtral (every
    layer routed); routing by softmax without shared experts either way."""
    e = m.moe
    family = "qwen3_moe" if m.qk_norm else "mixtral"
    if e.shared_experts or e.router != "softmax" or (family == "mixtral" and e.every != 1):
        raise ConfigError(f"model.moe (every={e.every}, shared_experts={e.shared_experts}, router={e.router}) has no "
                          f"Hugging Face family to export to; Mixtral needs every=1, Qwen3-MoE model.qk_norm, and "
                          f"both shared_experts=0, router=softmax")
    return family


def _where(i: int, m: LlamaConfig) -> tuple[int, int, bool]:
    """Layer i's place in maxtrain's stack: (block, sublayer, routed). Dense models: (i, 0, False);
    MoE models group `moe.every` layers in a block, the last routed (HF: layer i with (i + 1) a
    multiple of decoder_sparse_step)."""
    if m.moe is None:
        return i, 0, False
    k = m.moe.every
    return i // k, i % k, i % k == k - 1


def params_to_hf(params: dict, m: LlamaConfig) -> dict[str, np.ndarray]:
    """maxtrain params (numpy) -> HF state dict names and `[out, in]` layouts."""
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


def params_from_hf(get, m: LlamaConfig) -> dict:
    """HF tensors (`get(name) -> numpy array`) -> maxtrain params (numpy, stacked layers; MoE
    models in blocks of `moe.every` layers, `_where`)."""
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


def hf_shapes(m: LlamaConfig):
    """Yields (name, shape) for every tensor an HF checkpoint of `m` holds, as `config.json` implies."""
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


def check_tensors(found: dict[str, tuple[str, tuple[int, ...]]], m: LlamaConfig, hf_dir: str) -> None:
    """Raises ConfigError unless `found` (name -> (file, shape)) holds exactly the tensors of `m`."""
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


CONVERSION = HFConversion(tuple(ARCHITECTURES), model_config_from_hf, hf_config_from_model, hf_shapes, check_tensors,
                          params_from_hf, params_to_hf)
