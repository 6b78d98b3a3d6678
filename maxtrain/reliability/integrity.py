"""Silent corruption: replica fingerprints and the deterministic replay check."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from maxtrain.reliability.guards import Halted

log = logging.getLogger("maxtrain")


def _bits_sum(x):
    """Sum of the bit patterns of `x` as uint32 (wrapping): any flipped bit changes it."""
    bits = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]
    return jnp.sum(jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32), dtype=jnp.uint32)


def make_fingerprint(mesh, param_shardings):
    """Jitted `params -> uint32[mesh shape]`: one fingerprint per device of the shards it holds."""
    from jax.sharding import PartitionSpec as P
    specs = jax.tree.map(lambda s: s.spec, param_shardings)

    def local(params):
        total = sum(_bits_sum(x) for x in jax.tree.leaves(params))
        return jnp.reshape(total, (1,) * len(mesh.axis_names))

    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=P(*mesh.axis_names), check_vma=False)
    return jax.jit(fn)


def replica_axes(param_shardings, mesh) -> tuple[str, ...]:
    """Mesh axes no parameter is sharded over: devices that differ only along them must hold
    bit-identical parameters (the data-parallel replicas)."""
    used = set()
    for s in jax.tree.leaves(param_shardings):
        for dim in s.spec:
            used.update(dim if isinstance(dim, tuple) else (dim,) if dim else ())
    return tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)


def mismatched_devices(fingerprints, mesh, axes: tuple[str, ...]) -> list:
    """Devices whose fingerprint differs from the majority of their replica group (every device of
    a group without a strict majority)."""
    import numpy as np
    fp = np.asarray(fingerprints)
    devices = np.asarray(mesh.devices)
    idx = [mesh.axis_names.index(a) for a in axes]
    rest = [i for i in range(fp.ndim) if i not in idx]
    fp_g = np.transpose(fp, rest + idx).reshape(-1, int(np.prod([fp.shape[i] for i in idx] or [1])))
    dev_g = np.transpose(devices, rest + idx).reshape(fp_g.shape)
    bad = []
    for values, devs in zip(fp_g, dev_g):
        uniq, counts = np.unique(values, return_counts=True)
        if len(uniq) > 1:
            if counts.max() * 2 > len(values):  # a strict majority: the others are wrong
                majority = uniq[np.argmax(counts)]
                bad += [d for v, d in zip(values, devs) if v != majority]
            else:  # e.g. two replicas: which one is wrong cannot be told; name them all
                bad += list(devs)
    return bad


class Corrupted(Halted):
    """Replicas that should be identical are not: stop before the difference reaches a checkpoint."""


def check_replicas(fingerprint_fn, params, mesh, axes, step: int) -> None:
    if not axes:
        return
    fp = fingerprint_fn(params)
    if not fp.is_fully_addressable:  # multi-process: every process gets every device's fingerprint
        from jax.experimental import multihost_utils
        fp = multihost_utils.process_allgather(fp, tiled=True)
    bad = mismatched_devices(jax.device_get(fp), mesh, axes)
    if bad:
        names = ", ".join(f"{d} (process {d.process_index})" for d in bad)
        raise Corrupted(f"silent corruption at step {step}: parameters on {names} differ from their data-parallel "
                        f"replicas (mesh axes {', '.join(axes)}); no checkpoint was written after it — restart "
                        f"from the last checkpoint and drain that host")


class Nondeterministic(Corrupted):
    """The same step on the same batch gave different results: a faulty device or a
    nondeterministic kernel; either way the run's numbers can no longer be trusted bit for bit."""


def check_replay(first: dict, second: dict, step: int) -> None:
    """Loss and gradient norm of two runs of one step on one batch must agree bit for bit."""
    import numpy as np
    for key in ("loss", "grad_norm"):
        a, b = np.asarray(first[key]), np.asarray(second[key])
        if a.tobytes() != b.tobytes():
            raise Nondeterministic(f"step {step} recomputed on the same batch gave {key} {float(a)!r} then "
                                   f"{float(b)!r}; a device computes wrongly or a kernel is nondeterministic "
                                   f"(reliability.replay_every checks this)")
