"""Matrix products in the compute dtype, written the way the target's compiler runs them fastest.

On GPUs a `bf16 x bf16 -> bf16` einsum is one cuBLAS GEMM that accumulates in float32, whatever
the operands' layouts. XLA:CPU (jax 0.10-0.11) runs a 16-bit dot natively, through YNNPACK, only
when it returns float32 and both operands contract their inner (last / first) dimension; any other
16-bit dot it converts to a float32 dot, operands and all (`[4096, 512] x [512, 1536]` on the
2-core AMD EPYC test machine: 16 ms as `bf16 x bf16 -> bf16`, 7.7 ms as `-> float32` then rounded,
12.7 ms in float32; `python bench/cpu_efficiency.py --dots`). So on
CPU a projection asks for a float32 result and rounds it to the compute dtype itself (the same
values: float32 accumulation, one rounding), and `maxtrain.loss`'s onepass loop hoists the
transposes its backward products need out of the loop (`hoist_transposes`).

The backward products of a projection (`dx = g w^T`, `dw = x^T g`) contract a transposed operand
and stay float32 dots on CPU: forcing a transposed copy the compiler cannot fold back needs a
loop boundary, which the layer scan's backward does not have.
"""

from __future__ import annotations

import jax.numpy as jnp

from maxtrain.targets import traced_platform

NARROW = (jnp.bfloat16, jnp.float16)


def _narrow(dtype) -> bool:
    return any(jnp.dtype(dtype) == jnp.dtype(d) for d in NARROW)


def float32_results() -> bool:
    """Whether 16-bit dots should return float32 (rounded after) on the target: XLA:CPU's native path."""
    return traced_platform() == "cpu"


def hoist_transposes(dtype) -> bool:
    """Whether a loop that multiplies by `w` and by `w^T` should be handed `w^T` as its own array:
    16-bit operands on CPU (each dot then contracts inner dimensions and runs natively). On GPUs
    the copy would only cost memory."""
    return _narrow(dtype) and float32_results()


def einsum(eq: str, x, w):
    """`jnp.einsum(eq, x, w)` in x's dtype; on CPU, 16-bit operands multiply into float32 first."""
    if _narrow(x.dtype) and float32_results():
        return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum(eq, x, w)
