"""Custom kernels against what XLA and cuDNN give: time, TFLOP/s and compiled memory.

    python bench/kernel_bench.py                      # on a GPU: the full table
    python bench/kernel_bench.py --quick              # one size per kernel (CPU: seconds)

Attention (causal, bf16, head dim 128, 16 heads, batch x length = 16k tokens): our Pallas flash
attention (Triton lowering; on a GPU also the Mosaic GPU Hopper kernels, `backend="mosaic"`),
`jax.nn.dot_product_attention(implementation="cudnn")` and `"xla"`, forward and
forward+backward, at lengths 1k-16k. FLOPs count the causal half: forward 2 matmuls x 2 x B x H x
L^2/2 x D, backward 2.5x that. Cross-entropy (vocab 128256, 8k tokens, d_model 2048) and RMSNorm
(+ residual, 16k x 2048): ours against the plain-JAX references under XLA, forward+backward time and
the compiled program's memory (`memory_analysis()`: arguments + outputs + temporaries - aliased).

    python bench/kernel_bench.py --only tiles         # flash tile candidates at 4k (Triton; Mosaic on a GPU)
    python bench/kernel_bench.py --only tiles --head-dim 64   # ... at configs/llama3-1b.yaml's head dim

`--only tiles` times the flash kernels' tile candidates at one length (4k on a GPU): the Triton
forward tiles (q, k), then its backward tiles (bwd_q, bwd_k) with the fastest forward ones, and on
a GPU every `HopperBlocks` the Mosaic GPU kernels accept at the head dim, forward and
forward+backward; it prints the fastest of each as `best ...` lines.

Off GPU the same table runs with tiny sizes and the kernels in Pallas' interpreter (cuDNN rows
n/a): it checks the script works, not speed. The last line is one JSON object (a list of rows).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib.util
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxtrain.config import ConfigError
from maxtrain.kernels import BlockSizes, HopperBlocks, flash_attention
from maxtrain.kernels import flash as flash_mod
from maxtrain.kernels.cross_entropy import (cross_entropy, linear_cross_entropy, reference_cross_entropy,
                                            reference_linear_cross_entropy)
from maxtrain.kernels.rms_norm import reference_rms_norm, rms_norm
from maxtrain.metrics import memory_breakdown
from maxtrain.targets import TARGETS, on_gpu, target_devices


def _real_gpu() -> bool:
    """A GPU to run on (asked late: `--target` first keeps jax on the CPU)."""
    return jax.default_backend() == "gpu"

SIZES = {  # (full, quick) per backend
    True: dict(lengths=[1024, 2048, 4096, 8192, 16384], tokens=16384, heads=16, head_dim=128,
               ce=(8192, 2048, 128256), rms=(16384, 2048)),
    False: dict(lengths=[128, 256], tokens=256, heads=2, head_dim=64, ce=(64, 64, 1024), rms=(256, 256)),
}


def timed(fn, *args, iters: int) -> tuple[float | None, dict | None]:
    """(median seconds per call, memory breakdown) of `jit(fn)` after one warm-up call; with
    iters=0 only compiled (abstract arguments are fine): (None, memory breakdown)."""
    compiled = jax.jit(fn).lower(*args).compile()
    if iters == 0:
        return None, memory_breakdown(compiled)
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), memory_breakdown(compiled)


def _inputs(r, shapes, dtype, iters: int, scale: float = 1.0):
    """Random arrays, or (iters=0: compile only) their abstract shapes, so nothing is allocated;
    abstract ones live on the context mesh's devices (`--target`: a GPU this machine lacks)."""
    if iters == 0:
        mesh = jax.sharding.get_mesh()
        where = None if mesh.empty else NamedSharding(mesh, PartitionSpec())
        return [jax.ShapeDtypeStruct(shape, dtype, sharding=where) for shape in shapes]
    return [jnp.asarray(scale * r.normal(size=shape), dtype) for shape in shapes]


def fwd_bwd(fn):
    """fn(*args) -> out  ==>  (*args, dout) -> gradients (the forward runs inside, as in training)."""
    def run(*args):
        *inputs, dout = args
        out, vjp = jax.vjp(fn, *inputs)
        return vjp(dout)
    return run


def attention_impls():
    impls = {"flash": lambda q, k, v: flash_attention(q, k, v, causal=True)}
    if on_gpu():  # the Hopper kernels (sm_90 only; elsewhere the row shows the error)
        impls["flash mosaic"] = lambda q, k, v: flash_attention(q, k, v, causal=True, backend="mosaic")
    if _real_gpu():  # cuDNN plans its kernels on the device: not with --target
        impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    impls["xla"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    return impls


def bench_attention(sizes, iters, emit):
    r = np.random.default_rng(0)
    H, D = sizes["heads"], sizes["head_dim"]
    for L in sizes["lengths"]:
        B = max(1, sizes["tokens"] // L)
        q, k, v, do = _inputs(r, [(B, L, H, D)] * 4, jnp.bfloat16, iters)
        flops = 4.0 * B * H * L * L * D / 2  # causal forward
        for name, fn in attention_impls().items():
            for mode, f, args, fl in (("fwd", fn, (q, k, v), flops), ("fwd+bwd", fwd_bwd(fn), (q, k, v, do), 3.5 * flops)):
                emit(_row("attention", f"{name} {mode}", f"B={B} L={L} H={H} D={D}", f, args, iters, fl))


TRITON_FWD_TILES = [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)]  # (q, k)
TRITON_BWD_TILES = [(32, 64), (64, 64), (64, 128), (128, 64), (32, 128)]  # (bwd_q, bwd_k)


def hopper_tiles(head_dim: int) -> list[HopperBlocks]:
    """Every HopperBlocks the Mosaic GPU kernels accept at this head dim."""
    out = []
    for k, bwd_q, stages in itertools.product((64, 128), (64, 128), (1, 2, 3, 4)):
        try:
            out.append(HopperBlocks(k, bwd_q, stages).check(head_dim))
        except ConfigError:
            pass
    return out


def bench_attention_tiles(sizes, iters, emit, quick: bool, lengths):
    """The tile candidates of both flash backends at one length (>= 4k on a GPU), causal bf16:
    Triton forward tiles by forward time, then its backward tiles (with the best forward tiles) by
    forward+backward time; on a GPU every accepted HopperBlocks, both modes. Rows, then `best`."""
    r = np.random.default_rng(0)
    H, D = sizes["heads"], sizes["head_dim"]
    L = next((x for x in lengths if x >= 4096), lengths[0])  # 4k on a GPU, even with --quick
    B = max(1, sizes["tokens"] // L)
    q, k, v, do = _inputs(r, [(B, L, H, D)] * 4, jnp.bfloat16, iters)
    flops = 4.0 * B * H * L * L * D / 2
    shape = f"B={B} L={L} H={H} D={D}"
    fwd_tiles, bwd_tiles = (TRITON_FWD_TILES[:2], TRITON_BWD_TILES[:2]) if quick else (TRITON_FWD_TILES, TRITON_BWD_TILES)
    best = {}

    def run(backend, blocks, mode):
        fn = lambda q, k, v: flash_attention(q, k, v, causal=True, backend=backend, block_sizes=blocks)  # noqa: E731
        f, args, fl = (fn, (q, k, v), flops) if mode == "fwd" else (fwd_bwd(fn), (q, k, v, do), 3.5 * flops)
        row = _row("attention tiles", f"{backend} {_tile_name(blocks)} {mode}", shape, f, args, iters, fl)
        emit(row)
        if row.get("time_ms") is not None and row["time_ms"] < best.get((backend, mode), (1e30,))[0]:
            best[(backend, mode)] = (row["time_ms"], blocks)

    default = flash_mod.default_block_sizes(D)
    for bq, bk in fwd_tiles:
        run("triton", BlockSizes(bq, bk, default.bwd_q, default.bwd_k), "fwd")
    fq, fk = (best[("triton", "fwd")][1].q, best[("triton", "fwd")][1].k) if ("triton", "fwd") in best else (default.q, default.k)
    for bwd_q, bwd_k in bwd_tiles:
        run("triton", BlockSizes(fq, fk, bwd_q, bwd_k), "fwd+bwd")
    if _real_gpu():
        for blocks in hopper_tiles(D):
            for mode in ("fwd", "fwd+bwd"):
                run("mosaic", blocks, mode)
    for (backend, mode), (t, blocks) in sorted(best.items()):
        print(f"best {backend} {mode}: {_tile_name(blocks)} {t:.3f} ms ({shape})", flush=True)


def mosaic_registers(head_dim: int, default_only: bool, emit) -> None:
    """ptxas' registers and spill bytes of the three Mosaic GPU kernels (forward, dQ, dK/dV) for
    every accepted HopperBlocks at `head_dim`, causal with segment ids (the most masking): compiled
    only, on a GPU or for `--target`. Reads flash.py's internals to compile each kernel alone."""
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # ptxas -v of each Mosaic kernel, on stdout
    B, L, H, G, D = 2, 2048, 8, 4, head_dim
    r = np.random.default_rng(0)
    q, do, k, v = _inputs(r, [(B, L, H, D)] * 2 + [(B, L, G, D)] * 2, jnp.bfloat16, 0)
    lse, delta = _inputs(r, [(B, H, L)] * 2, jnp.float32, 0)
    (seg,) = _inputs(r, [(B, L)], jnp.int32, 0)
    seen: dict = {}  # Mosaic caches identical kernels, and a cached compile prints nothing
    for blocks in [HopperBlocks.for_head_dim(D)] if default_only else hopper_tiles(D):
        st = flash_mod._Static(length=L, padded=L, causal=True, window=None, segmented=True, group=H // G,
                               scale=D ** -0.5, blocks=blocks, interpret=False, num_warps=8, num_stages=2,
                               backend="mosaic")
        bwd = (q, k, v, seg, seg, do, lse, delta)
        kernels = {  # name -> (what the kernel's code depends on, program, its arguments)
            "forward": ((blocks.k, blocks.stages), lambda *a: flash_mod._forward(*a, st), (q, k, v, seg, seg)),
            "dq": ((blocks.k, blocks.stages), lambda *a: flash_mod._backward_dq(*a, st), bwd),
            "dkdv": ((blocks.bwd_q, blocks.stages), lambda *a: flash_mod._backward_dkdv(*a, st), bwd),
        }
        for name, (key, program, args) in kernels.items():
            if (name, key) not in seen:
                found = _ptxas_entries(_stdout_of(lambda: jax.jit(program).lower(*args).compile()))
                seen[(name, key)] = found[-1][1:] if found else (None, None)
            regs, spills = seen[(name, key)]
            emit({"kernel": f"mosaic {name}", "tiles": _tile_name(blocks), "head_dim": D,
                  "registers": regs, "spill_bytes": spills})


def triton_registers(head_dim: int, emit, others: bool = True) -> None:
    """ptxas' registers and spill bytes of the Pallas kernels XLA compiles through Triton (flash
    attention at its default tiles, causal with segment ids, forward and both backward kernels;
    with `others`, cross-entropy at vocab 128256 and add+RMSNorm at 2048): XLA dumps each program's PTX
    (`xla_dump_to`) and the ptxas next to XLA's own (the nvidia-cuda-nvcc wheel, or PATH) reads it."""
    ptxas = _ptxas()
    if ptxas is None:
        raise SystemExit("bench/kernel_bench.py: --only registers needs ptxas (pip install nvidia-cuda-nvcc-cu12, or PATH)")
    r = np.random.default_rng(0)
    B, L, H, G, D = 2, 2048, 8, 4, head_dim
    q, do = _inputs(r, [(B, L, H, D)] * 2, jnp.bfloat16, 0)
    k, v = _inputs(r, [(B, L, G, D)] * 2, jnp.bfloat16, 0)
    (seg,) = _inputs(r, [(B, L)], jnp.int32, 0)
    (logits,) = _inputs(r, [(1024, 128256)], jnp.bfloat16, 0)
    x, res = _inputs(r, [(1024, 2048)] * 2, jnp.bfloat16, 0)
    (scale,) = _inputs(r, [(2048,)], jnp.float32, 0)
    programs = [
        ("flash", fwd_bwd(lambda q, k, v, s: flash_attention(q, k, v, causal=True, segment_ids=s)),
         (q, k, v, seg, do)),
        ("cross-entropy", jax.grad(lambda x: jnp.sum(cross_entropy(x, jnp.arange(1024) % 128256)[0])), (logits,)),
        ("add+rmsnorm", jax.grad(lambda x, r, s: jnp.sum(rms_norm(x, s, residual=r, impl="pallas")[0]
                                                         .astype(jnp.float32)), argnums=(0, 1, 2)), (x, res, scale)),
    ][:None if others else 1]
    for name, fn, args in programs:
        with tempfile.TemporaryDirectory() as dump:
            jax.jit(fn).lower(*args).compile(compiler_options={"xla_dump_to": dump})
            for path in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
                log = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                                     capture_output=True, text=True).stderr
                for entry, regs, spills in _ptxas_entries(log):
                    if "fusion" in entry or entry.startswith("wrapped_"):  # XLA's own kernels
                        continue
                    emit({"kernel": f"triton {entry}", "tiles": "default", "head_dim": D if "flash" in entry else None,
                          "registers": regs, "spill_bytes": spills})


def _ptxas_entries(log: str) -> list[tuple[str, int | None, int | None]]:
    """(entry function, registers, spill-store bytes) for each kernel in a `ptxas -v` report."""
    out = []
    for entry, body in re.findall(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry|\Z)", log, re.S):
        regs, spills = re.search(r"Used (\d+) registers", body), re.search(r"(\d+) bytes spill stores", body)
        out.append((entry, int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else None))
    return out


def _ptxas() -> str | None:
    """The ptxas XLA would use: the nvidia-cuda-nvcc wheel's, else one on PATH."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except ImportError:
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(root, "bin", "ptxas")
        if os.path.exists(candidate):
            return candidate
    return shutil.which("ptxas")


def _stdout_of(fn) -> str:
    """What `fn` (and the C++ under it) writes to file descriptor 1."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    with tempfile.TemporaryFile("w+") as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            fn()
        finally:
            sys.stdout.flush()
            libc.fflush(None)  # C stdio buffers too: ptxas' report may sit there
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read()


def _tile_name(blocks) -> str:
    if isinstance(blocks, HopperBlocks):
        return f"k={blocks.k} bwd_q={blocks.bwd_q} stages={blocks.stages}"
    return f"q={blocks.q} k={blocks.k} bwd_q={blocks.bwd_q} bwd_k={blocks.bwd_k}"


def bench_cross_entropy(sizes, iters, emit):
    N, Dm, V = sizes["ce"]
    r = np.random.default_rng(1)
    if iters:
        t_ = jnp.asarray(r.integers(0, V, (N,)), jnp.int32)
        t = lambda: t_  # noqa: E731
    else:  # compile only: made inside the program, so no array has to live on the (maybe absent) device
        t = lambda: jnp.arange(N, dtype=jnp.int32) * 7919 % V  # noqa: E731
    logits, h = _inputs(r, [(N, V), (N, Dm)], jnp.bfloat16, iters)
    (w,) = _inputs(r, [(Dm, V)], jnp.bfloat16, iters, scale=0.02)
    (dl,) = _inputs(r, [(N,)], jnp.float32, iters)
    shape = f"N={N} V={V}"
    for name, fn in (("ours (Pallas, chunked)", lambda x: cross_entropy(x, t())[0]),
                     ("xla", lambda x: reference_cross_entropy(x, t())[0])):
        emit(_row("cross-entropy(logits)", f"{name} fwd+bwd", shape, fwd_bwd(fn), (logits, dl), iters))
    for name, fn in (("ours (chunked over vocab)", lambda h, w: linear_cross_entropy(h, w, t())[0]),
                     ("xla", lambda h, w: reference_linear_cross_entropy(h, w, t())[0])):
        emit(_row("linear+cross-entropy", f"{name} fwd+bwd", f"{shape} D={Dm}", fwd_bwd(fn), (h, w, dl), iters))


def bench_rms_norm(sizes, iters, emit):
    N, Dm = sizes["rms"]
    r = np.random.default_rng(2)
    x, res, dy, dh = _inputs(r, [(N, Dm)] * 4, jnp.bfloat16, iters)
    (scale,) = _inputs(r, [(Dm,)], jnp.float32, iters)
    auto = "ours (auto: jax-triton fwd on GPU)" if _real_gpu() else "ours (auto: Pallas here)"
    impls = {auto: lambda x, r, s: rms_norm(x, s, residual=r),
             "ours (Pallas)": lambda x, r, s: rms_norm(x, s, residual=r, impl="pallas"),
             "xla": lambda x, r, s: reference_rms_norm(x, s, residual=r)}
    for name, fn in impls.items():
        emit(_row("add+rmsnorm", f"{name} fwd+bwd", f"N={N} D={Dm}", fwd_bwd(fn), (x, res, scale, (dy, dh)), iters))


def _row(kernel, impl, shape, fn, args, iters, flops=None):
    try:
        t, mem = timed(fn, *args, iters=iters)
    except Exception as e:  # e.g. out of memory for XLA attention at 16k: report, keep going
        return {"kernel": kernel, "impl": impl, "shape": shape, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
    row = {"kernel": kernel, "impl": impl, "shape": shape, "time_ms": None if t is None else 1e3 * t,
           "memory_bytes": None if mem is None else mem["total"]}
    if flops is not None and t is not None:
        row["tflops"] = flops / t / 1e12
    return row


HEADER = f"{'kernel':24} {'implementation':50} {'shape':26} {'time ms':>10} {'TFLOP/s':>8} {'memory MiB':>11}"


def format_row(r) -> str:
    if "error" in r:
        return f"{r['kernel']:24} {r['impl']:50} {r['shape']:26} {r['error']}"
    tf = f"{r['tflops']:8.1f}" if "tflops" in r else f"{'':8}"
    mem = f"{r['memory_bytes'] / 2**20:11.1f}" if r.get("memory_bytes") is not None else f"{'n/a':>11}"
    t = f"{'n/a':>10}" if r["time_ms"] is None else f"{r['time_ms']:10.3f}"
    return f"{r['kernel']:24} {r['impl']:50} {r['shape']:26} {t} {tf} {mem}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one size per kernel, one timed call")
    p.add_argument("--only", choices=["attention", "ce", "rms", "tiles", "registers"], action="append",
                   help="run only these (repeatable); tiles and registers (never by default): the flash tile "
                        "candidates timed, or the Mosaic GPU kernels' ptxas registers and spills (GPU or --target)")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], help="attention lengths, e.g. 1024,4096")
    p.add_argument("--iters", type=int, help="timed calls per row (median)")
    p.add_argument("--default-tiles", action="store_true", help="--only registers: the default HopperBlocks only")
    p.add_argument("--head-dim", type=int, choices=[64, 128], help="attention head dim (default 128 on a GPU)")
    p.add_argument("--memory-only", action="store_true",
                   help="compile at the GPU sizes on any backend and report compiled memory only (nothing runs)")
    p.add_argument("--target", choices=list(TARGETS),
                   help="compile for this GPU without one (XLA's CUDA compiler, Pallas' Triton and Mosaic GPU "
                        "kernels, ptxas; needs jax's CUDA plugin): compiled memory, and --only registers")
    args = p.parse_args(argv)
    if args.target:
        args.memory_only = True
        jax.config.update("jax_platforms", "cpu")  # jax itself stays on the CPU; XLA compiles for the target
        try:
            devices = target_devices(args.target, 1)
        except ConfigError as e:
            raise SystemExit(f"bench/kernel_bench.py: {e}") from None
        with jax.set_mesh(jax.sharding.Mesh(np.array(devices), ("d",))):
            return _run(args)
    return _run(args)


def _run(args) -> int:
    gpu = _real_gpu()
    sizes = dict(SIZES[gpu or args.memory_only])
    if args.lengths:
        sizes["lengths"] = args.lengths
    if args.quick:
        sizes["lengths"] = sizes["lengths"][:1]
    if args.head_dim:
        sizes["head_dim"] = args.head_dim
    iters = 0 if args.memory_only else args.iters or (1 if args.quick else (10 if gpu else 2))
    only = set(args.only or ["attention", "ce", "rms"])
    target = args.target and jax.sharding.get_mesh().devices.flat[0].device_kind
    print(f"device {target or jax.devices()[0].device_kind} ({'compiled for, not run on' if target else jax.default_backend()}), "
          f"jax {jax.__version__}"
          + ("; compiled memory only, at the GPU sizes" if args.memory_only and not gpu else
             "" if gpu else "; kernels in Pallas' interpreter, tiny sizes: checks the script, not speed"))
    rows: list[dict] = []
    print(HEADER, flush=True)

    def emit(row):  # printed as measured: a run cut short by a timeout still shows what it got
        rows.append(row)
        print(format_row(row), flush=True)

    if "attention" in only:
        bench_attention(sizes, iters, emit)
    if "ce" in only:
        bench_cross_entropy(sizes, iters, emit)
    if "rms" in only:
        bench_rms_norm(sizes, iters, emit)
    if "tiles" in only:
        full_lengths = args.lengths or SIZES[gpu or args.memory_only]["lengths"]
        bench_attention_tiles(sizes, iters, emit, args.quick, full_lengths)
    if "registers" in only:
        if not on_gpu():
            raise SystemExit("bench/kernel_bench.py: --only registers needs a GPU or --target (ptxas runs for sm_90)")
        print(f"{'kernel':32} {'tiles':28} {'head dim':>8} {'registers':>9} {'spill bytes':>11}")

        def emit_registers(row):
            rows.append(row)
            print(f"{row['kernel']:32} {row['tiles']:28} {row['head_dim']!s:>8} {row['registers']!s:>9} "
                  f"{row['spill_bytes']!s:>11}", flush=True)
        for i, D in enumerate([args.head_dim] if args.head_dim else [64, 128]):
            triton_registers(D, emit_registers, others=i == 0)
            mosaic_registers(D, args.default_tiles, emit_registers)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
