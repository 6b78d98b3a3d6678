"""`maxtrain prepare`: raw text -> tokenized ArrayRecord shards with a checksummed manifest.

Layout of an output directory:

    manifest.json                       tokenizer, vocab size, dtype, per-shard counts and sha256, and
                                        manifest_sha256 over the rest of itself (canonical JSON)
    train-00000-of-00004.arrayrecord    one record per document: token ids (dtype) with EOS last
    train-00000-of-00004.lengths.npy    int64 length of each record, in record order
    val-00000-of-00001.arrayrecord      with --val-fraction
    tokenizer.json | tokenizer.model    a copy of the tokenizer (or the one --train-tokenizer trained;
                                        none for byte), named in the manifest relative to the directory,
                                        so the directory can move

Documents are read in input order (files sorted), tokenized by a pool of worker processes with a
bounded number of batches in flight (memory stays bounded), and written round-robin over the
shards, so the output is the same whatever the number of workers.
"""

from __future__ import annotations

import collections
import glob
import json
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from typing import Iterator

import numpy as np

from maxtrain import storage
from maxtrain.config import ConfigError, require_module
from maxtrain.outputs import building
from maxtrain.data.manifest import (CHECKSUM, FORMAT_VERSION, MANIFEST, manifest_digest,  # noqa: F401
                                    read_lengths, read_manifest, sha256_file)
from maxtrain.data.tokenizers import Tokenizer, load_tokenizer, token_dtype, train_bpe
from maxtrain.data.tokens import ShardSet

BATCH_BYTES = 4 * 2**20  # text per task sent to a worker

log = logging.getLogger("maxtrain")


# ---------------------------------------------------------------- reading inputs


def input_files(spec: str) -> list[str]:
    files = [spec] if os.path.isfile(spec) else sorted(
        f for f in glob.glob(os.path.join(spec, "**", "*") if os.path.isdir(spec) else spec, recursive=True)
        if os.path.isfile(f))
    if not files:
        raise ConfigError(f"--input {spec} matches no files")
    return files


def iter_documents(path: str, text_field: str = "text") -> Iterator[str]:
    """Documents of one file: JSONL (`.jsonl`/`.json`: one object per line), Parquet, or plain text
    (the whole file is one document)."""
    try:
        if is_jsonl(path):
            with open(path, "rb") as f:
                yield from jsonl_documents(path, _numbered_lines(f), text_field)
        elif path.endswith(".parquet"):
            yield from parquet_documents(path, path, text_field)
        else:
            with open(path, "rb") as f:
                text = plain_text(path, f.read())
            if text:
                yield text
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None


def is_jsonl(path: str) -> bool:
    return path.endswith((".jsonl", ".json"))


def _numbered_lines(f) -> Iterator[tuple[int, int | None, bytes]]:
    """(byte offset, line number, raw line) of a whole file read from its start."""
    offset = 0
    for n, raw in enumerate(f, 1):
        yield offset, n, raw
        offset += len(raw)


def jsonl_documents(path: str, lines, text_field: str) -> Iterator[str]:
    """The documents of JSONL `lines` ((byte offset, line number or None, raw bytes) of `path`):
    blank lines skipped, every other line an object with a `text_field` string."""
    for offset, n, raw in lines:
        line = _utf8(path, raw, offset)
        if not line.strip():
            continue
        where = f"line {n}" if n is not None else f"byte {offset}"
        try:
            doc = json.loads(line)[text_field]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path} {where}: not a JSON object with a {text_field!r} string "
                              f"(set --text-field)") from None
        if not isinstance(doc, str):
            raise ConfigError(f"{path} {where}: field {text_field!r} is not a string")
        yield doc


def parquet_documents(path: str, source, text_field: str) -> Iterator[str]:
    """The non-empty strings of the `text_field` column of a Parquet file (`source`: its path or a
    pyarrow buffer reader; `path` names it in errors)."""
    pq = require_module("pyarrow.parquet", "pyarrow", f"reading the Parquet file {path}", "data")

    try:
        pf = pq.ParquetFile(source)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{path} is not a readable Parquet file: {str(e)[:200]}") from None
    if text_field not in pf.schema_arrow.names:
        raise ConfigError(f"{path} has no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                          f"set --text-field")
    import pyarrow as pa

    if not pa.types.is_string(pf.schema_arrow.field(text_field).type) and \
            not pa.types.is_large_string(pf.schema_arrow.field(text_field).type):
        raise ConfigError(f"{path} column {text_field!r} is {pf.schema_arrow.field(text_field).type}, not text")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        yield from (t for t in batch.column(0).to_pylist() if t)


def _utf8(path: str, data: bytes, offset: int) -> str:
    """`data` (bytes from `offset` of `path`) as text, or an error naming the file's byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {offset + e.start}); "
                          f"convert it or drop it from --input") from None


def plain_text(path: str, data: bytes) -> str:
    """A plain-text file's bytes as one document, newlines as text mode reads them (CRLF and CR -> LF)."""
    nul = data.find(b"\0")
    if nul >= 0:  # valid UTF-8, but binary (or UTF-16) rather than text
        raise ConfigError(f"{path} is not UTF-8 text (NUL at byte {nul}: binary or UTF-16); "
                          f"convert it or drop it from --input")
    return _utf8(path, data, 0).replace("\r\n", "\n").replace("\r", "\n")


def _batches(files: list[str], text_field: str) -> Iterator[list[str]]:
    batch, size = [], 0
    for path in files:
        for doc in iter_documents(path, text_field):
            batch.append(doc)
            size += len(doc)
            if size >= BATCH_BYTES:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


# ---------------------------------------------------------------- tokenizing workers

_TOKENIZER: Tokenizer | None = None


def _worker_init(spec: str) -> None:
    global _TOKENIZER
    _TOKENIZER = load_tokenizer(spec)


def _encode_batch(docs: list[str]) -> tuple[list[np.ndarray], int]:
    return _TOKENIZER.encode_docs(docs), sum(len(d.encode("utf-8")) for d in docs)


def _ordered_pool_map(pool, fn, items: Iterator, window: int) -> Iterator:
    """`pool.imap` with at most `window` tasks in flight (imap reads its whole input eagerly)."""
    pending = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# ---------------------------------------------------------------- writing shards


def _is_val(doc_index: int, fraction: float, seed: int) -> bool:
    """The split rule, part one: document `doc_index` (its place in input order) is held out for val
    when a hash of it and the seed, as a fraction in [0, 1), is below `fraction`."""
    h = (doc_index * 0x9E3779B97F4A7C15 + seed * 0xBF58476D1CE4E5B9) % 2**64
    h = ((h ^ (h >> 31)) * 0x94D049BB133111EB) % 2**64
    return (h >> 11) / 2**53 < fraction


def val_mask(first: int, count: int, fraction: float, seed: int) -> np.ndarray:
    """`_is_val` of documents `first` .. `first + count - 1` at once (uint64 arithmetic wraps as
    the scalar's `% 2**64` does)."""
    if fraction <= 0:
        return np.zeros(count, bool)
    n = np.arange(first, first + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = n * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed * 0xBF58476D1CE4E5B9 % 2**64)
        h = (h ^ (h >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
    return (h >> np.uint64(11)).astype(np.float64) / 2**53 < fraction


def shard_names(split: str, n_shards: int) -> list[str]:
    return [f"{split}-{i:05d}-of-{n_shards:05d}" for i in range(n_shards)]


def shard_entry(name: str, path: str, lengths_path: str, lengths: list | np.ndarray) -> dict:
    """A shard's manifest entry (the same keys, in the same order, from either engine)."""
    return {"file": name + ".arrayrecord", "lengths_file": name + ".lengths.npy",
            "documents": len(lengths), "tokens": int(np.sum(lengths, dtype=np.int64)),
            "sha256": sha256_file(path), "lengths_sha256": sha256_file(lengths_path)}


def open_shard_writer(path: str):
    from array_record.python.array_record_module import ArrayRecordWriter

    return ArrayRecordWriter(path, "group_size:1")  # one record per chunk: fast random reads


class _SplitWriter:
    """A split's shards, written in order: the `t`-th document written goes to shard `t mod n`."""

    def __init__(self, out_dir: str, split: str, n_shards: int):
        self.names = shard_names(split, n_shards)
        self.paths = [os.path.join(out_dir, n + ".arrayrecord") for n in self.names]
        self.writers = [open_shard_writer(p) for p in self.paths]
        self.lengths = [[] for _ in range(n_shards)]
        self.next = 0

    def write(self, tokens: np.ndarray) -> None:
        i = self.next
        self.writers[i].write(tokens.tobytes())
        self.lengths[i].append(len(tokens))
        self.next = (i + 1) % len(self.writers)

    def close(self, out_dir: str) -> list[dict]:
        shards = []
        for name, path, w, lengths in zip(self.names, self.paths, self.writers, self.lengths):
            w.close()
            lengths_path = os.path.join(out_dir, name + ".lengths.npy")
            np.save(lengths_path, np.asarray(lengths, np.int64))
            shards.append(shard_entry(name, path, lengths_path, lengths))
        return shards


SHARD_INPUT_BYTES = 64 * 2**20  # the default: one shard per this much input text
MAX_DEFAULT_SHARDS = 64


def default_shards(files: list[str]) -> int:
    """One shard per `SHARD_INPUT_BYTES` of input, 1 to `MAX_DEFAULT_SHARDS` (17 documents get one
    shard, not four mostly empty ones)."""
    total = sum(os.path.getsize(f) for f in files)
    return max(1, min(MAX_DEFAULT_SHARDS, -(-total // SHARD_INPUT_BYTES)))


def prepare(inputs: str, out_dir: str, tokenizer: str = "byte", *, shards: int | None = None, val_fraction: float = 0.0,
            text_field: str = "text", train_tokenizer: int | None = None, workers: int | None = None,
            seed: int = 0, progress: bool | None = None) -> dict:
    """Tokenizes `inputs` into `out_dir` with a process pool on this machine; returns the manifest.
    (`maxtrain.data.prepare_ray.prepare_ray`: the same on a Ray cluster, byte for byte.)

    Everything is written into a sibling `OUT.partial-PID` directory that is renamed to `out_dir`
    once complete: a failed or killed run leaves no half-written output in the way of a rerun
    (a failure removes its partial directory; a killed run's can be deleted).

    `inputs` and `out_dir` may be s3:// or gs:// prefixes (`maxtrain.storage`): the input's objects
    are fetched into a temporary directory first; the output is written to one and put under the
    prefix when complete, manifest.json last (a reader that finds it finds every shard)."""
    if storage.is_url(inputs) or storage.is_url(out_dir):
        return _prepare_remote(inputs, out_dir, tokenizer, shards=shards, val_fraction=val_fraction,
                               text_field=text_field, train_tokenizer=train_tokenizer, workers=workers, seed=seed,
                               progress=progress)
    files = input_files(inputs)
    if not train_tokenizer and tokenizer != "byte" and not os.path.exists(tokenizer):
        raise ConfigError(f"--tokenizer {tokenizer} not found; give byte, a tokenizer.json (or a directory "
                          f"holding one) or a SentencePiece .model")
    shards = default_shards(files) if shards is None else shards
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConfigError(f"--output {out_dir} exists and is not an empty directory; choose a new directory")
    if os.path.isdir(inputs) and inside(out_dir, inputs):  # a rerun would read the shards as input
        raise ConfigError(f"--output {out_dir} is inside --input {inputs}; choose an output outside the input")
    if shards < 1 or not 0.0 <= val_fraction < 1.0 or (workers is not None and workers < 1):
        raise ConfigError("--shards and --workers must be >= 1 and --val-fraction in [0, 1)")
    with building(out_dir, "--output") as partial:
        return _prepare_into(partial, inputs, files, tokenizer, shards=shards, val_fraction=val_fraction,
                             text_field=text_field, train_tokenizer=train_tokenizer, workers=workers, seed=seed,
                             progress=progress)


def _prepare_remote(inputs: str, out_dir: str, tokenizer: str, **kwargs) -> dict:
    """`prepare` with an object-store input or output, through local temporary directories."""
    for what, url in (("--input", inputs), ("--output", out_dir)):
        if problem := storage.path_problem(what, url, urls=True):
            raise ConfigError(problem)
    if storage.is_url(out_dir):  # before any work
        storage.require_empty(out_dir, "--output")
    with tempfile.TemporaryDirectory(prefix="maxtrain-prepare-") as work:
        local_in = inputs
        if storage.is_url(inputs):
            objects = storage.list_objects(inputs)
            if objects:  # a prefix: its objects, by their relative names
                local_in = storage.stage(inputs, work, objects=objects)
            else:  # one object
                local_in = os.path.join(work, "input", inputs.rstrip("/").rsplit("/", 1)[-1])
                storage.download(inputs, local_in)
        local_out = os.path.join(work, "output") if storage.is_url(out_dir) else out_dir
        manifest = prepare(local_in, local_out, tokenizer, **kwargs)
        if storage.is_url(out_dir):
            storage.publish(local_out, out_dir, last=(MANIFEST,))
        return manifest


def inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def _prepare_into(work_dir: str, inputs: str, files: list[str], tokenizer: str, *, shards: int,
                  val_fraction: float, text_field: str, train_tokenizer: int | None, workers: int | None,
                  seed: int, progress: bool | None) -> dict:
    """`prepare`'s work, written into `work_dir` (renamed to the output when complete); the manifest
    names files relative to the directory."""
    t0 = time.perf_counter()
    if train_tokenizer:
        tok_path = os.path.join(work_dir, "tokenizer.json")
        texts = (d for f in files for d in iter_documents(f, text_field))
        tokenizer = train_bpe(texts, train_tokenizer, tok_path).spec
    tok = load_tokenizer(tokenizer)
    workers = workers or max(1, min(os.cpu_count() or 1, 8))
    splits = {"train": _SplitWriter(work_dir, "train", shards)}
    if val_fraction > 0:
        splits["val"] = _SplitWriter(work_dir, "val", 1)
    show = sys.stderr.isatty() if progress is None else progress
    n_docs, n_bytes = 0, 0
    ctx = mp.get_context("spawn")  # no fork of a process that may hold jax/threads
    with ctx.Pool(workers, initializer=_worker_init, initargs=(tok.spec,)) as pool:
        for encoded, size in _ordered_pool_map(pool, _encode_batch, _batches(files, text_field), 2 * workers):
            for tokens in encoded:
                split = "val" if val_fraction and _is_val(n_docs, val_fraction, seed) else "train"
                splits[split].write(tokens)
                n_docs += 1
            n_bytes += size
            if show:
                mb = n_bytes / 2**20
                sys.stderr.write(f"\r{n_docs:,} docs, {mb:,.1f} MiB, {mb / (time.perf_counter() - t0):,.1f} MiB/s")
                sys.stderr.flush()
    if show:
        sys.stderr.write("\n")
    if n_docs == 0:
        raise ConfigError(f"--input {inputs} holds no documents")
    tok_entry = tok.describe() if tok.kind == "byte" else tokenizer_copy(tok, work_dir)
    manifest = build_manifest(tok, tok_entry, n_bytes, {name: w.close(work_dir) for name, w in splits.items()})
    with open(os.path.join(work_dir, MANIFEST), "w") as f:
        f.write(manifest_text(manifest))
    manifest["seconds"] = time.perf_counter() - t0
    return manifest


def build_manifest(tok: Tokenizer, tok_entry: dict, text_bytes: int, splits: dict[str, list[dict]]) -> dict:
    """The manifest of a prepared directory (either engine): `splits` maps a split to its shards'
    entries; the checksum over the rest is added last."""
    manifest = {
        "format": FORMAT_VERSION,
        "tokenizer": tok_entry,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": token_dtype(tok.vocab_size).name,
        "text_bytes": text_bytes,
        "splits": {name: {"shards": shards} for name, shards in splits.items()},
    }
    manifest[CHECKSUM] = manifest_digest(manifest)
    return manifest


def manifest_text(manifest: dict) -> str:
    return json.dumps(manifest, indent=2)


def tokenizer_copy(tok: Tokenizer, work_dir: str) -> dict:
    """The manifest's tokenizer: its file copied into the output directory (a trained one is already
    there) and named relative to it, with its sha256; no machine path, so the directory can move
    (and two directories prepared with the same tokenizer name it alike)."""
    name = "tokenizer.model" if tok.kind == "sentencepiece" else "tokenizer.json"
    dest = os.path.join(work_dir, name)
    if os.path.abspath(tok.spec) != os.path.abspath(dest):
        shutil.copyfile(tok.spec, dest)
    return {**tok.describe(), "spec": name, "sha256": sha256_file(dest)}


def verify(out_dir: str) -> list[str]:
    """Every check: manifest, each shard's checksum and record count, and token ids < vocab."""

    problems = []
    manifest = read_manifest(out_dir)
    for split in manifest["splits"]:
        try:
            shard_set = ShardSet(out_dir, split)
            for i in range(len(shard_set.shards)):
                n = len(shard_set.lengths[i])
                for start in range(0, n, 4096):  # opening verifies the sha256; reading, sizes and ids
                    shard_set.read(i, list(range(start, min(start + 4096, n))))
        except ConfigError as e:
            problems.append(str(e))
    return problems
