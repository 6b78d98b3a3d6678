"""Deprecated: the Hugging Face converter moved (issue 42). Its file side is `maxtrain.convert`
(`hf_to_maxtrain`, `maxtrain_to_hf`, `read_hf`, `write_hf`, ...) and the llama family's names and
layouts are `maxtrain.models.llama.hf`. The old names resolve here, with a DeprecationWarning.
(This alias sits in the tools layer, beside `maxtrain.convert`: docs/architecture.md.)"""

import importlib
import warnings

_MOVED = {
    "hf_to_maxtrain": "maxtrain.convert", "maxtrain_to_hf": "maxtrain.convert", "read_hf": "maxtrain.convert",
    "read_hf_config": "maxtrain.convert", "read_hf_params": "maxtrain.convert", "write_hf": "maxtrain.convert",
    "model_config_from_hf": "maxtrain.convert", "hf_config_from_model": "maxtrain.convert",
    "params_to_hf": "maxtrain.convert", "params_from_hf": "maxtrain.convert", "hf_shapes": "maxtrain.convert",
    "config_with_model": "maxtrain.convert", "check_output_dir": "maxtrain.convert",
    "safetensors_header": "maxtrain.convert", "SOURCE_DIR": "maxtrain.convert",
    "ARCHITECTURES": "maxtrain.models.llama.hf",
}


def __getattr__(name):
    if name not in _MOVED:
        raise AttributeError(f"module 'maxtrain.models.hf_llama' has no attribute {name!r}")
    warnings.warn(f"maxtrain.models.hf_llama.{name} is now {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
