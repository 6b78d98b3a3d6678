#!/usr/bin/env bash
# One-shot check on a fresh GPU machine (within 8 minutes):
#   1. the kernel tests compiled for the GPU (Triton), not in Pallas' interpreter
#   2. bench/kernels.py (flash vs cuDNN vs XLA attention, cross-entropy, RMSNorm)
#   3. a real training step of configs/llama3-1b.yaml with each attention implementation
# and last a short table: test result, step time, tokens/s and MFU per implementation.
#
#   bash bench/gpu_check.sh            # logs in $OUT (if set) or /tmp/maxtrain_gpu_check
#
# Every part has its own timeout; a part that fails or times out is reported and the rest run.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-/tmp/maxtrain_gpu_check}"
mkdir -p "$LOG"
START=$SECONDS

if ! python -c "import maxtrain.kernels" 2>/dev/null; then  # not installed, or installed without kernels/
  pip install -q --no-deps --no-build-isolation -e . >"$LOG/install.log" 2>&1 || echo "gpu_check: install failed (see $LOG/install.log)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1
python -c "import jax; print('jax', jax.__version__, jax.devices())"

# 1. kernels compiled: the conftest defaults to CPU, so ask for the GPU; the training test needs 8 devices
MAXTRAIN_KERNEL_INTERPRET=0 JAX_PLATFORMS=cuda timeout 110 \
  python -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "not training" >"$LOG/tests.log" 2>&1
TESTS_RC=$?
tail -n 25 "$LOG/tests.log"

# 2. the kernel benchmark (rows print as measured, so a timeout still leaves a partial table)
timeout 120 python bench/kernels.py --lengths 1024,4096,16384 --iters 5 >"$LOG/kernels.log" 2>&1
BENCH_RC=$?
grep -v '^\[{' "$LOG/kernels.log" | tail -n 40

# 3. one real training step per attention implementation
for impl in xla cudnn flash; do
  timeout 70 python bench/step.py configs/llama3-1b.yaml "model.attention=$impl" "run_dir=$LOG/run_$impl" \
    --steps 3 >"$LOG/step_$impl.log" 2>&1
  echo "rc=$?" >>"$LOG/step_$impl.log"
done

echo
echo "== gpu_check summary ($((SECONDS - START)) s) =="
echo "kernel tests (compiled): $([ $TESTS_RC -eq 0 ] && echo passed || echo "FAILED rc=$TESTS_RC") — $(tail -n 1 "$LOG/tests.log")"
echo "bench/kernels.py: $([ $BENCH_RC -eq 0 ] && echo ok || echo "rc=$BENCH_RC (partial table above)")"
python - "$LOG" <<'EOF'
import json, os, sys
log = sys.argv[1]
print(f"{'attention':10} {'step time s':>12} {'tokens/s':>12} {'MFU':>7}  (configs/llama3-1b.yaml, bench/step.py)")
for impl in ("xla", "cudnn", "flash"):
    text = open(os.path.join(log, f"step_{impl}.log")).read().splitlines()
    last = next((line for line in reversed(text) if line.startswith("{")), None)
    if last is None:
        why = next((line for line in reversed(text) if line.strip() and not line.startswith("rc=")), "no output")
        rc = next((line for line in reversed(text) if line.startswith("rc=")), "")
        print(f"{impl:10} failed ({rc}): {why[:100]}")
        continue
    r = json.loads(last)
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    print(f"{impl:10} {r['step_time_s']:12.3f} {r['tokens_per_s']:12,.0f} {mfu:>7}")
EOF
