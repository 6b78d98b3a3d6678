"""Custom kernels (Pallas, jax-triton), each beside its plain-JAX reference.

Installed as `maxtrain.kernels` (pyproject/setup.py map this top-level `kernels/` directory onto
that package name). Everything here imports on a CPU-only machine; GPU-only modules (jax-triton)
are imported lazily inside the functions that use them, and the package itself loads a kernel
module only when one of its names is first used (`maxtrain.kernels.residuals` stays light).
"""

import importlib
import os
import sys


def _give_way() -> None:
    """Imported as a top-level `kernels` (Python started in the checkout's root, which comes first on
    `sys.path`): this directory is `maxtrain.kernels`, never `kernels`, so load the installed
    distribution of that name (Hugging Face's, which transformers imports) in its place."""
    from importlib import machinery, util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = machinery.PathFinder.find_spec(__name__, path)
    if spec is None:
        del sys.modules[__name__]
        raise ModuleNotFoundError(f"No module named {__name__!r} (this checkout's kernels/ directory is "
                                  f"maxtrain.kernels)", name=__name__)
    module = util.module_from_spec(spec)
    sys.modules[__name__] = module  # the import statement returns what sys.modules holds after this file
    spec.loader.exec_module(module)


if __name__ != "maxtrain.kernels":
    _give_way()

__all__ = ["BlockSizes", "HopperBlocks", "flash_attention", "reference_attention"]
_HOME = {"BlockSizes": "flash", "flash_attention": "flash", "reference_attention": "flash",
         "HopperBlocks": "flash_hopper"}


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module 'maxtrain.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"maxtrain.kernels.{_HOME[name]}"), name)
    globals()[name] = value
    return value
