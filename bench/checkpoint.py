"""Checkpoint saves by state size: what blocks the train loop in an async save, phase by phase.

    python bench/checkpoint.py [configs/tiny.yaml] [KEY=VALUE ...] [--sizes 10MB,30MB,100MB,300MB,1GB]
                               [--repeats N] [--dir DIR] [--no-restore]

For each size, the config's model is scaled (`model.d_model`, `d_ff = 3 d_model`, 4 layers) until
params + AdamW moments (float32) come closest to it; by default the state is held once, FSDP over
all devices (`mesh.data=1 mesh.fsdp=-1`; pass `mesh.data=-1 mesh.fsdp=1` for a replicated state).
Per size it runs one cold async save (the first in the process: XLA compiles the checksum and
Orbax's slicing), `--repeats` synchronous saves and `--repeats` warm async saves, each async save
waited for before the next, and one verified restore. The blocked time of an async save
(`Checkpointer.save`'s return) is split into its phases (`Checkpointer.last_save_phases`):

- previous:   waiting for the previous save's commit (zero here: each save is waited for)
- retention:  deciding which old checkpoints go and removing them
- listing:    the step listing (is this step already saved?)
- ready:      waiting for the computation that produced the arrays (zero here)
- checksum:   the per-array checksums, computed on device and fetched
- d2h:        Orbax copying the arrays off the devices (`replica_slices.transfer_arrays_to_host`)
- orbax:      the rest of Orbax's synchronous part of `CheckpointManager.save`
- thread:     starting our commit thread

Medians over the warm repeats. The last line is one JSON object (`sizes`: one record per size).

`--dir s3://BUCKET/PREFIX` (or gs://) measures saves into an object store (endpoint and credentials
from the standard AWS variables; each size's objects are deleted afterwards). `--s3-server` starts
a SeaweedFS server on 127.0.0.1 (the `weed` binary of the test extra, tests/s3server.py) and
measures against it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import jax

from maxtrain import load_config, models, storage
from maxtrain.checkpoint import Checkpointer
from maxtrain.mesh import use_mesh
from maxtrain.step import init_state, make_setup, sharded_abstract_state

DEFAULT_SIZES = "10MB,30MB,100MB,300MB,1GB"
PHASES = ("previous", "retention", "listing", "ready", "checksum", "d2h", "orbax", "thread")
STATE_COPIES = 3  # params + AdamW's two moments, all float32


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise SystemExit(f"--sizes: {text!r} is not a size like 30MB or 1GB")
    return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)])


def model_for(config: str, overrides: list[str], target_bytes: int) -> list[str]:
    """Overrides that scale the config's model so its train state comes closest to `target_bytes`."""
    best = None
    for d in range(64, 8193, 32):
        over = [f"model.d_model={d}", f"model.d_ff={3 * d}", "model.n_layers=4", "model.n_heads=8",
                "model.n_kv_heads=4"]
        cfg = load_config(config, overrides + over)
        model = models.get(cfg.model.name)
        shapes = jax.eval_shape(lambda k: model.init(cfg, k), jax.random.key(0))
        nbytes = STATE_COPIES * sum(x.size * 4 for x in jax.tree.leaves(shapes))
        if best is None or abs(nbytes - target_bytes) < abs(best[0] - target_bytes):
            best = (nbytes, over)
        if nbytes > target_bytes:
            break
    return best[1]


class D2HClock:
    """Seconds spent in Orbax's copy of arrays off the devices, summed since `reset`."""

    def __init__(self):
        from orbax.checkpoint._src.serialization import replica_slices

        self.seconds = 0.0
        real = replica_slices.transfer_arrays_to_host

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t

        replica_slices.transfer_arrays_to_host = timed  # Orbax looks it up on every save

    def reset(self) -> None:
        self.seconds = 0.0


def phases_of(ckpt: Checkpointer, blocked: float, d2h: float) -> dict[str, float]:
    ph = dict.fromkeys(PHASES, 0.0)
    ph.update({k: v for k, v in ckpt.last_save_phases.items() if k in ph})
    ph["d2h"] = min(d2h, ph["orbax"])
    ph["orbax"] -= ph["d2h"]
    ph["blocked"] = blocked
    return ph


def measure(cfg, root: str, repeats: int, restore: bool, clock: D2HClock) -> dict:
    setup = make_setup(cfg)
    out = {}
    with use_mesh(setup.mesh):
        state = init_state(setup, cfg.seed)
        jax.block_until_ready(state)
        out["state_bytes"] = sum(x.nbytes for x in jax.tree.leaves(state))
        out["params"] = sum(x.size for x in jax.tree.leaves(state.params))
        ck_cfg = dataclasses.replace(cfg.checkpoint, dir=root, async_=True, keep=1)
        ckpt = Checkpointer(root, ck_cfg)
        step = 0

        def one(is_async: bool):
            nonlocal step
            step += 1
            clock.reset()
            t0 = time.perf_counter()
            blocked = ckpt.save(step, state.params, state.opt_state, {"bench": True}, wait=not is_async)
            ph = phases_of(ckpt, blocked, clock.seconds)
            ckpt.wait(retention=False)  # as in the loop: the next save applies retention
            ph["total"] = time.perf_counter() - t0
            assert step in ckpt.steps(), f"the save of step {step} did not complete"
            return ph

        out["cold"] = one(True)
        sync = [one(False) for _ in range(repeats)]
        warm = [one(True) for _ in range(repeats)]
        out["sync_s"] = statistics.median(p["total"] for p in sync)
        out["async"] = {k: statistics.median(p[k] for p in warm) for k in warm[0]}
        if restore:
            abstract = sharded_abstract_state(setup)
            t0 = time.perf_counter()
            restored = ckpt.restore_latest_good(abstract.params, abstract.opt_state)
            jax.block_until_ready(restored.params)
            out["restore_s"] = time.perf_counter() - t0
            del restored
        ckpt.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml"))
    p.add_argument("overrides", nargs="*")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"state sizes (default {DEFAULT_SIZES})")
    p.add_argument("--repeats", type=int, default=2, help="sync and warm async saves per size (default 2)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--no-restore", dest="restore", action="store_false", help="skip the restore per size")
    p.add_argument("--s3-server", action="store_true",
                   help="start a local SeaweedFS S3 server and save into it (--dir default s3://maxtrain-test/bench)")
    args = p.parse_args(argv)
    if args.s3_server:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from s3server import BUCKET, S3Server

        server = S3Server(tempfile.mkdtemp(prefix="maxtrain-bench-s3-")).start()
        os.environ.update(server.env)
        args.dir = args.dir or f"s3://{BUCKET}/bench"
        try:
            return _run(args, p)
        finally:
            server.stop()
    return _run(args, p)


def _run(args, p) -> int:
    if "=" in args.config and not os.path.exists(args.config):  # only overrides were given
        args.overrides.insert(0, args.config)
        args.config = p.get_default("config")
    base_over = ["data.kind=synthetic", "mesh.data=1", "mesh.fsdp=-1", *args.overrides]
    root = args.dir or tempfile.mkdtemp(prefix="maxtrain-ckpt-bench-")
    clock = D2HClock()
    rows = []
    for text in args.sizes.split(","):
        target = parse_size(text)
        over = model_for(args.config, base_over, target)
        cfg = load_config(args.config, base_over + over)
        where = storage.join(root, text.strip())
        r = measure(cfg, where, args.repeats, args.restore, clock)
        if storage.is_url(where):
            storage.delete_prefix(where)
        else:
            shutil.rmtree(where, ignore_errors=True)
        r.update(size=text.strip(), d_model=cfg.model.d_model)
        rows.append(r)
        a = r["async"]
        print(f"{r['size']:>6}: {r['state_bytes'] / 1e6:,.0f} MB (d_model {cfg.model.d_model}), async blocked "
              f"{a['blocked']:.3f} s (cold {r['cold']['blocked']:.2f} s), async total {a['total']:.2f} s, "
              f"sync {r['sync_s']:.2f} s", flush=True)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)

    mesh = dict(make_setup(cfg).mesh.shape)
    print(f"\n{root if storage.is_url(root) else 'local disk'}: "
          f"{jax.device_count()} x {jax.devices()[0].device_kind}, mesh "
          f"{ {k: v for k, v in mesh.items() if v > 1} }; seconds (async: median of {args.repeats} warm saves)")
    head = ["state MB", *PHASES, "blocked", "cold", "async total", "sync save"] + (["restore"] if args.restore else [])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        a = r["async"]
        cells = [f"{r['state_bytes'] / 1e6:,.0f}", *(f"{a[k]:.3f}" for k in PHASES), f"**{a['blocked']:.3f}**",
                 f"{r['cold']['blocked']:.2f}", f"{a['total']:.2f}", f"{r['sync_s']:.2f}"]
        if args.restore:
            cells.append(f"{r['restore_s']:.2f}")
        print("| " + " | ".join(cells) + " |")
    print(json.dumps({"devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
                      "repeats": args.repeats, "sizes": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
