"""Checkpoint throughput: save and restore MB/s, and train-loop blocking of async vs sync saves.

    python bench/checkpoint.py [configs/tiny.yaml] [KEY=VALUE ...] [--dir DIR] [--repeats N]

By default a ~1 GB state (84M params + AdamW moments, float32). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax

from maxtrain import load_config
from maxtrain.checkpoint import Checkpointer
from maxtrain.mesh import use_mesh
from maxtrain.train import init_state, make_setup, sharded_abstract_state

ONE_GB_MODEL = ["model.vocab_size=16000", "model.d_model=1024", "model.n_layers=4", "model.n_heads=16",
                "model.n_kv_heads=16", "model.d_ff=2816", "data.kind=synthetic"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml"))
    p.add_argument("overrides", nargs="*")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    cfg = load_config(args.config, ONE_GB_MODEL + args.overrides)
    setup = make_setup(cfg)
    root = args.dir or tempfile.mkdtemp(prefix="maxtrain-ckpt-bench-")
    with use_mesh(setup.mesh):
        state = init_state(setup, cfg.seed)
        jax.block_until_ready(state)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        results = {}
        for mode, is_async in (("sync", False), ("async", True)):
            ck_cfg = dataclasses.replace(cfg.checkpoint, dir=os.path.join(root, mode), async_=is_async, keep=1)
            ckpt = Checkpointer(ck_cfg.dir, ck_cfg)
            blocked, total = [], []
            for i in range(args.repeats):
                t0 = time.perf_counter()
                blocked.append(ckpt.save(i + 1, state.params, state.opt_state, {"bench": True}))
                ckpt.wait()
                total.append(time.perf_counter() - t0)
            results[mode] = {"block_s": statistics.median(blocked), "total_s": statistics.median(total)}
            if mode == "async":
                abstract = sharded_abstract_state(setup)
                t0 = time.perf_counter()
                restored = ckpt.restore_latest_good(abstract.params, abstract.opt_state)
                jax.block_until_ready(restored.params)
                results["restore_s"] = time.perf_counter() - t0
            ckpt.close()
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    mb = nbytes / 2**20
    sync, asyn = results["sync"], results["async"]
    print(f"state {mb:,.0f} MiB on {setup.mesh.size} x {jax.devices()[0].device_kind}")
    print(f"sync save   {sync['total_s']:.2f} s  ({mb / sync['total_s']:,.0f} MiB/s), loop blocked {sync['block_s']:.3f} s")
    print(f"async save  {asyn['total_s']:.2f} s  ({mb / asyn['total_s']:,.0f} MiB/s), loop blocked {asyn['block_s']:.3f} s"
          f" = {100 * asyn['block_s'] / sync['block_s']:.1f}% of sync")
    print(f"restore     {results['restore_s']:.2f} s  ({mb / results['restore_s']:,.0f} MiB/s, checksums verified)")
    print(json.dumps({
        "state_bytes": nbytes,
        "save_sync_s": sync["total_s"], "save_sync_mb_per_s": mb / sync["total_s"],
        "save_async_total_s": asyn["total_s"], "async_block_s": asyn["block_s"], "sync_block_s": sync["block_s"],
        "async_block_fraction_of_sync": asyn["block_s"] / sync["block_s"],
        "restore_s": results["restore_s"], "restore_mb_per_s": mb / results["restore_s"],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
