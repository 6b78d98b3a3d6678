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


def test_bench_kernels_times_flash_tile_candidates():
    """`--only tiles`: Triton forward tiles, then backward tiles with the fastest forward ones
    (interpreted here; the Mosaic GPU candidates only on a GPU), and the fastest of each."""
    r = subprocess.run([sys.executable, "bench/kernels.py", "--only", "tiles", "--quick"], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    rows = json.loads(lines[-1])
    assert [row["impl"].split()[-1] for row in rows] == ["fwd", "fwd", "fwd+bwd", "fwd+bwd"]
    assert all("error" not in row and row["time_ms"] > 0 for row in rows), rows
    fastest_fwd = min(rows[:2], key=lambda row: row["time_ms"])["impl"]
    q, k = fastest_fwd.split()[1:3]
    assert all(row["impl"].split()[1:3] == [q, k] for row in rows[2:])  # backward runs the best forward tiles
    best = [line for line in lines if line.startswith("best triton")]
    assert len(best) == 2 and best[0].startswith(f"best triton fwd: {q} {k} ")


def _vs_maxtext():
    import importlib.util
    spec = importlib.util.spec_from_file_location("vs_maxtext", os.path.join(ROOT, "bench", "vs_maxtext.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vs_maxtext_translates_the_config_and_refuses_what_it_cannot_map():
    import pytest

    from maxtrain import load_config
    vs = _vs_maxtext()
    cfg = load_config(os.path.join(ROOT, "configs", "llama3-1b.yaml"), ["train.batch_size=16"])
    s, notes = vs.maxtext_settings(cfg, {"data": 2, "fsdp": 4, "tensor": 1}, 8, "NVIDIA H200")
    assert (s["base_emb_dim"], s["base_num_decoder_layers"], s["base_num_query_heads"], s["base_num_kv_heads"],
            s["head_dim"], s["base_mlp_dim"], s["vocab_size"]) == (2048, 16, 32, 8, 64, 8192, 128256)
    assert s["per_device_batch_size"] == 2 and s["max_target_length"] == 4096 and s["logits_via_embedding"]
    assert (s["ici_data_parallelism"], s["ici_fsdp_parallelism"], s["ici_tensor_parallelism"]) == (2, 4, 1)
    assert s["hardware"] == "gpu" and s["attention"] == "cudnn_flash_jax" and s["remat_policy"] == "minimal"
    assert any("RoPE scaling" in n for n in notes)  # llama3-1b's factor 32 is not MaxText's fixed 8
    flash = load_config(os.path.join(ROOT, "configs", "llama3-1b.yaml"), ["model.attention=flash_mosaic"])
    assert vs.maxtext_settings(flash, {"data": 8}, 8, "NVIDIA H200")[0]["remat_policy"] == "minimal_with_context"
    for bad in (["mesh.pipeline=2"], ["model.moe.num_experts=4"], ["model.sliding_window=64"]):
        with pytest.raises(vs.BenchError):
            vs.check_mappable(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), bad))


def test_vs_maxtext_without_maxtext_is_a_one_line_error():
    env = {k: v for k, v in os.environ.items() if k != "MAXTEXT_PYTHON"}
    r = subprocess.run([sys.executable, "bench/vs_maxtext.py", "configs/tiny.yaml"], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "maxtrain: error: MaxText interpreter not found; set MAXTEXT_PYTHON or pass --maxtext-python"]
