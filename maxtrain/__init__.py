"""maxtrain: a JAX/XLA compiler-driven trainer for large language models."""

from maxtrain.config import Config, ConfigError, load_config
from maxtrain.train import forward, train

__all__ = ["Config", "ConfigError", "load_config", "train", "forward"]
__version__ = "0.1.0"
