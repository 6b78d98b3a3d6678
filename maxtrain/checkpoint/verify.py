"""Reading a checkpoint as a user does: verify every step (`maxtrain verify`), the config and the
tokenizer saved with it, and its params (`load_checkpoint`, the library contract)."""

from __future__ import annotations

import logging
import os

import jax

from maxtrain import storage
from maxtrain.checkpoint.errors import CorruptCheckpoint, one_line
from maxtrain.checkpoint.manager import Checkpointer, open_path, split_step_path, split_step_url
from maxtrain.checkpoint.tokenizer import kept_tokenizer
from maxtrain.config import ConfigError

log = logging.getLogger("maxtrain")


def verify_path(path: str) -> list[tuple[int, str | None]]:
    """(step, error or None) for one step directory or every step under a checkpoint directory."""
    if storage.is_url(path):  # read in place, each array through TensorStore's driver
        root, step = split_step_url(path)
    else:
        root, step = split_step_path(path)
        if not os.path.isdir(root):
            raise ConfigError(f"checkpoint path {path} does not exist")
    ckpt = Checkpointer(root, read_only=True)
    steps = [step] if step is not None else ckpt.all_steps()
    if not steps:
        raise ConfigError(f"no committed checkpoints under {path}")
    results = []
    for s in steps:
        try:
            ckpt.verify(s)
            results.append((s, None))
        except CorruptCheckpoint as e:
            results.append((s, str(e)))
    return results


def _saved_config(ckpt: Checkpointer, steps: list[int], path: str):
    """The config of the newest step whose meta reads (its params are verified when restored)."""
    from maxtrain.config import from_dict

    for s in reversed(steps):
        try:
            return from_dict(ckpt.read_meta(s)["config"])
        except (CorruptCheckpoint, KeyError, ConfigError) as e:
            log.warning("checkpoint %s/%d: no usable config (%s); trying the previous step", ckpt.directory, s,
                        one_line(e))
            continue
    raise ConfigError(f"no checkpoint under {path} has a readable config; pass cfg=")


def saved_config(path: str):
    """The config saved with a checkpoint directory (its newest readable step) or one step directory."""
    ckpt, steps = open_path(path, "checkpoint")
    return _saved_config(ckpt, steps, path)


def saved_tokenizer(path: str) -> str | None:
    """The tokenizer kept with a checkpoint directory (its newest step that records one) or one step
    directory, as a `load_tokenizer` spec ("byte", or its copy's path); None when none is recorded
    (synthetic data, or a checkpoint from before they were kept). A copy that is gone or altered is
    a one-line error naming --tokenizer."""
    ckpt, steps = open_path(path, "checkpoint")
    for s in reversed(steps):
        try:
            record = ckpt.read_meta(s).get("tokenizer")
        except CorruptCheckpoint:
            continue
        if record is None:
            return None
        return kept_tokenizer(ckpt.directory, record, path)
    return None


def load_checkpoint(path: str, cfg=None, mesh=None):
    """`(cfg, params)` from a checkpoint directory (its latest good step) or one step directory.

    `cfg` defaults to the config saved with the checkpoint. Params are placed by the config's
    parameter rules on `mesh`, or on this host's first device when no mesh is given. A `cfg` with
    another pipeline layout than the saved one gets its layer stacks converted (`relayout_dims`).
    """
    from maxtrain import models, sharding

    ckpt, steps = open_path(path, "checkpoint")
    if cfg is None:
        cfg = _saved_config(ckpt, steps, path)
    model = models.get(cfg.model.name)
    shapes = jax.eval_shape(lambda k: model.init(cfg, k), jax.random.key(0))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, shapes)
    else:
        shardings = sharding.tree_shardings(mesh, model.logical_axes(cfg), cfg.sharding.params)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    restored = ckpt.restore_latest_good(abstract, None, steps=steps, fix="pass cfg=None to load it with the "
                                        "config saved with it, or a cfg of the same model")
    if restored is None:
        raise ConfigError(f"no checkpoint under {path} passes verification")
    return cfg, restored.params
