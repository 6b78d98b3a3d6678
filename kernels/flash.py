"""Flash attention (FlashAttention-2) in Pallas, forward and backward, for the Triton lowering.

`flash_attention(q, k, v)` takes q `[B, L, H, D]` and k, v `[B, L, KV, D]` (KV divides H) and
returns `[B, L, H, D]` in q's dtype. Scores, the online softmax and every accumulator are float32;
matmul inputs stay in the input dtype (bf16 on GPU), so tensor cores run at full rate.

How the work is laid out:

- Forward: one program per (query block, batch, head). It keeps its query block and walks the
  key/value blocks with an online softmax, then writes the output block and the log-sum-exp
  (base 2, the backward's residual).
- Backward, two kernels (no atomics): dQ with one program per (query block, batch, head) walking
  key blocks; dK/dV with one program per (key block, batch, KV head) walking the query blocks of
  every query head of its group, so dK/dV of a KV head are summed in registers and never written
  per query head.
- Grouped-query attention: the key/value BlockSpecs index KV head `h // (H // KV)` from query head
  `h`; K/V are never repeated in memory.
- Block skipping: each program computes, from its block index, the range of blocks that can hold
  an unmasked score (causal: nothing past the diagonal; sliding window: nothing before it; padded
  keys: nothing past the real length) and loops over that range only. Inside it, blocks that the
  mask cannot touch (fully below the diagonal, fully inside the window, no segment ids) skip the
  mask arithmetic.
- Lengths that are not a multiple of the block size are padded inside the wrapper; padded keys are
  masked by index, padded query rows are sliced off (their output cotangent is zero).

`interpret=True` runs the same kernels through Pallas' interpreter on any backend (the test suite
on CPU); `None` (the default) picks it when the devices compiled for are not GPUs (the context
mesh's, else the default backend's: `maxtrain.targets.on_gpu`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from maxtrain.errors import ConfigError
from maxtrain.kernels.flash_masks import kv_major_ranges as _kv_major_ranges  # this module's names for them
from maxtrain.kernels.flash_masks import q_major_ranges as _q_major_ranges
from maxtrain.kernels.flash_masks import score_mask as _mask
from maxtrain.kernels.limits import FLASH_HEAD_DIMS
from maxtrain.kernels.residuals import RESIDUAL_NAMES
from maxtrain.targets import on_gpu

try:  # the Triton compiler parameters; only used when compiling for a GPU
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the jax build
    plgpu = None

SUPPORTED_HEAD_DIMS = FLASH_HEAD_DIMS
NEG = -1e30  # masked score: finite, so NEG - NEG is 0 and never NaN
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_SQ = getattr(pl, "squeezed", None)  # a block dimension squeezed out of the kernel's view


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two, >= 16): forward query/key blocks, backward query/key blocks."""

    q: int = 128
    k: int = 64
    bwd_q: int = 64
    bwd_k: int = 64

    def all(self) -> tuple[int, ...]:
        return (self.q, self.k, self.bwd_q, self.bwd_k)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernels specialise on (hashable: the custom VJP's static argument)."""

    length: int  # real sequence length
    padded: int  # length rounded up to a multiple of every block size
    causal: bool
    window: int | None
    segmented: bool
    group: int  # query heads per KV head
    scale: float  # softmax scale, D ** -0.5
    blocks: BlockSizes  # flash_hopper.HopperBlocks when backend == "mosaic"
    interpret: bool
    num_warps: int
    num_stages: int
    backend: str = "triton"  # "mosaic": kernels/flash_hopper.py (sm_90 wgmma/TMA)


BACKENDS = ("triton", "mosaic")


# ---------------------------------------------------------------- reference


def reference_attention(q, k, v, *, causal: bool = True, segment_ids=None, sliding_window: int | None = None):
    """Plain-JAX attention with the kernel's semantics, all in float32: (out in q's dtype, lse `[B, H, L]`).

    Query i may attend key j when j <= i (causal), i - j < sliding_window, and both have the same
    segment id."""
    B, L, H, D = q.shape
    G = k.shape[2]
    qg = q.astype(jnp.float32).reshape(B, L, G, H // G, D)
    hi = jax.lax.Precision.HIGHEST  # exact float32 even where matmuls default to TF32 (GPU)
    s = jnp.einsum("blgrd,bsgd->bgrls", qg, k.astype(jnp.float32), precision=hi) * D ** -0.5
    i = jnp.arange(L)[:, None]
    j = jnp.arange(L)[None, :]
    mask = (j <= i) if causal else jnp.ones((L, L), bool)
    if sliding_window is not None:
        mask = mask & (i - j < sliding_window)
    mask = mask[None, None, None]
    if segment_ids is not None:
        q_seg, k_seg = _split_segments(segment_ids)
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
    s = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, G, R, L]
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bgrls,bsgd->blgrd", p, v.astype(jnp.float32), precision=hi).reshape(B, L, H, D)
    return o.astype(q.dtype), lse.reshape(B, H, L)


# ---------------------------------------------------------------- public API


def flash_attention(q, k, v, *, causal: bool = True, segment_ids=None, sliding_window: int | None = None,
                    interpret: bool | None = None, block_sizes=None,
                    return_lse: bool = False, backend: str = "triton"):
    """Flash attention; q `[B, L, H, D]`, k/v `[B, L, KV, D]` -> `[B, L, H, D]` in q's dtype.

    `segment_ids` `[B, L]` (or a `(q_segment_ids, kv_segment_ids)` pair) restricts attention to
    equal ids (packed documents); `sliding_window=w` keeps keys with i - j < w. `interpret`: None
    picks the Pallas interpreter when the devices compiled for are not GPUs. With `return_lse` also
    returns the natural log-sum-exp of the scores `[B, H, L]` (float32, differentiable).
    `backend`: "triton" (Pallas' Triton lowering, any NVIDIA GPU) or "mosaic" (Pallas' Mosaic GPU
    lowering for Hopper, `kernels/flash_hopper.py`: bf16/f16). `block_sizes`: the tiles, a
    `BlockSizes` for "triton", a `flash_hopper.HopperBlocks` for "mosaic" (default: per head dim).
    Bad shapes, head dims or settings raise `ConfigError` (a `ValueError`) with one line."""
    q_seg, k_seg = _check_inputs(q, k, v, segment_ids, sliding_window)
    B, L, H, D = q.shape
    interpret = _resolve_interpret(interpret)
    if backend == "mosaic":
        from maxtrain.kernels import flash_hopper
        if block_sizes is not None and not isinstance(block_sizes, flash_hopper.HopperBlocks):
            raise ConfigError("flash_attention: block_sizes for backend='mosaic' are a flash_hopper.HopperBlocks "
                              f"(key block, dK/dV query block, stages), got {type(block_sizes).__name__}")
        blocks = (block_sizes or flash_hopper.HopperBlocks.for_head_dim(D)).check(D)
        flash_hopper.check_supported(q, causal=bool(causal), interpret=interpret)
        padded = _round_up(L, blocks.cta_rows)  # a multiple of k and bwd_q too (64 or 128)
    elif backend == "triton":
        if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
            raise ConfigError("flash_attention: block_sizes for backend='triton' are a BlockSizes, "
                              f"got {type(block_sizes).__name__}")
        blocks = _fit_blocks(block_sizes or default_block_sizes(D), L)
        padded = _round_up(L, max(blocks.all()))
    else:
        raise ConfigError(f"flash_attention: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    st = _Static(length=L, padded=padded, causal=bool(causal), window=sliding_window,
                 segmented=q_seg is not None, group=H // k.shape[2], scale=D ** -0.5, blocks=blocks,
                 interpret=interpret, num_warps=8, num_stages=2, backend=backend)
    o, lse = _padded_call(q, k, v, q_seg, k_seg, st)
    return (o, lse) if return_lse else o


def default_block_sizes(head_dim: int) -> BlockSizes:
    """Tile sizes for an H100-class GPU. Not timed on hardware yet; chosen so that every kernel
    compiles for sm_90 without register spills (`bench/triton_lowering.py`): at head dim 128 the
    dK/dV kernel keeps two [bwd_k, 128] float32 accumulators plus K and V, so its query tile is 32."""
    return BlockSizes(128, 64, 32, 64) if head_dim > 64 else BlockSizes(128, 64, 64, 64)


def _resolve_interpret(interpret: bool | None) -> bool:
    gpu = on_gpu()  # the context mesh's devices: compiling for GPU targets counts as a GPU
    if interpret is None:
        return not gpu
    if not interpret and not gpu:
        raise ConfigError(f"flash_attention(interpret=False) needs a GPU (backend is {jax.default_backend()}); "
                          "pass interpret=True or None")
    return bool(interpret)


def _check_inputs(q, k, v, segment_ids, sliding_window):
    """One-line `ConfigError`s for inputs the kernel cannot take; returns (q_seg, kv_seg)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ConfigError(f"flash_attention: q, k, v must be [batch, length, heads, head_dim], got shapes "
                          f"{q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ConfigError(f"flash_attention: k and v shapes differ: {k.shape} vs {v.shape}")
    B, L, H, D = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, L, D):
        raise ConfigError(f"flash_attention: k/v shape {k.shape} does not match q shape {q.shape} "
                          "in batch, length or head_dim")
    if H % k.shape[2]:
        raise ConfigError(f"flash_attention: kv_heads={k.shape[2]} does not divide heads={H}; "
                          "grouped-query attention needs heads to be a multiple of kv_heads")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ConfigError(f"flash_attention: head_dim={D} is not supported; use one of "
                          f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))} (model.head_dim)")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ConfigError(f"flash_attention: q, k, v need one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ConfigError(f"flash_attention: sliding_window must be a positive integer or None, got {sliding_window!r}")
    if segment_ids is None:
        return None, None
    q_seg, k_seg = _split_segments(segment_ids)
    for name, s in (("segment_ids", q_seg), ("kv_segment_ids", k_seg)):
        if s.shape != (B, L) or not jnp.issubdtype(s.dtype, jnp.integer):
            raise ConfigError(f"flash_attention: {name} must be integer [batch, length] = {(B, L)}, "
                              f"got {s.dtype}{list(s.shape)}")
    return q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)


def _split_segments(segment_ids):
    if isinstance(segment_ids, (tuple, list)):
        return segment_ids[0], segment_ids[1]
    return segment_ids, segment_ids


def _fit_blocks(blocks: BlockSizes, length: int) -> BlockSizes:
    """Blocks no larger than the (power-of-two rounded) length; validates user-given sizes."""
    for b in blocks.all():
        if b < 16 or b & (b - 1):
            raise ConfigError(f"flash_attention: block sizes must be powers of two >= 16, got {blocks}")
    cap = max(16, pl.next_power_of_2(length))
    return BlockSizes(*(min(b, cap) for b in blocks.all()))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.partial(jax.jit, static_argnums=(5,))
def _padded_call(q, k, v, q_seg, k_seg, st: _Static):
    """Pads the length to the block multiple, runs the kernels, slices the padding off again."""
    pad = st.padded - st.length

    def grow(x, value=0):
        if x is None or pad == 0:
            return x
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, pad)
        return jnp.pad(x, widths, constant_values=value)

    o, lse2 = _flash(grow(q), grow(k), grow(v), grow(q_seg, -1), grow(k_seg, -1), st)
    return o[:, :st.length], lse2[:, :, :st.length] * LN2


# ---------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, k_seg, st: _Static):
    return _forward(q, k, v, q_seg, k_seg, st)


def _flash_fwd(q, k, v, q_seg, k_seg, st):
    o, lse2 = _forward(q, k, v, q_seg, k_seg, st)
    # named, so a remat policy can keep them (`model.remat: save_dots`) and spare the backward
    # pass a second run of the forward kernel
    o, lse2 = checkpoint_name(o, RESIDUAL_NAMES[0]), checkpoint_name(lse2, RESIDUAL_NAMES[1])
    return (o, lse2), (q, k, v, q_seg, k_seg, o, lse2)


def _flash_bwd(st, res, cts):
    q, k, v, q_seg, k_seg, o, lse2 = res
    do, dlse2 = cts
    # delta_i = sum_d dO_id O_id, the row term of the softmax backward: dS = P * (dP - delta).
    # The lse output's cotangent adds P_ij * log2(e) * dlse2_i (lse2 = log2(e) * lse), which is
    # the same as subtracting it from delta; zero unless the caller differentiates the lse.
    delta = jnp.einsum("blhd,blhd->bhl", o.astype(jnp.float32), do.astype(jnp.float32))
    delta = delta - dlse2.astype(jnp.float32) * LOG2E
    dq = _backward_dq(q, k, v, q_seg, k_seg, do, lse2, delta, st)
    dk, dv = _backward_dkdv(q, k, v, q_seg, k_seg, do, lse2, delta, st)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------- kernel helpers


def _dot(a, b, contract_a: int, contract_b: int):
    """2-D matmul with float32 accumulation; contracting dims pick a/b transposes (Triton-lowerable)."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


def _loop(ranges, body, carry):
    """Runs `body(j, carry, masked)` over the masked, unmasked, masked parts of `ranges`."""
    lo, b, c, hi = ranges
    carry = lax.fori_loop(lo, b, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(b, c, functools.partial(body, masked=False), carry)
    return lax.fori_loop(c, hi, functools.partial(body, masked=True), carry)


def _block_order(n: int, reverse: bool):
    """Program index -> block index. Causal query blocks run last-first: the long ones start early."""
    if reverse:
        return lambda p: n - 1 - p
    return lambda p: p


def _compiler_params(st: _Static, num_stages: int | None = None):
    if st.interpret or plgpu is None:
        return None
    return plgpu.CompilerParams(num_warps=st.num_warps, num_stages=num_stages or st.num_stages)


def _spec(block_shape, index_map):
    return pl.BlockSpec(tuple(_SQ if b is None else b for b in block_shape), index_map)


# ---------------------------------------------------------------- forward


def _forward_kernel(*refs, st: _Static, order):
    if st.segmented:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
        qs_ref = ks_ref = None
    bq, bk = st.blocks.q, st.blocks.k
    D = q_ref.shape[-1]
    i = order(pl.program_id(0))
    q = q_ref[...]
    q_seg = None if qs_ref is None else qs_ref[...]
    rows = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
    c2 = st.scale * LOG2E  # scores in log2 units: exp2 is the hardware's native exponential

    def body(j, carry, masked):
        o, m, l = carry
        keys = pl.ds(j * bk, bk)
        k = k_ref[keys, :]
        s = _dot(q, k, 1, 1) * c2  # [bq, bk]
        mask = None
        if masked:
            cols = j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
            mask = _mask(rows, cols, q_seg, None if ks_ref is None else ks_ref[keys], st, (bq, bk))
        if mask is not None:
            s = jnp.where(mask, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)  # a row masked so far has m_new = NEG: exp2(0) must not count
        alpha = jnp.exp2(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        v = v_ref[keys, :]
        o = alpha[:, None] * o + _dot(p.astype(v.dtype), v, 1, 0)
        return o, m_new, l

    carry = (jnp.zeros((bq, D), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    o, m, l = _loop(_q_major_ranges(i, bq, bk, st), body, carry)
    # A row that saw no key (only padded rows can) gets output 0 and lse = +BIG, so that the
    # backward's exp2(s - lse) is 0 for it whether or not its block applies the mask.
    empty = l == 0.0
    l = jnp.where(empty, 1.0, l)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -NEG, m + jnp.log2(l))


def _hopper(st: _Static):
    """kernels/flash_hopper.py and its tiles, when `st` asks for the Mosaic GPU backend."""
    if st.backend != "mosaic":
        return None, None
    from maxtrain.kernels import flash_hopper
    return flash_hopper, st.blocks


def _forward(q, k, v, q_seg, k_seg, st: _Static):
    B, Lp, H, D = q.shape
    hopper, hb = _hopper(st)
    if hopper is not None:
        return hopper.forward(q, k, v, q_seg, k_seg, st, blocks=hb)
    bq = st.blocks.q
    n_q = Lp // bq
    order = _block_order(n_q, st.causal)
    R = st.group
    in_specs = [
        _spec((None, bq, None, D), lambda i, b, h: (b, order(i), h, 0)),
        _spec((None, Lp, None, D), lambda i, b, h: (b, 0, lax.div(h, R), 0)),  # GQA: KV head of h
        _spec((None, Lp, None, D), lambda i, b, h: (b, 0, lax.div(h, R), 0)),
    ]
    args = [q, k, v]
    if st.segmented:
        in_specs += [_spec((None, bq), lambda i, b, h: (b, order(i))), _spec((None, Lp), lambda i, b, h: (b, 0))]
        args += [q_seg, k_seg]
    return pl.pallas_call(
        functools.partial(_forward_kernel, st=st, order=order),
        grid=(n_q, B, H),
        in_specs=in_specs,
        out_specs=[_spec((None, bq, None, D), lambda i, b, h: (b, order(i), h, 0)),
                   _spec((None, None, bq), lambda i, b, h: (b, h, order(i)))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, Lp), jnp.float32)],
        compiler_params=_compiler_params(st, num_stages=3),
        interpret=st.interpret,
        name="flash_attention_fwd",
    )(*args)


# ---------------------------------------------------------------- backward: dQ


def _dq_kernel(*refs, st: _Static, order):
    if st.segmented:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
        qs_ref = ks_ref = None
    bq, bk = st.blocks.bwd_q, st.blocks.bwd_k
    D = q_ref.shape[-1]
    i = order(pl.program_id(0))
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...][:, None]
    delta = delta_ref[...][:, None]
    q_seg = None if qs_ref is None else qs_ref[...]
    rows = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
    c2 = st.scale * LOG2E

    def body(j, dq, masked):
        keys = pl.ds(j * bk, bk)
        k = k_ref[keys, :]
        v = v_ref[keys, :]
        p = jnp.exp2(_dot(q, k, 1, 1) * c2 - lse)  # [bq, bk], the forward's probabilities
        if masked:
            cols = j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
            mask = _mask(rows, cols, q_seg, None if ks_ref is None else ks_ref[keys], st, (bq, bk))
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
        ds = p * (_dot(do, v, 1, 1) - delta)
        return dq + _dot(ds.astype(k.dtype), k, 1, 0)

    dq = _loop(_q_major_ranges(i, bq, bk, st), body, jnp.zeros((bq, D), jnp.float32))
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _backward_dq(q, k, v, q_seg, k_seg, do, lse2, delta, st: _Static):
    B, Lp, H, D = q.shape
    hopper, hb = _hopper(st)
    if hopper is not None:
        return hopper.backward_dq(q, k, v, q_seg, k_seg, do, lse2, delta, st, blocks=hb)
    bq = st.blocks.bwd_q
    n_q = Lp // bq
    order = _block_order(n_q, st.causal)
    R = st.group
    q_block = _spec((None, bq, None, D), lambda i, b, h: (b, order(i), h, 0))
    kv_full = _spec((None, Lp, None, D), lambda i, b, h: (b, 0, lax.div(h, R), 0))
    row_block = _spec((None, None, bq), lambda i, b, h: (b, h, order(i)))
    in_specs = [q_block, kv_full, kv_full]
    args = [q, k, v]
    if st.segmented:
        in_specs += [_spec((None, bq), lambda i, b, h: (b, order(i))), _spec((None, Lp), lambda i, b, h: (b, 0))]
        args += [q_seg, k_seg]
    in_specs += [q_block, row_block, row_block]
    args += [do, lse2, delta]
    return pl.pallas_call(
        functools.partial(_dq_kernel, st=st, order=order),
        grid=(n_q, B, H),
        in_specs=in_specs,
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(st),
        interpret=st.interpret,
        name="flash_attention_bwd_dq",
    )(*args)


# ---------------------------------------------------------------- backward: dK, dV


def _dkdv_kernel(*refs, st: _Static):
    if st.segmented:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
        qs_ref = ks_ref = None
    bq, bk = st.blocks.bwd_q, st.blocks.bwd_k
    D = k_ref.shape[-1]
    j = pl.program_id(0)
    k = k_ref[...]
    v = v_ref[...]
    k_seg = None if ks_ref is None else ks_ref[...]
    cols = j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
    c2 = st.scale * LOG2E
    ranges = _kv_major_ranges(j, bq, bk, st)

    def head(r, carry):  # every query head of this KV head's group adds into the same dK/dV
        def body(i, carry, masked):
            dk, dv = carry
            rows_ds = pl.ds(i * bq, bq)
            q = q_ref[rows_ds, r, :]
            do = do_ref[rows_ds, r, :]
            p = jnp.exp2(_dot(q, k, 1, 1) * c2 - lse_ref[r, rows_ds][:, None])  # [bq, bk]
            if masked:
                rows = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
                mask = _mask(rows, cols, None if qs_ref is None else qs_ref[rows_ds], k_seg, st, (bq, bk))
                if mask is not None:
                    p = jnp.where(mask, p, 0.0)
            dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
            ds = p * (_dot(do, v, 1, 1) - delta_ref[r, rows_ds][:, None])
            dk = dk + _dot(ds.astype(q.dtype), q, 0, 0)
            return dk, dv

        return _loop(ranges, body, carry)

    zeros = jnp.zeros((bk, D), jnp.float32)
    dk, dv = lax.fori_loop(0, st.group, head, (zeros, zeros))
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward_dkdv(q, k, v, q_seg, k_seg, do, lse2, delta, st: _Static):
    B, Lp, H, D = q.shape
    hopper, hb = _hopper(st)
    if hopper is not None:
        return hopper.backward_dkdv(q, k, v, q_seg, k_seg, do, lse2, delta, st, blocks=hb)
    KV = k.shape[2]
    bk = st.blocks.bwd_k
    R = st.group
    kv_block = _spec((None, bk, None, D), lambda j, b, g: (b, j, g, 0))
    q_group = _spec((None, Lp, R, D), lambda j, b, g: (b, 0, g, 0))  # the R query heads of KV head g
    row_group = _spec((None, R, Lp), lambda j, b, g: (b, g, 0))
    in_specs = [q_group, kv_block, kv_block]
    args = [q, k, v]
    if st.segmented:
        in_specs += [_spec((None, Lp), lambda j, b, g: (b, 0)), _spec((None, bk), lambda j, b, g: (b, j))]
        args += [q_seg, k_seg]
    in_specs += [q_group, row_group, row_group]
    args += [do, lse2, delta]
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st),
        grid=(Lp // bk, B, KV),
        in_specs=in_specs,
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(st),
        interpret=st.interpret,
        name="flash_attention_bwd_dkdv",
    )(*args)
