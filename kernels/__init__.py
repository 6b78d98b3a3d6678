"""Custom kernels (Pallas, jax-triton), each beside its plain-JAX reference.

Installed as `maxtrain.kernels` (pyproject/setup.py map this top-level `kernels/` directory onto
that package name). Everything here imports on a CPU-only machine; GPU-only modules (jax-triton)
are imported lazily inside the functions that use them, and the package itself loads a kernel
module only when one of its names is first used (`maxtrain.kernels.residuals` stays light).
"""

import importlib

__all__ = ["BlockSizes", "HopperBlocks", "flash_attention", "reference_attention"]
_HOME = {"BlockSizes": "flash", "flash_attention": "flash", "reference_attention": "flash",
         "HopperBlocks": "flash_hopper"}


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module 'maxtrain.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"maxtrain.kernels.{_HOME[name]}"), name)
    globals()[name] = value
    return value
