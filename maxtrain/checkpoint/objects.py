"""Checkpoint directories in object stores (`checkpoint.dir=s3://...` or `gs://...`): Orbax over
TensorStore's `s3` and `gcs` drivers.

Orbax (0.12) writes the arrays through TensorStore and does its directory work (step folders, its
metadata files, the commit marker) through etils `epath`, which reaches buckets through fsspec
(`s3fs`, a dependency; `gcsfs` for `gs://`, the `gcs` extra). Two things it lacks for S3 are supplied
here:

- Its TensorStore spec builder knows only `gs://`: `install()` makes it build TensorStore's `s3`
  kvstore (`storage.tensorstore_kvstore`: endpoint, region, credentials from the standard AWS
  chain) for an `s3://` directory. Every process writes its own shards straight to the bucket;
  nothing goes through a node's disk.
- Its atomic commit renames a temporary directory, and an object store has no rename: for a URL
  the commit is Orbax's `COMMIT_FILE` mode (`atomicity()`). A step is written in place; Orbax's
  finalize, after every process's writes are done and the per-process OCDBT manifests merged,
  writes `<step>/commit_success.txt` last; a step without it is not listed (Orbax reads the marker
  before it counts a step). Our checksums (`manifest`) are an item of the same step, written
  before the marker, so a listed step always has them. A killed save leaves a step prefix without
  the marker: not a checkpoint, removed by the next run's start (`Checkpointer`'s own clean-up of
  step prefixes; Orbax's `cleanup_tmp_directories` stays off here: in this mode it would delete
  every sub-prefix without a marker, a run_dir under checkpoint.dir included).
"""

from __future__ import annotations

import importlib.util

from maxtrain import imports, storage
from maxtrain.config import ConfigError

ocp = imports.quietly("orbax.checkpoint")

COMMIT_MARKER = "commit_success.txt"  # Orbax's COMMIT_FILE marker, the last object of a step
FILESYSTEMS = {"s3": ("s3fs", "pip install s3fs"), "gs": ("gcsfs", "pip install 'maxtrain[gcs]' (gcsfs)")}
_installed = False  # Orbax's spec builder is patched once per process


def atomicity(directory: str):
    """Orbax's atomicity options for a checkpoint directory: a commit marker in an object store,
    its default (an atomic rename of a temporary directory) on a filesystem."""
    if not storage.is_url(directory):
        return None
    return ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)


def require(directory: str) -> None:
    """A `checkpoint.dir` URL Orbax can reach: its fsspec filesystem installed, else one line."""
    scheme = storage.url_scheme(directory)
    module, fix = FILESYSTEMS[scheme]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"checkpoint.dir={directory}: {scheme}:// checkpoints need the `{module}` package; {fix}")
    install()


def install() -> None:
    """Teaches Orbax's TensorStore spec builder `s3://` (idempotent): the directory is kept as a URL
    (its normaliser would fold `s3://` into `s3:/`), taken as remote storage (no absolute-path
    check, read coalescing on), and its kvstore is TensorStore's `s3` driver."""
    global _installed
    if _installed:
        return
    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

    if not all(hasattr(m, n) for m, n in ((tsu, "_use_gcs_driver"), (tsu, "_normalize_path"),
                                          (gcs_utils, "get_kvstore_for_gcs"))):
        raise ConfigError(f"checkpoint.dir=s3://... needs orbax-checkpoint 0.12 (installed: {ocp.__version__}); "
                          f"pip install 'orbax-checkpoint>=0.12,<0.13'")

    remote, normalize, kvstore = tsu._use_gcs_driver, tsu._normalize_path, gcs_utils.get_kvstore_for_gcs

    def use_remote_driver(directory: str) -> bool:
        return directory.startswith("s3://") or remote(directory)

    def normalized(path: str) -> str:
        return "s3://" + normalize(path[len("s3://"):]).lstrip("/") if path.startswith("s3://") else normalize(path)

    def kvstore_spec(path: str) -> dict:
        return storage.tensorstore_kvstore(path) if path.startswith("s3://") else kvstore(path)

    tsu._use_gcs_driver, tsu._normalize_path = use_remote_driver, normalized
    gcs_utils.get_kvstore_for_gcs = kvstore_spec
    _installed = True
