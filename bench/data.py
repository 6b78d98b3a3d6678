"""Input pipeline throughput: `prepare` MB/s (byte and BPE) and loader tokens/s to the device.

    python bench/data.py [--mb 16] [--workers 2] [--steps 30]

The corpus is this Python's standard library (.py files, copied up to --mb MiB). The loader reads
packed rows of seq_len=2048, batch_size=64 from the prepared shards with `data.workers` grain
processes and places each batch on the device. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import jax

from maxtrain import load_config
from maxtrain.data import Loader, make_source
from maxtrain.data.prepare import prepare
from maxtrain.data.text import stdlib_files
from maxtrain.step import put_batch


def _corpus(dst: str, mb: float) -> int:
    os.makedirs(dst)
    total = 0
    for i, f in enumerate(stdlib_files()):
        size = os.path.getsize(f)
        if total + size > mb * 2**20:
            break
        shutil.copy(f, os.path.join(dst, f"{i:05d}.txt"))
        total += size
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=16.0, help="MiB of text to prepare")
    p.add_argument("--workers", type=int, default=2, help="grain worker processes for the loader")
    p.add_argument("--steps", type=int, default=30, help="batches timed")
    p.add_argument("--bpe-vocab", type=int, default=8192)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="maxtrain-data-bench-")
    try:
        nbytes = _corpus(os.path.join(root, "text"), args.mb)
        mb = nbytes / 2**20
        t0 = time.perf_counter()
        prepare(os.path.join(root, "text"), os.path.join(root, "byte"), "byte", shards=4, progress=False)
        byte_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        prepare(os.path.join(root, "text"), os.path.join(root, "bpe"), train_tokenizer=args.bpe_vocab, shards=4,
                progress=False)
        bpe_total_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        prepare(os.path.join(root, "text"), os.path.join(root, "bpe2"), os.path.join(root, "bpe", "tokenizer.json"),
                shards=4, progress=False)
        bpe_s = time.perf_counter() - t0

        cfg = load_config(None, ["data.kind=tokens", f"data.path={os.path.join(root, 'byte')}", "train.seq_len=2048",
                                 "train.batch_size=64", f"train.steps={args.steps + 5}", "model.vocab_size=512",
                                 f"data.workers={args.workers}", "data.prefetch=8"])
        source = make_source(cfg)
        sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("x",)), jax.sharding.PartitionSpec())
        loader = Loader(source, cfg, 0, cfg.train.steps, 0, 64)
        for _ in range(5):  # workers start, first shard opens and is verified
            jax.block_until_ready(put_batch(loader.next()[0], sharding))
        t0 = time.perf_counter()
        waited = 0.0
        for _ in range(args.steps):
            batch, wait = loader.next()
            waited += wait
            jax.block_until_ready(put_batch(batch, sharding))
        loader_s = time.perf_counter() - t0
        tokens = args.steps * 64 * 2048
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"corpus          {mb:.1f} MiB of Python source, {os.cpu_count()} CPU cores")
    print(f"prepare byte    {mb / byte_s:,.1f} MiB/s ({byte_s:.1f}s)")
    print(f"prepare BPE     {mb / bpe_s:,.1f} MiB/s with a trained {args.bpe_vocab}-token BPE ({bpe_s:.1f}s; "
          f"training it + tokenizing: {bpe_total_s:.1f}s)")
    print(f"loader          {tokens / loader_s:,.0f} tokens/s to the device (seq_len 2048, batch 64, "
          f"{args.workers} workers), {loader_s / args.steps * 1e3:.1f} ms/batch")
    print(json.dumps({"prepare_byte_mb_per_s": mb / byte_s, "prepare_bpe_mb_per_s": mb / bpe_s,
                      "bpe_train_and_prepare_s": bpe_total_s, "loader_tokens_per_s": tokens / loader_s,
                      "loader_ms_per_batch": loader_s / args.steps * 1e3, "workers": args.workers}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
