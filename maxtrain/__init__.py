"""maxtrain: a JAX/XLA compiler-driven trainer for large language models.

`maxtrain.config` (and so `maxtrain --help`, config errors, `maxtrain report`) imports no jax:
the names that need it (`train`, `forward`, `load_checkpoint`) are imported on first use.
"""

import importlib
import sys
import types

from maxtrain.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config", "train", "forward", "load_checkpoint", "configure_logging"]
__version__ = "0.1.0"

_LAZY = {"train": "maxtrain.train", "forward": "maxtrain.train", "load_checkpoint": "maxtrain.checkpoint",
         "configure_logging": "maxtrain.cli"}


class _Package(types.ModuleType):
    def __getattr__(self, name):  # only for names not set yet
        if name not in _LAZY:
            raise AttributeError(f"module 'maxtrain' has no attribute {name!r}")
        value = getattr(importlib.import_module(_LAZY[name]), name)
        types.ModuleType.__setattr__(self, name, value)
        return value

    def __setattr__(self, name, value):
        if name == "train" and isinstance(value, types.ModuleType):
            return  # importing the submodule binds it here; `maxtrain.train` stays the function
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
