"""What every process agrees on: process 0's list, a flag true on all, every process's values.

With one process each is the identity, and no collective runs.
"""

from __future__ import annotations

import jax
import numpy as np


def same_on_all_processes(steps: list[int]) -> list[int]:
    """Process 0's list of step numbers, on every process (the newest 4096 at most)."""
    if jax.process_count() == 1:
        return steps
    from jax.experimental import multihost_utils

    buf = np.full(4096, -1, np.int64)
    kept = steps[-4096:]  # the newest, if ever more (steps are sorted oldest first)
    buf[: len(kept)] = kept
    return [int(x) for x in multihost_utils.broadcast_one_to_all(buf) if x >= 0]


def true_on_all_processes(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(flag))))


def allgather(values: np.ndarray) -> np.ndarray:
    """`values` of every process, stacked along a new leading axis (in process order)."""
    if jax.process_count() == 1:
        return np.asarray(values)[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(values)))
