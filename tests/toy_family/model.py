"""The toy decoder as layered pure functions: token plus learned position embeddings, pre-norm
blocks of multi-head attention and a one-hidden-layer MLP, a final RMSNorm, a tied output head."""

import jax
import jax.numpy as jnp

from maxtrain.layers.attention import attention
from maxtrain.layers.norms import rms_norm
from maxtrain.models import ParamSpec, normal, ones
from maxtrain.sharding import constrain

ACT = {"gelu": jax.nn.gelu, "relu": jax.nn.relu}


def param_specs(m, rt=None) -> dict:
    D, H, K, F, N = m.d_model, m.n_heads, m.head_dim, m.d_ff, m.n_layers
    w = normal(m.init_std)
    return {
        "tok": ParamSpec((m.vocab_size, D), ("vocab", "embed"), w),
        "pos": ParamSpec((m.max_positions, D), (None, "embed"), w),
        "layers": {
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
    tokens = batch["inputs"]
    positions = batch.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = jnp.take(params["tok"], tokens, axis=0) + jnp.take(params["pos"], positions, axis=0)
    return constrain(x, ("batch", "length", "embed"), rt.rules), {"segment_ids": batch.get("segment_ids")}


def mlp(h, p, m):
    return jnp.einsum("blf,fd->bld", ACT[m.activation](jnp.einsum("bld,df->blf", h, p["w_in"])), p["w_mlp_out"])


def layer(x, p, rows, m, rt):
    h = rms_norm(x, p["norm1"], m.norm_eps)
    q, k, v = [jnp.einsum("bld,dhk->blhk", h, p["w_qkv"][:, i]) for i in range(3)]
    o = attention(q, k, v, impl=m.attention, segment_ids=rows["segment_ids"])
    x = x + jnp.einsum("blhk,hkd->bld", o, p["w_out"])
    x = x + mlp(rms_norm(x, p["norm2"], m.norm_eps), p, m)
    return constrain(x, ("batch", "length", "embed"), rt.rules), None


def final(params, x, stats, m, rt):
    return rms_norm(x, params["norm_f"], m.norm_eps), {}


def head(params, m, rt):
    return params["tok"].T
