"""Model families as pure functions, and the registry library users add to.

One folder per family (`maxtrain/models/<family>/`: its config class, model, Hugging Face conversion
and decoder), registered once: importing this package (no jax) registers each built-in family's
config class and declares the module that registers its model (`catalog`), which loads on first use.

A family registers as layered pure functions of its model config and a small runtime context
(`maxtrain.models.stack`: `param_specs`, `embed`, `layer`, `final`, `head`); the trainer runs the
layer stack (scan, remat, pipeline stages) and the loss. `batch` holds `inputs` `[B, L]` and
optionally `segment_ids` and `positions`. The registry hands the trainer each family as a `Model`:
`init(cfg, key)`, `apply(params, batch, cfg) -> (logits, aux)`, `logical_axes(cfg)`,
`features(params, batch, cfg) -> (hidden, aux)` and `head(params, cfg) -> [D, V]`, given the whole
Config (registering those directly still works, deprecated).
"""

import importlib

from maxtrain.models import deepseek, llama  # noqa: F401  (the built-in families: configs registered, no jax)

# name -> the module that owns it (imported on first use: they need jax)
_LAZY = {
    "FEATURES": "maxtrain.models.registry", "Model": "maxtrain.models.registry",
    "flops_per_token": "maxtrain.models.registry", "get": "maxtrain.models.registry",
    "names": "maxtrain.models.registry", "param_count": "maxtrain.models.registry",
    "register": "maxtrain.models.registry", "Decoder": "maxtrain.models.registry",
    "HFConversion": "maxtrain.models.registry",
    "ParamSpec": "maxtrain.models.specs", "axes_from_specs": "maxtrain.models.specs",
    "init_from_specs": "maxtrain.models.specs", "normal": "maxtrain.models.specs", "ones": "maxtrain.models.specs",
    "Runtime": "maxtrain.models.stack",
}


def __getattr__(name):  # only for names not set yet
    if name not in _LAZY:
        raise AttributeError(f"module 'maxtrain.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
