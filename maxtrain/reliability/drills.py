"""Fault drills (config section `drills:`), off by default: faults injected on purpose so that
every guard in docs/reliability.md can be triggered, in tests and on a real cluster.

Host drills (a hang, a crash, a slow process) run as a loop callback (`maxtrain.run.checks.Drills`);
the step drills (NaN, spike) wrap the step's gradients only when configured, so the production
step has no trace of them. Drills fire in one process (`drills.process`) and only in a job's first
attempt (`MAXTRAIN_RESTART=0`), so a restarted run gets past them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import optax

from maxtrain.config import DrillsConfig

log = logging.getLogger("maxtrain")


def first_attempt() -> bool:
    """Whether this is a job's first attempt (`MAXTRAIN_RESTART`, set by the launchers)."""
    return os.environ.get("MAXTRAIN_RESTART", "0") == "0"


def _here(cfg: DrillsConfig) -> bool:
    return jax.process_index() == cfg.process and first_attempt()


def host_faults(cfg: DrillsConfig, step: int) -> None:
    """Before 0-based step `step`: crash, be preempted (SIGTERM), hang or sleep here if the config asks for it."""
    if cfg.crash_step is not None and step == cfg.crash_step and _here(cfg):
        log.error("fault injection: crashing before step %d", step + 1)
        logging.shutdown()
        os._exit(1)
    if cfg.preempt_step is not None and step == cfg.preempt_step and _here(cfg):
        log.error("fault injection: SIGTERM to this process before step %d (a preemption)", step + 1)
        os.kill(os.getpid(), signal.SIGTERM)
    if cfg.hang_step is not None and step == cfg.hang_step and _here(cfg):
        log.error("fault injection: hanging before step %d", step + 1)
        threading.Event().wait()
    if cfg.sleep_s and _here(cfg):
        time.sleep(cfg.sleep_s)


def step_faults(cfg: DrillsConfig):
    """`(grads, metrics, step) -> (grads, metrics)` for the jitted step: at `nan_step` the loss and
    every gradient become NaN, at `spike_step` 1000x larger; the identity when neither is set."""
    if cfg.nan_step is None and cfg.spike_step is None:
        return lambda grads, metrics, step: (grads, metrics)

    def corrupt(grads, metrics, step):
        factor = jnp.float32(1.0)
        if cfg.nan_step is not None:
            factor = jnp.where(step == cfg.nan_step, jnp.nan, factor)
        if cfg.spike_step is not None:
            factor = jnp.where(step == cfg.spike_step, 1000.0, factor)
        grads = jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads)
        return grads, {**metrics, "loss": metrics["loss"] * factor, "grad_norm": optax.tree.norm(grads)}

    return corrupt


def _index_key(index) -> tuple:
    return tuple((sl.start, sl.stop, sl.step) for sl in index)


def flip_a_bit(params, device_index: int = -1):
    """Fault drill: one bit of the first replicated parameter, on one device only."""
    leaves, treedef = jax.tree.flatten(params)
    for i, leaf in enumerate(leaves):
        shards = leaf.addressable_shards
        if len({_index_key(s.index) for s in shards}) == len(shards):
            continue  # every shard distinct: no replica to disagree with
        victim = shards[device_index]
        data = jax.device_get(victim.data).copy()
        flat = data.reshape(-1).view({4: "uint32", 2: "uint16"}[data.dtype.itemsize])
        flat[0] ^= 1 << 3
        arrays = [jax.device_put(data, s.device) if s is victim else s.data for s in shards]
        leaves[i] = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays)
        log.error("fault injection: flipped a bit of parameter %d on %s", i, victim.device)
        return jax.tree.unflatten(treedef, leaves)
    return params
