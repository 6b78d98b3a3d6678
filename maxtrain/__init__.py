"""maxtrain: a JAX/XLA compiler-driven trainer for large language models.

`maxtrain.config` (and so `maxtrain --help`, config errors, `maxtrain report`) imports no jax:
the names that need it (`train`, `forward`, `load_checkpoint`, `configure_logging`) are
imported on first use (PEP 562's module `__getattr__`).
"""

import importlib

from maxtrain.config import Config, ConfigError, load_config
import maxtrain.models  # noqa: E402,F401  (the built-in families' config classes: `model.name` reads them; no jax)

__all__ = ["Config", "ConfigError", "load_config", "train", "forward", "load_checkpoint", "configure_logging"]
__version__ = "0.1.0"

# name -> the module that owns it
_LAZY = {"train": "maxtrain.run", "forward": "maxtrain.step", "load_checkpoint": "maxtrain.checkpoint",
         "configure_logging": "maxtrain.cli"}


def __getattr__(name):  # only for names not set yet
    if name not in _LAZY:
        raise AttributeError(f"module 'maxtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
