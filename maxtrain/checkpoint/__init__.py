"""Checkpoints: the persistent tier on Orbax and the local tier, one module per concern.

- `manager`: `Checkpointer` (async saves, the in-commit manifest, verified restore with fallback,
  retention, agreement with the other processes), `open_path`, the format constants;
- `checksums`: per-array checksums computed on the devices, leaf path keys, one-replica saving;
- `relayout`: restoring a leaf saved in another pipeline layout or dtype;
- `lock`: the directory lock a run holds on `checkpoint.dir` (`DirectoryLock`, `lock_directory`; in
  an object store the lease `ObjectLease`);
- `objects`: `checkpoint.dir` in an object store (Orbax over TensorStore's s3/gcs drivers, the
  commit marker);
- `verify`: reading a checkpoint as a user does (`verify_path`, `saved_config`, `saved_tokenizer`,
  `load_checkpoint`);
- `tokenizer`: the tokenizer record kept with each step; `meta`: a step's meta read without jax;
- `agreement`, `errors`: what the processes agree on, and how failures are named;
- `local`: the local tier (`checkpoint.local`), node-local shards with a ring peer copy.

The names below are imported on first use (PEP 562), so `maxtrain.checkpoint.meta` reads a step's
meta without importing jax or Orbax (`maxtrain.config` does, before jax).
"""

import importlib

# name -> the module that owns it (a literal table: tests/test_layering.py reads it)
_OWNER = {
    "FORMAT_VERSION": "maxtrain.checkpoint.manager",
    "PREEMPTED_EXIT_CODE": "maxtrain.checkpoint.manager",
    "MANIFEST": "maxtrain.checkpoint.manager",
    "LEGACY_MANIFEST": "maxtrain.checkpoint.manager",
    "TRASH": "maxtrain.checkpoint.manager",
    "Checkpointer": "maxtrain.checkpoint.manager",
    "Restored": "maxtrain.checkpoint.manager",
    "meta_digest": "maxtrain.checkpoint.manager",
    "open_path": "maxtrain.checkpoint.manager",
    "remove_settled": "maxtrain.checkpoint.manager",
    "split_step_path": "maxtrain.checkpoint.manager",
    "CorruptCheckpoint": "maxtrain.checkpoint.errors",
    "one_line": "maxtrain.checkpoint.errors",
    "ONE_REPLICA_BYTES": "maxtrain.checkpoint.checksums",
    "checksum_words": "maxtrain.checkpoint.checksums",
    "flat_by_path": "maxtrain.checkpoint.checksums",
    "one_replica": "maxtrain.checkpoint.checksums",
    "path_key": "maxtrain.checkpoint.checksums",
    "tree_checksums": "maxtrain.checkpoint.checksums",
    "relayout_dims": "maxtrain.checkpoint.relayout",
    "LOCK_FILE": "maxtrain.checkpoint.lock",
    "LOCK_HEARTBEAT_S": "maxtrain.checkpoint.lock",
    "LOCK_STALE_S": "maxtrain.checkpoint.lock",
    "DirectoryLock": "maxtrain.checkpoint.lock",
    "describe_holder": "maxtrain.checkpoint.lock",
    "lock_directory": "maxtrain.checkpoint.lock",
    "load_checkpoint": "maxtrain.checkpoint.verify",
    "saved_config": "maxtrain.checkpoint.verify",
    "saved_tokenizer": "maxtrain.checkpoint.verify",
    "verify_path": "maxtrain.checkpoint.verify",
    "data_tokenizer": "maxtrain.checkpoint.tokenizer",
    "keep_tokenizer": "maxtrain.checkpoint.tokenizer",
}

__all__ = sorted(_OWNER)


def __getattr__(name):  # only for names not set yet
    if name not in _OWNER:
        raise AttributeError(f"module 'maxtrain.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(_OWNER[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_OWNER))
