"""The schedule model against a measured GPU profile: a config's step compiled for a described GPU
(no device needed), its predicted step per category of kernel beside the device time a profile of
the real step measured, and the error of each.

    python bench/schedule_check.py                       # the 1B step on one H200 (docs/kernels.md)
    python bench/schedule_check.py CONFIG --target h100 --devices 8 --measured '{"matmul": 300, ...}' [KEY=VALUE ...]

The default is the one GPU profile we have: `configs/llama3-1b.yaml`, batch 8 x 4096, fused
cross-entropy, no remat, on one H200 (`bench/trace_summary.py` of two steps, docs/kernels.md:
matmuls 345 ms, attention 131 ms with flash_mosaic (cuDNN's 153), other fusions 130 ms, copies
39 ms; the step 0.663 s with cuDNN, 0.642 s with flash_mosaic). cuDNN cannot be compiled without
the device, so the prediction is for flash_mosaic. Prints a table; last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

H200_1B = {  # ms per step, docs/kernels.md (jax 0.11, one H200)
    "matmul": 345.0, "attention": 131.0, "fusion": 130.0, "copy": 39.0, "step": 642.0,
}
H200_1B_OVERRIDES = ["model.attention=flash_mosaic", "train.cross_entropy=fused", "model.remat=none",
                     "train.batch_size=8", "train.seq_len=4096", "mesh.data=1", "mesh.fsdp=1"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default="configs/llama3-1b.yaml")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--target", default="h200")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--measured", default=None, help="JSON: ms per step by category (matmul, attention, fusion, "
                                                    "copy, collective) and `step`; default the H200 1B profile")
    args = p.parse_intermixed_args(argv)
    measured = dict(H200_1B) if args.measured is None else json.loads(args.measured)
    overrides = (H200_1B_OVERRIDES if args.measured is None else []) + args.overrides

    import jax

    jax.config.update("jax_platforms", "cpu")
    from maxtrain.analysis.inspect import inspect_step
    from maxtrain.config import ConfigError, load_config
    from maxtrain.targets import target_devices

    try:
        cfg = load_config(args.config, overrides)
        r = inspect_step(cfg, target_devices(args.target, args.devices))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    roof, sched = r["roofline"], r["schedule"]
    predicted = {k: 1e3 * v for k, v in roof["by_category_s"].items()}
    predicted["collective (exposed)"] = 1e3 * sched["exposed_collective_s"]
    # a profile names kernels by what they do, the compiled program by how XLA emitted them: a
    # saved activation stacked in place is a "copy" in a trace and a dynamic-update-slice fusion here
    for both in (measured, predicted):
        if "fusion" in both or "copy" in both:
            both["fusion + copy"] = both.get("fusion", 0.0) + both.get("copy", 0.0)
    predicted["step"] = 1e3 * sched["predicted_step_s"]
    rows = []
    print(f"{args.config} {' '.join(overrides)} on {args.devices} {args.target} ({r['attention']})")
    print(f"{'category':22s} {'measured ms':>12s} {'predicted ms':>13s} {'error':>8s}")
    for cat in dict.fromkeys([*measured, *predicted]):
        m, q = measured.get(cat), predicted.get(cat)
        err = None if not m or q is None else (q - m) / m
        rows.append({"category": cat, "measured_ms": m, "predicted_ms": q, "error": err})
        print(f"{cat:22s} {_ms(m):>12s} {_ms(q):>13s} {'' if err is None else f'{100 * err:+.0f}%':>8s}")
    print(json.dumps({"rows": rows, "attention": r["attention"], "bound_ms": 1e3 * roof["step_s"]}))
    return 0


def _ms(v) -> str:
    return "-" if v is None else f"{v:,.1f}"


if __name__ == "__main__":
    sys.exit(main())
