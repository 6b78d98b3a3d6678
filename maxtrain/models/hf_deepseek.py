"""Deprecated: the deepseek family's Hugging Face mapping is `maxtrain.models.deepseek.hf` (issue 42).
The old names resolve here, with a DeprecationWarning."""

import importlib
import warnings

_MOVED = {
    "model_config_from_hf": "maxtrain.models.deepseek.hf", "hf_config_from_model": "maxtrain.models.deepseek.hf",
    "params_to_hf": "maxtrain.models.deepseek.hf", "params_from_hf": "maxtrain.models.deepseek.hf",
    "hf_shapes": "maxtrain.models.deepseek.hf", "check_tensors": "maxtrain.models.deepseek.hf",
    "read_hf_params": "maxtrain.models.deepseek.hf", "tensor_dtype": "maxtrain.models.deepseek.hf",
    "MODEL_TYPE": "maxtrain.models.deepseek.hf",
}


def __getattr__(name):
    if name not in _MOVED:
        raise AttributeError(f"module 'maxtrain.models.hf_deepseek' has no attribute {name!r}")
    warnings.warn(f"maxtrain.models.hf_deepseek.{name} is now {_MOVED[name]}.{name}", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
