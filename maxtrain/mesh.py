"""The named device mesh: axis sizes from `mesh.*`, device order with the fastest links innermost."""

from __future__ import annotations

import collections
import contextlib
import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from maxtrain.config import MESH_AXES, ConfigError, MeshConfig, resolve_mesh_shape

# Axes are ordered slowest-communicating first: `data` (and `pipeline`) can cross hosts over the
# data-centre network, `tensor` is innermost so its all-reduces stay on NVLink within a node.


def _dcn_split(shape: tuple[int, ...], n_processes: int) -> tuple[int, ...] | None:
    """Splits `n_processes` over the outer axes (data, pipeline, fsdp) so each host owns a block."""
    dcn = [1] * len(shape)
    left = n_processes
    for i, name in enumerate(MESH_AXES):
        if left == 1 or name not in ("data", "pipeline", "fsdp"):
            continue
        g = math.gcd(left, shape[i])
        dcn[i] = g
        left //= g
    return tuple(dcn) if left == 1 else None


def device_grid(shape: tuple[int, ...], devices=None) -> np.ndarray:
    """Devices arranged in `shape` (MESH_AXES order), hybrid ICI x DCN when multi-host."""
    devices = list(devices if devices is not None else jax.devices())
    n_proc = len({d.process_index for d in devices})
    if n_proc > 1:
        dcn = _dcn_split(shape, n_proc)
        if dcn is not None:
            ici = tuple(s // d for s, d in zip(shape, dcn))
            try:
                return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
            except (ValueError, AssertionError, KeyError):
                pass  # no slice/granule topology (e.g. CPU processes): plain process-major order below
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
        return np.asarray(devices, dtype=object).reshape(shape)
    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, AssertionError, NotImplementedError):
        return np.asarray(devices, dtype=object).reshape(shape)


def _processes_note(devices) -> str:
    """For a multi-process job: how the global device count the mesh must match is made up."""
    per = collections.Counter(d.process_index for d in devices)
    if len(per) < 2:
        return ""
    counts = sorted(set(per.values()))
    each = f"{counts[0]} each" if len(counts) == 1 else "/".join(map(str, counts))
    return f" (the {len(devices)} devices of all {len(per)} processes, {each}; the mesh spans every process)"


def build_mesh(mesh_cfg: MeshConfig, devices=None) -> Mesh:
    """A `Mesh` over all devices (or `devices`) with the six named axes, all `AxisType.Auto`.

    Auto axes let XLA's partitioner propagate shardings from our explicit constraints; we do not use
    sharding-in-types (Explicit axes), which would make every op's sharding part of its type.
    """
    devices = list(devices if devices is not None else jax.devices())
    try:
        sizes = resolve_mesh_shape(mesh_cfg, len(devices))
    except ConfigError as e:
        raise ConfigError(f"{e}{_processes_note(devices)}") from None
    shape = tuple(sizes[a] for a in MESH_AXES)
    grid = device_grid(shape, devices)
    # `pipeline` is placed second-outermost (above), but named last: the same devices per stage, and
    # shard_maps nested in the pipeline's (ring attention, expert parallelism) then list their own
    # manual axes before `pipeline` in every sharding, which the partitioner requires.
    names = tuple(a for a in MESH_AXES if a != "pipeline") + ("pipeline",)
    grid = np.moveaxis(grid, MESH_AXES.index("pipeline"), -1)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def fit_mesh(mesh_cfg: MeshConfig, n_devices: int, explicit=frozenset()) -> tuple[MeshConfig, str]:
    """The mesh an inference command (generate, eval) runs a checkpoint's config on: `(mesh, note)`.

    A mesh that fits `n_devices` is kept (note ""). Otherwise the axes in `explicit` (set on the
    command line) keep their values, each other axis keeps its size where that divides the devices
    left (innermost first: tensor, sequence, expert, fsdp, pipeline, data) and is 1 where not, and the
    rest goes to fsdp (to data when fsdp is explicit; to an explicit -1 axis when there is one).
    When explicit sizes themselves do not fit, the mesh is returned as given: `build_mesh` says why.
    The note is one sentence naming the mesh as given and the one chosen."""
    sizes = {a: getattr(mesh_cfg, a) for a in MESH_AXES}
    explicit = {a for a in explicit if a in sizes}
    if any(v == 0 or v < -1 for v in sizes.values()):
        return mesh_cfg, ""  # not a size: the config's validation says so
    if list(sizes.values()).count(-1) <= 1:
        try:
            resolve_mesh_shape(mesh_cfg, n_devices)
            return mesh_cfg, ""
        except ConfigError:
            pass
    fixed = math.prod(sizes[a] for a in explicit if sizes[a] != -1)
    open_axes = [a for a in ("fsdp", "data") + MESH_AXES if a not in explicit]
    fills = [a for a in MESH_AXES if a in explicit and sizes[a] == -1] or open_axes[:1]
    if n_devices % fixed or not fills or len(fills) > 1:
        return mesh_cfg, ""
    left, fitted = n_devices // fixed, dict(sizes)
    for a in reversed(MESH_AXES):
        if a in explicit:
            continue
        keep = a != fills[0] and sizes[a] != -1 and left % sizes[a] == 0
        fitted[a] = -1 if a == fills[0] else sizes[a] if keep else 1
        left //= fitted[a] if keep else 1
    out = MeshConfig(**fitted)
    chosen = resolve_mesh_shape(out, n_devices)
    shown = ", ".join(f"mesh.{a}={chosen[a]}" for a in MESH_AXES if chosen[a] != 1) or "every axis 1"
    return out, (f"mesh {_sizes_str(sizes)} does not fit the {n_devices} device{'s' if n_devices != 1 else ''} "
                 f"here; using {shown} (the axes that divide kept, the rest on {fills[0]}; mesh.* overrides "
                 f"choose another)")


def _sizes_str(sizes: dict[str, int]) -> str:
    return ", ".join(f"{a}={v}" for a, v in sizes.items() if v != 1) or "every axis 1"


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    return dict(mesh.shape)


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
    """Makes `mesh` the context mesh, which activation constraints resolve against."""
    with jax.set_mesh(mesh):
        yield mesh
