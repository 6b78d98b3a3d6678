"""Which blocks a flash attention tile visits and which of its scores it masks: shared by the
Triton kernels (`kernels/flash.py`) and the Mosaic GPU ones (`kernels/flash_hopper.py`), so both
backends skip and mask the same blocks.

`st` is `flash._Static` (the settings the kernels specialise on); these read its `length`,
`padded`, `causal`, `window` and `segmented`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _cdiv(a, b: int):
    """Ceil division of a non-negative (traced) int by a static one (lax.div: no floor fix-ups)."""
    return lax.div(a + (b - 1), b)


def _clip(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def _split_range(lo, lo_full, hi_full, hi):
    """[lo, hi) as masked [lo, b), unmasked [b, c), masked [c, hi); [b, c) lies inside [lo_full, hi_full)."""
    hi = jnp.maximum(hi, lo)
    b = _clip(lo_full, lo, hi)
    c = _clip(hi_full, b, hi)
    return lo, b, c, hi


def q_major_ranges(i, bq: int, bk: int, st):
    """Key blocks for query block i (rows [i*bq, (i+1)*bq)): (lo, b, c, hi), see `_split_range`.

    A key block outside [lo, hi) has no unmasked score; one in [b, c) has no masked score."""
    L, w = st.length, st.window
    n_k = -(-L // bk)  # key blocks holding real keys
    r0 = i * bq
    r1 = r0 + bq
    if st.causal:
        hi = jnp.minimum(n_k, _cdiv(r1, bk))  # past the block's last row: masked
        hi_full = lax.div(r0 + 1, bk)  # blocks ending at or before the first row
    else:
        hi = jnp.int32(n_k)
        hi_full = jnp.int32(n_k)
    hi_full = jnp.minimum(hi_full, L // bk)  # a block with padded keys needs the mask
    if w is not None:
        lo = lax.div(jnp.maximum(r0 - w + 1, 0), bk)  # the block holding the first row's oldest key
        lo_full = _cdiv(jnp.maximum(r1 - w, 0), bk)  # blocks the last row's window fully covers
    else:
        lo = lo_full = jnp.int32(0)
    if st.segmented:
        hi_full = jnp.int32(0)  # segment ids can mask anywhere
    hi = jnp.where(r0 < L, hi, lo)  # a block of padded rows only: nothing to compute
    return _split_range(lo, lo_full, hi_full, hi)


def kv_major_ranges(j, bq: int, bk: int, st):
    """Query blocks for key block j (columns [j*bk, (j+1)*bk)): (lo, b, c, hi), see `_split_range`."""
    L, w = st.length, st.window
    n_q = -(-L // bq)  # query blocks holding real rows (padded rows have zero cotangent)
    c0 = j * bk
    c1 = c0 + bk
    if st.causal:
        lo = lax.div(c0, bq)  # rows before the block's first column: masked
        lo_full = _cdiv(c1 - 1, bq)  # blocks starting at or after the last column
    else:
        lo = lo_full = jnp.int32(0)
    if w is not None:
        hi = jnp.minimum(n_q, _cdiv(c1 - 1 + w, bq))  # rows past the last column's window
        hi_full = lax.div(c0 + w, bq)  # blocks whose last row still sees the first column
    else:
        hi = hi_full = jnp.int32(n_q)
    hi_full = jnp.where(c1 <= L, hi_full, 0)  # padded keys in this block need the mask
    if st.segmented:
        hi_full = jnp.int32(0)
    hi = jnp.where(c0 < L, hi, lo)  # a block of padded keys only: its dK/dV are zero
    return _split_range(lo, lo_full, hi_full, hi)


def score_mask(rows, cols, q_seg, k_seg, st, shape):
    """Boolean `shape` = [rows, cols]: True where the score is kept; None when nothing is masked.

    rows `[bq, 1]` and cols `[1, bk]` are global token indices; q_seg `[bq]`, k_seg `[bk]` or None."""
    mask = None

    def both(a, b):
        return b if a is None else a & b

    if st.causal:
        mask = both(mask, cols <= rows)
    if st.window is not None:
        mask = both(mask, rows - cols < st.window)
    if st.padded != st.length:
        mask = both(mask, cols < st.length)
    if q_seg is not None:
        mask = both(mask, q_seg[:, None] == k_seg[None, :])
    return None if mask is None else jnp.broadcast_to(mask, shape)
