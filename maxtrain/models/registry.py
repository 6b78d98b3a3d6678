"""The model registry and parameter-spec helpers (what model families import; no family here)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from maxtrain.config import Config, ConfigError, did_you_mean


@dataclass(frozen=True)
class Model:
    name: str
    init: Callable[[Config, jax.Array], Any]
    apply: Callable[[Any, dict, Config], tuple[jax.Array, dict]]
    logical_axes: Callable[[Config], Any]
    # Training FLOPs per token at a sequence length; None: 6 x parameter count.
    flops_per_token: Callable[[Config, int], float] | None = None
    # Last hidden states and output projection (logits = features @ head), for the fused losses.
    features: Callable[[Any, dict, Config], tuple[jax.Array, dict]] | None = None
    head: Callable[[Any, Config], jax.Array] | None = None
    # Parallelism the model's own code implements (FEATURES); anything else asked of it is a config error.
    supports: frozenset = frozenset()


FEATURES = ("pipeline",)  # pipeline: mesh.pipeline > 1 splits the model's layers into stages


_REGISTRY: dict[str, Model] = {}


def register(name: str, *, init, apply, logical_axes, flops_per_token=None, features=None, head=None,
             supports=()) -> Model:
    """Adds a model family selectable as `model.name: NAME`; `supports` names the FEATURES its code
    implements (a config asking a model for one it lacks is a one-line error, not a silent no-op)."""
    if (features is None) != (head is None):
        raise ValueError(f"models.register({name!r}): give both features and head, or neither")
    unknown = set(supports) - set(FEATURES)
    if unknown:
        raise ValueError(f"models.register({name!r}): supports={sorted(unknown)} unknown; known: {', '.join(FEATURES)}")
    model = Model(name, init, apply, logical_axes, flops_per_token, features, head, frozenset(supports))
    _REGISTRY[name] = model
    return model


def get(name: str) -> Model:
    if name not in _REGISTRY:
        raise ConfigError(f"model.name={name!r} is not a registered model; {did_you_mean(name, _REGISTRY)}"
                          f"registered: {', '.join(sorted(_REGISTRY))} (add yours with maxtrain.models.register)")
    return _REGISTRY[name]


def names() -> list[str]:
    return sorted(_REGISTRY)


# ---------------------------------------------------------------- parameter declarations


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape, its logical axis names, and how to initialise it."""
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Callable[[jax.Array, tuple[int, ...]], jax.Array]


def normal(std: float):
    return lambda key, shape: std * jax.random.normal(key, shape, jnp.float32)


def ones(key, shape):
    return jnp.ones(shape, jnp.float32)


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def init_from_specs(specs, key: jax.Array, dtype) -> Any:
    """Initialises every leaf with its own key folded in by position (stable under any sharding)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    arrays = [s.init(jax.random.fold_in(key, i), s.shape).astype(dtype) for i, s in enumerate(leaves)]
    return jax.tree.unflatten(treedef, arrays)


def axes_from_specs(specs) -> Any:
    return jax.tree.map(lambda s: s.axes, specs, is_leaf=_is_spec)


def param_count(cfg: Config) -> int:
    """Parameter count computed abstractly (no memory is allocated)."""
    model = get(cfg.model.name)
    shapes = jax.eval_shape(lambda k: model.init(cfg, k), jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def flops_per_token(cfg: Config, seq_len: int) -> float:
    model = get(cfg.model.name)
    if model.flops_per_token is not None:
        return model.flops_per_token(cfg, seq_len)
    return 6.0 * param_count(cfg)
