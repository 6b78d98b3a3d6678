"""The toy family's KV-cached decoder: each layer writes its keys and values for positions
`start .. start+T-1` into `[N, B, S, H, K]` buffers and attends over the cache (causal by absolute
position)."""

import jax.numpy as jnp
from jax import lax

from maxtrain.layers.norms import rms_norm
from maxtrain.models.llama.decode import attend_cached
from toy_family.model import mlp


def init_cache(m, batch: int, max_len: int, dtype) -> dict:
    shape = (m.n_layers, batch, max_len, m.n_heads, m.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def forward_cached(params, tokens_BT, cache, start, m):
    T = tokens_BT.shape[1]
    pos_T = start + jnp.arange(T)
    x = jnp.take(params["tok"], tokens_BT, axis=0) + jnp.take(params["pos"], pos_T, axis=0)[None]

    def body(x, layer):
        p, k_BSHK, v_BSHK = layer
        h = rms_norm(x, p["norm1"], m.norm_eps)
        q, k, v = [jnp.einsum("btd,dhk->bthk", h, p["w_qkv"][:, i]) for i in range(3)]
        k_BSHK = lax.dynamic_update_slice(k_BSHK, k.astype(k_BSHK.dtype), (0, start, 0, 0))
        v_BSHK = lax.dynamic_update_slice(v_BSHK, v.astype(v_BSHK.dtype), (0, start, 0, 0))
        x = x + jnp.einsum("bthk,hkd->btd", attend_cached(q, k_BSHK, v_BSHK, pos_T, None), p["w_out"])
        x = x + mlp(rms_norm(x, p["norm2"], m.norm_eps), p, m)
        return x, (k_BSHK, v_BSHK)

    x, (ks, vs) = lax.scan(body, x, (params["layers"], cache["k"], cache["v"]))
    h = rms_norm(x, params["norm_f"], m.norm_eps)
    return jnp.einsum("btd,dv->btv", h, params["tok"].T, preferred_element_type=jnp.float32), {"k": ks, "v": vs}
