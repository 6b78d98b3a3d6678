#!/usr/bin/env bash
# One-shot check on a fresh GPU machine (about 10 minutes):
#   0. `maxtrain preflight` (full, FP8 too): each device's figures against the device table
#   1. the kernel tests compiled for the GPU (Triton and Mosaic GPU), not in Pallas' interpreter
#   2. bench/kernel_bench.py (flash vs cuDNN vs XLA attention, cross-entropy, RMSNorm)
#   3. a real training step of configs/llama3-1b.yaml per attention implementation (xla, cudnn, flash
#      on Triton, flash_mosaic on Hopper's wgmma/TMA), then cuDNN and flash_mosaic with the fused
#      cross-entropy and no remat, and flash_mosaic + fused CE + save_dots in bf16 against FP8
#      (train.fp8.recipe tensorwise and delayed): is FP8 faster, on the same step
# and last a short table: test result, step time, tokens/s, MFU, memory, the roofline bound and the
# schedule model's predicted step against the measured one per run, and for the two
# runs without remat the device time by category and the kernels taking the most of it (a two-step
# jax.profiler trace, summarised by bench/trace_summary.py).
#
#   bash bench/gpu_check.sh            # logs in /tmp/maxtrain_gpu_check; with $OUT set, also packed
#                                      # into $OUT/gpu_check.tgz (+ the traces) at the end
#
# A machine with no package index lacks grain, tensorboardX and jax-triton: run `bash
# bench/gpu_wheels.sh` where pip works first, and bring the .whl/ it fills (this installs it).
#
# Every part has its own timeout; a part that fails or times out is reported and the rest run.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=/tmp/maxtrain_gpu_check
# jax takes 75% of the GPU by default; the 1B step with the fused loss and no remat needs 96% of
# that (maxtrain inspect --target h200 --devices 1), so give it 90% as the Slurm launcher does
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
mkdir -p "$LOG"
START=$SECONDS

PY="${PYTHON:-$(command -v python3 || command -v python)}"
# wheels the machine lacks (grain, tensorboardX, jax-triton), fetched here by bench/gpu_wheels.sh
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/maxtrain_site \
    .whl/*.whl >"$LOG/wheels.log" 2>&1 || echo "gpu_check: installing .whl/ failed (see $LOG/wheels.log)"
  export PYTHONPATH="/tmp/maxtrain_site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import grain, tensorboardX" 2>/dev/null ||
  echo "gpu_check: grain/tensorboardX missing, so the training steps will fail: run bash bench/gpu_wheels.sh where pip works and bring .whl/"
if ! "$PY" -c "import maxtrain.kernels" 2>/dev/null; then  # not installed, or installed without kernels/
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$LOG/install.log" 2>&1 || echo "gpu_check: install failed (see $LOG/install.log)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
# the GPU overlap options this jaxlib knows (maxtrain.step.GPU_OVERLAP_OPTIONS; unknown ones are left out)
"$PY" -c "
from maxtrain import step
unknown = step.unknown_compiler_options(tuple(sorted(step.GPU_OVERLAP_OPTIONS.items())))
print('overlap options unknown to this jaxlib:', sorted(unknown) or 'none')" 2>&1 | tail -n 1

# 0. the preflight (docs/reliability.md#preflight), full mode with FP8: every figure of every local
#    device, against the device table (one process: nothing else to compare with)
timeout 120 "$PY" -m maxtrain.cli preflight configs/llama3-1b.yaml --mode full --out "$LOG/preflight.json" \
  train.fp8.recipe=tensorwise >"$LOG/preflight.log" 2>&1
PREFLIGHT_RC=$?
grep -E 'TFLOP/s|^ *[^ ]+ +0 |preflight:' "$LOG/preflight.log" | tail -n 4

, so ask for the GPU; the training test needs 8 devices.
#    Compiling dominates (8 of 36 tests in 70 s on one process), so 8 pytest workers share the GPU,
#    each allocating what it uses rather than jax's default 75% of the memory.
MAXTRAIN_KERNEL_INTERPRET=0 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 180 \
  "$PY" -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py -k "not training" >"$LOG/tests.log" 2>&1
TESTS_RC=$?
tail -n 25 "$LOG/tests.log"

# 2. the kernel benchmark (rows print as measured, so a timeout still leaves a partial table)
#    MOSAIC_GPU_DUMP_PTXAS: ptxas -v for the Mosaic GPU kernels (registers, spills), summarised last
MOSAIC_GPU_DUMP_PTXAS=1 timeout 130 "$PY" bench/kernel_bench.py --lengths 1024,4096,16384 --iters 3 >"$LOG/kernels.log" 2>&1
BENCH_RC=$?
grep -v -E '^\[\{|ptxas|bytes stack frame' "$LOG/kernels.log" | tail -n 40

# 3. one real training step per (attention, cross-entropy, remat), 52 s each. XLA attention runs
#    with remat=full: with save_dots it would keep [B, H, L, L] float32 scores per layer (~275 GB).
RUNS="xla:xla:full:none cudnn:xla:save_dots:none flash:xla:save_dots:none flash_mosaic:xla:save_dots:none cudnn:fused:none:none flash_mosaic:fused:none:none flash_mosaic:fused:save_dots:none flash_mosaic:onepass:save_dots:none flash_mosaic:fused:save_dots:tensorwise flash_mosaic:fused:save_dots:delayed"
for run in $RUNS; do
  IFS=: read -r impl ce remat fp8 <<<"$run"
  name="${impl}_${ce}_${remat}_${fp8}"
  profile=() limit=52
  [ "$remat" = none ] && profile=(--profile "$LOG/prof_${impl}") limit=62  # two traced steps more
  timeout $limit "$PY" bench/step.py configs/llama3-1b.yaml "model.attention=$impl" "train.cross_entropy=$ce" \
    "model.remat=$remat" "train.fp8.recipe=$fp8" "run_dir=$LOG/run_$name" --steps 3 "${profile[@]}" \
    >"$LOG/step_$name.log" 2>&1
  echo "rc=$?" >>"$LOG/step_$name.log"
done
for prof in "$LOG"/prof_*; do
  [ -d "$prof" ] || continue
  echo
  echo "== device time, ${prof##*/prof_} + fused CE, no remat (bench/trace_summary.py, 2 steps) =="
  "$PY" bench/trace_summary.py "$prof" --steps 2 --top 22 2>&1 | tail -n 26
done

echo
echo "== gpu_check summary ($((SECONDS - START)) s) =="
echo "kernel tests (compiled): $([ $TESTS_RC -eq 0 ] && echo passed || echo "FAILED rc=$TESTS_RC") — $(tail -n 1 "$LOG/tests.log")"
echo "bench/kernel_bench.py: $([ $BENCH_RC -eq 0 ] && echo ok || echo "rc=$BENCH_RC (partial table above)")"
"$PY" bench/preflight.py --vs-table "$LOG/preflight.json" || echo "preflight: rc=$PREFLIGHT_RC, see $LOG/preflight.log"
echo "Mosaic GPU ptxas (count, line): $(grep -cE 'bytes spill' "$LOG/kernels.log") reports"
grep -E 'Used [0-9]+ registers|bytes spill' "$LOG/kernels.log" | sed 's/^ *//' | sort | uniq -c | head -n 12
"$PY" - "$LOG" $RUNS <<'EOF'
import json, os, sys
log, runs = sys.argv[1], sys.argv[2:]
print(f"{'attention':12} {'CE':6} {'remat':10} {'FP8':10} {'step time s':>12} {'tokens/s':>12} {'MFU':>7} {'GiB/dev':>8}"
      f" {'x bound':>8} {'predicted s':>12} {'x pred':>7}  (configs/llama3-1b.yaml, with the default GPU compile"
      f" options; MFU against the bf16 peak, FP8 too; x bound: step time over the roofline's; predicted: the"
      f" schedule model's step, maxtrain.analysis.schedule)")
for run in runs:
    impl, ce, remat, fp8 = run.split(":")
    head = f"{impl:12} {ce:6} {remat:10} {fp8:10}"
    text = open(os.path.join(log, f"step_{impl}_{ce}_{remat}_{fp8}.log")).read().splitlines()
    last = next((line for line in reversed(text) if line.startswith("{")), None)
    if last is None:
        why = next((line for line in reversed(text) if line.strip() and not line.startswith("rc=")), "no output")
        rc = next((line for line in reversed(text) if line.startswith("rc=")), "")
        print(f"{head} failed ({rc}): {why[:100]}")
        continue
    r = json.loads(last)
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    mem = r["memory_per_device_bytes"]
    mem = "n/a" if mem is None else f"{mem / 2**30:.1f}"
    bound = r.get("roofline_step_s")
    bound = "n/a" if not bound else f"{r['step_time_s'] / bound:.2f}"
    pred = r.get("predicted_step_s")
    ratio = "n/a" if not pred else f"{r['step_time_s'] / pred:.2f}"
    pred = "n/a" if not pred else f"{pred:.3f}"
    print(f"{head} {r['step_time_s']:12.3f} {r['tokens_per_s']:12,.0f} {mfu:>7} {mem:>8} {bound:>8} {pred:>12} {ratio:>7}")
EOF
if [ -n "${OUT:-}" ]; then  # what comes back from a device machine: one archive, and the traces
  tar czf "$OUT/gpu_check.tgz" --exclude='prof_*' --exclude='run_*' -C "$LOG" . 2>/dev/null
  for prof in "$LOG"/prof_*; do
    trace=$(find "$prof" -name 'perfetto_trace.json.gz' 2>/dev/null | head -n 1)
    [ -n "$trace" ] && cp "$trace" "$OUT/trace_${prof##*/prof_}.json.gz"
  done
fi
