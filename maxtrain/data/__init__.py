"""Input pipelines. A source maps a global example index to one packed row; batches are ranges.

Every row is a dict of `[seq_len]` numpy arrays: `inputs`, `targets`, `loss_mask`, `segment_ids`
(1-based document index within the row) and `positions` (restarting per document). The global
batch of step s is examples `s*B .. s*B+B-1`; each process reads only the rows its devices hold.
Because examples are addressed by global index, a restart at step s sees exactly batch s, on any
number of processes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Protocol

import numpy as np

from maxtrain import imports, storage
from maxtrain.config import Config, ConfigError, did_you_mean
from maxtrain.data.packing import step_rng  # noqa: F401  (the sources import it from packing: no circle)

log = logging.getLogger("maxtrain")

KINDS = ("synthetic", "text", "tokens")


class Source(Protocol):
    vocab_size: int  # smallest model vocabulary that covers the source's token ids

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]: ...

    def batch(self, step: int) -> dict[str, np.ndarray]: ...


def _build(cfg: Config, path, *, split: str, stream: int) -> Source:
    from maxtrain.data import synthetic, text, tokens

    if cfg.data.kind == "synthetic":
        return synthetic.SyntheticSource(cfg, stream=stream)
    if cfg.data.kind == "text":
        if isinstance(path, list):
            raise ConfigError("data.kind=text takes one data.path (file, directory, glob or stdlib); "
                              "mixtures need data.kind=tokens")
        return text.TextSource(cfg, path, stream_seed=0x7E47 + stream)
    if path is None:
        raise ConfigError("data.kind=tokens needs data.path: a directory written by `maxtrain prepare`")
    return tokens.make_tokens_source(cfg, path, split)


def check_inputs(cfg: Config) -> None:
    """The data errors found without reading data or importing jax or grain (the CLI checks these
    before anything slow): an unknown kind, text paths that match no files, evaluation without a
    source."""
    _check_kind(cfg)
    if cfg.data.kind == "text":
        from maxtrain.data.text import resolve_files

        resolve_files(cfg.data.path)
        if cfg.train.eval_every and cfg.data.eval_path is not None:
            resolve_files(cfg.data.eval_path)
    if cfg.train.eval_every and cfg.data.eval_path is None and cfg.data.kind == "text":
        raise _no_eval_source()
    if cfg.data.kind == "tokens":
        for key, value in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
            if value is not None:
                _check_prepared(key, value)


def _check_prepared(key: str, value) -> None:
    """Every directory of a tokens `data.path` (or mixture) has a `maxtrain prepare` manifest; a raw
    text file given instead says how to prepare it. Only names are looked up here: the manifest is
    read (and checked) later, under the hang watchdog, as a stuck filesystem can block a read."""
    from maxtrain.data.manifest import MANIFEST
    from maxtrain.data.tokens import parse_mixture

    for path, _ in parse_mixture(value):
        if storage.is_url(path):
            if not storage.exists(storage.join(path, MANIFEST)):
                raise ConfigError(f"{storage.join(path, MANIFEST)} not found; {key} must be a prefix written by "
                                  f"`maxtrain prepare --output {path}`")
            continue
        if os.path.isfile(path):
            raise ConfigError(f"{key}={path} is a file (raw text?), not prepared tokens; run `maxtrain prepare "
                              f"--input {path} --output DIR` and give {key}=DIR")
        if not os.path.exists(os.path.join(path, MANIFEST)):
            raise ConfigError(f"{os.path.join(path, MANIFEST)} not found; {key} must be a directory written by "
                              f"`maxtrain prepare`")


def _check_kind(cfg: Config) -> None:
    if cfg.data.kind not in KINDS:
        raise ConfigError(f"data.kind={cfg.data.kind!r} is unknown; {did_you_mean(cfg.data.kind, KINDS)}"
                          f"choose one of {', '.join(KINDS)}")


def _no_eval_source() -> ConfigError:
    return ConfigError("train.eval_every > 0 needs data.eval_path (or data.kind=tokens with a val split "
                       "from `maxtrain prepare --val-fraction`)")


def make_source(cfg: Config) -> Source:
    _check_kind(cfg)
    source = _build(cfg, cfg.data.path, split="train", stream=0)
    check_vocab(source, cfg)
    return source


def last_step(cfg: Config, source: Source) -> int:
    """`train.steps`, or the last step before a `data.path` source marked `repeat: false` would
    start its second pass (`tokens.first_pass_end`): the run ends there (said once)."""
    if cfg.data.kind != "tokens" or not isinstance(cfg.data.path, (list, tuple)):
        return cfg.train.steps
    from maxtrain.data.tokens import Mixture, first_pass_end, parse_repeats

    end = first_pass_end(source, parse_repeats(cfg.data.path), cfg.train.steps)
    if end is None:
        return cfg.train.steps
    step, which = end
    names = source.names() if isinstance(source, Mixture) else [os.path.basename(os.path.normpath(source.shards.path))]
    what = ", ".join(names[i] for i in which)
    if step == 0:
        raise ConfigError(f"data.path source {what} (repeat: false) runs out within the first batch of "
                          f"train.batch_size={cfg.train.batch_size}; give it more data or set repeat: true")
    log.warning("data: source %s (repeat: false) runs out after step %d: the run stops there, before "
                "train.steps=%d", what, step, cfg.train.steps)
    return step


def make_eval_source(cfg: Config) -> Source | None:
    """The evaluation source when `train.eval_every > 0`: `data.eval_path`, else the val split."""
    if not cfg.train.eval_every:
        return None
    if cfg.data.eval_path is not None:
        source = _build(cfg, cfg.data.eval_path, split="train", stream=1)
    elif cfg.data.kind == "tokens":
        source = _build(cfg, cfg.data.path, split="val", stream=1)
    elif cfg.data.kind == "synthetic":
        source = _build(cfg, None, split="val", stream=1)
    else:
        raise _no_eval_source()
    check_vocab(source, cfg)
    return source


def data_order(cfg: Config) -> dict:
    """The settings that decide which examples step s trains on (examples s*B .. s*B+B-1 of a
    stream fixed by the seed, the row length and the data): a run resuming at step s must agree on
    all of them, or it skips or repeats data. Prepared data is named by its manifests' sha256, so
    a moved copy is the same data. JSON-ready (checkpoint meta)."""
    order: dict = {"seed": cfg.seed, "train.batch_size": cfg.train.batch_size, "train.seq_len": cfg.train.seq_len,
                   "data.kind": cfg.data.kind}
    if cfg.data.kind == "text":
        order.update({"data.path": cfg.data.path, "data.max_bytes": cfg.data.max_bytes})
    elif cfg.data.kind == "tokens":
        from maxtrain.data.tokens import parse_mixture

        order["data.path"] = [[_manifest_sha256(p), w if isinstance(w, float) else [list(x) for x in w]]
                              for p, w in parse_mixture(cfg.data.path)]  # a schedule as JSON keeps it
    return order


def _manifest_sha256(path: str) -> str:
    """The sha256 of a prepared directory's (or prefix's) manifest: the same data on a filesystem
    and in a bucket is the same data."""
    from maxtrain.data.manifest import MANIFEST, sha256_file

    if storage.is_url(path):
        return hashlib.sha256(storage.read_bytes(storage.join(path, MANIFEST))).hexdigest()
    return sha256_file(os.path.join(path, MANIFEST))


def data_order_changes(saved: dict, now: dict) -> list[str]:
    """`key: saved -> now` for every setting of `data_order` that differs."""
    out = []
    for k in sorted(set(saved) | set(now)):
        if saved.get(k) != now.get(k):
            if k == "data.path" and now.get("data.kind") == "tokens":
                out.append("data.path: other prepared data (the manifests differ)")
            else:
                out.append(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}")
    return out


def check_vocab(source: Source, cfg: Config) -> None:
    if source.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's "
                          f"{source.vocab_size} token ids; set model.vocab_size>={source.vocab_size}")


class HostRows:
    """Step -> this process's rows of that step's global batch (picklable for grain workers)."""

    def __init__(self, source: Source, batch_size: int, lo: int, hi: int):
        self.source, self.batch_size, self.lo, self.hi = source, batch_size, lo, hi

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        base = int(step) * self.batch_size
        return self.source.rows(base + self.lo, base + self.hi)


def _ignore_stop_signals(worker_index: int, worker_count: int) -> None:
    """Grain workers leave SIGINT/SIGTERM to the trainer, which saves and then stops them."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Loader:
    """A grain pipeline producing this process's rows for steps `start..stop-1`, in order, prefetched
    by threads (and `data.workers` processes); `next()` also returns the seconds it waited."""

    def __init__(self, source: Source, cfg: Config, start: int, stop: int, lo: int, hi: int):
        grain = imports.quietly("grain")  # on first use: resolving data paths needs none of it
        ds = grain.MapDataset.range(start, max(stop, start)).map(HostRows(source, cfg.train.batch_size, lo, hi))
        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=max(1, min(cfg.data.prefetch, 8)),
                                                  prefetch_buffer_size=cfg.data.prefetch))
        if cfg.data.workers > 0:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # grain's worker pool reads absl flags; we have no absl main
                flags.FLAGS.mark_as_parsed()
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.data.workers),
                                worker_init_fn=_ignore_stop_signals)
        self._it = iter(it)

    def next(self) -> tuple[dict[str, np.ndarray], float]:
        t0 = time.perf_counter()
        batch = next(self._it)
        return batch, time.perf_counter() - t0
