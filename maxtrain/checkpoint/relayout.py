"""Restoring into another layout: a layer stack saved with another pipeline layout, or a leaf
saved in another dtype, is read as saved (so its checksums verify) and converted afterwards."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from maxtrain.checkpoint.checksums import flat_by_path, path_key


def relayout_dims(path: str, saved: tuple[int, ...], want: tuple[int, ...]) -> int | None:
    """For a layer-stack leaf saved in another pipeline layout, the number of trailing dims the two
    shapes share; None when the shapes are not the same stack.

    A pipelined stack `[R, S, N/(R S), ...]` is the flat `[N, ...]` stack reshaped (chunk r*S + s
    at [r, s]; see `maxtrain.parallel.pipeline.stage_specs`), so any two layouts of it convert
    by a reshape: a run may resume with another `mesh.pipeline` or `train.pipeline_repeats`. Only
    the leading layer dims may differ (one of them flat, three pipelined); every other dim must
    be identical, so a different model (say heads x head_dim regrouped) is never accepted.
    """
    saved, want = tuple(saved), tuple(want)
    if saved == want or "layers" not in path.split("/"):
        return None
    for lead_saved, lead_want in ((1, 3), (3, 1), (3, 3)):
        rest = len(saved) - lead_saved
        if rest >= 0 and rest == len(want) - lead_want and saved[lead_saved:] == want[lead_want:] and (
                math.prod(saved[:lead_saved]) == math.prod(want[:lead_want])):
            return rest
    return None


def restorable(path: str, saved: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """A saved leaf restores into `want` as is, or by a pipeline relayout."""
    return tuple(saved) == tuple(want) or relayout_dims(path, saved, want) is not None


def _relayout_target(x: jax.ShapeDtypeStruct, saved_shape: tuple[int, ...], k: int) -> jax.ShapeDtypeStruct:
    """Where to read a leaf saved as `saved_shape` before reshaping it into `x`: the shared trailing
    dims keep x's sharding; the mesh axes x splits its leading (layer) dims over split the first
    saved leading dim they divide, so no device reads more of the stack than it needs."""
    sh = x.sharding
    if not isinstance(sh, NamedSharding):  # one device (load_checkpoint without a mesh): read it whole
        return jax.ShapeDtypeStruct(saved_shape, x.dtype, sharding=sh)
    spec = tuple(sh.spec) + (None,) * (len(x.shape) - len(sh.spec))
    lead_axes = [a for e in spec[:len(x.shape) - k] if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    n = math.prod(sh.mesh.shape[a] for a in lead_axes)
    lead = [None] * (len(saved_shape) - k)
    if lead_axes:
        for d in range(len(lead)):
            if saved_shape[d] % n == 0:
                lead[d] = tuple(lead_axes) if len(lead_axes) > 1 else lead_axes[0]
                break
    rest = spec[len(x.shape) - k:]
    return jax.ShapeDtypeStruct(saved_shape, x.dtype, sharding=NamedSharding(sh.mesh, PartitionSpec(*lead, *rest)))


def read_targets(abstract, saved_tree):
    """(what to restore, {path: final target}): leaves saved in another pipeline layout or dtype
    are read as saved (so their checksums verify) and converted afterwards."""
    have = flat_by_path(saved_tree)
    relaid = {}

    def one(path, x):
        name = path_key(path)
        if name not in have:
            return x
        k = relayout_dims(name, tuple(have[name].shape), x.shape)
        dtype = jnp.dtype(getattr(have[name], "dtype", None) or x.dtype)
        if k is None and dtype == x.dtype:
            return x
        relaid[name] = x
        target = x if k is None else _relayout_target(x, tuple(have[name].shape), k)
        return jax.ShapeDtypeStruct(target.shape, dtype, sharding=target.sharding)

    return jax.tree_util.tree_map_with_path(one, abstract), relaid


def apply_relayout(tree, relaid: dict):
    """Reshapes and casts the converted leaves into their final shapes, dtypes and shardings, one
    at a time, each saved-layout array freed once converted (peak: the state plus one leaf)."""
    def one(path, x):
        target = relaid.get(path_key(path))
        if target is None:
            return x
        out = _reshaper(target.shape, jnp.dtype(target.dtype), target.sharding)(x)
        x.delete()
        return out

    return jax.tree_util.tree_map_with_path(one, tree)


@functools.lru_cache(maxsize=None)
def _reshaper(shape: tuple[int, ...], dtype, out_sharding):
    """One compiled reshape and cast per target (layer stacks share a few)."""
    return jax.jit(lambda a: a.reshape(shape).astype(dtype), out_shardings=out_sharding)
