"""A step's saved meta read without Orbax or jax (the standard library only), so the config can
read a checkpoint's `model` section before anything heavy is imported.

`Checkpointer.save` (manager.py) writes the meta as the Orbax item `meta`, whose JSON handler
keeps it in `DIR/<step>/meta/metadata`. What is read here is not verified: the restore checks the
meta against the step's manifest later.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

META_ITEM = "meta"  # the Orbax item holding a step's meta
META_FILE = "metadata"  # the file Orbax's JSON handler writes inside the item's directory


def step_dirs(path: str) -> list[str]:
    """One step directory as itself; a checkpoint directory as its step directories, newest first
    (under an s3:// or gs:// prefix: its step prefixes, committed or not)."""
    from maxtrain import storage

    if storage.is_url(path):
        names = storage.list_prefixes(path)
        return [storage.join(path, d) for d in sorted((d for d in names if d.isdigit()), key=int, reverse=True)]
    if os.path.isdir(os.path.join(path, META_ITEM)):
        return [path]
    names = os.listdir(path) if os.path.isdir(path) else []
    return [os.path.join(path, d) for d in sorted((d for d in names if d.isdigit()), key=int, reverse=True)]


def read_step_meta(step_dir: str) -> dict | None:
    """The meta JSON object of one step directory; None when it is missing, unreadable or not an object."""
    try:
        with open(os.path.join(step_dir, META_ITEM, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def saved_metas(path: str) -> Iterator[dict]:
    """The readable metas of a checkpoint directory's steps (newest first) or of one step directory,
    on a filesystem or under an s3:// or gs:// prefix."""
    from maxtrain import storage

    if storage.is_url(path):
        yield from _saved_metas_at(path)
        return
    for step_dir in step_dirs(path):
        meta = read_step_meta(step_dir)
        if meta is not None:
            yield meta


def _saved_metas_at(url: str) -> Iterator[dict]:
    """`saved_metas` of a prefix in an object store (its listing, then one read per step)."""
    from maxtrain import storage

    own = f"{META_ITEM}/{META_FILE}"
    keys = {o["key"] for o in storage.list_objects(url)}
    if own in keys:
        prefixes = [url]
    else:
        steps = {k.split("/", 1)[0] for k in keys if k.count("/") == 2 and k.endswith("/" + own)}
        prefixes = [storage.join(url, s) for s in sorted((s for s in steps if s.isdigit()), key=int, reverse=True)]
    for prefix in prefixes:
        try:
            meta = json.loads(storage.read_bytes(storage.join(prefix, own)))
        except (ValueError, storage.StorageError):
            continue
        if isinstance(meta, dict):
            yield meta
