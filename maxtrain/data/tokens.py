"""`data.kind: tokens`: packed rows read at random from `maxtrain prepare` shards, and mixtures."""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

from maxtrain.config import Config, ConfigError
from maxtrain.data.packing import PackedSource, mix_seed
from maxtrain.data.manifest import read_lengths, read_manifest, sha256_file, tokenizer_identity

log = logging.getLogger("maxtrain")


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
    remainder), in a seeded order, so proportions match the weights and example g is random access.

    A weight may be a schedule, `((step, weight), ...)`: piecewise linear between the steps, constant
    before the first and after the last; a block takes the weights of its first example's step.
    Each source's example index is the count of its examples in the blocks before (a running sum over
    blocks, kept) plus its rank in the block, so the stream is still a pure function of the seed and
    the global index: exactly resumable. A source that runs out starts its next epoch (its rows in a
    new order); one marked `repeat: false` ends the run before that (`first_pass_end`)."""

    def __init__(self, sources: list, weights: list, seed: int, batch_size: int):
        if len(sources) != len(weights):
            raise ConfigError("data.path mixture weights must be positive numbers, one per directory")
        ids = [tokenizer_identity(s.shards.path, s.shards.manifest) for s in sources]
        if len(set(ids)) > 1:
            other = next(i for i, x in enumerate(ids) if x != ids[0])
            raise ConfigError(f"data.path mixes directories prepared with different tokenizers ({sources[0].shards.path} "
                              f"and {sources[other].shards.path}); prepare every source with the same tokenizer")
        self.sources, self.batch_size = sources, batch_size
        self.vocab_size = max(s.vocab_size for s in sources)
        self.schedules = [_schedule(w) for w in weights]
        self.scheduled = any(len(sch) > 1 for sch in self.schedules)
        _check_weights(self.schedules, self.scheduled)
        self._seed = seed
        self._lock = threading.Lock()
        self._counts = np.zeros((0, len(sources)), np.int64)  # per block, per source
        self._cum = np.zeros((1, len(sources)), np.int64)  # examples of each source before block b
        self._block_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        if not self.scheduled:
            self.counts = self._block_counts(np.arange(1))[0]
            if (self.counts == 0).any():
                raise ConfigError(f"data.path mixture weight below 1/{MIX_BLOCK} of the total would never be sampled")

    def weights_at(self, steps: np.ndarray) -> np.ndarray:
        """The normalised weights [len(steps), sources] at `steps`."""
        w = np.stack([np.interp(steps, [k for k, _ in sch], [v for _, v in sch]) for sch in self.schedules], axis=1)
        # summed left to right, as a fixed mixture always was (numpy's pairwise sum can differ in the last
        # bit from 8 sources on, and move a block's leftover example to another source)
        return w / np.asarray([sum(row.tolist()) for row in w])[:, None]

    def _block_counts(self, blocks: np.ndarray) -> np.ndarray:
        """Examples of each source in each of `blocks` (largest remainder of MIX_BLOCK x the weights)."""
        w = self.weights_at(blocks * MIX_BLOCK // self.batch_size) * MIX_BLOCK
        counts = np.floor(w).astype(np.int64)
        short = MIX_BLOCK - counts.sum(axis=1)
        order = np.argsort(-(w - counts), axis=1)  # as a fixed mixture's one row always was
        for k in range(counts.shape[1]):
            counts[np.arange(len(blocks)), order[:, k]] += (short > k).astype(np.int64)
        return counts

    def _upto(self, b: int) -> None:
        """Block counts and running sums through block `b`."""
        if b < len(self._counts):
            return
        with self._lock:  # grain threads share this object
            have = len(self._counts)
            if b < have:
                return
            more = self._block_counts(np.arange(have, max(b + 1, 2 * have)))
            counts = np.concatenate([self._counts, more])
            self._cum = np.concatenate([self._cum, self._cum[-1] + np.cumsum(more, axis=0)])
            self._counts = counts

    def _block(self, b: int):
        cache = self._block_cache  # read once: grain threads share this object
        if cache is None or cache[0] != b:
            self._upto(b)
            counts = self._counts[b]
            labels = np.repeat(np.arange(len(self.sources)), counts)
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
        return s, int(self._cum[b, s]) + int(rank[i])

    def examples_before(self, index: int) -> np.ndarray:
        """How many of the global examples before `index` each source gave."""
        b, i = divmod(index, MIX_BLOCK)
        labels, _ = self._block(b)
        return self._cum[b] + np.bincount(labels[:i], minlength=len(self.sources))

    def names(self) -> list[str]:
        """Each source's directory name (its index added where two share one)."""
        base = [os.path.basename(os.path.normpath(src.shards.path)) for src in self.sources]
        return [b if base.count(b) == 1 else f"{b}#{i}" for i, b in enumerate(base)]

    def tokens_seen(self, step: int) -> dict[str, int]:
        """Training tokens each source gave through `step` (steps from 1; rows of seq_len tokens)."""
        seq_len = self.sources[0].seq_len
        return {n: int(c) * seq_len for n, c in zip(self.names(), self.examples_before(step * self.batch_size))}

    def epochs(self, step: int) -> list[int]:
        """The epoch each source is in after `step` (0: its first pass)."""
        return [int(c) // max(len(src), 1) for c, src in zip(self.examples_before(step * self.batch_size), self.sources)]

    def example(self, index: int) -> dict[str, np.ndarray]:
        s, j = self.source_of(index)
        return self.sources[s].example(j)

    rows = PackedSource.rows
    batch = PackedSource.batch


def _schedule(weight) -> tuple[tuple[int, float], ...]:
    """A `data.path` weight as ((step, weight), ...), sorted by step: a number is one point."""
    if isinstance(weight, (int, float)):
        return ((0, float(weight)),)
    if isinstance(weight, dict):
        return tuple(sorted((int(k), float(v)) for k, v in weight.items()))
    return tuple(sorted((int(k), float(v)) for k, v in weight))


def _check_weights(schedules: list, scheduled: bool) -> None:
    """Weights are finite and not negative, positive for a source of a fixed mixture, and some source's
    positive at every scheduled step; a step's weights not summing to 1 are normalised (said once)."""
    for sch in schedules:
        for step, w in sch:
            if not np.isfinite(w) or w < 0 or (not scheduled and w <= 0):
                raise ConfigError("data.path mixture weights must be positive numbers, one per directory"
                                  + (" (a schedule's may be 0)" if scheduled else ""))
    steps = sorted({k for sch in schedules for k, _ in sch})
    sums = [sum(float(np.interp(k, [a for a, _ in sch], [v for _, v in sch])) for sch in schedules) for k in steps]
    if any(t <= 0 for t in sums):
        raise ConfigError(f"data.path mixture: every weight is 0 at step {steps[sums.index(min(sums))]}; "
                          "some source must be read at every step")
    if scheduled and any(abs(t - 1) > 1e-6 for t in sums):
        log.warning("data.path mixture: the weights sum to %s at steps %s, not 1; they are normalised",
                    ", ".join(f"{t:g}" for t in sums), ", ".join(map(str, steps)))


ENTRY_KEYS = ("path", "weight", "weights", "repeat")


def parse_mixture(path) -> list[tuple[str, float]]:
    """`DIR`, `[DIR, ...]` (equal weights) or `[{path: DIR, weight: W}, ...]` -> [(dir, weight)]."""
    if isinstance(path, str):
        return [(path, 1.0)]
    out = []
    for item in path:
        unknown = sorted(set(item) - set(ENTRY_KEYS)) if isinstance(item, dict) else []
        if unknown:
            raise ConfigError(f"data.path entry {item.get('path', item)!r}: unknown key {unknown[0]!r}; an entry takes "
                              f"{', '.join(ENTRY_KEYS)}")
        if isinstance(item, str):
            out.append((item, 1.0))
        elif isinstance(item, dict) and "path" in item and "weights" in item:
            if "weight" in item:
                raise ConfigError(f"data.path entry {item['path']}: give weight (a number) or weights (a schedule), "
                                  "not both")
            out.append((item["path"], _parse_schedule(item["path"], item["weights"])))
        elif isinstance(item, dict) and "path" in item:
            try:
                out.append((item["path"], float(item.get("weight", 1.0))))
            except (TypeError, ValueError):
                raise ConfigError(f"data.path weight {item.get('weight')!r} of {item['path']} is not a number") from None
        else:
            raise ConfigError(f"data.path entry {item!r} is neither a directory nor {{path: DIR, weight: W}}")
    return out


def parse_repeats(path) -> list[bool]:
    """Each `data.path` entry's `repeat` (default true: a source that runs out starts another pass;
    false: the run stops before it would, `first_pass_end`)."""
    if isinstance(path, str):
        return [True]
    out = []
    for item in path:
        r = item.get("repeat", True) if isinstance(item, dict) else True
        if not isinstance(r, bool):
            raise ConfigError(f"data.path entry {item['path']}: repeat={r!r} must be true or false")
        out.append(r)
    return out


def first_pass_end(source, repeats: list[bool], limit: int) -> tuple[int, list[int]] | None:
    """(the last step whose batches take no second pass over a `repeat: false` source, the sources
    that run out right after it), or None when none runs out within `limit` steps (steps from 1;
    a pure function of the stream, so a resumed run stops at the same step)."""
    once = [i for i, r in enumerate(repeats) if not r]
    if not once:
        return None
    sizes = np.asarray([len(x) for x in (source.sources if isinstance(source, Mixture) else [source])])

    def taken(step: int) -> np.ndarray:  # examples of each source the first `step` steps read
        n = step * source.batch_size
        return source.examples_before(n) if isinstance(source, Mixture) else np.asarray([n])

    def fits(step: int) -> bool:
        return bool((taken(step)[once] <= sizes[once]).all())

    if fits(limit):
        return None
    lo, hi = 0, limit  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, [i for i in once if taken(hi)[i] > sizes[i]]


def _parse_schedule(path: str, weights) -> tuple[tuple[int, float], ...]:
    """`weights: {STEP: WEIGHT, ...}` of one data.path entry -> ((step, weight), ...)."""
    if not isinstance(weights, dict) or not weights:
        raise ConfigError(f"data.path weights of {path} must be a mapping {{STEP: WEIGHT, ...}}, e.g. "
                          "{0: 0.8, 10000: 0.3}")
    out = []
    for k, v in weights.items():
        whole = (isinstance(k, int) and not isinstance(k, bool)) or (isinstance(k, str) and k.strip().isdigit())
        if not whole or int(k) < 0:
            raise ConfigError(f"data.path weights of {path}: step {k!r} must be a whole number >= 0")
        try:
            w = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"data.path weights of {path}: weight {v!r} at step {k} is not a number") from None
        out.append((int(k), w))
    return tuple(sorted(out))


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
