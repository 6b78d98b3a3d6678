"""Parameter declarations: a model states each parameter's shape, logical axes and initialiser
once (`ParamSpec`), and params and their logical axes are both read from that tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape, its logical axis names, and how to initialise it."""
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Callable[[jax.Array, tuple[int, ...]], jax.Array]
    # False: state the model updates itself (e.g. a router's balancing bias), which the optimizer leaves alone
    learned: bool = True


def normal(std: float):
    return lambda key, shape: std * jax.random.normal(key, shape, jnp.float32)


def ones(key, shape):
    return jnp.ones(shape, jnp.float32)


def zeros(key, shape):
    return jnp.zeros(shape, jnp.float32)


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def init_from_specs(specs, key: jax.Array, dtype) -> Any:
    """Initialises every leaf with its own key folded in by position (stable under any sharding)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    # state the model updates itself (not learned: a balancing bias) stays float32, where its small
    # steps are not rounded away
    arrays = [s.init(jax.random.fold_in(key, i), s.shape).astype(dtype if s.learned else jnp.float32)
              for i, s in enumerate(leaves)]
    return jax.tree.unflatten(treedef, arrays)


def axes_from_specs(specs) -> Any:
    return jax.tree.map(lambda s: s.axes, specs, is_leaf=is_spec)


def learned_from_specs(specs) -> Any:
    """A tree like the params of whether the optimizer updates each leaf (`ParamSpec.learned`)."""
    return jax.tree.map(lambda s: s.learned, specs, is_leaf=is_spec)
