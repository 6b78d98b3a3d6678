"""Context parallelism: ring attention over the `sequence` mesh axis (`model.attention: ring`).

Queries, keys and values stay sharded along length. Each of the n devices keeps its query block
and passes its key/value block (with segment ids) to the next device n-1 times with `ppermute`,
updating an online softmax, so no device ever holds more than two K/V blocks. The backward pass
(a custom VJP) is a ring too: the K/V block travels with its dK/dV accumulators and arrives back at
its owner after the last hop. GQA is kept grouped: K/V are never repeated to the query heads.

Causal load balance (`model.ring_layout: zigzag`, the default). With blocks in natural order,
device i would attend to i+1 blocks and the last device would set the pace for all. Instead the
sequence is cut into 2n chunks and device i holds chunks i and 2n-1-i (`zigzag_order`), a layout
the train step applies once to the token batch (`to_ring_layout`, a gather of integer arrays, not
activations). Then at every hop after the first, each device does exactly half a block of work:
  - the visiting block comes from an earlier device (src < me): both local query chunks see only
    the visitor's first chunk, and nothing of its second chunk;
  - it comes from a later device (src > me): only the local second query chunk sees anything, and
    it sees both visiting chunks.
A `lax.cond` picks the half; masks (segments, sliding window) are still applied inside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maxtrain.layers.attention import register_attention
from maxtrain.sharding import logical_to_spec

AXIS = "sequence"
NEG = -1e30


# ---------------------------------------------------------------- layout


def zigzag_order(length: int, n: int) -> np.ndarray:
    """Token order for `n` devices: device i's slice holds chunks i and 2n-1-i of 2n equal chunks."""
    if length % (2 * n):
        raise ValueError(f"length {length} is not divisible by 2 x {n} sequence shards")
    c = length // (2 * n)
    chunks = np.arange(length).reshape(2 * n, c)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def ring_layout_shards(impl: str, layout: str) -> int:
    """How many sequence shards the batch is reordered for: the context mesh's `sequence` size for
    zig-zag ring attention, else 1 (natural order)."""
    if impl != "ring" or layout != "zigzag":
        return 1
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.shape.get(AXIS, 1)


def to_ring_layout(batch: dict, n: int) -> dict:
    """Reorders every `[B, L]` batch array along length into the zig-zag layout for n shards.

    Positions are made explicit first: the model must see each token's true position, and the
    loss (a sum over tokens) does not care about order."""
    if n == 1:
        return batch
    B, L = batch["inputs"].shape
    batch = dict(batch)
    if batch.get("positions") is None:
        batch["positions"] = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None, :], (B, L))
    order = jnp.asarray(zigzag_order(L, n))
    return {k: jnp.take(v, order, axis=1) for k, v in batch.items()}


def from_ring_layout(x, n: int, axis: int = 1):
    """Undoes `to_ring_layout` along `axis` (for outputs such as logits)."""
    if n == 1:
        return x
    return jnp.take(x, jnp.asarray(np.argsort(zigzag_order(x.shape[axis], n))), axis=axis)


def _global_index(dev, block: int, n: int, zigzag: bool):
    """Positions in the original sequence of device `dev`'s block of `block` tokens."""
    if not zigzag:
        return dev * block + jnp.arange(block)
    c = block // 2
    return jnp.concatenate([dev * c + jnp.arange(c), (2 * n - 1 - dev) * c + jnp.arange(c)])


# ---------------------------------------------------------------- per-block math


def _block_mask(q_idx, k_idx, q_seg, k_seg, causal, window):
    """`[B or 1, 1, 1, Lq, Lk]` bool for one (query block, key block) pair from global token indices."""
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


def _fwd_block(carry, q, k, v, mask, scale):
    """Online-softmax update of (o, m, l) for the query rows `q` against one key block."""
    o, m, l = carry
    s = jnp.where(mask, _scores(q, k, scale), NEG)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + p.sum(-1)
    o = o * corr[..., None] + jnp.einsum("bgrls,bsgk->bgrlk", p.astype(v.dtype), v,
                                         preferred_element_type=jnp.float32)
    return o, m_new, l


def _bwd_block(q, do, lse, delta, k, v, mask, scale):
    """(dq, dk, dv) contributions of one (query rows, key block) pair, from the saved log-sum-exp."""
    s = _scores(q, k, scale)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)  # [B, G, R, Lq, Lk]
    dv = jnp.einsum("bgrls,blgrk->bsgk", p, do)
    dp = jnp.einsum("blgrk,bsgk->bgrls", do, v.astype(jnp.float32))
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bgrls,bsgk->blgrk", ds, k.astype(jnp.float32))
    dk = jnp.einsum("bgrls,blgrk->bsgk", ds, q.astype(jnp.float32))
    return dq, dk, dv


def _earlier_mask(q_idx, k_idx, q_seg, k_seg, C, causal, window):
    """Zig-zag hop from an earlier device: every local query against the visitor's first chunk."""
    return _block_mask(q_idx, k_idx[:C], q_seg, _seg(k_seg, 0, C), causal, window)


def _later_mask(q_idx, k_idx, q_seg, k_seg, C, causal, window):
    """Zig-zag hop from a later device: the local second chunk against the whole visitor."""
    return _block_mask(q_idx[C:], k_idx, _seg(q_seg, C, q_idx.shape[0]), k_seg, causal, window)


def _rows(x, lo, hi, axis):
    return jax.lax.slice_in_dim(x, lo, hi, axis=axis)


def _seg(seg, lo, hi):
    return None if seg is None else seg[:, lo:hi]


# ---------------------------------------------------------------- the ring, per device


def _ring_fwd_local(q, k, v, q_seg, k_seg, *, n, causal, window, zigzag):
    B, Lq, H, K = q.shape
    G, Lk = k.shape[2], k.shape[1]
    R, C = H // G, Lq // 2
    qg = q.reshape(B, Lq, G, R, K)
    scale = K ** -0.5
    me = jax.lax.axis_index(AXIS)
    q_idx = _global_index(me, Lq, n, zigzag)
    carry = (jnp.zeros((B, G, R, Lq, K), jnp.float32), jnp.full((B, G, R, Lq), NEG, jnp.float32),
             jnp.zeros((B, G, R, Lq), jnp.float32))
    perm = [(j, (j + 1) % n) for j in range(n)]
    for step in range(n):
        src = (me - step) % n
        k_idx = _global_index(src, Lk, n, zigzag)
        if step == 0 or not (zigzag and causal):
            mask = _block_mask(q_idx, k_idx, q_seg, k_seg, causal, window)
            carry = _fwd_block(carry, qg, k, v, mask, scale)
        else:
            def earlier(carry, k=k, v=v, k_seg=k_seg, k_idx=k_idx):
                mask = _earlier_mask(q_idx, k_idx, q_seg, k_seg, C, causal, window)
                return _fwd_block(carry, qg, k[:, :C], v[:, :C], mask, scale)

            def later(carry, k=k, v=v, k_seg=k_seg, k_idx=k_idx):
                mask = _later_mask(q_idx, k_idx, q_seg, k_seg, C, causal, window)
                part = _fwd_block(tuple(_rows(c, C, Lq, 3) for c in carry), qg[:, C:], k, v, mask, scale)
                return tuple(jnp.concatenate([_rows(c, 0, C, 3), p], axis=3) for c, p in zip(carry, part))

            carry = jax.lax.cond(src < me, earlier, later, carry)
        if step < n - 1:
            k, v = jax.lax.ppermute((k, v), AXIS, perm)
            if k_seg is not None:
                k_seg = jax.lax.ppermute(k_seg, AXIS, perm)
    o, m, l = carry
    out = o / l[..., None]
    lse = m + jnp.log(l)
    out_blhk = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, Lq, H, K).astype(q.dtype)
    return out_blhk, lse


def _ring_bwd_local(q, k, v, q_seg, k_seg, out, lse, d_out, *, n, causal, window, zigzag):
    B, Lq, H, K = q.shape
    G, Lk = k.shape[2], k.shape[1]
    R, C = H // G, Lq // 2
    scale = K ** -0.5
    qg = q.reshape(B, Lq, G, R, K)
    do = d_out.reshape(B, Lq, G, R, K).astype(jnp.float32)
    delta = jnp.einsum("blgrk,blgrk->bgrl", do, out.reshape(B, Lq, G, R, K).astype(jnp.float32))
    me = jax.lax.axis_index(AXIS)
    q_idx = _global_index(me, Lq, n, zigzag)
    dq = jnp.zeros(qg.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    perm = [(j, (j + 1) % n) for j in range(n)]
    for step in range(n):
        src = (me - step) % n
        k_idx = _global_index(src, Lk, n, zigzag)
        if step == 0 or not (zigzag and causal):
            mask = _block_mask(q_idx, k_idx, q_seg, k_seg, causal, window)
            ddq, ddk, ddv = _bwd_block(qg, do, lse, delta, k, v, mask, scale)
            dq, dk, dv = dq + ddq, dk + ddk, dv + ddv
        else:
            def earlier(acc, k=k, v=v, k_seg=k_seg, k_idx=k_idx):
                dq, dk, dv = acc
                mask = _earlier_mask(q_idx, k_idx, q_seg, k_seg, C, causal, window)
                ddq, ddk, ddv = _bwd_block(qg, do, lse, delta, k[:, :C], v[:, :C], mask, scale)
                pad = [(0, 0), (0, Lk - C), (0, 0), (0, 0)]
                return dq + ddq, dk + jnp.pad(ddk, pad), dv + jnp.pad(ddv, pad)

            def later(acc, k=k, v=v, k_seg=k_seg, k_idx=k_idx):
                dq, dk, dv = acc
                mask = _later_mask(q_idx, k_idx, q_seg, k_seg, C, causal, window)
                ddq, ddk, ddv = _bwd_block(qg[:, C:], do[:, C:], _rows(lse, C, Lq, 3), _rows(delta, C, Lq, 3),
                                           k, v, mask, scale)
                return dq + jnp.pad(ddq, [(0, 0), (C, 0), (0, 0), (0, 0), (0, 0)]), dk + ddk, dv + ddv

            dq, dk, dv = jax.lax.cond(src < me, earlier, later, (dq, dk, dv))
        # the K/V block moves on with its gradient accumulators; after n hops the accumulators are
        # home (K/V themselves are not sent on the last hop: their owner still has them)
        if step < n - 1:
            k, v, dk, dv = jax.lax.ppermute((k, v, dk, dv), AXIS, perm)
            if k_seg is not None:
                k_seg = jax.lax.ppermute(k_seg, AXIS, perm)
        else:
            dk, dv = jax.lax.ppermute((dk, dv), AXIS, perm)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring_local(n, causal, window, zigzag, q, k, v, q_seg, k_seg):
    return _ring_fwd_local(q, k, v, q_seg, k_seg, n=n, causal=causal, window=window, zigzag=zigzag)[0]


def _ring_local_fwd(n, causal, window, zigzag, q, k, v, q_seg, k_seg):
    out, lse = _ring_fwd_local(q, k, v, q_seg, k_seg, n=n, causal=causal, window=window, zigzag=zigzag)
    return out, (q, k, v, q_seg, k_seg, out, lse)


def _ring_local_bwd(n, causal, window, zigzag, res, d_out):
    q, k, v, q_seg, k_seg, out, lse = res
    dq, dk, dv = _ring_bwd_local(q, k, v, q_seg, k_seg, out, lse, d_out, n=n, causal=causal, window=window,
                                 zigzag=zigzag)
    return dq, dk, dv, None, None  # segment ids are integers: no cotangent


_ring_local.defvjp(_ring_local_fwd, _ring_local_bwd)


def ring_attention(q, k, v, *, q_segment_ids=None, kv_segment_ids=None, causal=True, sliding_window=None,
                   rules=None, layout: str = "contiguous"):
    """Ring attention over the context mesh's `sequence` axis; plain XLA attention without one.

    `layout="zigzag"` means q, k, v (and segment ids) are already in `zigzag_order` along length."""
    mesh = jax.sharding.get_abstract_mesh()
    n = 1 if mesh.empty else mesh.shape.get(AXIS, 1)
    if n == 1:
        from maxtrain.layers.attention import xla_attention
        return xla_attention(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                             causal=causal, sliding_window=sliding_window)
    zigzag = layout == "zigzag"
    if zigzag and q.shape[1] % (2 * n):
        raise ValueError(f"zig-zag ring attention needs length {q.shape[1]} divisible by 2 x {n}")
    rules = rules or {}
    batch = logical_to_spec(("batch",), rules)[0]
    heads = logical_to_spec(("heads",), rules)[0]
    kv_heads = logical_to_spec(("kv_heads",), rules)[0]
    q_spec, kv_spec, seg_spec = P(batch, AXIS, heads, None), P(batch, AXIS, kv_heads, None), P(batch, AXIS)
    local = functools.partial(_ring_local, n, causal, sliding_window, zigzag)
    if q_segment_ids is None:
        fn = jax.shard_map(lambda q, k, v: local(q, k, v, None, None), mesh=mesh,
                           in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False)
        return fn(q, k, v)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, seg_spec),
                       out_specs=q_spec, check_vma=False)
    return fn(q, k, v, q_segment_ids, kv_segment_ids)


@register_attention("ring")
def _ring_impl(q, k, v, *, q_segment_ids, kv_segment_ids, causal, sliding_window, rules=None,
               ring_layout="contiguous", **_):
    return ring_attention(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, causal=causal,
                          sliding_window=sliding_window, rules=rules, layout=ring_layout)
