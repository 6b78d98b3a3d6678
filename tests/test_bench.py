import json
import os
import subprocess
import sys

from conftest import ROOT, SMALL


def test_bench_step_prints_json_figures(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    r = subprocess.run([sys.executable, "bench/step.py", "configs/tiny.yaml", *SMALL,
                        "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "--steps", "2", "--profile", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("compile_s", "step_time_s", "tokens_per_s", "memory_per_device_bytes",
                "xla_flops_per_step", "model_flops_per_step"):
        assert key in figures
    assert figures["step_time_s"] > 0 and figures["memory_per_device_bytes"] > 0
    assert figures["xla_flops_per_step"] > 0 and figures["model_flops_per_step"] > 0
    # --profile: a Perfetto trace of two more steps, which trace_summary reads (no GPU streams here)
    s = subprocess.run([sys.executable, "bench/trace_summary.py", str(tmp_path), "--steps", "2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert s.returncode == 0 and "perfetto_trace.json.gz" in s.stdout and "no device streams" in s.stdout, s


def test_trace_summary_splits_a_gpu_stream_by_kernel_and_category():
    """The device side of a GPU trace as jax writes it: kernels on a stream line (the "XLA Ops"
    line repeats them and is not counted), busy time as the union of the kernels' intervals."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("trace_summary", os.path.join(ROOT, "bench", "trace_summary.py"))
    ts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ts)
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 14, "args": {"name": "Stream #14(Compute,Memset)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "XLA Ops"}}]
    kernels = [("nvjet_sm90_tst_128x160", 0, 10), ("loop_multiply_fusion", 5, 10), ("memcpy32_post", 20, 4),
               ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 30, 10), ("ncclDevKernel_AllGather", 30, 6)]
    events = meta + [{"ph": "X", "pid": 1, "tid": 14, "ts": t, "dur": d, "name": n} for n, t, d in kernels]
    events += [{"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 40, "name": "fusion.1"},
               {"ph": "X", "pid": 7, "tid": 9, "ts": 0, "dur": 99, "name": "python"}]
    s = ts.summarize(events)
    assert list(s) == ["/device:GPU:0"]
    gpu = s["/device:GPU:0"]
    assert gpu["wall_us"] == 40 and gpu["busy_us"] == 15 + 4 + 10 and gpu["kernel_us"] == 40 and gpu["n_kernels"] == 5
    assert gpu["by_category"] == {"matmul": 10, "other": 10, "copy": 4, "attention": 10, "collective": 6}


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
