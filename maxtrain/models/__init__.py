"""Model families as pure functions, and the registry library users add to.

A model is `init(cfg, key) -> params`, `apply(params, batch, cfg) -> (logits, aux)` and
`logical_axes(cfg) -> tree of axis-name tuples` matching params. `cfg` is the whole `Config`;
`batch` holds `inputs` `[B, L]` and optionally `segment_ids` and `positions`. A model that also
gives `features(params, batch, cfg) -> (hidden [B, L, D], aux)` and `head(params, cfg) -> [D, V]`
(with `apply` their product) can train with the fused losses (`train.cross_entropy: fused|pallas`),
which never build the logits.
"""

from maxtrain.models.registry import (FEATURES, Model, ParamSpec, axes_from_specs, flops_per_token, get,  # noqa: F401
                                      init_from_specs, names, normal, ones, param_count, register)
from maxtrain.models import llama as _llama  # noqa: E402,F401  (registers "llama")
from maxtrain.parallel import ring_attention as _ring  # noqa: E402,F401  (registers attention "ring")
