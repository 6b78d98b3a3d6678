"""Custom kernels (Pallas, jax-triton), each beside its plain-JAX reference.

Installed as `maxtrain.kernels` (pyproject/setup.py map this top-level `kernels/` directory onto
that package name). Everything here imports on a CPU-only machine; GPU-only modules (jax-triton)
are imported lazily inside the functions that use them.
"""

from maxtrain.kernels.flash import BlockSizes, flash_attention, reference_attention
from maxtrain.kernels.flash_hopper import HopperBlocks

__all__ = ["BlockSizes", "HopperBlocks", "flash_attention", "reference_attention"]
