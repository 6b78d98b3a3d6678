"""The RMSNorm forward as a `triton.jit` kernel called through `jax_triton.triton_call`.

Imported only on a GPU (by `maxtrain.kernels.rms_norm`), since `triton` and `jax_triton` exist only
there; the Pallas kernel in `rms_norm.py` is the same computation and the fallback. One program
normalises `BLOCK_ROWS` rows of width `D` (a power of two, whole rows in registers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax_triton as jt
import triton
import triton.language as tl


@triton.jit
def _normalise_rows(h, w_ptr, y_ptr, rstd_ptr, rows, offs, D: tl.constexpr, EPS: tl.constexpr):
    """h `[BLOCK_ROWS, D]` float32 -> y = h * rstd * w stored at offs; rstd stored per row."""
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + EPS)
    w = tl.load(w_ptr + tl.arange(0, D)).to(tl.float32)
    y = h * rstd[:, None] * w[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty))
    tl.store(rstd_ptr + rows, rstd)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, D: tl.constexpr, EPS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    h = tl.load(x_ptr + offs).to(tl.float32)
    _normalise_rows(h, w_ptr, y_ptr, rstd_ptr, rows, offs, D, EPS)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, D: tl.constexpr, EPS: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    h = tl.load(x_ptr + offs).to(tl.float32) + tl.load(r_ptr + offs).to(tl.float32)
    h = h.to(h_ptr.dtype.element_ty)  # the residual stream in x's dtype, normalised as stored
    tl.store(h_ptr + offs, h)
    _normalise_rows(h.to(tl.float32), w_ptr, y_ptr, rstd_ptr, rows, offs, D, EPS)


def forward(x, r, scale, *, eps: float, block_rows: int):
    """(y, h or None, rstd) for x `[N, D]` with N a multiple of block_rows (the caller pads)."""
    N, D = x.shape
    y = jax.ShapeDtypeStruct((N, D), x.dtype)
    rstd = jax.ShapeDtypeStruct((N,), jnp.float32)
    common = dict(grid=(N // block_rows,), num_warps=4 if D <= 4096 else 8, num_stages=1,
                  D=D, EPS=eps, BLOCK_ROWS=block_rows)
    if r is None:
        out, inv = jt.triton_call(x, scale, kernel=_rms_norm_kernel, out_shape=[y, rstd], name="rms_norm", **common)
        return out, None, inv
    out, h, inv = jt.triton_call(x, r, scale, kernel=_add_rms_norm_kernel, out_shape=[y, y, rstd],
                                 name="add_rms_norm", **common)
    return out, h, inv
