"""Deterministic synthetic tokens with learnable structure, for tests and benchmarks."""

from __future__ import annotations

import numpy as np

from maxtrain.config import Config
from maxtrain.data import step_rng


class SyntheticSource:
    """Each row is an arithmetic progression `(a + i*b) mod V` with random start and stride.

    Predicting the next token needs the two before it, so a model's loss falls well below
    log(V) as it learns; the batch of step s is a pure function of (seed, s).
    """

    def __init__(self, cfg: Config):
        self.batch_size = cfg.train.batch_size
        self.seq_len = cfg.train.seq_len
        self.vocab_size = cfg.model.vocab_size
        self.seed = cfg.seed

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rng = step_rng(self.seed, 0x5EED, step)
        B, L, V = self.batch_size, self.seq_len, self.vocab_size
        start = rng.integers(0, V, size=(B, 1))
        stride = rng.integers(1, min(V, 17), size=(B, 1))
        seq = ((start + stride * np.arange(L + 1)[None, :]) % V).astype(np.int32)
        return {
            "inputs": seq[:, :-1],
            "targets": seq[:, 1:],
            "loss_mask": np.ones((B, L), np.float32),
            "segment_ids": np.ones((B, L), np.int32),
            "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy(),
        }
