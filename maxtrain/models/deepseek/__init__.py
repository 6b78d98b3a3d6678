"""The DeepSeek-V3 family (`model.name: deepseek`): multi-head latent attention, fine-grained
experts with shared experts and auxiliary-loss-free balancing, multi-token prediction.

- `family.py`: registers the family (loaded on first use)
- `config.py`: its config class (`model.mla`, `model.mtp`; no jax, registered here when
  `maxtrain.models` is imported)
- `model.py`: the layered model
- `hf.py`: its Hugging Face conversion (`deepseek_v3`)
- `decode.py`: its KV-cached decoder (the latent cache of MLA)
"""

import importlib
import warnings

from maxtrain.config import register_model_config
from maxtrain.models import catalog
from maxtrain.models.deepseek.config import DeepSeekConfig

NAME = "deepseek"
catalog.declare(NAME, "maxtrain.models.deepseek.family")
register_model_config(NAME, DeepSeekConfig)

# The model's functions were this module's before the family became a folder (issue 42): they still
# resolve here, with a DeprecationWarning naming their module now.
_MOVED = {
    "param_specs": "maxtrain.models.deepseek.model",
    "mla_out": "maxtrain.models.deepseek.model",
    "dense_layer": "maxtrain.models.deepseek.model",
    "moe_layer": "maxtrain.models.deepseek.model",
    "embed": "maxtrain.models.deepseek.model",
    "layer": "maxtrain.models.deepseek.model",
    "final": "maxtrain.models.deepseek.model",
    "mtp_positions": "maxtrain.models.deepseek.model",
    "mtp_loss": "maxtrain.models.deepseek.model",
    "head": "maxtrain.models.deepseek.model",
    "balance": "maxtrain.models.deepseek.model",
    "active_params": "maxtrain.models.deepseek.model",
    "flops_per_token": "maxtrain.models.deepseek.model",
}


def __getattr__(name):
    if name not in _MOVED:
        raise AttributeError(f"module 'maxtrain.models.deepseek' has no attribute {name!r}")
    warnings.warn(f"maxtrain.models.deepseek.{name} is now {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
