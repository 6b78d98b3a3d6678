"""Model families as pure functions, and the registry library users add to.

A family registers as layered pure functions of its model config and a small runtime context
(`maxtrain.models.stack`: `param_specs`, `embed`, `layer`, `final`, `head`); the trainer runs the
layer stack (scan, remat, pipeline stages) and the loss. `batch` holds `inputs` `[B, L]` and
optionally `segment_ids` and `positions`. The registry hands the trainer each family as a `Model`:
`init(cfg, key)`, `apply(params, batch, cfg) -> (logits, aux)`, `logical_axes(cfg)`,
`features(params, batch, cfg) -> (hidden, aux)` and `head(params, cfg) -> [D, V]`, given the whole
Config (registering those directly still works, deprecated).
"""

from maxtrain.models.registry import (FEATURES, Model, flops_per_token, get, names, param_count,  # noqa: F401
                                      register)
from maxtrain.models.specs import ParamSpec, axes_from_specs, init_from_specs, normal, ones  # noqa: F401
from maxtrain.models.stack import Runtime  # noqa: F401
from maxtrain.models import llama as _llama  # noqa: E402,F401  (registers "llama")
from maxtrain.models import deepseek as _deepseek  # noqa: E402,F401  (registers "deepseek")
from maxtrain.parallel import ring_attention as _ring  # noqa: E402,F401  (registers attention "ring")
