"""JAX's persistent compilation cache: a restarted job loads its compiled step."""

from __future__ import annotations

import os

import jax


def enable_compilation_cache(path: str | None) -> str | None:
    """JAX's persistent compilation cache, so a restarted job skips recompiling its step."""
    if not path:
        return None
    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path
