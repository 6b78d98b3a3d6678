"""Tokenizers loaded from local files: `byte`, a Hugging Face `tokenizer.json`, a SentencePiece `.model`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from maxtrain.config import ConfigError, require_module

BYTE_VOCAB = 256
BYTE_EOS = 256


@dataclass(frozen=True)
class Tokenizer:
    spec: str  # "byte" or the file path it was loaded from
    kind: str  # byte | hf | sentencepiece
    vocab_size: int  # ids are < vocab_size
    eos_id: int
    encode: Callable[[str], list[int]]
    encode_batch: Callable[[list[str]], list[np.ndarray]] | None = None  # faster path, same ids
    decode: Callable[[list[int]], str] | None = None  # ids -> text (`maxtrain generate`)

    def encode_docs(self, docs: list[str]) -> list[np.ndarray]:
        """Token ids of each document with EOS appended, in the shard dtype."""
        dtype = token_dtype(self.vocab_size)
        ids = self.encode_batch(docs) if self.encode_batch else [np.asarray(self.encode(d)) for d in docs]
        return [np.concatenate([np.asarray(x, dtype=dtype), np.array([self.eos_id], dtype)]) for x in ids]

    def describe(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


def _byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _byte_encode_batch(docs: list[str]) -> list[np.ndarray]:
    return [np.frombuffer(d.encode("utf-8"), np.uint8) for d in docs]


def _byte_decode(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", "replace")  # EOS and beyond dropped


def byte_tokenizer() -> Tokenizer:
    return Tokenizer("byte", "byte", BYTE_VOCAB + 1, BYTE_EOS, _byte_encode, _byte_encode_batch, _byte_decode)


def load_tokenizer(spec: str) -> Tokenizer:
    """`byte`, a `tokenizer.json` (or a directory holding one), or a SentencePiece `.model` file."""
    if spec == "byte":
        return byte_tokenizer()
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer {spec} not found; give 'byte', a tokenizer.json or a SentencePiece .model")
    if path.endswith(".model"):
        return _sentencepiece(path)
    return _hf(path)


def _hf(path: str) -> Tokenizer:
    HFTokenizer = require_module("tokenizers", "tokenizers", f"the tokenizer {path}", "data").Tokenizer

    try:
        tok = HFTokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001  (the library raises plain Exceptions for bad files)
        raise ConfigError(f"tokenizer {path} does not load: {str(e).splitlines()[0][:200]}") from None
    eos = _special_id(tok.token_to_id, ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[EOS]"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if eos is None:
        raise ConfigError(f"tokenizer {path} has no end-of-text token (</s>, <|endoftext|>, <eos>, ...)")

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def encode_batch(docs: list[str]) -> list[np.ndarray]:  # the Rust side parallelises the batch
        return [np.asarray(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False)]

    return Tokenizer(path, "hf", vocab, eos, encode, encode_batch, lambda ids: tok.decode(list(ids)))


def _special_id(lookup, names: Iterable[str]) -> int | None:
    for name in names:
        i = lookup(name)
        if i is not None:
            return int(i)
    return None


def _sentencepiece(path: str) -> Tokenizer:
    spm = require_module("sentencepiece", "sentencepiece", f"the SentencePiece tokenizer {path}", "data")

    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"tokenizer {path} does not load as SentencePiece: {str(e).splitlines()[0][:200]}") from None
    eos = sp.eos_id()
    if eos < 0:
        raise ConfigError(f"tokenizer {path} has no end-of-sequence id")

    def encode(text: str) -> list[int]:
        return sp.encode(text)

    def encode_batch(docs: list[str]) -> list[np.ndarray]:
        return [np.asarray(x) for x in sp.encode(docs)]

    return Tokenizer(path, "sentencepiece", sp.get_piece_size(), eos, encode, encode_batch,
                     lambda ids: sp.decode([int(i) for i in ids]))


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str) -> Tokenizer:
    """Trains a byte-level BPE tokenizer with an `<|endoftext|>` token and saves it as tokenizer.json."""
    require_module("tokenizers", "tokenizers", "--train-tokenizer", "data")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tok.save(out_path)
    return _hf(out_path)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
