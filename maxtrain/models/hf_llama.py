"""Hugging Face interchange for the Llama family: `config.json` + safetensors <-> maxtrain params.

HF stores each projection as `[out, in]`; maxtrain as `[in, (heads, head_dim)]` with layers
stacked. Both use the rotate-half RoPE layout, so q/k need no permutation. `config.json` is read in
both the older (`rope_theta` + `rope_scaling`) and the newer (`rope_parameters`) form.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from maxtrain.config import Config, ConfigError, ModelConfig, RopeScaling

SHARD_BYTES = 5 * 2**30  # safetensors file size, as HF's save_pretrained


# ---------------------------------------------------------------- config.json


def model_config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from an HF Llama/Mistral `config.json` dict."""
    kind = hf.get("model_type", "llama")
    if kind not in ("llama", "mistral"):
        raise ConfigError(f"config.json model_type={kind!r} is not supported; convert llama or mistral models")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"config.json {key}=true is not supported (Llama models have no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r} is not supported; only silu (SwiGLU)")
    rope = dict(hf.get("rope_parameters") or {})  # newer form: theta and scaling together
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", rope.get("type")) not in (None, "default") else hf.get("rope_scaling")
    rope_scaling = None
    if scaling:
        kind_ = scaling.get("rope_type", scaling.get("type"))
        if kind_ not in ("llama3", "default"):
            raise ConfigError(f"config.json rope scaling type {kind_!r} is not supported; only llama3")
        if kind_ == "llama3":
            rope_scaling = RopeScaling(
                factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position=int(scaling["original_max_position_embeddings"]))
    n_heads = hf["num_attention_heads"]
    return ModelConfig(
        name="llama", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, d_ff=hf["intermediate_size"],
        rope_theta=float(theta), rope_scaling=rope_scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=hf.get("sliding_window") if kind == "mistral" else None,
    )


def hf_config_from_model(m: ModelConfig, *, rope_format: str = "legacy", dtype: str = "float32",
                         max_position: int = 8192) -> dict:
    """An HF `config.json` dict; `rope_format` "legacy" (rope_theta/rope_scaling) or "parameters"."""
    scaling = None
    if m.rope_scaling is not None:
        s = m.rope_scaling
        scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                   "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position}
    mistral = m.sliding_window is not None
    out = {
        "architectures": ["MistralForCausalLM" if mistral else "LlamaForCausalLM"],
        "model_type": "mistral" if mistral else "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "max_position_embeddings": max_position, "torch_dtype": dtype,
    }
    if mistral:
        out["sliding_window"] = m.sliding_window
    if rope_format == "parameters":
        out["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": m.rope_theta}
    elif rope_format == "legacy":
        out["rope_theta"] = m.rope_theta
        out["rope_scaling"] = scaling
    else:
        raise ConfigError(f"--rope-format={rope_format!r} is not valid; choose legacy or parameters")
    return out


# ---------------------------------------------------------------- weights


def params_to_hf(params: dict, m: ModelConfig) -> dict[str, np.ndarray]:
    """maxtrain params (numpy) -> HF state dict names and `[out, in]` layouts."""
    D, H, G, K = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    L = params["layers"]
    out = {"model.embed_tokens.weight": params["embed"]["embedding"], "model.norm.weight": params["final_norm"]["scale"]}
    if not m.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]["kernel"].T
    for i in range(m.n_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = L["attn_norm"][i]
        out[p + "post_attention_layernorm.weight"] = L["mlp_norm"][i]
        out[p + "self_attn.q_proj.weight"] = L["wq"][i].reshape(D, H * K).T
        out[p + "self_attn.k_proj.weight"] = L["wk"][i].reshape(D, G * K).T
        out[p + "self_attn.v_proj.weight"] = L["wv"][i].reshape(D, G * K).T
        out[p + "self_attn.o_proj.weight"] = L["wo"][i].reshape(H * K, D).T
        out[p + "mlp.gate_proj.weight"] = L["w_gate"][i].T
        out[p + "mlp.up_proj.weight"] = L["w_up"][i].T
        out[p + "mlp.down_proj.weight"] = L["w_down"][i].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def params_from_hf(get, m: ModelConfig) -> dict:
    """HF tensors (`get(name) -> numpy array`) -> maxtrain params (numpy, stacked layers)."""
    D, H, G, K = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim

    def stack(fn):
        return np.stack([fn(f"model.layers.{i}.") for i in range(m.n_layers)])

    params = {
        "embed": {"embedding": get("model.embed_tokens.weight")},
        "layers": {
            "attn_norm": stack(lambda p: get(p + "input_layernorm.weight")),
            "wq": stack(lambda p: get(p + "self_attn.q_proj.weight").T.reshape(D, H, K)),
            "wk": stack(lambda p: get(p + "self_attn.k_proj.weight").T.reshape(D, G, K)),
            "wv": stack(lambda p: get(p + "self_attn.v_proj.weight").T.reshape(D, G, K)),
            "wo": stack(lambda p: get(p + "self_attn.o_proj.weight").T.reshape(H, K, D)),
            "mlp_norm": stack(lambda p: get(p + "post_attention_layernorm.weight")),
            "w_gate": stack(lambda p: get(p + "mlp.gate_proj.weight").T),
            "w_up": stack(lambda p: get(p + "mlp.up_proj.weight").T),
            "w_down": stack(lambda p: get(p + "mlp.down_proj.weight").T),
        },
        "final_norm": {"scale": get("model.norm.weight")},
    }
    if not m.tie_embeddings:
        params["lm_head"] = {"kernel": get("lm_head.weight").T}
    return params


# ---------------------------------------------------------------- files


def _tensor_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(hf_dir, n) for n in names]
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ConfigError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json")


def read_hf(hf_dir: str, param_dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(ModelConfig, numpy params) from an HF model directory (safetensors, bf16/f16/f32)."""
    from safetensors import safe_open

    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} not found; give a Hugging Face model directory") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    m = model_config_from_hf(hf)
    handles = [safe_open(f, framework="flax") for f in _tensor_files(hf_dir)]
    where = {k: h for h in handles for k in h.keys()}

    def get(name):
        if name not in where:
            raise ConfigError(f"{hf_dir}: tensor {name} missing; is this a Llama checkpoint matching config.json?")
        return np.asarray(where[name].get_tensor(name).astype(param_dtype))

    return m, params_from_hf(get, m)


def write_hf(out_dir: str, params: dict, m: ModelConfig, *, dtype: str = "float32",
             rope_format: str = "legacy") -> list[str]:
    """Writes `config.json` and safetensors (sharded past 5 GiB, with an index) to `out_dir`."""
    import jax.numpy as jnp
    from safetensors.flax import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: jnp.asarray(v, dtype=dtype) for k, v in params_to_hf(params, m).items()}
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
        json.dump(hf_config_from_model(m, rope_format=rope_format, dtype=dtype), f, indent=2)
    return files


def config_with_model(base: Config, m: ModelConfig) -> Config:
    """`base` with its model section replaced by the converted one (keeping attention and remat)."""
    return dataclasses.replace(base, model=dataclasses.replace(
        m, attention=base.model.attention, remat=base.model.remat, init_std=base.model.init_std))


# ---------------------------------------------------------------- commands


def hf_to_maxtrain(hf_dir: str, out_dir: str, base: Config) -> str:
    """Converts an HF model directory into a params-only maxtrain checkpoint; returns its step dir."""
    from maxtrain.checkpoint import Checkpointer
    from maxtrain.config import CheckpointConfig, to_dict, validate

    m, params = read_hf(hf_dir, base.train.param_dtype)
    cfg = config_with_model(base, m)
    validate(cfg)
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"output {out_dir} is not empty; choose a new directory")
    ckpt = Checkpointer(out_dir, CheckpointConfig(dir=out_dir, async_=False, keep=1))
    ckpt.save(0, params, None, {"seed": cfg.seed, "config": to_dict(cfg), "source": os.path.abspath(hf_dir)},
              wait=True)
    ckpt.close()
    return os.path.join(os.path.abspath(out_dir), "0")


def maxtrain_to_hf(ckpt_path: str, out_dir: str, *, dtype: str = "float32", rope_format: str = "legacy") -> list[str]:
    """Writes the params of a maxtrain checkpoint (latest good step, or a step dir) as an HF model."""
    import jax

    from maxtrain.checkpoint import load_checkpoint, saved_config
    from maxtrain.config import unpipelined

    # a pipelined run's layer stacks are [repeats, stages, ...]: read them back in the flat layout
    cfg, params = load_checkpoint(ckpt_path, unpipelined(saved_config(ckpt_path)))
    if cfg.model.name != "llama":
        raise ConfigError(f"model.name={cfg.model.name!r}: only the llama family converts to Hugging Face")
    return write_hf(out_dir, jax.device_get(params), cfg.model, dtype=dtype, rope_format=rope_format)
