"""Checkpoints: the persistent tier on Orbax and the local tier, one module per concern.

- `manager`: `Checkpointer` (async saves, the in-commit manifest, verified restore with fallback,
  retention, agreement with the other processes), `open_path`, the format constants;
- `checksums`: per-array checksums computed on the devices, leaf path keys, one-replica saving;
- `relayout`: restoring a leaf saved in another pipeline layout or dtype;
- `lock`: the directory lock a run holds on `checkpoint.dir` (`DirectoryLock`, `lock_directory`);
- `verify`: reading a checkpoint as a user does (`verify_path`, `saved_config`, `saved_tokenizer`,
  `load_checkpoint`);
- `tokenizer`: the tokenizer record kept with each step; `meta`: a step's meta read without jax;
- `agreement`, `errors`: what the processes agree on, and how failures are named;
- `local`: the local tier (`checkpoint.local`), node-local shards with a ring peer copy.

The names below are imported on first use (PEP 562), so `maxtrain.checkpoint.meta` reads a step's
meta without importing jax or Orbax (`maxtrain.config` does, before jax).
"""

import importlib

# the module that owns each name
_NAMES = {
    "maxtrain.checkpoint.manager": ("FORMAT_VERSION", "PREEMPTED_EXIT_CODE", "MANIFEST", "LEGACY_MANIFEST", "TRASH",
                                    "Checkpointer", "Restored", "meta_digest", "open_path", "remove_settled",
                                    "split_step_path"),
    "maxtrain.checkpoint.errors": ("CorruptCheckpoint", "one_line"),
    "maxtrain.checkpoint.checksums": ("ONE_REPLICA_BYTES", "checksum_words", "flat_by_path", "one_replica",
                                      "path_key", "tree_checksums"),
    "maxtrain.checkpoint.relayout": ("relayout_dims",),
    "maxtrain.checkpoint.lock": ("LOCK_FILE", "LOCK_HEARTBEAT_S", "LOCK_STALE_S", "DirectoryLock", "describe_holder",
                                 "lock_directory"),
    "maxtrain.checkpoint.verify": ("load_checkpoint", "saved_config", "saved_tokenizer", "verify_path"),
    "maxtrain.checkpoint.tokenizer": ("data_tokenizer", "keep_tokenizer"),
}
_OWNER = {name: module for module, names in _NAMES.items() for name in names}

__all__ = sorted(_OWNER)


def __getattr__(name):  # only for names not set yet
    if name not in _OWNER:
        raise AttributeError(f"module 'maxtrain.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(_OWNER[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_OWNER))
