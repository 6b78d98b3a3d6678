"""The llama family (`model.name: llama`): Llama 2 and 3, Mistral, Qwen3, and their mixtures of
experts (Mixtral, Qwen3-MoE).

- `family.py`: registers the family (loaded on first use)
- `config.py`: its config class (no jax, registered here when `maxtrain.models` is imported)
- `model.py`: the layered model (`param_specs`, `embed`, `layer`, `final`, `head`)
- `hf.py`: its Hugging Face conversion (config.json and tensor names, both ways)
- `decode.py`: its KV-cached decoder (`maxtrain generate`, `train.sample_every`)
"""

import importlib
import warnings

from maxtrain.config import register_model_config
from maxtrain.models import catalog
from maxtrain.models.llama.config import LlamaConfig

NAME = "llama"
catalog.declare(NAME, "maxtrain.models.llama.family")
register_model_config(NAME, LlamaConfig, default=True)

# The model's functions were this module's before the family became a folder (issue 42): they still
# resolve here, with a DeprecationWarning naming their module now.
_MOVED = {
    "param_specs": "maxtrain.models.llama.model",
    "sublayer": "maxtrain.models.llama.model",
    "embed": "maxtrain.models.llama.model",
    "layer": "maxtrain.models.llama.model",
    "final": "maxtrain.models.llama.model",
    "head": "maxtrain.models.llama.model",
    "flops_per_token": "maxtrain.models.llama.model",
}


def __getattr__(name):
    if name not in _MOVED:
        raise AttributeError(f"module 'maxtrain.models.llama' has no attribute {name!r}")
    warnings.warn(f"maxtrain.models.llama.{name} is now {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
