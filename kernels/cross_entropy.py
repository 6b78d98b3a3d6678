"""Fused cross-entropy: per-token loss and log-sum-exp without float32 logits in memory.

Two kernels, both chunked over the vocabulary with an online log-sum-exp, forward and backward:

- `cross_entropy(logits, targets)` (Pallas): logits `[..., V]` in their own dtype (bf16 in
  training). The forward kernel walks a row block's vocab chunks keeping the running max, sum of
  exponentials and target logit in float32 registers; the backward kernel writes
  `dlogits = softmax * (dloss + dlse) - onehot * dloss` chunk by chunk, in the logits' dtype. XLA's
  version materialises float32 logits (and their softmax) of the whole `[tokens, vocab]` array.
- `linear_cross_entropy(h, w, targets)` (plain JAX, XLA matmuls): the output projection fused in,
  so the logits never exist whole in any dtype: `[tokens, chunk]` slices of `h @ w` are made,
  reduced and dropped, in the forward and again in the backward (which adds `g @ w_c^T` into dh
  and writes `h^T @ g` as w's gradient chunk). Memory is O(tokens x chunk) instead of
  O(tokens x vocab): the part that matters at vocab 128k.

Both return `(loss, lse)` float32 with the batch shape of `targets`; `lse` feeds a z-loss and is
differentiable. Targets outside `[0, V)` (an ignore index) select nothing: their loss is `lse`,
so mask them afterwards.

Inside `shard_map` (vocab-parallel use: `maxtrain/loss.py`) give h, w and targets the same varying
mesh axes (`lax.pcast`): the scans' carries are made like them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maxtrain.errors import ConfigError
from maxtrain.targets import on_gpu

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

NEG = -1e30


def reference_cross_entropy(logits, targets):
    """Plain JAX in float32: (loss, lse) per token."""
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    picked = jnp.take_along_axis(x, jnp.clip(targets, 0, x.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    picked = jnp.where((targets >= 0) & (targets < x.shape[-1]), picked, 0.0)
    return lse - picked, lse


def reference_linear_cross_entropy(h, w, targets):
    """Plain JAX: logits = h @ w in float32, then `reference_cross_entropy`."""
    logits = jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    return reference_cross_entropy(logits, targets)


# ---------------------------------------------------------------- Pallas: cross_entropy(logits)


@dataclasses.dataclass(frozen=True)
class _Static:
    vocab: int  # real vocab size (columns past it are padding)
    block_rows: int
    block_vocab: int
    interpret: bool


def cross_entropy(logits, targets, *, block_rows: int = 16, block_vocab: int = 1024, interpret: bool | None = None):
    """Per-token (loss, lse) float32 of logits `[..., V]` (any float dtype) against int targets `[...]`."""
    if logits.shape[:-1] != targets.shape or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ConfigError(f"cross_entropy: targets must be integers of shape {logits.shape[:-1]}, "
                          f"got {targets.dtype}{list(targets.shape)}")
    for name, b in (("block_rows", block_rows), ("block_vocab", block_vocab)):
        if b < 1 or b & (b - 1):
            raise ConfigError(f"cross_entropy: {name} must be a power of two, got {b}")
    interpret = not on_gpu() if interpret is None else bool(interpret)
    V = logits.shape[-1]
    st = _Static(vocab=V, block_rows=block_rows, block_vocab=_vocab_block(V, block_vocab), interpret=interpret)
    lead = targets.shape
    loss, lse = _padded_call(logits.reshape(-1, V), targets.reshape(-1).astype(jnp.int32), st)
    return loss.reshape(lead), lse.reshape(lead)


def _vocab_block(V: int, want: int) -> int:
    """The largest power of two <= want that divides V (no padding copy), down to 128."""
    b = want
    while b > 128 and V % b:
        b //= 2
    return b


@functools.partial(jax.jit, static_argnums=(2,))
def _padded_call(logits, targets, st: _Static):
    """Pads rows and vocab to block multiples (padded logits: the dtype's minimum, never chosen)."""
    N, V = logits.shape
    pad_n = -N % st.block_rows
    pad_v = -V % st.block_vocab
    if pad_n or pad_v:
        logits = jnp.pad(logits, ((0, pad_n), (0, 0)))
        logits = jnp.pad(logits, ((0, 0), (0, pad_v)), constant_values=jnp.finfo(logits.dtype).min)
        targets = jnp.pad(targets, (0, pad_n))
    loss, lse = _ce(logits, targets, st)
    return loss[:N], lse[:N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ce(logits, targets, st):
    return _ce_forward(logits, targets, st)


def _ce_fwd(logits, targets, st):
    loss, lse = _ce_forward(logits, targets, st)
    return (loss, lse), (logits, targets, lse)


def _ce_bwd(st, res, cts):
    logits, targets, lse = res
    dloss, dlse = cts
    return _ce_backward(logits, targets, lse, dloss.astype(jnp.float32), dlse.astype(jnp.float32), st), None


_ce.defvjp(_ce_fwd, _ce_bwd)


def _out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """An output shape that varies over the same manual mesh axes as `like` (a pallas_call inside a
    `shard_map` with check_vma must say so); outside shard_map, a plain one."""
    aval = jax.typeof(like)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if mat is not None and mat.varying:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    if getattr(aval, "vma", None):  # jax < 0.10
        return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)
    return jax.ShapeDtypeStruct(shape, dtype)


def _compiler_params(interpret: bool, num_warps: int = 4):
    if interpret or plgpu is None:
        return None
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=2)


def _ce_forward_kernel(x_ref, t_ref, loss_ref, lse_ref, *, st: _Static, n_chunks: int):
    bn, bv = st.block_rows, st.block_vocab
    t = t_ref[...][:, None]

    def body(j, carry):
        m, l, picked = carry
        x = x_ref[:, pl.ds(j * bv, bv)].astype(jnp.float32)  # [bn, bv]
        cols = j * bv + jnp.arange(bv, dtype=jnp.int32)[None, :]
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)
        picked = picked + jnp.sum(jnp.where((cols == t) & (cols < st.vocab), x, 0.0), axis=1)  # not padding
        return m_new, l, picked

    zeros = jnp.zeros((bn,), jnp.float32)
    m, l, picked = lax.fori_loop(0, n_chunks, body, (jnp.full((bn,), NEG, jnp.float32), zeros, zeros))
    lse = m + jnp.log(l)
    lse_ref[...] = lse
    loss_ref[...] = lse - picked


def _ce_forward(logits, targets, st: _Static):
    N, Vp = logits.shape
    bn = st.block_rows
    row = pl.BlockSpec((bn,), lambda i: (i,))
    return pl.pallas_call(
        functools.partial(_ce_forward_kernel, st=st, n_chunks=Vp // st.block_vocab),
        grid=(N // bn,),
        in_specs=[pl.BlockSpec((bn, Vp), lambda i: (i, 0)), row],
        out_specs=[row, row],
        out_shape=[_out_struct((N,), jnp.float32, logits)] * 2,
        compiler_params=_compiler_params(st.interpret, num_warps=8),
        interpret=st.interpret,
        name="cross_entropy_fwd",
    )(logits, targets)


def _ce_backward_kernel(x_ref, t_ref, lse_ref, dloss_ref, dlse_ref, dx_ref, *, st: _Static):
    bv = st.block_vocab
    j = pl.program_id(1)
    x = x_ref[...].astype(jnp.float32)
    cols = j * bv + jnp.arange(bv, dtype=jnp.int32)[None, :]
    p = jnp.exp(x - lse_ref[...][:, None])
    dloss = dloss_ref[...][:, None]
    hit = (cols == t_ref[...][:, None]) & (cols < st.vocab)  # a target in the padding selects nothing
    dx = p * (dloss + dlse_ref[...][:, None]) - jnp.where(hit, dloss, 0.0)
    dx_ref[...] = dx.astype(dx_ref.dtype)


def _ce_backward(logits, targets, lse, dloss, dlse, st: _Static):
    N, Vp = logits.shape
    bn, bv = st.block_rows, st.block_vocab
    row = pl.BlockSpec((bn,), lambda i, j: (i,))
    tile = pl.BlockSpec((bn, bv), lambda i, j: (i, j))
    return pl.pallas_call(
        functools.partial(_ce_backward_kernel, st=st),
        grid=(N // bn, Vp // bv),
        in_specs=[tile, row, row, row, row],
        out_specs=tile,
        out_shape=_out_struct(logits.shape, logits.dtype, logits),
        compiler_params=_compiler_params(st.interpret, num_warps=8),
        interpret=st.interpret,
        name="cross_entropy_bwd",
    )(logits, targets, lse, dloss, dlse)


# ---------------------------------------------------------------- linear_cross_entropy(h, w)


def linear_cross_entropy(h, w, targets, *, chunk: int = 4096):
    """Per-token (loss, lse) float32 of `h @ w` (h `[..., D]`, w `[D, V]`) against targets `[...]`,
    with the logits made `chunk` vocab columns at a time (never `[tokens, V]`)."""
    if h.shape[-1] != w.shape[0] or w.ndim != 2 or h.shape[:-1] != targets.shape:
        raise ConfigError(f"linear_cross_entropy: need h [..., D], w [D, V], targets h's batch shape; got "
                          f"{h.shape}, {w.shape}, {targets.shape}")
    if chunk < 1:
        raise ConfigError(f"linear_cross_entropy: chunk must be positive, got {chunk}")
    lead = targets.shape
    loss, lse = _linear_ce(h.reshape(-1, h.shape[-1]), w, targets.reshape(-1).astype(jnp.int32), min(chunk, w.shape[1]))
    return loss.reshape(lead), lse.reshape(lead)


def _chunk_logits(h, w, j, chunk: int):
    """float32 logits of vocab columns [j*chunk, (j+1)*chunk) (past V: NEG) and their column ids."""
    V = w.shape[1]
    start = jnp.minimum(j * chunk, V - chunk)  # the last chunk overlaps the previous one ...
    logits = jnp.dot(h, lax.dynamic_slice_in_dim(w, start, chunk, axis=1), preferred_element_type=jnp.float32)
    cols = start + jnp.arange(chunk)
    fresh = cols >= j * chunk  # ... and counts only columns not seen before
    return jnp.where(fresh[None, :], logits, NEG), cols, fresh, start


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _linear_ce(h, w, targets, chunk):
    return _linear_ce_fwd(h, w, targets, chunk)[0]


def _linear_ce_fwd(h, w, targets, chunk):
    n = -(-w.shape[1] // chunk)

    def body(carry, j):
        m, l, picked = carry
        logits, cols, fresh, _ = _chunk_logits(h, w, j, chunk)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[:, None]), axis=1)
        hit = (cols[None, :] == targets[:, None]) & fresh[None, :]
        picked = picked + jnp.sum(jnp.where(hit, logits, 0.0), axis=1)
        return (m_new, l, picked), None

    row = h[:, 0]  # carries made "like" the inputs keep their varying mesh axes inside shard_map
    zeros = lax.full_like(row, 0, jnp.float32)
    (m, l, picked), _ = lax.scan(body, (lax.full_like(row, NEG, jnp.float32), zeros, zeros), jnp.arange(n))
    lse = m + jnp.log(l)
    return (lse - picked, lse), (h, w, targets, lse)


def _linear_ce_bwd(chunk, res, cts):
    h, w, targets, lse = res
    dloss, dlse = (c.astype(jnp.float32) for c in cts)
    n = -(-w.shape[1] // chunk)

    def body(carry, j):
        dh, dw = carry
        logits, cols, fresh, start = _chunk_logits(h, w, j, chunk)
        p = jnp.exp(logits - lse[:, None])  # 0 on the overlap's stale columns (NEG)
        g = p * (dloss + dlse)[:, None] - jnp.where(cols[None, :] == targets[:, None], dloss[:, None], 0.0)
        g = jnp.where(fresh[None, :], g, 0.0).astype(h.dtype)
        dh = dh + jnp.dot(g, lax.dynamic_slice_in_dim(w, start, chunk, axis=1).T, preferred_element_type=jnp.float32)
        # a chunk's columns of dw are complete after this one product: written once, in w's dtype
        # (a float32 [D, V] accumulator would be the largest buffer of the backward)
        dw_c = jnp.dot(h.T, g, preferred_element_type=jnp.float32).astype(w.dtype)
        old = lax.dynamic_slice_in_dim(dw, start, chunk, axis=1)  # overlap: keep what earlier chunks wrote
        dw = lax.dynamic_update_slice_in_dim(dw, jnp.where(fresh[None, :], dw_c, old), start, axis=1)
        return (dh, dw), None

    init = (lax.full_like(h, 0, jnp.float32), lax.full_like(w, 0))
    (dh, dw), _ = lax.scan(body, init, jnp.arange(n))
    return dh.astype(h.dtype), dw, None


_linear_ce.defvjp(_linear_ce_fwd, _linear_ce_bwd)
