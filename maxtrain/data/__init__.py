"""Input pipelines. A source maps a global step to the global batch of that step.

Every batch is a dict of `[batch_size, seq_len]` numpy arrays: `inputs`, `targets`, `loss_mask`,
`segment_ids` (1-based document index within the row) and `positions` (restarting per document).
Sources are stateless functions of the step, so a restart at step s sees exactly batch s.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from maxtrain.config import Config, ConfigError, did_you_mean


class Source(Protocol):
    vocab_size: int  # smallest model vocabulary that covers the source's token ids

    def batch(self, step: int) -> dict[str, np.ndarray]: ...


def make_source(cfg: Config) -> Source:
    from maxtrain.data import synthetic, text

    kinds = {"synthetic": synthetic.SyntheticSource, "text": text.TextSource}
    if cfg.data.kind not in kinds:
        raise ConfigError(f"data.kind={cfg.data.kind!r} is unknown; {did_you_mean(cfg.data.kind, kinds)}choose one of {', '.join(kinds)}")
    source = kinds[cfg.data.kind](cfg)
    if source.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's "
                          f"{source.vocab_size} token ids; set model.vocab_size>={source.vocab_size}")
    return source


def step_rng(seed: int, *stream: int) -> np.random.Generator:
    """A generator determined by (seed, stream...), independent of call order."""
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))
