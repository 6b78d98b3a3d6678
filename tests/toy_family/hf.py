"""The toy family's Hugging Face files: `model_type: maxtrain_toy`, one tensor per parameter of each
layer, `[out, in]` as Hugging Face stores projections."""

import numpy as np

from maxtrain.config import ConfigError
from maxtrain.models import HFConversion
from toy_family.config import ToyConfig

MODEL_TYPE = "maxtrain_toy"


def config_from_hf(hf: dict) -> ToyConfig:
    try:
        return ToyConfig(name="toy", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
                         n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"], d_ff=hf["intermediate_size"],
                         norm_eps=hf["rms_norm_eps"], activation=hf["hidden_act"], max_positions=hf["max_positions"])
    except KeyError as e:
        raise ConfigError(f"config.json has no {e.args[0]}; a {MODEL_TYPE} config.json gives it") from None


def config_to_hf(m: ToyConfig, *, rope_format: str, dtype: str, max_position: int) -> dict:
    return {"model_type": MODEL_TYPE, "architectures": ["MaxtrainToyForCausalLM"], "vocab_size": m.vocab_size,
            "hidden_size": m.d_model, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
            "intermediate_size": m.d_ff, "rms_norm_eps": m.norm_eps, "hidden_act": m.activation,
            "max_positions": m.max_positions, "max_position_embeddings": max_position, "torch_dtype": dtype}


def hf_shapes(m: ToyConfig):
    D, HK, F = m.d_model, m.n_heads * m.head_dim, m.d_ff
    yield "tok.weight", (m.vocab_size, D)
    yield "pos.weight", (m.max_positions, D)
    yield "norm_f.weight", (D,)
    for i in range(m.n_layers):
        p = f"layers.{i}."
        yield from {p + "norm1.weight": (D,), p + "qkv.weight": (3 * HK, D), p + "out.weight": (D, HK),
                    p + "norm2.weight": (D,), p + "fc_in.weight": (F, D), p + "fc_out.weight": (D, F)}.items()


def check_tensors(found: dict, m: ToyConfig, hf_dir: str) -> None:
    want = dict(hf_shapes(m))
    missing = sorted(set(want) - set(found))
    wrong = sorted(k for k in want if k in found and tuple(found[k][1]) != want[k])
    if missing or wrong or set(found) - set(want):
        raise ConfigError(f"{hf_dir}: not a {MODEL_TYPE} checkpoint of config.json's sizes "
                          f"(missing {missing[:3]}, wrong shapes {wrong[:3]}, extra {sorted(set(found) - set(want))[:3]})")


def params_from_hf(get, m: ToyConfig) -> dict:
    D, H, K = m.d_model, m.n_heads, m.head_dim

    def stack(name, fn):
        return np.stack([fn(get(f"layers.{i}.{name}.weight")) for i in range(m.n_layers)])

    layers = {"norm1": stack("norm1", lambda w: w), "norm2": stack("norm2", lambda w: w),
              "w_qkv": stack("qkv", lambda w: w.T.reshape(D, 3, H, K)),
              "w_out": stack("out", lambda w: w.T.reshape(H, K, D)),
              "w_in": stack("fc_in", lambda w: w.T), "w_mlp_out": stack("fc_out", lambda w: w.T)}
    return {"tok": get("tok.weight"), "pos": get("pos.weight"), "norm_f": get("norm_f.weight"), "layers": layers}


def params_to_hf(params: dict, m: ToyConfig) -> dict:
    D, HK = m.d_model, m.n_heads * m.head_dim
    L = params["layers"]
    out = {"tok.weight": params["tok"], "pos.weight": params["pos"], "norm_f.weight": params["norm_f"]}
    for i in range(m.n_layers):
        p = f"layers.{i}."
        out.update({p + "norm1.weight": L["norm1"][i], p + "norm2.weight": L["norm2"][i],
                    p + "qkv.weight": L["w_qkv"][i].reshape(D, 3 * HK).T, p + "out.weight": L["w_out"][i].reshape(HK, D).T,
                    p + "fc_in.weight": L["w_in"][i].T, p + "fc_out.weight": L["w_mlp_out"][i].T})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


CONVERSION = HFConversion((MODEL_TYPE,), config_from_hf, config_to_hf, hf_shapes, check_tensors, params_from_hf,
                          params_to_hf)
