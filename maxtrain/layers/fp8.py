"""FP8 projections with current scaling (issue 24, first part: the matmul; not yet wired into a model).

`fp8_project(x, w, n, recipe)` contracts the last `n` dimensions of `x` with the first `n` of `w`
(every projection of the model has this form: `bld,dhk->blhk`, `blhk,hkd->bld`, `blf,fd->bld`)
as one `[M, K] @ [K, N]` GEMM in FP8, forward and backward:

- forward `y = x @ w`: both operands in `float8_e4m3fn`;
- backward, by a custom VJP, `dx = g @ w^T` and `dw = x^T @ g`: the incoming gradient `g` in
  `float8_e5m2` (its range, not its precision, is what gradients need), the saved `x` and `w`
  re-quantized for each GEMM;
- accumulation in float32 (`preferred_element_type`), the result scaled back and cast to `x`'s
  dtype.

Scaling is current (from this tensor's absolute maximum, no state): `tensorwise` takes one scale
per operand; `rowwise` one per row of the left operand and per column of the right one, i.e.
along each GEMM's contracting dimension, so every GEMM quantizes its operands again along the
dimension it sums over (the saved high-precision `x` and `w` make that possible). A scale maps
the amax to the format's largest finite value; values beyond it saturate, values below the
smallest subnormal flush to zero. `fp8_project_reference` is the same arithmetic written plainly
(quantise, dequantise, float32 dot) that the tests compare against.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # activations and weights: more precision
E5M2 = jnp.float8_e5m2  # gradients: more range
RECIPES = ("tensorwise", "rowwise")


def quantize(x, dtype, axis: int | None):
    """`(q, scale)` with `q * scale ~ x`, `q` in the FP8 `dtype`: one scale for the whole tensor
    (`axis=None`) or one per slice along `axis` (the amax taken over that axis)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32)) if axis is None else jnp.max(jnp.abs(x32), axis=axis, keepdims=True)
    fmax = float(jnp.finfo(dtype).max)
    scale = jnp.where(amax > 0, amax / fmax, 1.0)
    q = jnp.clip(x32 / scale, -fmax, fmax).astype(dtype)
    return q, scale


def _gemm(a, b, a_dtype, b_dtype, rowwise: bool):
    """`a [M, K] @ b [K, N]` in FP8 with float32 accumulation, scaled back: float32 `[M, N]`."""
    qa, sa = quantize(a, a_dtype, 1 if rowwise else None)
    qb, sb = quantize(b, b_dtype, 0 if rowwise else None)
    return jax.lax.dot(qa, qb, preferred_element_type=jnp.float32) * sa * sb


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_matmul(x_MK, w_KN, rowwise: bool):
    """`x @ w` as an FP8 GEMM, its backward GEMMs FP8 too (see the module docstring)."""
    return _gemm(x_MK, w_KN, E4M3, E4M3, rowwise).astype(x_MK.dtype)


def _fwd(x_MK, w_KN, rowwise):
    return fp8_matmul(x_MK, w_KN, rowwise), (x_MK, w_KN)


def _bwd(rowwise, res, g_MN):
    x_MK, w_KN = res
    dx = _gemm(g_MN, w_KN.T, E5M2, E4M3, rowwise).astype(x_MK.dtype)
    dw = _gemm(x_MK.T, g_MN, E4M3, E5M2, rowwise).astype(w_KN.dtype)
    return dx, dw


fp8_matmul.defvjp(_fwd, _bwd)


def _as_matrices(x, w, n: int):
    lead, inner = x.shape[:x.ndim - n], x.shape[x.ndim - n:]
    if w.shape[:n] != inner:
        raise ValueError(f"fp8_project: x's last {n} dims {inner} do not match w's first {w.shape[:n]}")
    K = math.prod(inner)
    return x.reshape(-1, K), w.reshape(K, -1), lead, w.shape[n:]


def fp8_project(x, w, n: int = 1, recipe: str = "tensorwise"):
    """`x` contracted over its last `n` dims with `w`'s first `n`, as one FP8 GEMM (`recipe`:
    tensorwise or rowwise current scaling); the result has `x`'s leading and `w`'s trailing dims."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}: choose one of {', '.join(RECIPES)}")
    x2, w2, lead, tail = _as_matrices(x, w, n)
    return fp8_matmul(x2, w2, recipe == "rowwise").reshape(lead + tail)


def fp8_project_reference(x, w, n: int = 1, recipe: str = "tensorwise"):
    """The forward of `fp8_project` written plainly: quantise, dequantise, a float32 dot."""
    x2, w2, lead, tail = _as_matrices(x, w, n)
    rowwise = recipe == "rowwise"
    qx, sx = quantize(x2, E4M3, 1 if rowwise else None)
    qw, sw = quantize(w2, E4M3, 0 if rowwise else None)
    y = (qx.astype(jnp.float32) * sx) @ (qw.astype(jnp.float32) * sw)
    return y.astype(x.dtype).reshape(lead + tail)
