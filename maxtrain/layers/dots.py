"""Matrix products in the compute dtype, written the way the target's compiler runs them fastest.

On GPUs a `bf16 x bf16 -> bf16` einsum is one cuBLAS GEMM that accumulates in float32, whatever
the operands' layouts. XLA:CPU (jax 0.10-0.11) runs a bf16 dot natively, through YNNPACK, only
when it returns float32 and both operands contract their inner (last / first) dimension; any other
bf16 dot it converts to a float32 dot, operands and all (`[4096, 512] x [512, 1536]` on the 2-core
AMD EPYC test machine: 16 ms as `bf16 x bf16 -> bf16`, 7.7 ms as `-> float32` then rounded, 12.7 ms
in float32; `python bench/cpu_efficiency.py --dots`). It has no float16 dot kernels: float16 dots
always run in float32. So on CPU a bf16 projection asks for a float32 result and rounds it to
bf16 itself (the same values: float32 accumulation, one rounding), and `maxtrain.loss`'s onepass
loop hoists the transposes its backward products need out of the loop (`hoist_transposes`).

The backward products of a projection (`dx = g w^T`, `dw = x^T g`) contract a transposed operand
and stay float32 dots on CPU, as they were before: forcing a transposed copy the compiler cannot
fold back needs a loop boundary, which the layer scan's backward does not have. Their incoming
gradient is the float32 cotangent of the rounding (the bf16 gradient converted, exactly), which
the float32 dot would have converted anyway. With `model.remat: save_dots` the saved projection
outputs are the float32 products (the rounding is recomputed): on CPU that policy keeps twice the
bytes per saved projection.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxtrain.targets import traced_platform


def _bf16(*arrays) -> bool:
    """All operands bf16: XLA:CPU's YNNPACK has bf16 dot kernels, not float16 ones (an f16 dot
    converts to float32 whatever it returns)."""
    return all(a.dtype == jnp.bfloat16 for a in arrays)


def float32_results() -> bool:
    """Whether bf16 dots should return float32 (rounded after) on the target: XLA:CPU's native path."""
    return traced_platform() == "cpu"


def hoist_transposes(dtype) -> bool:
    """Whether a loop that multiplies by `w` and by `w^T` should be handed `w^T` as its own array:
    bf16 operands on CPU (each dot then contracts inner dimensions and runs natively). On GPUs
    the copy would only cost memory; in float32 it measured slower (docs/performance.md)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and float32_results()


def _rounded(product, x, w):
    """`product(**kw)` of x and w; on CPU with bf16 operands asked for float32, then rounded once."""
    if _bf16(x, w) and float32_results():
        return product(preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return product()


def einsum(eq: str, x, w):
    """`jnp.einsum(eq, x, w)`; on CPU, bf16 operands multiply into float32, then round once."""
    return _rounded(functools.partial(jnp.einsum, eq, x, w), x, w)


def ragged_dot(x, w, group_sizes):
    """`lax.ragged_dot(x, w, group_sizes)` (grouped experts), written as `einsum` is."""
    return _rounded(functools.partial(jax.lax.ragged_dot, x, w, group_sizes), x, w)
