"""Context parallelism: ring attention over the `sequence` mesh axis (`model.attention: ring`).

Queries, keys and values stay sharded along length. Each of the n devices keeps its query block
and passes its key/value block (with segment ids) to the next device n-1 times with `ppermute`,
updating an online softmax, so no device ever holds more than two K/V blocks. The backward pass
(a custom VJP) is a ring too: the K/V block travels with its dK/dV accumulators and arrives back at
its owner after the last hop. GQA is kept grouped: K/V are never repeated to the query heads.

Blocks are in natural order (device i holds positions [i*L/n, (i+1)*L/n)), so under a causal
mask later devices do more work than earlier ones; zig-zag balancing is not implemented yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxtrain.layers.attention import register_attention
from maxtrain.sharding import logical_to_spec

AXIS = "sequence"
NEG = -1e30


def _block_mask(q_idx, k_idx, q_seg, k_seg, causal, window):
    """`[B, 1, 1, Lq, Lk]` bool for one (query block, key block) pair from global token indices."""
    mask = jnp.ones((q_idx.shape[0], k_idx.shape[0]), bool)
    if causal:
        mask = k_idx[None, :] <= q_idx[:, None]
    if window is not None:
        mask = mask & (q_idx[:, None] - k_idx[None, :] < window)
    mask = mask[None, None, None]
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
    return mask


def _scores(q, k, scale):
    # q [B, Lq, G, R, K], k [B, Lk, G, K] -> [B, G, R, Lq, Lk]
    return jnp.einsum("blgrk,bsgk->bgrls", q, k, preferred_element_type=jnp.float32) * scale


def _ring_fwd_local(q, k, v, q_seg, k_seg, *, n, causal, window):
    B, Lq, H, K = q.shape
    G = k.shape[2]
    qg = q.reshape(B, Lq, G, H // G, K)
    scale = K ** -0.5
    me = jax.lax.axis_index(AXIS)
    q_idx = me * Lq + jnp.arange(Lq)
    o = jnp.zeros((B, G, H // G, Lq, K), jnp.float32)
    m = jnp.full((B, G, H // G, Lq), NEG, jnp.float32)
    l = jnp.zeros((B, G, H // G, Lq), jnp.float32)
    perm = [(j, (j + 1) % n) for j in range(n)]
    for step in range(n):
        src = (me - step) % n
        k_idx = src * k.shape[1] + jnp.arange(k.shape[1])
        mask = _block_mask(q_idx, k_idx, q_seg, k_seg, causal, window)
        s = jnp.where(mask, _scores(qg, k, scale), NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        o = o * corr[..., None] + jnp.einsum("bgrls,bsgk->bgrlk", p.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
        m = m_new
        if step < n - 1:
            k, v = jax.lax.ppermute((k, v), AXIS, perm)
            if k_seg is not None:
                k_seg = jax.lax.ppermute(k_seg, AXIS, perm)
    out = o / l[..., None]
    lse = m + jnp.log(l)
    out_blhk = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, Lq, H, K).astype(q.dtype)
    return out_blhk, lse


def _ring_bwd_local(q, k, v, q_seg, k_seg, out, lse, d_out, *, n, causal, window):
    B, Lq, H, K = q.shape
    G = k.shape[2]
    R = H // G
    scale = K ** -0.5
    qg = q.reshape(B, Lq, G, R, K)
    do = d_out.reshape(B, Lq, G, R, K).astype(jnp.float32)
    delta = jnp.einsum("blgrk,blgrk->bgrl", do, out.reshape(B, Lq, G, R, K).astype(jnp.float32))
    me = jax.lax.axis_index(AXIS)
    q_idx = me * Lq + jnp.arange(Lq)
    dq = jnp.zeros(qg.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    perm = [(j, (j + 1) % n) for j in range(n)]
    for step in range(n):
        src = (me - step) % n
        k_idx = src * k.shape[1] + jnp.arange(k.shape[1])
        mask = _block_mask(q_idx, k_idx, q_seg, k_seg, causal, window)
        s = _scores(qg, k, scale)
        p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)  # [B, G, R, Lq, Lk]
        dv = dv + jnp.einsum("bgrls,blgrk->bsgk", p, do)
        dp = jnp.einsum("blgrk,bsgk->bgrls", do, v.astype(jnp.float32))
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("bgrls,bsgk->blgrk", ds, k.astype(jnp.float32))
        dk = dk + jnp.einsum("bgrls,blgrk->bsgk", ds, qg.astype(jnp.float32))
        # the K/V block moves on with its gradient accumulators; after n hops all are home
        k, v, dk, dv = jax.lax.ppermute((k, v, dk, dv), AXIS, perm)
        if k_seg is not None:
            k_seg = jax.lax.ppermute(k_seg, AXIS, perm)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring_local(n, causal, window, q, k, v, q_seg, k_seg):
    return _ring_fwd_local(q, k, v, q_seg, k_seg, n=n, causal=causal, window=window)[0]


def _ring_local_fwd(n, causal, window, q, k, v, q_seg, k_seg):
    out, lse = _ring_fwd_local(q, k, v, q_seg, k_seg, n=n, causal=causal, window=window)
    return out, (q, k, v, q_seg, k_seg, out, lse)


def _ring_local_bwd(n, causal, window, res, d_out):
    q, k, v, q_seg, k_seg, out, lse = res
    dq, dk, dv = _ring_bwd_local(q, k, v, q_seg, k_seg, out, lse, d_out, n=n, causal=causal, window=window)
    return dq, dk, dv, None, None  # segment ids are integers: no cotangent


_ring_local.defvjp(_ring_local_fwd, _ring_local_bwd)


def ring_attention(q, k, v, *, q_segment_ids=None, kv_segment_ids=None, causal=True, sliding_window=None,
                   rules=None):
    """Ring attention over the context mesh's `sequence` axis; plain XLA attention without one."""
    mesh = jax.sharding.get_abstract_mesh()
    n = 1 if mesh.empty else mesh.shape.get(AXIS, 1)
    if n == 1:
        from maxtrain.layers.attention import xla_attention
        return xla_attention(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                             causal=causal, sliding_window=sliding_window)
    rules = rules or {}
    batch = logical_to_spec(("batch",), rules)[0]
    heads = logical_to_spec(("heads",), rules)[0]
    kv_heads = logical_to_spec(("kv_heads",), rules)[0]
    q_spec, kv_spec, seg_spec = P(batch, AXIS, heads, None), P(batch, AXIS, kv_heads, None), P(batch, AXIS)
    local = functools.partial(_ring_local, n, causal, sliding_window)
    if q_segment_ids is None:
        fn = jax.shard_map(lambda q, k, v: local(q, k, v, None, None), mesh=mesh,
                           in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False)
        return fn(q, k, v)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, seg_spec),
                       out_specs=q_spec, check_vma=False)
    return fn(q, k, v, q_segment_ids, kv_segment_ids)


@register_attention("ring")
def _ring_impl(q, k, v, *, q_segment_ids, kv_segment_ids, causal, sliding_window, rules=None):
    return ring_attention(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, causal=causal,
                          sliding_window=sliding_window, rules=rules)
