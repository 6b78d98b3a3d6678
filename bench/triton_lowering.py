"""Lowers every Pallas kernel for an NVIDIA GPU on any machine, no GPU needed; with the `triton`
package installed also compiles each one for sm_90 and prints shared memory, registers and spills.

    python bench/triton_lowering.py            # lowering only (what tests/test_kernels.py checks)
    pip install triton && python bench/triton_lowering.py --compile

Pallas' Triton lowering runs on a CPU-only jaxlib (`jax.export` for platform "cuda"); this script
captures the Triton IR of each kernel on the way and hands it to Triton's own compiler (with its
bundled ptxas), so tile sizes that do not fit (shared memory, register spills) show up before any
GPU time is spent. It reads jax internals (`jax._src.pallas.triton`): a development tool, not an API.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax import export

from maxtrain.kernels import cross_entropy as ce_mod
from maxtrain.kernels import flash as flash_mod
from maxtrain.kernels import rms_norm as rms_mod

TRITON_TARGET = "__gpu$xla.gpu.triton"


def cases():
    """name -> (fn, abstract args, num_warps, num_stages) per kernel family, at training sizes."""
    def flash(D, seg):
        B, L, H, G = 2, 1024, 8, 2
        q = jax.ShapeDtypeStruct((B, L, H, D), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((B, L, G, D), jnp.bfloat16)
        s = jax.ShapeDtypeStruct((B, L), jnp.int32)

        def f(q, k, v, s=None):
            return jax.grad(lambda q, k, v: jnp.sum(flash_mod.flash_attention(
                q, k, v, segment_ids=s, sliding_window=None if s is None else 256,
                interpret=False).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
        return f, ((q, kv, kv, s) if seg else (q, kv, kv)), 8  # what flash.py asks for

    def rms(x, r, w):
        return jax.grad(lambda x, r, w: jnp.sum(rms_mod.rms_norm(x, w, residual=r, impl="pallas", interpret=False)[0]
                                                .astype(jnp.float32)), argnums=(0, 1, 2))(x, r, w)

    def ce(x, t):
        return jax.grad(lambda x: jnp.sum(ce_mod.cross_entropy(x, t, interpret=False)[0]))(x)

    out = {f"flash D={D}{' segments+window' if seg else ''}": flash(D, seg) for D in (64, 128) for seg in (False, True)}
    out["add+rmsnorm 2048"] = (rms, (jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16),) * 2
                               + (jax.ShapeDtypeStruct((2048,), jnp.float32),), 8)
    out["cross-entropy 128256"] = (ce, (jax.ShapeDtypeStruct((64, 128256), jnp.bfloat16),
                                        jax.ShapeDtypeStruct((64,), jnp.int32)), 8)
    return out


def lower_for_gpu(fn, args, ir_dir: str | None = None) -> int:
    """Exports `fn` for CUDA; returns the number of Triton kernels. With `ir_dir`, writes each
    kernel's Triton IR there (named after the kernel)."""
    from jax._src.pallas.triton import pallas_call_registration as reg  # internal: the capture hook

    original = reg.lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, grid_mapping, *a, **k):
        result = original(jaxpr, grid_mapping, *a, **k)
        if ir_dir is not None:
            assert result.module.operation.verify()
            with open(os.path.join(ir_dir, f"{jaxpr.debug_info.func_name}.ttir"), "w") as f:
                f.write(result.module.operation.get_asm())
        return result

    real = flash_mod._resolve_interpret
    flash_mod._resolve_interpret = lambda interpret: False  # lowering for a GPU we do not have
    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        exp = export.export(jax.jit(fn), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_TARGET)])(*args)
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = original
        flash_mod._resolve_interpret = real
    return exp.mlir_module().count(TRITON_TARGET)


def compile_ir(path: str, num_warps: int, num_stages: int) -> dict:
    """Triton IR -> cubin for sm_90 with the `triton` package; shared bytes, registers, spills."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    info = {"shared": kernel.metadata.shared}
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas*"))
    if ptxas:
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(kernel.asm["ptx"])
            f.flush()
            log = subprocess.run([ptxas[0], "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                                 capture_output=True, text=True).stderr
        regs, spills = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
        info.update(registers=int(regs.group(1)) if regs else None, spill_bytes=int(spills.group(1)) if spills else None)
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile", action="store_true", help="also compile with the triton package (sm_90)")
    args = p.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    ok = True
    for name, (fn, fargs, warps) in cases().items():
        with tempfile.TemporaryDirectory() as d:
            try:
                n = lower_for_gpu(fn, fargs, d if args.compile else None)
            except Exception as e:
                print(f"{name:32} lowering FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                ok = False
                continue
            print(f"{name:32} lowered: {n} Triton kernels")
            for path in sorted(glob.glob(os.path.join(d, "*.ttir"))):
                stages = 3 if path.endswith("flash_attention_fwd.ttir") else (2 if "flash" in path else 1)
                try:
                    info = compile_ir(path, warps, stages)
                except Exception as e:
                    print(f"    {os.path.basename(path):34} compile FAILED: {type(e).__name__}: {str(e)[:200]}")
                    ok = False
                    continue
                print(f"    {os.path.basename(path):34} warps={warps} stages={stages} " +
                      " ".join(f"{k}={v}" for k, v in info.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
