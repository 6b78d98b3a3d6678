"""The tokenizer kept with a checkpoint.

A run's saved config names its data by `data.path` as written, often relative to where training
ran; generate and eval may run anywhere. So each save records the data's tokenizer in the step's
meta (`tokenizer`: {"kind": "byte"}, or the kind, file name and sha256 of a copy in DIR):
`data_tokenizer` writes that record, `kept_tokenizer` turns it back into a tokenizer spec
(`verify.saved_tokenizer` finds the record of a checkpoint's newest step).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil

import jax

from maxtrain import storage
from maxtrain.checkpoint.errors import one_line
from maxtrain.config import ConfigError

log = logging.getLogger("maxtrain")


def keep_tokenizer(directory: str, spec: str) -> dict:
    """The meta record of tokenizer `spec` ("byte", or a tokenizer.json / SentencePiece .model file):
    a file is copied into the checkpoint `directory` (by process 0; an s3:// or gs:// prefix gets an
    object) as tokenizer.json / tokenizer.model, or tokenizer-<sha256 prefix>.<ext> when another
    tokenizer holds that name."""
    from maxtrain.data.manifest import sha256_file

    if spec == "byte":
        return {"kind": "byte"}
    ext = ".model" if spec.endswith(".model") else ".json"
    digest = sha256_file(spec)
    name = "tokenizer" + ext
    if storage.is_url(directory):
        return _keep_in_bucket(directory, spec, name, digest)
    held = os.path.join(directory, name)
    if os.path.exists(held) and sha256_file(held) != digest:
        name = f"tokenizer-{digest[:12]}{ext}"
    dest = os.path.join(directory, name)
    if jax.process_index() == 0 and not os.path.exists(dest):
        os.makedirs(directory, exist_ok=True)
        tmp = f"{dest}.tmp-{os.getpid()}"
        shutil.copyfile(spec, tmp)
        os.replace(tmp, dest)
    return {"kind": "sentencepiece" if ext == ".model" else "hf", "file": name, "sha256": digest}


def _keep_in_bucket(url: str, spec: str, name: str, digest: str) -> dict:
    """`keep_tokenizer` into a checkpoint prefix in an object store."""
    held = storage.join(url, name)
    if storage.exists(held) and hashlib.sha256(storage.read_bytes(held)).hexdigest() != digest:
        name = f"tokenizer-{digest[:12]}{os.path.splitext(name)[1]}"
    dest = storage.join(url, name)
    if jax.process_index() == 0 and not storage.exists(dest):
        storage.upload(spec, dest)
    kind = "sentencepiece" if name.endswith(".model") else "hf"
    return {"kind": kind, "file": name, "sha256": digest}


@functools.lru_cache(maxsize=8)
def _data_tokenizer(directory: str, kind: str, path_json: str, cache: str, cwd: str) -> dict | None:
    from maxtrain.data.manifest import manifest_tokenizer, read_manifest
    from maxtrain.data.tokens import parse_mixture

    path = json.loads(path_json)
    if kind == "text":
        return {"kind": "byte"}
    if kind != "tokens" or not path:
        return None
    first = parse_mixture(path)[0][0]  # a mixture's sources share one tokenizer (make_tokens_source)
    if storage.is_url(first):  # the node's copy the data is read from (tokens.py staged it)
        first = storage.cache_path(first, cache)
    return keep_tokenizer(directory, manifest_tokenizer(first, read_manifest(first)))


def data_tokenizer(directory: str, config: dict | None) -> dict | None:
    """The record of the tokenizer the saved `config` (a mapping) trains on, kept with the checkpoint
    in `directory` (once per process); None for data that names none (synthetic). Never fails a
    save: a tokenizer that cannot be read or copied is one warning, and generate then needs
    --tokenizer."""
    data = (config or {}).get("data") or {}
    try:
        cache = (config or {}).get("object_cache") or storage.DEFAULT_CACHE
        return _data_tokenizer(directory, str(data.get("kind")), json.dumps(data.get("path")), cache, os.getcwd())
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
        log.warning("checkpoint %s: the training data's tokenizer is not kept with it (%s); generate and eval "
                    "from it need --tokenizer", directory, one_line(e))
        return None


def kept_tokenizer(directory: str, record: dict, path: str) -> str:
    """A meta's tokenizer `record` as a `load_tokenizer` spec: "byte", or the path of its copy in the
    checkpoint `directory`. A copy that is gone or altered is a one-line error (naming `path`, the
    checkpoint as the user gave it) that names --tokenizer."""
    from maxtrain.data.manifest import sha256_file

    if record.get("kind") == "byte":
        return "byte"
    copy = os.path.join(directory, record["file"])
    if not os.path.isfile(copy) or sha256_file(copy) != record["sha256"]:
        raise ConfigError(f"checkpoint {path}: the tokenizer kept with it, {copy}, is "
                          f"{'altered' if os.path.isfile(copy) else 'missing'}; pass --tokenizer (byte, a "
                          f"tokenizer.json or a SentencePiece .model)")
    return copy
