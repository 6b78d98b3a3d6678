"""Where paths may point. Today: local and shared (POSIX) filesystems only. A path with a URL
scheme (`s3://bucket/x`, `gs://...`, `file://...`) is refused with one line before anything is
read or written: taken as a local path it would become a directory named `s3:` in the working
directory (on a cluster, on one node's disk, gone with it). Imports nothing heavy."""

from __future__ import annotations

import re

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(path) -> str | None:
    """The URL scheme `path` starts with (`s3`, `gs`, ...), or None for a plain path."""
    match = _SCHEME.match(path) if isinstance(path, str) else None
    return match.group(1).lower() if match else None


def local_path_problem(what: str, path) -> str | None:
    """One line saying why `path` (given as `what`) cannot be used, or None when it can."""
    scheme = url_scheme(path)
    if scheme is None:
        return None
    return (f"{what}={path}: {scheme}:// paths are not supported (object stores are not yet); give a local or "
            f"shared-filesystem path (a mounted bucket works)")


def mixture_paths(value) -> list:
    """The paths in a `data.path`-style value: one path, a list of them, or a list of {path, weight}."""
    items = value if isinstance(value, list) else [value]
    return [item.get("path") if isinstance(item, dict) else item for item in items if item is not None]
