"""Checksums of a tree of arrays, computed on the devices, and the names of its leaves.

A manifest (manager.py) holds, per array, two uint32 words keyed by the leaf's container-neutral
path (`path_key`). Replicated arrays are saved, and summed, from one replica (`one_replica`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ONE_REPLICA_BYTES = 1 << 20  # replicated arrays up to this size (any size on CPU) are saved from one replica


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (one per element; 8-byte elements give two)."""
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing dim of 2
    raise TypeError(f"no checksum for dtype {x.dtype}")


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """`[sum(w), sum(w * (1 + flat_index mod 65521))]` mod 2^32 over the words `w` of `x`.

    Integer sums are exact and associative, so the result does not depend on the sharding, and
    the index weighting also catches values moved to the wrong place. Computed elementwise plus one
    reduction: no gather of the array.
    """
    w = _words(x)
    if w.ndim == 0:
        w = w[None]
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % 2**32)
        stride *= w.shape[d]
    weight = index % jnp.uint32(65521) + jnp.uint32(1)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * weight, dtype=jnp.uint32)])


@jax.jit
def tree_checksums(tree):
    """A uint32[2] checksum for every array leaf of `tree` (same tree structure)."""
    return jax.tree.map(_leaf_checksum, tree)


def checksum_words(tree) -> dict[str, list[int]]:
    """`tree_checksums` on the host, keyed by `path_key`: the manifest's `checksums`. Leaves on
    different sets of devices (replicated arrays saved from one replica, `one_replica`) are summed
    by one program per set."""
    leaves = flat_by_path(tree)
    groups: dict = {}
    for k, v in leaves.items():
        groups.setdefault(frozenset(v.sharding.device_set) if isinstance(v, jax.Array) else None, {})[k] = v
    pending = []
    for devices, part in groups.items():
        if devices is not None and len(devices) == 1:  # the caller's context mesh may span every device
            with jax.set_mesh(jax.sharding.Mesh(np.array(list(devices)), ("replica",))):
                pending.append(tree_checksums(part))
        else:
            pending.append(tree_checksums(part))
    sums = {k: v for part in jax.device_get(pending) for k, v in part.items()}
    return {k: [int(w) for w in np.asarray(sums[k])] for k in leaves}


def one_replica(x):
    """A fully replicated array as its first replica (the same values on one device, no copy) where
    Orbax's replica-parallel copy gains nothing: one process saves it, and its devices are CPUs
    (where the copy off the devices copies nothing) or it is small. Orbax would otherwise slice
    every replica (one more compiled program per replica and array on the first save, a dispatch
    each on every save) and the checksum would be computed on every replica."""
    if not isinstance(x, jax.Array) or len(x.sharding.device_set) < 2 or not x.sharding.is_fully_replicated:
        return x
    if jax.process_count() != 1:  # each process would write the whole array
        return x
    if next(iter(x.sharding.device_set)).platform != "cpu" and x.nbytes > ONE_REPLICA_BYTES:
        return x  # a large array: its replicas copy their slices off the devices in parallel
    return x.addressable_shards[0].data


def _path_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_key(path) -> str:
    """A container-neutral name for a tree path (`opt_state/1/0/mu/layers/wq`)."""
    return "/".join(_path_name(e) for e in path)


def flat_by_path(tree) -> dict[str, Any]:
    """Leaves keyed by `path_key`: optax NamedTuples and the dicts Orbax's metadata gives back for
    them name the same leaf the same way."""
    return {path_key(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
