"""Compile time, step time, throughput, compiled memory and FLOPs of the train step of a config.

    python bench/step.py configs/tiny.yaml [KEY=VALUE ...] [--steps N] [--profile DIR]

On CPU, fake devices first: XLA_FLAGS=--xla_force_host_platform_device_count=8. On a GPU it also
prints the step's roofline bound (`maxtrain.analysis.hlo`) and the schedule model's predicted step
(`maxtrain.analysis.schedule`), and how far the measured step is from each. The
last line printed is one JSON object with the figures. `--profile DIR` traces two more steps after
the timed ones into DIR (`jax.profiler`, with a Perfetto trace that `bench/trace_summary.py` reads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax

from maxtrain import load_config
from maxtrain.config import ConfigError
from maxtrain.data import make_source
from maxtrain.mesh import use_mesh
from maxtrain.metrics import memory_breakdown, peak_tflops, throughput, xla_flops
from maxtrain.analysis.inspect import step_performance
from maxtrain.step import compile_train_step, init_state, make_setup, put_batch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=10, help="timed steps after 2 warm-up steps")
    p.add_argument("--profile", metavar="DIR", help="trace two more steps (not timed) into DIR")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        setup = make_setup(cfg)
        source = make_source(cfg)
    except ConfigError as e:
        print(f"maxtrain: error: {e}", file=sys.stderr)
        return 2
    n_dev = setup.mesh.size
    with use_mesh(setup.mesh):
        state = init_state(setup, cfg.seed)
        compiled, compile_s = compile_train_step(setup)
        # cost_analysis reports one device's program under SPMD: scale to the whole step
        per_dev = xla_flops(compiled)
        xla_total = per_dev * n_dev if per_dev is not None else None
        perf = step_performance(compiled.as_text(), setup, cfg)  # None off GPUs
        roof, sched = perf["roofline"], perf["schedule"]
        breakdown = memory_breakdown(compiled)
        mem = breakdown["total"] if breakdown else None
        state, times = time_steps(compiled, state, source, setup, args.steps)
        if args.profile:
            state = _trace_steps(args.profile, compiled, state, source, setup, first=args.steps + 2)
    step_time = statistics.median(times)
    peak = peak_tflops(jax.devices()[0].device_kind, cfg.train.peak_tflops)
    tp = throughput(step_time, setup.tokens_per_step, setup.flops_per_step, n_dev, peak)
    print(f"config {args.config} {' '.join(args.overrides)}")
    print(f"mesh {dict(setup.mesh.shape)} on {n_dev} x {jax.devices()[0].device_kind}")
    print(f"compile            {compile_s:.2f} s")
    print(f"step time (median) {step_time * 1e3:.1f} ms over {len(times)} steps")
    print(f"tokens/s           {tp['tokens_per_s']:,.0f}")
    mfu = "n/a (unknown device peak)" if tp["mfu"] is None else f"{100 * tp['mfu']:.1f}%"
    print(f"TFLOP/s/device     {tp['tflops_per_device']:.4g}  (mfu {mfu})")
    print(f"memory/device      {mem / 2**20 if mem is not None else float('nan'):.1f} MiB (compiled: args + outputs + temps - aliased)")
    xla = "n/a" if xla_total is None else f"{xla_total:.4g}"
    print(f"FLOPs/step         model {setup.flops_per_step:.4g} | XLA {xla}")
    if roof is not None:
        print(f"roofline           step >= {roof['step_s'] * 1e3:.1f} ms (MFU <= {100 * roof['mfu_ceiling']:.1f}%): "
              f"measured {step_time / roof['step_s']:.2f}x the bound")
    if sched is not None:
        print(f"schedule model     step ~ {sched['predicted_step_s'] * 1e3:.1f} ms predicted (exposed communication "
              f"{sched['exposed_collective_s'] * 1e3:.1f} ms): measured {step_time / sched['predicted_step_s']:.2f}x "
              f"the prediction")
    print(json.dumps({
        "compile_s": round(compile_s, 3),
        "step_time_s": step_time,
        "tokens_per_s": tp["tokens_per_s"],
        "memory_per_device_bytes": mem,
        "xla_flops_per_step": xla_total,
        "model_flops_per_step": setup.flops_per_step,
        "tflops_per_device": tp["tflops_per_device"],
        "mfu": tp["mfu"],
        "roofline_step_s": None if roof is None else roof["step_s"],
        "predicted_step_s": None if sched is None else sched["predicted_step_s"],
        "exposed_collective_s": None if sched is None else sched["exposed_collective_s"],
    }))
    return 0


def time_steps(compiled, state, source, setup, steps: int, warmup: int = 2):
    """Runs `warmup + steps` steps of the compiled train step on batches 0, 1, ... (each placed and
    ready before its clock starts); returns the state and the `steps` timed seconds after the warm-up."""
    times = []
    for i in range(warmup + steps):
        batch = put_batch(source.batch(i), setup.batch_sharding)
        jax.block_until_ready(batch)
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return state, times


def _trace_steps(out_dir, compiled, state, source, setup, first, n=2):
    """Runs n more steps under jax.profiler (each a named step), after the timed ones."""
    batches = [put_batch(source.batch(first + i), setup.batch_sharding) for i in range(n)]
    jax.block_until_ready(batches)
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        for i, batch in enumerate(batches):
            with jax.profiler.StepTraceAnnotation("train", step_num=first + i):
                state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
    return state


if __name__ == "__main__":
    sys.exit(main())
