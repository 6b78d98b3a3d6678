"""Deterministic synthetic tokens with learnable structure, for tests and benchmarks."""

from __future__ import annotations

import numpy as np

from maxtrain.config import Config
from maxtrain.data import step_rng


class SyntheticSource:
    """Each row is an arithmetic progression `(a + i*b) mod V` with random start and stride.

    Predicting the next token needs the two before it, so a model's loss falls well below
    log(V) as it learns; example g is a pure function of (seed, stream, g).
    """

    def __init__(self, cfg: Config, stream: int = 0):
        self.batch_size = cfg.train.batch_size
        self.seq_len = cfg.train.seq_len
        self.vocab_size = cfg.model.vocab_size
        self.seed = cfg.seed
        self.stream = stream

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
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
