"""Text files -> byte tokens -> packed fixed-length rows with segment ids and positions."""

from __future__ import annotations

import glob
import os
import sysconfig

import numpy as np

from maxtrain.config import Config, ConfigError
from maxtrain.data.packing import PackedSource, mix_seed, step_rng
from maxtrain.data.tokenizers import BYTE_EOS

EOS_ID = BYTE_EOS  # appended to every document
BYTE_TOKENIZER_SIZE = BYTE_EOS + 1


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


class TextSource(PackedSource):
    """Byte-level packed rows over text files; rows shuffled per epoch with the run's seed."""

    vocab_size = BYTE_TOKENIZER_SIZE

    def __init__(self, cfg: Config, path: str | None = None, stream_seed: int = 0x7E47):
        path = path if path is not None else cfg.data.path
        self.batch_size = cfg.train.batch_size
        self.seq_len = cfg.train.seq_len
        self.seed = cfg.seed
        self.stream, self.doc_starts = load_corpus(resolve_files(path), cfg.data.max_bytes, cfg.seed)
        self.n_tokens = len(self.stream)
        self._init_rows(mix_seed(cfg.seed, stream_seed))
        if self.n_rows < 1:
            raise ConfigError(f"data.path has {len(self.stream)} tokens, fewer than one row of "
                              f"train.seq_len={self.seq_len}; add text or shorten seq_len")

    def window(self, offset: int, length: int) -> np.ndarray:
        return self.stream[offset: offset + length]
