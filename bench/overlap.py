"""What each GPU overlap option buys: the train step compiled for described GPUs with the default
options (`maxtrain.step.GPU_OVERLAP_OPTIONS`), with none of them, and with each one left out (or
an extra one added), and for each the schedule model's predicted step, exposed communication and
MFU (`maxtrain.analysis.schedule`), the roofline bound and the compiled memory per device.

    python bench/overlap.py configs/llama3-8b.yaml --target h100 --devices 8 [KEY=VALUE ...]
        [--extra '{"xla_gpu_enable_while_loop_double_buffering": true}'] [--only all,none]

Compiles without a GPU (jax's CUDA plugin, `maxtrain.targets`); one trace, one compile per row.
Prints a table and, last, one JSON list of the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--target", default="h100")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--extra", default="{}", help="JSON: options to try added to the defaults, one row each")
    p.add_argument("--only", default="", help="comma-separated row names to compile (all, none, -FLAG, +FLAG)")
    args = p.parse_intermixed_args(argv)

    import jax

    jax.config.update("jax_platforms", "cpu")
    from maxtrain.analysis.hlo import gpu_roofline
    from maxtrain.analysis.inspect import step_hlo
    from maxtrain.analysis.schedule import predict
    from maxtrain.config import ConfigError, load_config
    from maxtrain.devices import device_figures
    from maxtrain.mesh import use_mesh
    from maxtrain.metrics import memory_breakdown
    from maxtrain.step import GPU_OVERLAP_OPTIONS, make_setup, step_compiler_options, trace_train_step
    from maxtrain.targets import target_devices

    try:
        cfg = load_config(args.config, args.overrides)
        devices = target_devices(args.target, args.devices)
        setup = make_setup(cfg, devices)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base = step_compiler_options(setup.cfg, "gpu")
    off = step_compiler_options(setup.cfg, "cpu")  # the step's own options, none of the overlap ones
    rows = {"all": base, "none": off}
    for flag in GPU_OVERLAP_OPTIONS:
        if flag in base:
            rows[f"-{flag}"] = {k: v for k, v in base.items() if k != flag}
    for flag, value in json.loads(args.extra).items():
        rows[f"+{flag}={value}"] = {**base, flag: value}
    if args.only:
        rows = {k: v for k, v in rows.items() if k in args.only.split(",") or k.split("=")[0] in args.only.split(",")}
    t0 = time.perf_counter()
    with use_mesh(setup.mesh):
        lowered = trace_train_step(setup).lower()
    print(f"{args.config} on {args.devices} {args.target}: mesh "
          f"{','.join(f'{k}={v}' for k, v in setup.mesh.shape.items() if v > 1)}, traced in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    device = device_figures(devices[0].device_kind)
    per_host = min(8, len(devices))
    model_flops = setup.flops_per_step / len(devices)
    out = []
    for name, options in rows.items():
        t0 = time.perf_counter()
        try:
            compiled = lowered.compile(compiler_options=options)
        except Exception as e:  # a row that does not compile is reported, not fatal
            out.append({"row": name, "error": str(e).splitlines()[0][:300]})
            continue
        hlo = step_hlo(compiled.as_text(), setup.cfg)
        roof = gpu_roofline(hlo, devices[0].device_kind, devices_per_host=per_host)
        sched = predict(hlo, roof, devices_per_host=per_host, link_latency_s=device.link_latency_s,
                        network_latency_s=device.network_latency_s)
        out.append({"row": name, "compile_s": round(time.perf_counter() - t0, 1),
                    "memory_gib": round(memory_breakdown(compiled)["total"] / 2**30, 2),
                    "bound_ms": round(1e3 * roof.step_s, 2), "predicted_ms": round(1e3 * sched.step_s, 2),
                    "exposed_ms": round(1e3 * sched.exposed_s, 2), "collective_ms": round(1e3 * sched.collective_s, 2),
                    "predicted_mfu": round(sched.mfu(model_flops), 4),
                    "exposed_by_kind_ms": {k: round(1e3 * v, 2) for k, v in sched.exposed_by_kind().items()}})
        print(_row(out[-1]), file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


def _row(r: dict) -> str:
    if "error" in r:
        return f"{r['row']:58s} error: {r['error']}"
    return (f"{r['row']:58s} predicted {r['predicted_ms']:9.2f} ms  exposed {r['exposed_ms']:8.2f} ms "
            f"({100 * r['exposed_ms'] / r['predicted_ms']:4.1f}%)  bound {r['bound_ms']:9.2f} ms  "
            f"MFU {100 * r['predicted_mfu']:4.1f}%  {r['memory_gib']:6.1f} GiB  compile {r['compile_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
