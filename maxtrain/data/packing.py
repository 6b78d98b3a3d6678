"""Packing a token stream into fixed rows, and the seeded global row order shared by all sources.

A source is a stream of documents (each ending with EOS) laid end to end. Row r is the
`seq_len + 1` tokens from offset `r * seq_len`; global example g is row `order[g]`, where the
order is a seeded permutation per epoch (grain's index shuffle: O(1) memory, random access).
Example g therefore depends only on (data, seed, seq_len, g), never on how many hosts read it.
"""

from __future__ import annotations

import numpy as np

from maxtrain import imports


def pack_row(window: np.ndarray, doc_starts: np.ndarray, offset: int) -> dict[str, np.ndarray]:
    """Training arrays for the row whose `seq_len + 1` tokens `window` start at stream `offset`.

    A document cut by the row edge continues in the next row at position 0. The last token of each
    document is not trained to predict the first token of the next one.
    """
    window = window.astype(np.int32)
    idx = np.arange(offset, offset + len(window))
    doc = np.searchsorted(doc_starts, idx, side="right") - 1
    seg = (doc - doc[0] + 1).astype(np.int32)
    row_start = np.maximum(doc_starts[doc], offset)  # documents start at 0 or at the row edge
    positions = (idx - row_start).astype(np.int32)
    return {
        "inputs": window[:-1],
        "targets": window[1:],
        "loss_mask": (seg[:-1] == seg[1:]).astype(np.float32),
        "segment_ids": seg[:-1],
        "positions": positions[:-1],
    }


def step_rng(seed: int, *stream: int) -> np.random.Generator:
    """A generator determined by (seed, stream...), independent of call order."""
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


def mix_seed(*parts: int) -> int:
    """A 31-bit seed derived from several integers (run seed, stream id, ...)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0] >> 1)


class PackedSource:
    """Base for stream sources: subclasses set `n_tokens`, `doc_starts` and implement `window`."""

    n_tokens: int
    doc_starts: np.ndarray
    seq_len: int
    batch_size: int
    seed: int

    def window(self, offset: int, length: int) -> np.ndarray:
        raise NotImplementedError

    def _init_rows(self, stream_seed: int) -> None:
        self.n_rows = (self.n_tokens - 1) // self.seq_len
        grain = imports.quietly("grain")
        self._order = grain.MapDataset.range(max(self.n_rows, 1)).shuffle(seed=stream_seed)

    def __len__(self) -> int:
        return self.n_rows

    def example(self, index: int) -> dict[str, np.ndarray]:
        """Global example `index` (over all epochs)."""
        offset = int(self._order[index]) * self.seq_len
        return pack_row(self.window(offset, self.seq_len + 1), self.doc_starts, offset)

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Global examples `start..stop-1` stacked."""
        rows = [self.example(g) for g in range(start, stop)]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step * self.batch_size, (step + 1) * self.batch_size)
