"""FP8 numerics, measured: the same model trained in bf16 and in each FP8 recipe from the same init
and data, and how far apart their loss curves end.

    python bench/fp8.py                      # ~20M-parameter Llama, 300 steps, every recipe (CPU: ~25 min)
    python bench/fp8.py --recipes float32    # the noise floor alone: bf16 against float32 compute
    python bench/fp8.py --steps 50 --recipes tensorwise

On CPU FP8 is emulated: the arithmetic is slow, but every value is rounded to e4m3/e5m2 exactly as
on a GPU, so the loss curves are the numerics a GPU run would have. Prints, per recipe: the eval
loss after the last step (the same 16 held-out batches for every run: the headline, free of the
training batches' noise) and its relative gap to bf16, the final training loss (mean of the last
`--tail` steps) and its gap, the largest gap over the smoothed curves, and the run's mean
underflow and saturation shares (the `fp8_*` metrics). `float32` is the bf16 run with float32
compute: how far apart two runs end that differ only in rounding, the floor under which an FP8
gap is noise of the trajectory, not FP8's. Then,
from the trained state, per layer and projection: the amaxes and scales of x, w and g and the
shares of each that flushed to zero or were clipped. Writes `fp8.json` and `fp8_loss.png` under
`--out`. The last line is the JSON summary.
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

# ~20M parameters (byte tokens: the embeddings are small, the layers are the model)
MODEL = ["model.d_model=512", "model.n_layers=6", "model.n_heads=8", "model.n_kv_heads=4", "model.d_ff=1536"]
RUN = ["train.batch_size=8", "train.seq_len=128", "train.dtype=bfloat16", "train.log_every=1",
       "optim.warmup_steps=30", "seed=0", "mesh.data=1", "mesh.fsdp=1", "train.eval_steps=16",
       "data.eval_path=stdlib"]  # evaluated on another shuffled stream of the corpus


def train_one(recipe: str, steps: int, out: str, overrides: list[str]):
    from maxtrain import load_config, train

    precision = ["train.dtype=float32", "train.fp8.recipe=none"] if recipe == "float32" else \
        [f"train.fp8.recipe={recipe}"]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), MODEL + RUN + [
        f"train.steps={steps}", f"train.eval_every={steps}", *precision, f"run_dir={out}/run-{recipe}",
        "logging.tensorboard=false", *overrides])
    import jax

    t0 = time.perf_counter()
    result = train(cfg, devices=jax.devices()[:1])
    return cfg, result, time.perf_counter() - t0


def smooth(x: np.ndarray, k: int) -> np.ndarray:
    k = max(1, min(k, len(x)))
    return np.convolve(x, np.ones(k) / k, mode="valid")


def layer_stats(cfg, result) -> list[dict]:
    """Per layer and projection, the FP8 statistics of one training batch on the trained state."""
    from maxtrain.data import make_source
    from maxtrain.layers.fp8 import E4M3, E5M2, PROBE
    from maxtrain.step import make_setup, precision_statistics, put_batch
    import jax
    import jax.numpy as jnp

    setup = make_setup(cfg, jax.devices()[:1])
    source = make_source(cfg)
    batch = put_batch(source.batch(cfg.train.steps), setup.batch_sharding)
    probes = jax.device_get(precision_statistics(setup, result.state, batch))
    fmax = {"x": float(jnp.finfo(E4M3).max), "w": float(jnp.finfo(E4M3).max), "g": float(jnp.finfo(E5M2).max)}
    rows = []
    for name, leaf in sorted(jax.tree_util.tree_flatten_with_path(probes)[0], key=lambda p: str(p[0])):
        proj = "/".join(str(getattr(k, "key", k)) for k in name)
        for layer, values in enumerate(np.asarray(leaf).reshape(-1, len(PROBE))):
            v = dict(zip(PROBE, values.tolist()))
            row = {"layer": layer, "projection": proj}
            for t in "xwg":
                row[f"{t}_amax"] = v[f"{t}_amax"]
                row[f"{t}_scale"] = v[f"{t}_amax"] / fmax[t]
                row[f"{t}_underflow"] = v[f"{t}_underflow"]
                row[f"{t}_saturation"] = v[f"{t}_saturation"]
            rows.append(row)
    return rows


def plot(curves: dict[str, np.ndarray], path: str, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for i, (name, losses) in enumerate(curves.items()):
        color = f"C{i}"  # the same colour for a run in both panels
        top.plot(np.arange(k, len(losses) + 1), smooth(losses, k), label=name, color=color)
        if name != "bf16":
            gap = smooth(losses, k) / smooth(curves["bf16"], k) - 1
            bottom.plot(np.arange(k, len(losses) + 1), 100 * gap, label=name, color=color,
                        ls="--" if name == "float32" else "-")
    top.set_ylabel(f"loss (mean of {k} steps)")
    top.legend()
    bottom.axhline(0, color="gray", lw=0.5)
    bottom.set_ylabel("gap to bf16 (%)")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--recipes", default="float32,tensorwise,rowwise,delayed",
                    help="FP8 recipes; float32: the bf16 run with float32 compute, the gap any change of rounding "
                         "makes (the noise floor the FP8 gaps compare against)")
    ap.add_argument("--tail", type=int, default=20, help="steps the final loss is averaged over")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "fp8"))
    ap.add_argument("overrides", nargs="*", help="config overrides (KEY=VALUE) for every run")
    args = ap.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    os.makedirs(args.out, exist_ok=True)

    curves, summary = {}, {"steps": args.steps, "recipes": {}}
    for recipe in ["none"] + recipes:
        cfg, result, secs = train_one(recipe, args.steps, args.out, args.overrides)
        name = "bf16" if recipe == "none" else recipe
        curves[name] = np.array([r["loss"] for r in result.history])
        row = {"seconds": round(secs, 1), "final_loss": float(curves[name][-args.tail:].mean()),
               "eval_loss": float(result.history[-1]["eval_loss"])}
        fp8 = recipe not in ("none", "float32")
        if recipe != "none":
            base = curves["bf16"]
            row["final_gap"] = row["final_loss"] / float(base[-args.tail:].mean()) - 1
            row["eval_gap"] = row["eval_loss"] / summary["recipes"]["bf16"]["eval_loss"] - 1
            row["max_smoothed_gap"] = float(np.max(np.abs(smooth(curves[name], args.tail) / smooth(base, args.tail) - 1)))
        if fp8:
            for key in sorted(k for k in result.history[0] if k.startswith("fp8_") and not k.endswith("amax")):
                row[key] = float(np.mean([r[key] for r in result.history]))
            layers = layer_stats(cfg, result)
            row["layers"] = layers
            print(f"\n{name}: per layer, one batch on the trained state (scale = amax / format max)")
            print(f"{'layer':>5} {'projection':<10} {'x amax':>9} {'w amax':>9} {'g amax':>9} "
                  f"{'x under':>8} {'w under':>8} {'g under':>8} {'x sat':>7} {'g sat':>7}")
            for r in layers:
                print(f"{r['layer']:>5} {r['projection']:<10} {r['x_amax']:>9.3g} {r['w_amax']:>9.3g} {r['g_amax']:>9.3g} "
                      f"{r['x_underflow']:>8.2%} {r['w_underflow']:>8.2%} {r['g_underflow']:>8.2%} "
                      f"{r['x_saturation']:>7.2%} {r['g_saturation']:>7.2%}")
        summary["recipes"][name] = row
        print(f"{name:>10}: eval loss {row['eval_loss']:.4f}" + (f" ({row['eval_gap']:+.2%} vs bf16)" if recipe != "none"
                                                                 else "") + f", train loss {row['final_loss']:.4f}"
              + (f" ({row['final_gap']:+.2%} vs bf16, largest smoothed gap {row['max_smoothed_gap']:.2%})"
                 if recipe != "none" else "")
              + (f"; mean underflow x {row['fp8_x_underflow']:.2%} w {row['fp8_w_underflow']:.2%} "
                 f"g {row['fp8_g_underflow']:.2%}, saturation x {row['fp8_x_saturation']:.3%} "
                 f"g {row['fp8_g_saturation']:.3%}" if fp8 else "")
              + f", {secs:.0f} s", flush=True)
    plot(curves, os.path.join(args.out, "fp8_loss.png"), args.tail)
    with open(os.path.join(args.out, "fp8.json"), "w") as f:
        json.dump({**summary, "curves": {k: v.tolist() for k, v in curves.items()}}, f)
    brief = {k: {kk: vv for kk, vv in v.items() if kk != "layers"} for k, v in summary["recipes"].items()}
    print(json.dumps({"steps": args.steps, "recipes": brief}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
