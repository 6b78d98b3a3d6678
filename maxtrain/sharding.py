"""Logical axis names -> mesh axes. The only module that knows mesh axis names."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtrain.config import ConfigError, axes_size

Axes = Sequence[str | None]
Rules = Mapping[str, Any]  # logical name -> mesh axis, list of mesh axes, or None


def logical_to_spec(axes: Axes, rules: Rules) -> PartitionSpec:
    """`("batch", "length", "embed")` -> `P(("data", "fsdp"), "sequence", None)`.

    A logical name missing from the rules is replicated. A mesh axis may shard only one dimension of
    an array, so a later dimension mapped to an axis already used is replicated instead.
    """
    used: set[str] = set()
    spec = []
    for name in axes:
        rule = rules.get(name) if name is not None else None
        mesh_axes = [a for a in (rule if isinstance(rule, list) else [rule]) if a is not None and a not in used]
        used.update(mesh_axes)
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, axes: Axes, rules: Rules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules))


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_shardings(mesh: Mesh, axes_tree, rules: Rules):
    """A NamedSharding for every leaf of a tree of logical-axes tuples."""
    return jax.tree.map(lambda a: named_sharding(mesh, a, rules), axes_tree, is_leaf=_is_axes)


def check_divisible(shapes, axes_tree, rules: Rules, sizes: Mapping[str, int], section: str) -> None:
    """Every sharded dimension must divide evenly by its shard count; names the offending leaf."""
    flat_axes = {jax.tree_util.keystr(p): a for p, a in
                 jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=_is_axes)[0]}
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        name = jax.tree_util.keystr(path)
        axes = flat_axes[name]
        spec = logical_to_spec(axes, rules)
        for dim, (size, logical, mesh_axes) in enumerate(zip(leaf.shape, axes, spec)):
            n = axes_size(list(mesh_axes) if isinstance(mesh_axes, tuple) else mesh_axes, sizes)
            if size % n:
                raise ConfigError(
                    f"{section} {name} dimension {dim} ({logical}={size}) does not divide into {n} "
                    f"shards over mesh axes {mesh_axes}; change sharding.{section}.{logical} or the mesh")


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple of axes)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def constrain(x: jax.Array, axes: Axes, rules: Rules) -> jax.Array:
    """Constrains an activation's sharding by logical names against the context mesh (no-op without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return constrain_spec(x, logical_to_spec(axes, rules))


def constrain_spec(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """`constrain` with a PartitionSpec already resolved (no-op without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def _spec_text(spec: PartitionSpec, sizes: Mapping[str, int]) -> str:
    """`P(("data", "fsdp"), "sequence", None)` -> `"data+fsdp,sequence,-"`, leaving out mesh axes of size 1."""
    dims = []
    for d in spec:
        axes = [a for a in (d if isinstance(d, tuple) else (d,)) if a is not None and sizes.get(a, 1) > 1]
        dims.append("+".join(axes) or "-")
    return ",".join(dims)


def _sub_jaxprs(params: Mapping[str, Any]):
    """The jaxprs an equation's parameters hold (pjit, scan, cond branches, remat, custom_vjp, shard_map)."""
    for v in params.values():
        for item in (v if isinstance(v, (tuple, list)) else [v]):
            if hasattr(item, "eqns"):
                yield item
            elif hasattr(getattr(item, "jaxpr", None), "eqns"):
                yield item.jaxpr


def activation_constraints(jaxpr, sizes: Mapping[str, int]) -> dict[str, int]:
    """Every sharding constraint a traced program applies, as `"f32[16,32,64] data+fsdp,sequence,-"`
    -> how many times (forward and backward, each scanned layer body once), sorted; mesh axes of
    size 1 (per `sizes`) are left out, so the spec is the sharding the array really gets.

    Read from the jaxpr (what `constrain` asked for), not from XLA's output, so it is the same on
    every jax and backend; `maxtrain inspect` prints it and the tests pin it per strategy."""
    counts: dict[str, int] = {}
    stack = [getattr(jaxpr, "jaxpr", jaxpr)]
    while stack:
        for eqn in stack.pop().eqns:
            if eqn.primitive.name == "sharding_constraint":
                aval = eqn.invars[0].aval
                key = f"{aval.str_short(short_dtypes=True)} {_spec_text(eqn.params['sharding'].spec, sizes)}"
                counts[key] = counts.get(key, 0) + 1
            stack.extend(_sub_jaxprs(eqn.params))
    return dict(sorted(counts.items()))
