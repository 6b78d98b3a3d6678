import json
import os
import subprocess
import sys

from conftest import ROOT, SMALL


def test_bench_step_prints_json_figures():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    r = subprocess.run([sys.executable, "bench/step.py", "configs/tiny.yaml", *SMALL,
                        "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "--steps", "2"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("compile_s", "step_time_s", "tokens_per_s", "memory_per_device_bytes",
                "xla_flops_per_step", "model_flops_per_step"):
        assert key in figures
    assert figures["step_time_s"] > 0 and figures["memory_per_device_bytes"] > 0
    assert figures["xla_flops_per_step"] > 0 and figures["model_flops_per_step"] > 0


def test_bench_kernels_runs_its_table_in_interpret_mode():
    r = subprocess.run([sys.executable, "bench/kernels.py", "--quick"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    kernels = {row["kernel"] for row in rows}
    assert kernels == {"attention", "cross-entropy(logits)", "linear+cross-entropy", "add+rmsnorm"}
    for row in rows:
        assert "error" not in row, row
        assert row["time_ms"] > 0 and row["memory_bytes"] > 0
    assert {row["impl"] for row in rows if row["kernel"] == "attention"} == {
        "flash fwd", "flash fwd+bwd", "xla fwd", "xla fwd+bwd"}
