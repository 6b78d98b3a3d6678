"""`maxtrain prepare --engine ray`: the same output as the local engine, tokenized on a Ray cluster.

The rule both engines follow (docs/data.md#the-shard-rule): documents are numbered n = 0, 1, ...
in input order (files sorted by name; a JSONL file's non-blank lines, a Parquet file's non-empty
strings, a plain-text file as one document). Document n is held out for val when
`prepare._is_val(n)`; otherwise it is the t-th train document and becomes record floor(t / S) of
train shard t mod S (S = --shards). The v-th val document is record v of the one val shard.

Here that rule is applied in three rounds of Ray tasks, each a pure function of the plan:

1. **count**: the input is cut into pieces (a JSONL file by byte ranges of `--piece-mib`, a line
   belonging to the piece holding its first byte; a Parquet or plain-text file whole), and each
   piece's documents are counted, which gives every piece its first document number and its first
   train number. The plan (pieces, counts, a fingerprint of the input, tokenizer and arguments) is
   written to `_prepare/plan.json` before anything else.
2. **tokenize**: each piece is tokenized and written as one file of its documents grouped by the
   shard they go to (train shard 0, 1, ..., S-1, then val) with their lengths, then a marker
   naming the files' sizes and each group's counts.
3. **write**: each output shard reads its group from every piece, in piece order, and writes the
   ArrayRecord file and its lengths, then a marker holding its manifest entry.

The driver merges the markers into manifest.json, removes `_prepare/`, and (on local disk)
renames `OUT.partial-ray` to OUT; in an object store, manifest.json is put last.

Resuming: a killed prepare (the driver, or the whole cluster) resumes when run again with the same
input, tokenizer and arguments: a piece or shard whose marker is there and whose files have the
sizes the marker records is kept; everything else is done again (a file written without its marker
is a half-written one, on local disk, where files land by rename, and on S3, where they do not).
A rerun with anything different is refused, naming what changed.

Every task writes only files named by the plan, with contents fixed by it, so a straggler from a
killed run that finishes late writes the same bytes the rerun does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Iterator

import numpy as np

from maxtrain import storage
from maxtrain.config import ConfigError, require_module
from maxtrain.data.manifest import MANIFEST
from maxtrain.data.prepare import (BATCH_BYTES, inside, is_jsonl, tokenizer_copy, build_manifest, input_files,
                                   jsonl_documents, manifest_text, open_shard_writer, parquet_documents,
                                   plain_text, shard_entry, shard_names, val_mask)
from maxtrain.data.tokenizers import Tokenizer, load_tokenizer, token_dtype

PIECE_BYTES = 64 * 2**20  # the default: a JSONL file is cut into pieces of this much text
WORK = "_prepare"  # the state of an unfinished prepare, under the output
PLAN = f"{WORK}/plan.json"
PLAN_VERSION = 1
READ_AHEAD = 1 << 20  # a piece's last line is read past the piece's end in steps of this


# ---------------------------------------------------------------- input: files and pieces


def list_inputs(spec: str) -> list[dict]:
    """The input files, sorted as the local engine reads them: {"path", "name" (relative to the
    input), "size", "version" (mtime_ns, or the object's ETag)}."""
    if not storage.is_url(spec):
        files = input_files(spec)
        base = spec if os.path.isdir(spec) else os.path.dirname(spec)
        return [{"path": os.path.abspath(f), "name": os.path.relpath(f, base), "size": os.path.getsize(f),
                 "version": str(os.stat(f).st_mtime_ns)} for f in files]
    objects = [o for o in storage.list_objects(spec)
               if not any(part.startswith(".") for part in o["key"].split("/"))]  # as the local glob skips
    if objects:
        return [{"path": storage.join(spec, o["key"]), "name": o["key"], "size": o["size"], "version": o["e_tag"]}
                for o in sorted(objects, key=lambda o: o["key"])]
    found = storage.head(spec)
    if found is None:
        raise ConfigError(f"--input {spec} matches no objects")
    return [{"path": spec, "name": spec.rstrip("/").rsplit("/", 1)[-1], "size": found["size"],
             "version": found["e_tag"]}]


def make_pieces(files: list[dict], piece_bytes: int) -> list[dict]:
    """A JSONL file as byte ranges of `piece_bytes`; any other file whole."""
    pieces = []
    for f in files:
        if is_jsonl(f["path"]) and f["size"] > piece_bytes:
            for start in range(0, f["size"], piece_bytes):
                pieces.append({"path": f["path"], "start": start, "end": min(f["size"], start + piece_bytes),
                               "size": f["size"]})
        else:
            pieces.append({"path": f["path"], "start": 0, "end": f["size"], "size": f["size"]})
    return pieces


def _read(path: str, start: int, end: int) -> bytes:
    if storage.is_url(path):
        return storage.read_range(path, start, end)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None


def range_lines(path: str, start: int, end: int, size: int) -> Iterator[tuple[int, None, bytes]]:
    """The lines of `path` that begin in bytes [start, end), whole (the last one read past `end`):
    (byte offset, None, raw line with its newline), as iterating the file from its start gives them."""
    if start > 0:
        data = _read(path, start - 1, end)  # the byte before: is `start` the beginning of a line?
        cut = data.find(b"\n")
        if cut < 0:
            return
        base, data = start + cut, data[cut + 1:]
    else:
        base, data = 0, _read(path, 0, end)
    if base >= end:
        return
    pos = end
    while pos < size and not data.endswith(b"\n"):  # the last line goes on past the piece
        more = _read(path, pos, min(size, pos + READ_AHEAD))
        if not more:
            break
        cut = more.find(b"\n")
        if cut >= 0:
            data += more[:cut + 1]
            break
        data, pos = data + more, pos + len(more)
    offset = base
    for raw in _split_lf(data):
        yield offset, None, raw
        offset += len(raw)


def _split_lf(data: bytes) -> list[bytes]:
    """Lines ending in b"\\n" only, as a binary file's iteration cuts them (splitlines also cuts at
    \\r and other separators)."""
    lines = data.split(b"\n")
    out = [line + b"\n" for line in lines[:-1]]
    return out + ([lines[-1]] if lines[-1] else [])


def piece_documents(piece: dict, text_field: str) -> Iterator[str]:
    path = piece["path"]
    if is_jsonl(path):
        yield from jsonl_documents(path, range_lines(path, piece["start"], piece["end"], piece["size"]), text_field)
    elif path.endswith(".parquet"):
        if storage.is_url(path):
            import pyarrow as pa

            yield from parquet_documents(path, pa.BufferReader(storage.read_bytes(path)), text_field)
        else:
            yield from parquet_documents(path, path, text_field)
    else:
        text = plain_text(path, _read(path, 0, piece["size"]))
        if text:
            yield text


# ---------------------------------------------------------------- the output: a local directory or a prefix


def _at(root: str, rel: str) -> str:
    return storage.join(root, rel) if storage.is_url(root) else os.path.join(root, *rel.split("/"))


def put_bytes(root: str, rel: str, data: bytes) -> None:
    """`data` at `rel` under `root`, whole or not at all: on disk by rename, in a bucket by one put."""
    if storage.is_url(root):
        storage.write_bytes(_at(root, rel), data)
        return
    dest = _at(root, rel)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f"{dest}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, dest)


def put_file(root: str, rel: str, local: str) -> None:
    """A finished local file put at `rel` (moved, on disk: `local` is beside it)."""
    if storage.is_url(root):
        storage.upload(local, _at(root, rel))
    else:
        os.replace(local, _at(root, rel))


def get_bytes(root: str, rel: str, start: int, end: int) -> bytes:
    path = _at(root, rel)
    data = storage.read_range(path, start, end) if storage.is_url(root) else _read(path, start, end)
    if len(data) != end - start:
        raise ConfigError(f"{path} is shorter than its marker says ({start + len(data)} < {end} bytes); "
                          f"it changed underneath this prepare: run it again")
    return data


def read_json(root: str, rel: str) -> dict | None:
    path = _at(root, rel)
    try:
        if storage.is_url(root):
            return json.loads(storage.read_bytes(path)) if storage.exists(path) else None
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # a marker cut short is no marker: its piece or shard is done again


def listing(root: str, rel: str) -> dict[str, int]:
    """Size of each file directly under `rel`, by name."""
    if storage.is_url(root):
        return {o["key"]: o["size"] for o in storage.list_objects(_at(root, rel)) if "/" not in o["key"]}
    try:
        with os.scandir(_at(root, rel)) as it:
            return {e.name: e.stat().st_size for e in it if e.is_file()}
    except FileNotFoundError:
        return {}


# ---------------------------------------------------------------- the tokenizer, shipped to the workers

_TOKENIZERS: dict[str, Tokenizer] = {}


def tokenizer_blob(tok: Tokenizer) -> dict:
    """What a worker needs to load `tok` without the driver's filesystem: the file's bytes."""
    if tok.kind == "byte":
        return {"kind": "byte", "sha256": "byte"}
    name = "tokenizer.model" if tok.kind == "sentencepiece" else "tokenizer.json"
    with open(tok.spec, "rb") as f:
        data = f.read()
    return {"kind": tok.kind, "name": name, "sha256": hashlib.sha256(data).hexdigest(), "data": data}


def worker_tokenizer(blob: dict) -> Tokenizer:
    key = blob["sha256"]
    if key not in _TOKENIZERS:
        if blob["kind"] == "byte":
            _TOKENIZERS[key] = load_tokenizer("byte")
        else:
            directory = tempfile.mkdtemp(prefix="maxtrain-tokenizer-")
            path = os.path.join(directory, blob["name"])
            with open(path, "wb") as f:
                f.write(blob["data"])
            _TOKENIZERS[key] = load_tokenizer(path)
    return _TOKENIZERS[key]


# ---------------------------------------------------------------- the three rounds of tasks


def count_piece(piece: dict, text_field: str) -> int:
    """Round 1: the number of documents in a piece (read and parsed as round 2 will: a malformed line
    is reported now, before any tokenizing)."""
    return sum(1 for _ in piece_documents(piece, text_field))


def _piece_rel(index: int, suffix: str) -> str:
    return f"{WORK}/pieces/{index:06d}.{suffix}"


def tokenize_piece(root: str, index: int, piece: dict, first_doc: int, first_train: int, documents: int,
                   args: dict, blob: dict) -> dict:
    """Round 2: a piece tokenized into `_prepare/pieces/INDEX.tokens` (its documents' token ids,
    grouped by the shard each goes to: train 0 .. S-1, then val; input order within a group) and
    `.lengths` (int64 lengths, same order), then the `.json` marker: sizes and each group's
    [documents, tokens]."""
    tok = worker_tokenizer(blob)
    encoded, text_bytes, batch, size = [], 0, [], 0
    for doc in piece_documents(piece, args["text_field"]):
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_BYTES:
            encoded += tok.encode_docs(batch)
            text_bytes += sum(len(d.encode("utf-8")) for d in batch)
            batch, size = [], 0
    if batch:
        encoded += tok.encode_docs(batch)
        text_bytes += sum(len(d.encode("utf-8")) for d in batch)
    if len(encoded) != documents:
        raise ConfigError(f"{piece['path']} changed while being prepared ({documents} documents counted, "
                          f"{len(encoded)} now); remove the partial output and prepare again")
    n_shards = args["shards"]
    is_val = val_mask(first_doc, len(encoded), args["val_fraction"], args["seed"])
    train_number = first_train + np.cumsum(~is_val) - 1
    group = np.where(is_val, n_shards, train_number % n_shards)
    order = np.argsort(group, kind="stable")
    lengths = np.array([len(x) for x in encoded], np.int64)
    tokens = b"".join(encoded[i].tobytes() for i in order)
    docs_per_group = np.bincount(group, minlength=n_shards + 1)
    tokens_per_group = np.bincount(group, weights=lengths, minlength=n_shards + 1).astype(np.int64)
    put_bytes(root, _piece_rel(index, "tokens"), tokens)
    put_bytes(root, _piece_rel(index, "lengths"), lengths[order].tobytes())
    marker = {"documents": len(encoded), "text_bytes": text_bytes, "tokens_bytes": len(tokens),
              "lengths_bytes": 8 * len(encoded),
              "groups": [[int(d), int(t)] for d, t in zip(docs_per_group, tokens_per_group)]}
    put_bytes(root, _piece_rel(index, "json"), json.dumps(marker).encode())
    return marker


def write_shard(root: str, name: str, before: np.ndarray, counts: np.ndarray, itemsize: int) -> dict:
    """Round 3: one output shard from its group of every piece, in piece order (`before[p]`: the
    [documents, tokens] of piece p's earlier groups; `counts[p]`: its group's), then the marker
    `_prepare/shards/NAME.json`: the shard's manifest entry and sizes."""
    local = not storage.is_url(root)
    tmp = tempfile.mkdtemp(prefix=".shard-", dir=root if local else None)
    try:
        ar_path, lengths_path = os.path.join(tmp, name + ".arrayrecord"), os.path.join(tmp, name + ".lengths.npy")
        writer = open_shard_writer(ar_path)
        parts = []
        for p in np.flatnonzero(counts[:, 0]):
            (d0, t0), (nd, nt) = before[p], counts[p]
            lens = np.frombuffer(get_bytes(root, _piece_rel(p, "lengths"), 8 * d0, 8 * (d0 + nd)), np.int64)
            data = get_bytes(root, _piece_rel(p, "tokens"), itemsize * t0, itemsize * (t0 + nt))
            ends = np.cumsum(lens) * itemsize
            for a, b in zip(np.concatenate([[0], ends[:-1]]), ends):
                writer.write(data[a:b])
            parts.append(lens)
        writer.close()
        lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        np.save(lengths_path, lengths)
        entry = shard_entry(name, ar_path, lengths_path, lengths)
        sizes = {"bytes": os.path.getsize(ar_path), "lengths_bytes": os.path.getsize(lengths_path)}
        put_file(root, entry["file"], ar_path)
        put_file(root, entry["lengths_file"], lengths_path)
        put_bytes(root, f"{WORK}/shards/{name}.json", json.dumps({"entry": entry, **sizes}).encode())
        return entry
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- the driver


def fingerprint(files: list[dict], blob: dict, args: dict) -> dict:
    """What a partial output was started with: a rerun that differs in any of it is refused."""
    return {"version": PLAN_VERSION, "input": [[f["name"], f["size"], f["version"]] for f in files],
            "tokenizer": blob["sha256"], **{k: args[k] for k in sorted(args)}}


def changes(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints, in words."""
    out = []
    if old.get("version") != new["version"]:
        out.append(f"it was written by another maxtrain (plan version {old.get('version')})")
    if old.get("input") != new["input"]:
        before = {f[0]: f[1:] for f in old.get("input", [])}
        now = {f[0]: f[1:] for f in new["input"]}
        differ = sorted(set(before) ^ set(now)) + sorted(n for n in set(before) & set(now) if before[n] != now[n])
        out.append(f"the input ({', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''})")
    if old.get("tokenizer") != new["tokenizer"]:
        out.append("the tokenizer")
    out += [f"--{k.replace('_', '-')} {old.get(k)} -> {new[k]}" for k in sorted(new)
            if k not in ("version", "input", "tokenizer") and old.get(k) != new[k]]
    return out


def output_root(inputs: str, out_dir: str) -> str:
    """Where this prepare writes: `OUT.partial-ray` beside a local OUT (renamed to OUT when
    complete), or the prefix itself. Refuses an output that is complete or holds something else."""
    if storage.is_url(out_dir):
        keys = {o["key"] for o in storage.list_objects(out_dir)}
        if MANIFEST in keys:
            raise ConfigError(f"--output {out_dir} already holds a prepared dataset; choose a new prefix")
        if keys and PLAN not in keys:
            raise ConfigError(f"--output {out_dir} already holds objects; choose a new prefix")
        return out_dir.rstrip("/")
    target = os.path.realpath(out_dir)
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise ConfigError(f"--output {out_dir} exists and is not an empty directory; choose a new directory")
    if not storage.is_url(inputs) and os.path.isdir(inputs) and inside(target, inputs):
        raise ConfigError(f"--output {out_dir} is inside --input {inputs}; choose an output outside the input")
    return target + ".partial-ray"


def address_problem(address: str, timeout: float = 5.0) -> str | None:
    """Why a `host:port` cluster address cannot be joined (nothing listening there), else None: Ray
    itself retries a dead address for minutes. Other forms (`auto`, `ray://...`) are Ray's to check."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in address:
        return None
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
        return None
    except OSError as e:
        return (f"--ray-address {address}: nothing answers there ({e.strerror or e}); give the head's "
                f"address as `ray start --head` printed it, or leave --ray-address out for a local cluster")


def _start_ray(ray, address: str | None, workers: int | None) -> None:
    options = {"include_dashboard": False, "logging_level": "WARNING", "log_to_driver": False,
               "runtime_env": {"env_vars": {k: os.environ[k] for k in storage.ENV_VARIABLES if k in os.environ}}}
    if address and (problem := address_problem(address)):
        raise ConfigError(problem)
    try:
        if address:
            ray.init(address=address, **options)
        else:
            ray.init(num_cpus=workers or os.cpu_count(), **options)
    except (ConnectionError, ValueError, RuntimeError) as e:
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise ConfigError(f"cannot start or join {where}: {str(e).splitlines()[0][:200]}; start one with "
                          f"`ray start --head` and pass its address, or leave --ray-address out") from None


def _gather(ray, refs: dict, on_result, show: str | None) -> None:
    """Waits for every task of `refs` ({ref: key}), calling `on_result(key, result)` as each ends; a
    task's ConfigError (bad input, a storage failure) becomes the driver's."""
    pending, done, t0 = list(refs), 0, time.perf_counter()
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=min(len(pending), 64), timeout=1.0)
            for ref in ready:
                on_result(refs[ref], _result(ray, ref))
                done += 1
            if show:
                sys.stderr.write(f"\r{show}: {done:,}/{len(refs):,} ({time.perf_counter() - t0:,.0f} s)")
                sys.stderr.flush()
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise
    finally:
        if show and refs:
            sys.stderr.write("\n")


def _result(ray, ref):
    """A task's result; its ConfigError (bad input, a storage failure) raised here as the driver's, and
    a task Ray gave up on (its worker killed more often than Ray retries) as one line saying to rerun."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise
    except ray.exceptions.RayError as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"a prepare task failed on the cluster ({type(e).__name__}: {first}); what is done is "
                          f"kept: run the same command again to resume") from None


def prepare_ray(inputs: str, out_dir: str, tokenizer: str = "byte", *, shards: int | None = None,
                val_fraction: float = 0.0, text_field: str = "text", seed: int = 0, workers: int | None = None,
                ray_address: str | None = None, piece_bytes: int = PIECE_BYTES, progress: bool | None = None,
                train_tokenizer: int | None = None) -> dict:
    """`prepare` on a Ray cluster (`ray_address`, else `RAY_ADDRESS`, else a local one of `workers`
    CPUs); returns the manifest, with "seconds", "rounds" (seconds spent starting or joining the
    cluster, counting, tokenizing, writing shards) and "resumed" ({"pieces", "shards"} found done).
    `train_tokenizer` is refused: training runs on one machine (train on a sample first)."""
    from maxtrain.data.prepare import SHARD_INPUT_BYTES, MAX_DEFAULT_SHARDS

    t0 = time.perf_counter()
    if train_tokenizer:
        raise ConfigError("--train-tokenizer runs on one machine, not under --engine ray: train it on a sample "
                          "first (maxtrain prepare --input SAMPLE --output TOKDIR --train-tokenizer N), then "
                          "pass --tokenizer TOKDIR/tokenizer.json")
    for what, path in (("--input", inputs), ("--output", out_dir)):
        if problem := storage.path_problem(what, path, urls=True):
            raise ConfigError(problem)
    if (shards is not None and shards < 1) or not 0.0 <= val_fraction < 1.0 or (workers is not None and workers < 1):
        raise ConfigError("--shards and --workers must be >= 1 and --val-fraction in [0, 1)")
    if piece_bytes < 1:
        raise ConfigError("--piece-mib must be > 0")
    if ray_address and workers:
        raise ConfigError("--workers sizes the local Ray cluster prepare starts; with --ray-address the "
                          "cluster's CPUs decide: leave --workers out")
    if tokenizer != "byte" and not os.path.exists(tokenizer):
        raise ConfigError(f"--tokenizer {tokenizer} not found; give byte, a tokenizer.json (or a directory "
                          f"holding one) or a SentencePiece .model")
    ray = require_module("ray", "ray", "prepare --engine ray", "ray")
    files = list_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    blob = tokenizer_blob(tok)
    if shards is None:
        shards = max(1, min(MAX_DEFAULT_SHARDS, -(-sum(f["size"] for f in files) // SHARD_INPUT_BYTES)))
    args = {"shards": shards, "val_fraction": val_fraction, "seed": seed, "text_field": text_field,
            "piece_bytes": piece_bytes}
    fp = fingerprint(files, blob, args)
    root = output_root(inputs, out_dir)
    plan = read_json(root, PLAN)
    if plan is not None and (changed := changes(plan["fingerprint"], fp)):
        where = root if storage.is_url(root) else f"{root} (delete it to start over)"
        raise ConfigError(f"--output {out_dir} holds an unfinished prepare of something else: {'; '.join(changed)} "
                          f"differ; rerun it as it was started, or choose a new output. Its partial output: {where}")
    show = sys.stderr.isatty() if progress is None else progress
    rounds = {"start_s": time.perf_counter()}
    _start_ray(ray, ray_address, workers)
    try:
        rounds["count_s"] = time.perf_counter()
        if plan is None:
            plan = _plan(ray, root, files, fp, args, inputs, show)
        rounds["tokenize_s"] = time.perf_counter()
        markers, resumed_pieces = _tokenize(ray, root, plan, args, blob, show)
        rounds["write_s"] = time.perf_counter()
        entries, resumed_shards = _write(ray, root, plan, markers, args, tok, show)
        rounds["end"] = time.perf_counter()
    finally:
        ray.shutdown()
    marks = list(rounds.values())
    rounds = {k: b - a for k, a, b in zip(rounds, marks, marks[1:])}
    if resumed_pieces or resumed_shards:
        print(f"maxtrain: resumed {out_dir}: {resumed_pieces} of {len(plan['pieces'])} pieces were tokenized, "
              f"{resumed_shards} of {len(entries['train']) + len(entries.get('val', []))} shards written",
              file=sys.stderr)
    manifest = _finish(root, out_dir, tok, sum(m["text_bytes"] for m in markers), entries)
    return {**manifest, "seconds": time.perf_counter() - t0, "rounds": rounds,
            "resumed": {"pieces": resumed_pieces, "shards": resumed_shards}}


def _plan(ray, root: str, files: list[dict], fp: dict, args: dict, inputs: str, show: bool) -> dict:
    """Round 1, then the plan written: each piece with its first document and first train number."""
    pieces = make_pieces(files, args["piece_bytes"])
    task = ray.remote(num_cpus=1)(count_piece)
    counts = [0] * len(pieces)
    _gather(ray, {task.remote(p, args["text_field"]): i for i, p in enumerate(pieces)},
            counts.__setitem__, "counting documents" if show else None)
    total = sum(counts)
    if total == 0:
        raise ConfigError(f"--input {inputs} holds no documents")
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    vals = [int(val_mask(int(f), c, args["val_fraction"], args["seed"]).sum()) for f, c in zip(first, counts)]
    first_train = first - np.concatenate([[0], np.cumsum(vals)[:-1]]).astype(np.int64)
    plan = {"fingerprint": fp, "pieces": [{**p, "documents": c, "first_doc": int(f), "first_train": int(t)}
                                          for p, c, f, t in zip(pieces, counts, first, first_train)]}
    if not storage.is_url(root):
        os.makedirs(root, exist_ok=True)
    put_bytes(root, PLAN, json.dumps(plan).encode())
    return plan


def _tokenize(ray, root: str, plan: dict, args: dict, blob: dict, show: bool) -> tuple[list[dict], int]:
    """Round 2 for every piece not already done (its marker there and its files of the sizes named)."""
    sizes = listing(root, f"{WORK}/pieces")
    markers: list[dict | None] = [None] * len(plan["pieces"])
    for i, piece in enumerate(plan["pieces"]):
        if f"{i:06d}.json" in sizes:
            m = read_json(root, _piece_rel(i, "json"))
            if m and sizes.get(f"{i:06d}.tokens") == m["tokens_bytes"] and \
                    sizes.get(f"{i:06d}.lengths") == m["lengths_bytes"] and m["documents"] == piece["documents"]:
                markers[i] = m
    resumed = sum(m is not None for m in markers)
    task = ray.remote(num_cpus=1)(tokenize_piece)
    blob_ref = ray.put(blob)
    refs = {task.remote(root, i, p, p["first_doc"], p["first_train"], p["documents"], args, blob_ref): i
            for i, p in enumerate(plan["pieces"]) if markers[i] is None}
    _gather(ray, refs, markers.__setitem__, "tokenizing pieces" if show else None)
    return markers, resumed


def _write(ray, root: str, plan: dict, markers: list[dict], args: dict, tok: Tokenizer, show: bool
           ) -> tuple[dict[str, list[dict]], int]:
    """Round 3 for every shard not already written."""
    n = args["shards"]
    groups = np.array([m["groups"] for m in markers], np.int64)  # [piece, group, (documents, tokens)]
    before = np.cumsum(groups, axis=1) - groups
    names = {"train": shard_names("train", n)}
    if args["val_fraction"] > 0:
        names["val"] = shard_names("val", 1)
    sizes = listing(root, "")
    done = listing(root, f"{WORK}/shards")
    entries = {split: [None] * len(ns) for split, ns in names.items()}
    refs = {}
    task = ray.remote(num_cpus=1)(write_shard)
    itemsize = token_dtype(tok.vocab_size).itemsize
    resumed = 0
    for split, ns in names.items():
        for k, name in enumerate(ns):
            m = read_json(root, f"{WORK}/shards/{name}.json") if f"{name}.json" in done else None
            if m and sizes.get(m["entry"]["file"]) == m["bytes"] and \
                    sizes.get(m["entry"]["lengths_file"]) == m["lengths_bytes"]:
                entries[split][k] = m["entry"]
                resumed += 1
                continue
            g = k if split == "train" else n
            refs[task.remote(root, name, before[:, g], groups[:, g], itemsize)] = (split, k)
    _gather(ray, refs, lambda key, entry: entries[key[0]].__setitem__(key[1], entry), "writing shards" if show else None)
    return entries, resumed


def _finish(root: str, out_dir: str, tok: Tokenizer, text_bytes: int, entries: dict[str, list[dict]]) -> dict:
    """The manifest from the shards' entries; `_prepare/` removed; the output put in place."""
    if storage.is_url(root):
        with tempfile.TemporaryDirectory(prefix="maxtrain-prepare-") as tmp:
            tok_entry = tok.describe() if tok.kind == "byte" else tokenizer_copy(tok, tmp)
            if tok.kind != "byte":
                storage.upload(os.path.join(tmp, tok_entry["spec"]), storage.join(root, tok_entry["spec"]))
        manifest = build_manifest(tok, tok_entry, text_bytes, entries)
        storage.write_bytes(storage.join(root, MANIFEST), manifest_text(manifest).encode())  # last: complete
        storage.delete_prefix(storage.join(root, WORK))
        return manifest
    tok_entry = tok.describe() if tok.kind == "byte" else tokenizer_copy(tok, root)
    manifest = build_manifest(tok, tok_entry, text_bytes, entries)
    keep = {MANIFEST} | {tok_entry["spec"]} | {e[f] for es in entries.values() for e in es
                                              for f in ("file", "lengths_file")}
    for name in os.listdir(root):  # the plan, markers, pieces, and what killed writers left
        if name not in keep:
            path = os.path.join(root, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    with open(os.path.join(root, MANIFEST), "w") as f:
        f.write(manifest_text(manifest))
    target = os.path.realpath(out_dir)
    try:
        os.replace(root, target)
    except OSError as e:
        raise ConfigError(f"--output {out_dir} could not be put in place ({e.strerror}); "
                          "did something else write there meanwhile?") from None
    return manifest
