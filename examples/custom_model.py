"""Register a custom architecture from outside the package and train it with the maxtrain loop.

    python examples/custom_model.py [KEY=VALUE ...]

The model is a small GPT-style decoder (learned absolute positions, GELU MLP, no GQA), written as
the three pure functions maxtrain needs: init, apply and logical_axes. Nothing in maxtrain changes.
It also registers `features` and `head` (apply is their product), so it trains with the fused
losses too: `python examples/custom_model.py train.cross_entropy=fused`.
"""

from __future__ import annotations

import logging
import os
import sys

import jax
import jax.numpy as jnp

import maxtrain
from maxtrain import models
from maxtrain.layers.attention import attention
from maxtrain.layers.norms import rms_norm
from maxtrain.models import ParamSpec, normal, ones
from maxtrain.sharding import constrain


def param_specs(cfg) -> dict:
    m = cfg.model
    D, H, K, F, V = m.d_model, m.n_heads, m.head_dim, m.d_ff, m.vocab_size
    max_len = m.extra.get("max_len", cfg.train.seq_len)
    w = normal(m.init_std)
    block = {
        "norm1": ParamSpec((D,), ("norm",), ones),
        "w_qkv": ParamSpec((D, 3, H, K), ("embed", None, "heads", "head_dim"), w),
        "w_out": ParamSpec((H, K, D), ("heads", "head_dim", "embed"), w),
        "norm2": ParamSpec((D,), ("norm",), ones),
        "w_in": ParamSpec((D, F), ("embed", "mlp"), w),
        "w_mlp_out": ParamSpec((F, D), ("mlp", "embed"), w),
    }
    return {
        "tok": ParamSpec((V, D), ("vocab", "embed"), w),
        "pos": ParamSpec((max_len, D), (None, "embed"), w),
        "blocks": [block] * m.n_layers,  # a python list of layers: simple, unrolled at trace time
        "norm_f": ParamSpec((D,), ("norm",), ones),
    }


def init(cfg, key):
    return models.init_from_specs(param_specs(cfg), key, jnp.dtype(cfg.train.param_dtype))


def logical_axes(cfg):
    return models.axes_from_specs(param_specs(cfg))


def features(params, batch, cfg):
    """Final-normed hidden states [B, L, D] in the compute dtype, and no auxiliary losses."""
    m, rules = cfg.model, cfg.sharding.activations
    p = jax.tree.map(lambda a: a.astype(cfg.train.dtype), params)
    tokens = batch["inputs"]
    x = jnp.take(p["tok"], tokens, axis=0) + p["pos"][None, : tokens.shape[1]]
    x = constrain(x, ("batch", "length", "embed"), rules)
    for blk in p["blocks"]:
        h = rms_norm(x, blk["norm1"], m.norm_eps)
        q, k, v = [jnp.einsum("bld,dhk->blhk", h, blk["w_qkv"][:, i]) for i in range(3)]
        o = attention(q, k, v, impl=m.attention, segment_ids=batch.get("segment_ids"))
        x = x + jnp.einsum("blhk,hkd->bld", o, blk["w_out"])
        h = rms_norm(x, blk["norm2"], m.norm_eps)
        x = x + jnp.einsum("blf,fd->bld", jax.nn.gelu(jnp.einsum("bld,df->blf", h, blk["w_in"])), blk["w_mlp_out"])
        x = constrain(x, ("batch", "length", "embed"), rules)
    return rms_norm(x, p["norm_f"], m.norm_eps), {}


def head(params, cfg):
    """The output projection [D, V]: the token embedding, tied."""
    return params["tok"].astype(cfg.train.dtype).T


def apply(params, batch, cfg):
    x, aux = features(params, batch, cfg)
    return jnp.einsum("bld,dv->blv", x, head(params, cfg), preferred_element_type=jnp.float32), aux


models.register("mini_gpt", init=init, apply=apply, logical_axes=logical_axes, features=features, head=head)


def main(argv):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml")
    cfg = maxtrain.load_config(config, ["model.name=mini_gpt", "model.n_layers=2", "model.n_kv_heads=8",
                                        "train.steps=30", "train.batch_size=8", "train.seq_len=64",
                                        "train.log_every=10", "data.kind=synthetic",
                                        "run_dir=runs/mini_gpt", *argv])
    result = maxtrain.train(cfg)
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    print(f"mini_gpt: loss {first:.3f} -> {last:.3f} in {cfg.train.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
