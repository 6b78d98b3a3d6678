"""How much of this CPU's matmul rate a train step achieves, and where the rest goes.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python bench/cpu_efficiency.py [CONFIG] [KEY=VALUE ...] [--steps N]

The default is the MaxText comparator (46.4M-parameter Llama, fsdp=8, full remat, float32; see
docs/performance.md). Prints:

- the CPU's float32 matmul peak: a 2048^3 `jnp.dot` in a loop on one device (XLA:CPU runs one
  dot on every core), GFLOP/s;
- the step: median wall time, model GFLOP/s (the analytic 6N + attention count) and its share of
  the peak;
- the matmul FLOPs the compiled step executes (`maxtrain.analysis.hlo.roofline` over the CPU program, all
  devices): remat's recomputed forward and XLA attention's masked half add to the model's count;
- the split of the step: the executed matmuls at the measured peak, and the rest (elementwise
  work, collectives between the fake devices, dispatch), in seconds and as a share.

The 8 fake devices share the cores, so the figures are for the whole machine, not per device.
The last line is one JSON object.

    python bench/cpu_efficiency.py --dots

times instead one projection-sized product (`[4096, 512] x [512, 1536]`, one device) written each
way a train step writes it, and says which ones XLA:CPU runs as a 16-bit dot ("bf16") and which it
converts to a float32 one ("f32"): the reason for `maxtrain.layers.dots`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from maxtrain import load_config
from maxtrain.config import ConfigError
from maxtrain.data import make_source
from maxtrain.layers import dots
from maxtrain.analysis.hlo import roofline
from maxtrain.mesh import use_mesh
from maxtrain.step import compile_train_step, init_state, make_setup
from step import time_steps  # bench/step.py: the same timed steps

COMPARATOR = ["model.vocab_size=32000", "model.d_model=512", "model.n_layers=4", "model.n_heads=8",
              "model.n_kv_heads=8", "model.d_ff=1536", "model.tie_embeddings=false", "train.seq_len=512",
              "train.batch_size=8", "mesh.data=1", "mesh.fsdp=8", "model.remat=full", "train.dtype=float32",
              "data.kind=synthetic"]


def median_seconds(fn, *args, iters: int) -> float:
    """Median wall seconds of `fn(*args)` (a compiled program) over `iters` timed runs, after one."""
    fn(*args).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak(n: int = 2048, iters: int = 10) -> float:
    """float32 GFLOP/s of an n^3 dot on one device (median of `iters` timed runs)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    return 2.0 * n**3 / median_seconds(jax.jit(jnp.dot), a, b, iters=iters) / 1e9


DOT_FORMS = {  # name -> (operands' dtype, fn(x [M, K], w [K, N], g [M, N]))
    "float32 x @ w": (jnp.float32, lambda x, w, g: x @ w),
    "bf16 x @ w -> bf16": (jnp.bfloat16, lambda x, w, g: x @ w),
    "bf16 x @ w -> float32": (jnp.bfloat16, lambda x, w, g: jnp.dot(x, w, preferred_element_type=jnp.float32)),
    "bf16 x @ w -> float32 -> bf16 (layers.dots)": (jnp.bfloat16, lambda x, w, g: dots.einsum("mk,kn->mn", x, w)),
    "bf16 dx = g @ w.T -> float32": (jnp.bfloat16, lambda x, w, g: jnp.dot(g, w.T, preferred_element_type=jnp.float32)),
    "bf16 dw = x.T @ g -> float32": (jnp.bfloat16, lambda x, w, g: jnp.dot(x.T, g, preferred_element_type=jnp.float32)),
}


def dot_forms(m: int = 4096, k: int = 512, n: int = 1536, iters: int = 40) -> list[dict]:
    """Each of DOT_FORMS on one device: median ms, GFLOP/s, and the operand type of the dot XLA compiled."""
    rows = []
    for name, (dtype, fn) in DOT_FORMS.items():
        x, w, g = (jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(dtype)
                   for i, shape in enumerate(((m, k), (k, n), (m, n))))
        compiled = jax.jit(fn).lower(x, w, g).compile()
        gemms = roofline(compiled.as_text(), peak_flops=1e12, bandwidth=1e11, link_bandwidth=1e11).gemms()
        t = median_seconds(compiled, x, w, g, iters=iters)
        rows.append({"form": name, "ms": t * 1e3, "gflops": 2.0 * m * k * n / t / 1e9, "dot": "+".join(sorted(gemms))})
    return rows


def split(step_s: float, model_flops: float, executed_flops: float, peak_flops: float) -> dict:
    """The step's time at the measured peak for its executed matmuls, and the rest."""
    matmul_s = executed_flops / peak_flops
    return {"efficiency": model_flops / step_s / peak_flops, "matmul_s": matmul_s,
            "other_s": max(step_s - matmul_s, 0.0), "matmul_share": min(matmul_s / step_s, 1.0),
            "recompute_ratio": executed_flops / model_flops}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml"))
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dots", action="store_true", help="time one product written each way a step writes it")
    args = p.parse_args(argv)
    if args.dots:
        rows = dot_forms()
        print(f"{'[4096, 512] x [512, 1536], one device':<44} {'ms':>7} {'GFLOP/s':>8}  dot XLA:CPU runs")
        for r in rows:
            print(f"{r['form']:<44} {r['ms']:7.2f} {r['gflops']:8.1f}  {r['dot']}")
        print(json.dumps(rows))
        return 0
    try:
        cfg = load_config(args.config, COMPARATOR + args.overrides)
        setup = make_setup(cfg)
        source = make_source(cfg)
    except ConfigError as e:
        print(f"maxtrain: error: {e}", file=sys.stderr)
        return 2
    peak = matmul_peak() * 1e9
    with use_mesh(setup.mesh):
        state = init_state(setup, cfg.seed)
        compiled, _ = compile_train_step(setup)
        r = roofline(compiled.as_text(), peak_flops=peak, bandwidth=1e11, link_bandwidth=1e11)
        executed = (r.flops("matmul") + r.flops("attention")) * setup.mesh.size  # one device's program x devices
        _, times = time_steps(compiled, state, source, setup, args.steps)
    step_s = statistics.median(times)
    model = setup.flops_per_step
    s = split(step_s, model, executed, peak)
    print(f"CPU f32 matmul peak   {peak / 1e9:8.1f} GFLOP/s (2048^3 jnp.dot, {os.cpu_count()} cores)")
    print(f"step                  {step_s * 1e3:8.1f} ms median of {len(times)} on {setup.mesh.size} devices")
    print(f"model FLOPs           {model / 1e9:8.2f} GFLOP/step -> {model / step_s / 1e9:.1f} GFLOP/s, "
          f"{100 * s['efficiency']:.1f}% of the peak")
    print(f"executed matmul FLOPs {executed / 1e9:8.2f} GFLOP/step ({s['recompute_ratio']:.2f}x the model's: remat "
          f"recompute, masked attention)")
    print(f"split                 matmuls at the peak {s['matmul_s'] * 1e3:.1f} ms ({100 * s['matmul_share']:.0f}%), "
          f"the rest {s['other_s'] * 1e3:.1f} ms (elementwise, collectives, dispatch)")
    print(json.dumps({"peak_gflops": peak / 1e9, "step_s": step_s, "model_gflops_per_step": model / 1e9,
                      "executed_matmul_gflops_per_step": executed / 1e9, **s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
