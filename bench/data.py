"""Input pipeline throughput: `prepare` MB/s (byte and BPE) and loader tokens/s to the device,
beside the tokens/s a GPU host's training step consumes.

    python bench/data.py [--mb 16] [--workers 0,2] [--steps 30] [--config configs/llama3-8b.yaml]
                         [--gpu h100] [--mfu 0.45] [--gpus-per-host 8] [--s3-server]

The corpus is this Python's standard library (.py files, copied up to --mb MiB). The loader reads
packed rows of the config's `train.seq_len`, 64 rows a batch, from the prepared shards with each
`--workers` count of grain processes, and places each batch on the device. The step's appetite:
`--gpus-per-host` GPUs of `--gpu` at `--mfu` of their bf16 peak, each token costing the model's
training FLOPs per token (6 N plus attention, `models.flops_per_token`); the margin is the
loader's rate over it. `--s3-server` also puts the prepared shards on a SeaweedFS server on
127.0.0.1 (the test extra's `weed`) and trains from the bucket: its shards are copied once into the
node-local `object_cache` (that copy's MB/s is printed) and then read from there. The last line is
one JSON object.
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

from maxtrain import load_config, storage
from maxtrain.data import Loader, make_source
from maxtrain.metrics import peak_tflops
from maxtrain.models.registry import flops_per_token
from maxtrain.targets import get_target
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
        try:  # a few of the standard library's files are Latin-1: prepare refuses them
            with open(f, encoding="utf-8") as fh:
                fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        shutil.copy(f, os.path.join(dst, f"{i:05d}.txt"))
        total += size
    return total


ROWS = 64  # rows a batch in the loader measurement


def step_appetite(config: str, gpu: str, mfu: float, gpus_per_host: int) -> dict:
    """Tokens/s one host's training step consumes: its GPUs' bf16 peak at `mfu`, over the model's
    training FLOPs per token at the config's sequence length."""
    cfg = load_config(config, ["data.kind=synthetic"])
    target = get_target(gpu)
    per_token = flops_per_token(cfg, cfg.train.seq_len)
    per_gpu = mfu * peak_tflops(target.device_kind) * 1e12 / per_token
    return {"config": os.path.basename(config), "seq_len": cfg.train.seq_len, "gpu": gpu, "mfu": mfu,
            "flops_per_token": per_token, "tokens_per_s_per_gpu": per_gpu,
            "tokens_per_s_per_host": per_gpu * gpus_per_host, "gpus_per_host": gpus_per_host}


def loader_rate(path: str, seq_len: int, workers: int, steps: int, cache: str) -> dict:
    """Tokens/s the loader delivers to the device from prepared shards at `path` (a directory or a
    bucket prefix, then read from its copy under `cache`)."""
    cfg = load_config(None, ["data.kind=tokens", f"data.path={path}", f"train.seq_len={seq_len}",
                             f"train.batch_size={ROWS}", f"train.steps={steps + 5}", "model.vocab_size=512",
                             f"data.workers={workers}", "data.prefetch=8", f"object_cache={cache}"])
    t0 = time.perf_counter()
    source = make_source(cfg)  # a bucket's shards are copied here, once per node
    open_s = time.perf_counter() - t0
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("x",)), jax.sharding.PartitionSpec())
    loader = Loader(source, cfg, 0, cfg.train.steps, 0, ROWS)
    for _ in range(5):  # workers start, first shard opens and is verified
        jax.block_until_ready(put_batch(loader.next()[0], sharding))
    t0 = time.perf_counter()
    for _ in range(steps):
        batch, _ = loader.next()
        jax.block_until_ready(put_batch(batch, sharding))
    loader_s = time.perf_counter() - t0
    return {"workers": workers, "tokens_per_s": steps * ROWS * seq_len / loader_s,
            "ms_per_batch": loader_s / steps * 1e3, "open_s": open_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=16.0, help="MiB of text to prepare")
    p.add_argument("--workers", default="0,2", help="grain worker process counts to measure (default 0,2)")
    p.add_argument("--steps", type=int, default=30, help="batches timed")
    p.add_argument("--bpe-vocab", type=int, default=8192)
    p.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                                                     "llama3-8b.yaml"), help="the model whose step is compared")
    p.add_argument("--gpu", default="h100", help="GPU kind of the step (maxtrain.targets: h100, h200, ...)")
    p.add_argument("--mfu", type=float, default=0.45, help="the step's assumed MFU (default 0.45)")
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--s3-server", action="store_true", help="also load from a local SeaweedFS S3 server")
    args = p.parse_args(argv)
    appetite = step_appetite(args.config, args.gpu, args.mfu, args.gpus_per_host)
    server = None
    if args.s3_server:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from s3server import BUCKET, S3Server

        server = S3Server(tempfile.mkdtemp(prefix="maxtrain-bench-s3-")).start()
        os.environ.update(server.env)
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

        seq_len = appetite["seq_len"]
        workers = [int(w) for w in args.workers.split(",")]
        local = [loader_rate(os.path.join(root, "byte"), seq_len, w, args.steps, os.path.join(root, "cache"))
                 for w in workers]
        remote = []
        if server is not None:
            url = f"s3://{BUCKET}/bench-tokens"
            storage.publish(os.path.join(root, "byte"), url, last=("manifest.json",))
            remote = [loader_rate(url, seq_len, w, args.steps, os.path.join(root, f"cache-{w}")) for w in workers]
            shard_mb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "byte"))
                           for f in fs) / 2**20
            for r in remote:
                r["copy_mb_per_s"] = shard_mb / r["open_s"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if server is not None:
            server.stop()
    print(f"corpus          {mb:.1f} MiB of Python source, {os.cpu_count()} CPU cores")
    print(f"prepare byte    {mb / byte_s:,.1f} MiB/s ({byte_s:.1f}s)")
    print(f"prepare BPE     {mb / bpe_s:,.1f} MiB/s with a trained {args.bpe_vocab}-token BPE ({bpe_s:.1f}s; "
          f"training it + tokenizing: {bpe_total_s:.1f}s)")
    need = appetite["tokens_per_s_per_host"]
    print(f"step appetite   {need:,.0f} tokens/s per host: {appetite['config']} at seq_len {appetite['seq_len']}, "
          f"{appetite['flops_per_token'] / 1e9:.1f} GFLOP/token, {args.gpus_per_host} x {args.gpu} at MFU "
          f"{args.mfu:.0%} ({appetite['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU)")
    for where, rows in (("local disk", local), ("S3 (local copy)", remote)):
        for r in rows:
            copy = f", copied once at {r['copy_mb_per_s']:,.0f} MiB/s" if "copy_mb_per_s" in r else ""
            print(f"loader          {where}, {r['workers']} workers: {r['tokens_per_s']:,.0f} tokens/s "
                  f"({r['ms_per_batch']:.1f} ms per {ROWS} x {seq_len} batch{copy}): "
                  f"{r['tokens_per_s'] / need:.1f}x the step's appetite")
    print(json.dumps({"prepare_byte_mb_per_s": mb / byte_s, "prepare_bpe_mb_per_s": mb / bpe_s,
                      "bpe_train_and_prepare_s": bpe_total_s, "step": appetite, "loader_local": local,
                      "loader_s3": remote, "cpu_cores": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
