"""`data.kind: tokens`: packed rows read at random from `maxtrain prepare` shards, and mixtures."""

from __future__ import annotations

import json
import os
import threading

import numpy as np

from maxtrain.config import Config, ConfigError
from maxtrain.data.packing import PackedSource, mix_seed
from maxtrain.data.manifest import read_lengths, read_manifest, sha256_file, tokenizer_identity


class ShardSet:
    """One split of a prepared directory as a virtual stream of its documents, shard after shard.

    Cheap checks run at construction (manifest, files present, length indexes, vocab). When this
    process first opens a shard it checks the record count and, with `verify="sha256"` (the
    default), the shard's sha256, before any of its records is used. That reads every shard once
    per process: for large data on many hosts, `maxtrain prepare --verify DIR` once and
    `verify="count"` (`data.verify: count`) skip it. Every read checks each record's size against
    its length and dtype, and its token ids against the vocab size.
    """

    VERIFY = ("sha256", "count")

    def __init__(self, path: str, split: str = "train", vocab_size: int | None = None, verify: str = "sha256"):
        if verify not in self.VERIFY:
            raise ConfigError(f"data.verify={verify!r} is unknown; choose one of {', '.join(self.VERIFY)}")
        self.path, self.verify = path, verify
        manifest = read_manifest(path)
        if split not in manifest["splits"]:
            raise ConfigError(f"{path} has no {split!r} split (has {', '.join(manifest['splits']) or 'none'})")
        self.manifest = manifest
        self.vocab_size = int(manifest["vocab_size"])
        self.dtype = np.dtype(manifest["dtype"])
        if vocab_size is not None and self.vocab_size > vocab_size:
            raise ConfigError(f"{path}: tokenizer vocab size {self.vocab_size} exceeds model.vocab_size={vocab_size}; "
                              f"set model.vocab_size>={self.vocab_size}")
        self.shards = manifest["splits"][split]["shards"]
        self.lengths = [self._lengths(s) for s in self.shards]
        doc_lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        if doc_lengths.sum() < 2:
            raise ConfigError(f"{path} split {split!r} holds no tokens")
        self.doc_starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]).astype(np.int64)
        self.n_tokens = int(doc_lengths.sum())
        counts = np.array([len(x) for x in self.lengths])
        self._first_doc = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # per shard
        self._readers: dict[int, object] = {}
        self._locks = [threading.Lock() for _ in self.shards]  # prefetch threads: each shard opened once

    def _lengths(self, s: dict) -> np.ndarray:
        for f in (s["file"], s["lengths_file"]):
            full = os.path.join(self.path, f)
            if not os.path.isfile(full):
                why = "is not a file" if os.path.exists(full) else "is missing"
                raise ConfigError(f"{self.path}: {f} listed in the manifest {why}; re-run prepare")
        lp = os.path.join(self.path, s["lengths_file"])
        if sha256_file(lp) != s["lengths_sha256"]:
            raise ConfigError(f"{lp} does not match its manifest checksum; the data is corrupt, re-run prepare")
        lengths = read_lengths(lp)
        if len(lengths) != s["documents"] or int(lengths.sum()) != s["tokens"]:
            raise ConfigError(f"{lp} disagrees with the manifest's counts; re-run prepare")
        return lengths

    def __getstate__(self):  # readers are per process; reopened (and re-verified) after pickling
        return {**self.__dict__, "_readers": {}, "_locks": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._locks = [threading.Lock() for _ in self.shards]

    def reader(self, i: int):
        if i in self._readers:
            return self._readers[i]
        with self._locks[i]:
            if i not in self._readers:
                self._readers[i] = self._open(i)
        return self._readers[i]

    def _open(self, i: int):
        from array_record.python.array_record_module import ArrayRecordReader

        s = self.shards[i]
        path = os.path.join(self.path, s["file"])
        if self.verify == "sha256":
            if sha256_file(path) != s["sha256"]:
                raise ConfigError(f"{path} does not match its manifest checksum; the shard is corrupt, re-run prepare")
        try:
            r = ArrayRecordReader(path)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"{path} is not a readable ArrayRecord file: {str(e)[:200]}") from None
        if r.num_records() != s["documents"]:
            raise ConfigError(f"{path} has {r.num_records()} records, the manifest says {s['documents']}")
        return r

    def window(self, offset: int, length: int) -> np.ndarray:
        """Tokens `[offset, offset + length)` of the stream."""
        first = int(np.searchsorted(self.doc_starts, offset, side="right") - 1)
        last = int(np.searchsorted(self.doc_starts, offset + length - 1, side="right") - 1)
        parts = []
        doc = first
        while doc <= last:
            shard = int(np.searchsorted(self._first_doc, doc, side="right") - 1)
            stop = min(last + 1, int(self._first_doc[shard + 1]))
            local = list(range(doc - int(self._first_doc[shard]), stop - int(self._first_doc[shard])))
            parts.append(self.read(shard, local))
            doc = stop
        tokens = np.concatenate(parts)
        start = offset - int(self.doc_starts[first])
        return tokens[start: start + length]

    def read(self, shard: int, local: list[int]) -> np.ndarray:
        """Records `local` of a shard as one array of token ids, each record's size checked against
        its length and the dtype, and every id against the vocab size (the manifest's, which
        model.vocab_size covers): a wrong manifest never reaches the model as other ids."""
        path = os.path.join(self.path, self.shards[shard]["file"])
        try:
            records = self.reader(shard).read(local)
        except RuntimeError as e:  # riegeli's own chunk checks (data.verify=count skips the sha256)
            raise ConfigError(f"{path} is corrupt ({str(e).splitlines()[0][:160]}); re-run prepare") from None
        lengths = self.lengths[shard][local]
        sizes = np.array([len(r) for r in records], np.int64)
        bad = np.flatnonzero(sizes != lengths * self.dtype.itemsize)
        if len(bad):
            k = int(bad[0])
            raise ConfigError(f"{path} record {local[k]} holds {sizes[k]} bytes, not {lengths[k]} {self.dtype} "
                              f"tokens; the shard or manifest.json is corrupt, re-run prepare")
        ids = np.frombuffer(b"".join(records), self.dtype)
        if len(ids) and int(ids.max()) >= self.vocab_size:
            at = int(np.argmax(ids >= self.vocab_size))
            k = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
            raise ConfigError(f"{path} record {local[k]} holds token id {int(ids[at])} >= vocab size "
                              f"{self.vocab_size}; the shard or manifest.json is corrupt, re-run prepare")
        return ids


class TokensSource(PackedSource):
    """Packed rows over one prepared directory (split `train`, or `val` for evaluation)."""

    def __init__(self, cfg: Config, path: str, split: str = "train", stream: int = 0):
        self.batch_size = cfg.train.batch_size
        self.seq_len = cfg.train.seq_len
        self.seed = cfg.seed
        self.shards = ShardSet(path, split, cfg.model.vocab_size, verify=cfg.data.verify)
        self.vocab_size = self.shards.vocab_size
        self.n_tokens = self.shards.n_tokens
        self.doc_starts = self.shards.doc_starts
        self._init_rows(mix_seed(cfg.seed, 0x70C5, stream))
        if self.n_rows < 1:
            raise ConfigError(f"{path} split {split!r} has {self.n_tokens} tokens, fewer than one row of "
                              f"train.seq_len={self.seq_len}")

    def window(self, offset: int, length: int) -> np.ndarray:
        return self.shards.window(offset, length)


MIX_BLOCK = 1024  # examples per block in which the mixture's proportions are exact


class Mixture:
    """Weighted sources: each block of MIX_BLOCK global examples holds each source's share (largest
    remainder), in a seeded order, so proportions match the weights and example g is random access."""

    def __init__(self, sources: list, weights: list[float], seed: int, batch_size: int):
        if len(sources) != len(weights) or not all(np.isfinite(w) and w > 0 for w in weights):
            raise ConfigError("data.path mixture weights must be positive numbers, one per directory")
        ids = [tokenizer_identity(s.shards.path, s.shards.manifest) for s in sources]
        if len(set(ids)) > 1:
            other = next(i for i, x in enumerate(ids) if x != ids[0])
            raise ConfigError(f"data.path mixes directories prepared with different tokenizers ({sources[0].shards.path} "
                              f"and {sources[other].shards.path}); prepare every source with the same tokenizer")
        self.sources, self.batch_size = sources, batch_size
        self.vocab_size = max(s.vocab_size for s in sources)
        w = np.asarray(weights, float) / sum(weights)
        counts = np.floor(w * MIX_BLOCK).astype(int)
        for i in np.argsort(-(w * MIX_BLOCK - counts))[: MIX_BLOCK - counts.sum()]:
            counts[i] += 1
        if (counts == 0).any():
            raise ConfigError(f"data.path mixture weight below 1/{MIX_BLOCK} of the total would never be sampled")
        self.counts = counts
        self._seed = seed
        self._block_cache: tuple[int, np.ndarray, np.ndarray] | None = None

    def _block(self, b: int):
        cache = self._block_cache  # read once: grain threads share this object
        if cache is None or cache[0] != b:
            labels = np.repeat(np.arange(len(self.sources)), self.counts)
            labels = np.random.default_rng([self._seed, 0x313, b]).permutation(labels)
            rank = np.zeros(MIX_BLOCK, np.int64)
            for s in range(len(self.sources)):
                where = labels == s
                rank[where] = np.arange(where.sum())
            cache = self._block_cache = (b, labels, rank)
        return cache[1:]

    def source_of(self, index: int) -> tuple[int, int]:
        """(source, that source's example index) for global example `index`."""
        b, i = divmod(index, MIX_BLOCK)
        labels, rank = self._block(b)
        s = int(labels[i])
        return s, b * int(self.counts[s]) + int(rank[i])

    def example(self, index: int) -> dict[str, np.ndarray]:
        s, j = self.source_of(index)
        return self.sources[s].example(j)

    rows = PackedSource.rows
    batch = PackedSource.batch


def parse_mixture(path) -> list[tuple[str, float]]:
    """`DIR`, `[DIR, ...]` (equal weights) or `[{path: DIR, weight: W}, ...]` -> [(dir, weight)]."""
    if isinstance(path, str):
        return [(path, 1.0)]
    out = []
    for item in path:
        if isinstance(item, str):
            out.append((item, 1.0))
        elif isinstance(item, dict) and "path" in item:
            try:
                out.append((item["path"], float(item.get("weight", 1.0))))
            except (TypeError, ValueError):
                raise ConfigError(f"data.path weight {item.get('weight')!r} of {item['path']} is not a number") from None
        else:
            raise ConfigError(f"data.path entry {item!r} is neither a directory nor {{path: DIR, weight: W}}")
    return out


def local_mixture(path, cache_dir: str) -> list[tuple[str, float]]:
    """`parse_mixture`, with each s3:// or gs:// prefix mirrored into `cache_dir` (`object_cache`)
    and named by its local copy (`storage.stage`: fetched once per node, again when an object
    changes; the shards' sha256 is still checked when a process first opens them)."""
    from maxtrain import storage

    return [(storage.stage(p, cache_dir) if storage.is_url(p) else p, w) for p, w in parse_mixture(path)]


def make_tokens_source(cfg: Config, path, split: str = "train"):
    entries = local_mixture(path, cfg.object_cache)
    sources = [TokensSource(cfg, p, split, stream=i) for i, (p, _) in enumerate(entries)]
    if len(sources) == 1:
        return sources[0]
    return Mixture(sources, [w for _, w in entries], cfg.seed, cfg.train.batch_size)
