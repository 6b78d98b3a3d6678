"""Are a config's defaults the fastest choice? Its train step compiled for described GPUs (no device
needed) over attention x loss x remat, each with its compiled memory per device, the roofline
bound and the schedule model's predicted step and MFU (`maxtrain.analysis`), and where the
config's own defaults stand against the best that fits.

    python bench/defaults.py configs/llama3-8b.yaml --target h100 --devices 8 train.batch_size=8
        [--attention auto,xla] [--loss auto,xla] [--remat full,save_dots,none]

A choice fits when its compiled memory is within what jax's allocator gets on the target
(`maxtrain.targets.device_memory`). Prints a table; last line one JSON object with the rows, the
default's row and the best.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--target", default="h100")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--attention", default="auto,xla")
    p.add_argument("--loss", default="auto,xla")
    p.add_argument("--remat", default="full,save_dots,none")
    args = p.parse_intermixed_args(argv)

    import jax

    jax.config.update("jax_platforms", "cpu")
    from maxtrain.analysis.inspect import inspect_step
    from maxtrain.config import ConfigError, load_config
    from maxtrain.targets import device_memory, target_devices

    try:
        devices = target_devices(args.target, args.devices)
        default = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    limit = device_memory(devices[0])
    mine = (default.model.attention, default.train.cross_entropy, default.model.remat)
    grid = list(itertools.product(args.attention.split(","), args.loss.split(","), args.remat.split(",")))
    if mine not in grid:
        grid.insert(0, mine)
    rows = []
    print(f"{args.config} {' '.join(args.overrides)} on {args.devices} {args.target}; defaults {'/'.join(mine)}; "
          f"{limit / 2**30:.1f} GiB per device", file=sys.stderr)
    for attention, loss, remat in grid:
        t0 = time.perf_counter()
        try:
            cfg = load_config(args.config, [*args.overrides, f"model.attention={attention}",
                                            f"train.cross_entropy={loss}", f"model.remat={remat}"])
            r = inspect_step(cfg, devices)
        except Exception as e:  # a choice that cannot compile is a row, not the end
            rows.append({"attention": attention, "loss": loss, "remat": remat, "error": str(e).splitlines()[0][:200]})
            print(f"{attention:6s} {loss:6s} {remat:10s} error: {rows[-1]['error']}", file=sys.stderr, flush=True)
            continue
        mem = r["memory_per_device"]["total"]
        sched, roof = r["schedule"], r["roofline"]
        rows.append({"attention": attention, "runs": r["attention"], "loss": loss, "remat": remat,
                     "memory_gib": round(mem / 2**30, 2), "fits": bool(limit and mem <= limit),
                     "bound_ms": round(1e3 * roof["step_s"], 1), "predicted_ms": round(1e3 * sched["predicted_step_s"], 1),
                     "predicted_mfu": round(sched["predicted_mfu"], 4), "compile_s": round(time.perf_counter() - t0, 1)})
        x = rows[-1]
        print(f"{attention:6s} {loss:6s} {remat:10s} {x['memory_gib']:7.1f} GiB {'fits' if x['fits'] else 'OVER':4s} "
              f"bound {x['bound_ms']:9.1f} ms  predicted {x['predicted_ms']:9.1f} ms  MFU {100 * x['predicted_mfu']:5.1f}%  "
              f"({x['runs']})", file=sys.stderr, flush=True)
    fitting = [r for r in rows if r.get("fits")]
    best = min(fitting, key=lambda r: r["predicted_ms"], default=None)
    own = next((r for r in rows if (r["attention"], r["loss"], r["remat"]) == mine and "error" not in r), None)
    if best and own:
        print(f"defaults {'/'.join(mine)}: {own['predicted_ms']:.1f} ms predicted{'' if own['fits'] else ' (does not fit)'}"
              f"; best that fits {best['attention']}/{best['loss']}/{best['remat']}: {best['predicted_ms']:.1f} ms; "
              f"the defaults take {own['predicted_ms'] / best['predicted_ms']:.3f}x", file=sys.stderr)
    print(json.dumps({"rows": rows, "defaults": own, "best": best}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
