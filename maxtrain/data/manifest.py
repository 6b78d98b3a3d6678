"""A prepared directory's `manifest.json` and length indexes, read and checked: what `prepare`
writes and the token sources read (neither imports the other for it)."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np

from maxtrain.config import ConfigError
from maxtrain.data.tokenizers import token_dtype

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CHECKSUM = "manifest_sha256"  # a manifest field: sha256 of the manifest's canonical JSON without it

log = logging.getLogger("maxtrain")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{mpath} not found; data.path must be a directory written by `maxtrain prepare`") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{mpath} is unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION or "splits" not in manifest:
        raise ConfigError(f"{mpath} has an unknown format; re-run `maxtrain prepare`")
    problem = _manifest_problem(manifest)
    if problem:
        raise ConfigError(f"{mpath} is malformed ({problem}); re-run `maxtrain prepare`")
    _check_digest(manifest, mpath)
    return manifest


def manifest_tokenizer(path: str, manifest: dict) -> str:
    """The tokenizer a prepared directory was tokenized with, as a `load_tokenizer` spec: "byte", or
    its file: named relative to the directory (`prepare` keeps a copy there, so the directory can
    move), or an absolute path as an earlier maxtrain wrote it."""
    spec = manifest["tokenizer"].get("spec", "byte")
    return spec if spec == "byte" or os.path.isabs(spec) else os.path.join(path, spec)


def tokenizer_identity(path: str, manifest: dict) -> str:
    """What makes two prepared directories' tokenizers the same (canonical JSON): kind, vocabulary,
    EOS and the file's sha256, never where the file was. A manifest of an earlier maxtrain names its
    tokenizer by an absolute path and no sha256: the file's is computed, when it is still there."""
    record = {k: v for k, v in manifest["tokenizer"].items() if k != "spec"}
    spec = manifest_tokenizer(path, manifest)
    if spec != "byte" and "sha256" not in record and os.path.isfile(spec):
        record["sha256"] = sha256_file(spec)
    elif spec != "byte" and "sha256" not in record:
        record["file"] = spec  # gone: only its name can tell
    return json.dumps(record, sort_keys=True)


def manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_WARNED: set[str] = set()


def _check_digest(manifest: dict, mpath: str) -> None:
    if CHECKSUM not in manifest:  # written before manifests carried one: shards still checked as read
        if mpath not in _WARNED:
            _WARNED.add(mpath)
            log.warning("%s has no %s (written by an earlier maxtrain): its fields are checked only against "
                        "the shards as they are read (`maxtrain prepare --verify` reads them all)", mpath, CHECKSUM)
    elif manifest[CHECKSUM] != manifest_digest(manifest):
        raise ConfigError(f"{mpath} does not match its checksum ({CHECKSUM}): it was edited or damaged; "
                          f"re-run `maxtrain prepare`")


def read_lengths(path: str) -> np.ndarray:
    """A shard's length index: a 1-D integer .npy of lengths >= 1 (each record holds its EOS).
    Never unpickled."""
    try:
        lengths = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(f"{path} is not a plain .npy integer array ({str(e).splitlines()[0][:120]}); "
                          f"re-run prepare") from None
    if not isinstance(lengths, np.ndarray):  # an .npz archive
        raise ConfigError(f"{path} is not a plain .npy integer array; re-run prepare")
    if lengths.dtype.kind not in "iu":
        raise ConfigError(f"{path} is {lengths.dtype}, not integer: not a length index; re-run prepare")
    if lengths.ndim != 1:
        raise ConfigError(f"{path} is {lengths.ndim}-D, not 1-D: not a length index; re-run prepare")
    if len(lengths) and int(lengths.min()) < 1:
        raise ConfigError(f"{path} holds a length < 1 ({int(lengths.min())}); re-run prepare")
    return lengths.astype(np.int64)


_SHARD_FIELDS = {"file": str, "lengths_file": str, "documents": int, "tokens": int, "sha256": str,
                 "lengths_sha256": str}


def _of_type(value, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _manifest_problem(manifest: dict) -> str | None:
    """What a manifest lacks that readers index, or holds that prepare never writes (None when sound)."""
    for key, kind in (("vocab_size", int), ("dtype", str), ("tokenizer", dict), ("splits", dict)):
        if not _of_type(manifest.get(key), kind):
            return f"{key} is missing or not of type {kind.__name__}"
    if manifest["vocab_size"] < 1:
        return f"vocab_size {manifest['vocab_size']} is not positive"
    want = token_dtype(manifest["vocab_size"]).name
    if manifest["dtype"] != want:
        return f"dtype {manifest['dtype']!r} is not {want}, the dtype of vocab_size {manifest['vocab_size']}"
    files = set()
    for name, split in manifest["splits"].items():
        shards = split.get("shards") if isinstance(split, dict) else None
        if not isinstance(shards, list):
            return f"split {name!r} has no shard list"
        for i, shard in enumerate(shards):
            problem = _shard_problem(shard, files)
            if problem:
                return f"split {name!r} shard {i}: {problem}"
    return None


def _shard_problem(shard, files: set) -> str | None:
    for key, kind in _SHARD_FIELDS.items():
        if not isinstance(shard, dict) or not _of_type(shard.get(key), kind):
            return f"{key} is missing or not of type {kind.__name__}"
    for key in ("documents", "tokens"):
        if shard[key] < 0:
            return f"{key} {shard[key]} is negative"
    for key in ("file", "lengths_file"):
        name = shard[key]
        if os.path.basename(name) != name or name in ("", ".", ".."):  # prepare writes plain names
            return f"{key} {name!r} is not a file name in the data directory"
        if name in files:
            return f"{name} is listed twice"
        files.add(name)
    return None
