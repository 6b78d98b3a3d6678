"""Text files -> byte tokens -> packed fixed-length rows with segment ids and positions."""

from __future__ import annotations

import glob
import os
import sysconfig

import numpy as np

from maxtrain.config import Config, ConfigError
from maxtrain.data import step_rng

BYTE_VOCAB = 256
EOS_ID = 256  # appended to every document
BYTE_TOKENIZER_SIZE = 257


def stdlib_files() -> list[str]:
    """The `.py` files of this Python's standard library: real text on every machine with Python."""
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    return sorted(f for f in files if "site-packages" not in f)


def resolve_files(path: str | None) -> list[str]:
    """`stdlib`, a file, a directory (all files below it), or a glob -> sorted file list."""
    if path in (None, "stdlib"):
        files = stdlib_files()
    elif os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(f))
    else:
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
        raise ConfigError(f"data.path={path!r} matches no files; give a file, a directory, a glob or 'stdlib'")
    return files


def encode_bytes(text: bytes) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8).astype(np.uint16)


def load_corpus(files: list[str], max_bytes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated byte tokens (EOS after each document) and each document's start offset.

    Files are taken in a seeded order until `max_bytes`, so the corpus is the same on every run.
    """
    order = step_rng(seed, 0xF11E).permutation(len(files))
    chunks, starts, total = [], [], 0
    for i in order:
        try:
            with open(files[i], "rb") as f:
                data = f.read(max(max_bytes - total, 0))
        except OSError as e:
            raise ConfigError(f"cannot read data file {files[i]}: {e.strerror}") from None
        if not data:
            continue
        starts.append(total)
        chunks.append(encode_bytes(data))
        chunks.append(np.array([EOS_ID], np.uint16))
        total += len(data) + 1
        if total >= max_bytes:
            break
    if not chunks:
        raise ConfigError("data files are all empty; point data.path at text")
    return np.concatenate(chunks), np.asarray(starts, np.int64)


def pack_row(stream: np.ndarray, doc_starts: np.ndarray, offset: int, seq_len: int) -> dict[str, np.ndarray]:
    """The row of `seq_len` tokens starting at `offset` of the stream, with packing metadata.

    A document cut by the row edge continues in the next row at position 0. The last token of each
    document is not trained to predict the first token of the next one.
    """
    window = stream[offset: offset + seq_len + 1].astype(np.int32)
    idx = np.arange(offset, offset + seq_len + 1)
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


class TextSource:
    """Byte-level packed rows over text files; rows shuffled per epoch with the run's seed."""

    vocab_size = BYTE_TOKENIZER_SIZE

    def __init__(self, cfg: Config):
        self.batch_size = cfg.train.batch_size
        self.seq_len = cfg.train.seq_len
        self.seed = cfg.seed
        self.stream, self.doc_starts = load_corpus(resolve_files(cfg.data.path), cfg.data.max_bytes, cfg.seed)
        self.n_rows = (len(self.stream) - 1) // self.seq_len
        if self.n_rows < 1:
            raise ConfigError(f"data.path has {len(self.stream)} tokens, fewer than one row of "
                              f"train.seq_len={self.seq_len}; add text or shorten seq_len")
        self._perm_epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.n_rows

    def _row_order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm_epoch, self._perm = epoch, step_rng(self.seed, 0x7E47, epoch).permutation(self.n_rows)
        return self._perm

    def example(self, index: int) -> dict[str, np.ndarray]:
        """Global example `index` (over all epochs)."""
        epoch, i = divmod(index, self.n_rows)
        row = int(self._row_order(epoch)[i])
        return pack_row(self.stream, self.doc_starts, row * self.seq_len, self.seq_len)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rows = [self.example(step * self.batch_size + b) for b in range(self.batch_size)]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
