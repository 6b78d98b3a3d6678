"""Register a custom architecture from outside the package and train it with the maxtrain loop.

    python examples/custom_model.py [KEY=VALUE ...]

The model is a small GPT-style decoder (learned absolute positions, GELU MLP, no GQA), written as
the five pure functions of a layered model (`maxtrain.models.stack`): its parameter specs (the
layers stacked under "layers"), the embedding, one layer, the final norm and the output head. Each
gets the model config and a small runtime context (compute dtype, sharding rules), never the whole
Config, and holds no parallel wiring: the trainer runs the stack with `lax.scan` and the remat
policy, cuts it into pipeline stages (`mesh.pipeline=2`), and computes the loss, fused or not
(`train.cross_entropy=fused`). Nothing in maxtrain changes.
"""

from __future__ import annotations

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


def param_specs(m, rt) -> dict:
    D, H, K, F, V, N = m.d_model, m.n_heads, m.head_dim, m.d_ff, m.vocab_size, m.n_layers
    max_len = m.extra.get("max_len", rt.seq_len)
    w = normal(m.init_std)
    return {
        "tok": ParamSpec((V, D), ("vocab", "embed"), w),
        "pos": ParamSpec((max_len, D), (None, "embed"), w),
        "layers": {  # every leaf [N, ...]: the trainer scans (or pipelines) over the first axis
            "norm1": ParamSpec((N, D), ("layers", "norm"), ones),
            "w_qkv": ParamSpec((N, D, 3, H, K), ("layers", "embed", None, "heads", "head_dim"), w),
            "w_out": ParamSpec((N, H, K, D), ("layers", "heads", "head_dim", "embed"), w),
            "norm2": ParamSpec((N, D), ("layers", "norm"), ones),
            "w_in": ParamSpec((N, D, F), ("layers", "embed", "mlp"), w),
            "w_mlp_out": ParamSpec((N, F, D), ("layers", "mlp", "embed"), w),
        },
        "norm_f": ParamSpec((D,), ("norm",), ones),
    }


def embed(params, batch, m, rt):
    """Token plus position embeddings [B, L, D]; the rows each layer needs (the segment ids)."""
    tokens = batch["inputs"]
    x = jnp.take(params["tok"], tokens, axis=0) + params["pos"][None, : tokens.shape[1]]
    return constrain(x, ("batch", "length", "embed"), rt.rules), {"segment_ids": batch.get("segment_ids")}


def layer(x, p, rows, m, rt):
    """One pre-norm block: attention, then a GELU MLP. No auxiliary statistics."""
    h = rms_norm(x, p["norm1"], m.norm_eps)
    q, k, v = [jnp.einsum("bld,dhk->blhk", h, p["w_qkv"][:, i]) for i in range(3)]
    o = attention(q, k, v, impl=m.attention, segment_ids=rows["segment_ids"])
    x = x + jnp.einsum("blhk,hkd->bld", o, p["w_out"])
    h = rms_norm(x, p["norm2"], m.norm_eps)
    x = x + jnp.einsum("blf,fd->bld", jax.nn.gelu(jnp.einsum("bld,df->blf", h, p["w_in"])), p["w_mlp_out"])
    return constrain(x, ("batch", "length", "embed"), rt.rules), None


def final(params, x, stats, m, rt):
    """Final-normed hidden states [B, L, D], and no auxiliary losses."""
    return rms_norm(x, params["norm_f"], m.norm_eps), {}


def head(params, m, rt):
    """The output projection [D, V]: the token embedding, tied."""
    return params["tok"].T


models.register("mini_gpt", param_specs=param_specs, embed=embed, layer=layer, final=final, head=head)


def main(argv):
    maxtrain.configure_logging()  # the CLI's progress lines; importing maxtrain configures no logging
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
