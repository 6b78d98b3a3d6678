"""maxtrain: a JAX/XLA compiler-driven trainer for large language models."""

from maxtrain.checkpoint import load_checkpoint
from maxtrain.config import Config, ConfigError, load_config
from maxtrain.train import forward, train

__all__ = ["Config", "ConfigError", "load_config", "train", "forward", "load_checkpoint"]
__version__ = "0.1.0"
