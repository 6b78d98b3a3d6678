"""Deterministic synthetic tokens with learnable structure, for tests and benchmarks."""

from __future__ import annotations

import numpy as np

from maxtrain.config import Config
from maxtrain.data.packing import step_rng


class SyntheticSource:
    """Each row is an arithmetic progression `(a + i*b) mod V` with random start and stride.

    Predicting the next token needs the two before it, so a model's loss falls well below
    log(V) as it learns; example g is a pure function of (seed, stream, g).

    With `data.synthetic_doc_len` N > 0 a row packs several progressions instead, as real packed
    data does: documents of random length 2..2N-1 (segment ids 1, 2, ..., positions restarting
    at 0, a document's last token predicting nothing), about one token in ten masked out of the
    loss, and in a third of the rows a padding tail (token 0, its own segment, fully masked).
    Every row's metadata differs, so a step that mixes rows up cannot match a reference.
    """

    def __init__(self, cfg: Config, stream: int = 0):
        self.batch_size = cfg.train.batch_size
        self.seq_len = cfg.train.seq_len
        self.vocab_size = cfg.model.vocab_size
        self.seed = cfg.seed
        self.stream = stream
        self.doc_len = cfg.data.synthetic_doc_len

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        if self.doc_len:
            rows = [_packed_row(step_rng(self.seed, 0x5EED, self.stream, g), self.seq_len, self.vocab_size,
                                self.doc_len) for g in range(start, stop)]
            return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        L, V, n = self.seq_len, self.vocab_size, stop - start
        ab = np.stack([step_rng(self.seed, 0x5EED, self.stream, g).integers(1, 2**31, 2) for g in range(start, stop)])
        start_tok, stride = (ab[:, :1] % V), 1 + ab[:, 1:] % min(V - 1, 16)
        seq = ((start_tok + stride * np.arange(L + 1)[None, :]) % V).astype(np.int32)
        return {
            "inputs": seq[:, :-1],
            "targets": seq[:, 1:],
            "loss_mask": np.ones((n, L), np.float32),
            "segment_ids": np.ones((n, L), np.int32),
            "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (n, L)).copy(),
        }

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step * self.batch_size, (step + 1) * self.batch_size)


def _packed_row(rng: np.random.Generator, L: int, V: int, doc_len: int) -> dict[str, np.ndarray]:
    """One row of packed progressions (see `SyntheticSource`)."""
    row = {"inputs": np.zeros(L, np.int32), "targets": np.zeros(L, np.int32), "loss_mask": np.zeros(L, np.float32),
           "segment_ids": np.zeros(L, np.int32), "positions": np.zeros(L, np.int32)}
    pad = min(int(rng.integers(1, doc_len // 2 + 2)), L - 1) if rng.random() < 1 / 3 else 0
    body, t, seg = L - pad, 0, 0
    while t < body:
        n = min(int(rng.integers(2, 2 * doc_len)) if doc_len > 1 else 2, body - t)
        a, b = rng.integers(0, V), 1 + rng.integers(0, min(V - 1, 16))
        seq = ((a + b * np.arange(n + 1)) % V).astype(np.int32)
        seg += 1
        mask = (rng.random(n) >= 0.1).astype(np.float32)
        mask[-1] = 0.0  # a document's last token predicts nothing
        for k, v in (("inputs", seq[:n]), ("targets", seq[1:]), ("loss_mask", mask), ("segment_ids", seg),
                     ("positions", np.arange(n))):
            row[k][t:t + n] = v
        t += n
    if pad:  # token 0 in a segment of its own, nothing trained
        row["segment_ids"][body:] = seg + 1
        row["positions"][body:] = np.arange(pad)
    return row
