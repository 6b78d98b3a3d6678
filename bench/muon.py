"""Muon against AdamW, measured: the same model, data and learning-rate schedule trained with each
optimizer from the same init, and where their losses end.

    python bench/muon.py                       # ~20M-parameter Llama on byte-level text, 300 steps each
    python bench/muon.py --steps 100 --lrs 1e-3,3e-3

One device (CPU here), float32 compute. Muon uses `optim.muon.rms_scale=0.2` (its update RMS
matched to AdamW's, Moonlight's recipe), so both runs share `optim.lr` and weight decay; `--lrs`
sweeps the learning rate for both. Prints per optimizer and rate: the eval loss after the last
step (the same 16 held-out batches for every run), the final training loss (mean of the last
`--tail` steps) and seconds per step. The last line is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["model.d_model=512", "model.n_layers=6", "model.n_heads=8", "model.n_kv_heads=4", "model.d_ff=1536"]
RUN = ["train.batch_size=8", "train.seq_len=128", "train.dtype=float32", "train.log_every=1", "optim.warmup_steps=30",
       "seed=0", "mesh.data=1", "mesh.fsdp=1", "train.eval_steps=16", "data.eval_path=stdlib",
       "logging.tensorboard=false"]


def train_one(name: str, lr: float, steps: int, tail: int, out: str, overrides: list[str]) -> dict:
    import jax

    from maxtrain import load_config, train

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), MODEL + RUN + [
        f"optim.name={name}", f"optim.lr={lr}", f"train.steps={steps}", f"train.eval_every={steps}",
        f"run_dir={out}/run-{name}-{lr:g}", *overrides])
    t0 = time.perf_counter()
    result = train(cfg, devices=jax.devices()[:1])
    seconds = time.perf_counter() - t0
    losses = np.asarray([r["loss"] for r in result.history])
    return {"optimizer": name, "lr": lr, "eval_loss": float(result.history[-1]["eval_loss"]),
            "train_loss": float(losses[-tail:].mean()), "s_per_step": seconds / steps, "losses": losses.tolist()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lrs", default="1e-3,3e-3")
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "muon"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    rows = []
    for lr in (float(x) for x in args.lrs.split(",")):
        for name in ("adamw", "muon"):
            rows.append(train_one(name, lr, args.steps, args.tail, args.out, args.overrides))
            r = rows[-1]
            print(f"{name:<6} lr {lr:<7g} eval loss {r['eval_loss']:.4f}  train loss {r['train_loss']:.4f}  "
                  f"{1e3 * r['s_per_step']:.0f} ms/step", flush=True)
    print(json.dumps([{k: v for k, v in r.items() if k != "losses"} for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
