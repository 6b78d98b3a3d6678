import json
import os
import subprocess
import sys

from conftest import FAST_COMPILE, ROOT, SMALL


def test_bench_step_prints_json_figures(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8" + FAST_COMPILE}
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
    # --profile: a Perfetto trace of two more steps, which trace_summary reads: on CPU, XLA's
    # per-op events of the host threads, per fake device
    s = subprocess.run([sys.executable, "bench/trace_summary.py", str(tmp_path), "--steps", "2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert s.returncode == 0 and "perfetto_trace.json.gz" in s.stdout, s
    assert "host ops of jit_train_step" in s.stdout and "mean of 8 CPU devices" in s.stdout, s.stdout
    assert "matmul" in s.stdout and "collective" in s.stdout, s.stdout


def _bench_module(name: str):
    """bench/NAME.py loaded by its path: bench/ on sys.path would put its scripts' names (`step`,
    `parallel`, ...) before any package of the same name for the rest of this worker."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trace_summary_splits_a_gpu_stream_by_kernel_and_category():
    """The device side of a GPU trace as jax writes it: kernels on a stream line (the "XLA Ops"
    line repeats them and is not counted), busy time as the union of the kernels' intervals."""
    ts = _bench_module("trace_summary")
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


def test_trace_summary_sums_xla_cpu_op_events_per_device():
    """Off GPUs: XLA:CPU's per-op events (`args.hlo_op`, one per executed thunk and device),
    averaged over the devices, by op and by category; the thunks' completion events are not ops, and
    a while loop's event, which spans its body's ops, is not counted again."""
    ts = _bench_module("trace_summary")
    meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}}]
    ops = [("ynn_fusion.3", "0", 0, 30), ("ynn_fusion.3", "1", 0, 50), ("all-gather.2", "0", 30, 10),
           ("all_gather.2", "1", 50, 6), ("wrapped_convert", "0", 40, 4), ("copy_bitcast_fusion", "1", 56, 2),
           ("add_multiply_fusion", "0", 44, 8), ("dot.7", "1", 58, 12), ("while.3", "0", 0, 52)]
    events = meta + [{"ph": "X", "pid": 7, "tid": 1, "ts": t, "dur": d, "name": n,
                      "args": {"hlo_op": n, "hlo_module": "jit_train_step", "device_ordinal": o}}
                     for n, o, t, d in ops]
    events += [{"ph": "X", "pid": 7, "tid": 1, "ts": 30, "dur": 0.1, "name": "end: ynn_fusion.3", "args": {}},
               {"ph": "X", "pid": 7, "tid": 1, "ts": 0, "dur": 60, "name": "ThunkExecutor::Execute"}]
    s = ts.summarize(events)
    assert list(s) == ["host ops of jit_train_step, mean of 2 CPU devices"]
    cpu = s[next(iter(s))]
    # a shard_map's collectives are named with underscores (`all_gather.3`)
    assert cpu["by_category"] == {"matmul": (30 + 50 + 12) / 2, "collective": 5 + 3, "convert": 2, "copy": 1,
                                  "other": 4}
    assert cpu["by_name"]["ynn_fusion.3"] == 40 and cpu["runs"]["ynn_fusion.3"] == 1
    # busy: device 0's ops cover 0-52 (the while loop is not an op), device 1's 0-70
    assert cpu["busy_us"] == (52 + 70) / 2 and cpu["wall_us"] == 70 and cpu["n_kernels"] == 4


def test_bench_kernels_runs_its_table_in_interpret_mode():
    r = subprocess.run([sys.executable, "bench/kernel_bench.py", "--quick"], capture_output=True, text=True, cwd=ROOT,
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
    r = subprocess.run([sys.executable, "bench/kernel_bench.py", "--only", "tiles", "--quick"], capture_output=True,
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


def test_vs_maxtext_translates_the_config_and_refuses_what_it_cannot_map():
    import pytest

    from maxtrain import load_config
    vs = _bench_module("vs_maxtext")
    cfg = load_config(os.path.join(ROOT, "configs", "llama3-1b.yaml"), ["train.batch_size=16"])
    s, notes = vs.maxtext_settings(cfg, {"data": 2, "fsdp": 4, "tensor": 1}, 8, "NVIDIA H200")
    assert (s["base_emb_dim"], s["base_num_decoder_layers"], s["base_num_query_heads"], s["base_num_kv_heads"],
            s["head_dim"], s["base_mlp_dim"], s["vocab_size"]) == (2048, 16, 32, 8, 64, 8192, 128256)
    assert s["per_device_batch_size"] == 2 and s["max_target_length"] == 4096 and s["logits_via_embedding"]
    assert (s["ici_data_parallelism"], s["ici_fsdp_parallelism"], s["ici_tensor_parallelism"]) == (2, 4, 1)
    # llama3-1b: flash_mosaic with save_dots keeps the kernel's output, as MaxText's minimal_with_context
    assert s["hardware"] == "gpu" and s["attention"] == "cudnn_flash_jax"
    assert s["remat_policy"] == "minimal_with_context"
    assert any("RoPE scaling" in n for n in notes)  # llama3-1b's factor 32 is not MaxText's fixed 8
    plain = load_config(os.path.join(ROOT, "configs", "llama3-1b.yaml"), ["model.attention=xla"])
    assert vs.maxtext_settings(plain, {"data": 8}, 8, "NVIDIA H200")[0]["remat_policy"] == "minimal"
    for bad in (["mesh.pipeline=2"], ["model.moe.num_experts=4"], ["model.sliding_window=64"]):
        with pytest.raises(vs.BenchError):
            vs.check_mappable(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), bad))


def test_vs_maxtext_without_maxtext_is_a_one_line_error(tmp_path):
    # no MAXTEXT_PYTHON, and a HOME without bench/maxtext_env.sh's venv
    env = {k: v for k, v in os.environ.items() if k not in ("MAXTEXT_PYTHON", "MAXTEXT_VENV")}
    r = subprocess.run([sys.executable, "bench/vs_maxtext.py", "configs/tiny.yaml"], capture_output=True,
                       text=True, cwd=ROOT, env={**env, "HOME": str(tmp_path)}, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "maxtrain: error: MaxText interpreter not found; run `bash bench/maxtext_env.sh`, or set MAXTEXT_PYTHON "
        "or pass --maxtext-python"]


def test_vs_maxtext_abba_order_and_pair_ratios():
    """A B B A ...: each adjacent pair holds one step of each side, each side first in half the pairs; the
    per-pair ratio A/B cancels a load that drifts over the run, where the ratio of medians does not."""
    import pytest

    vs = _bench_module("vs_maxtext")
    assert vs.abba_order(4) == list("ABBAABBA")
    order = vs.abba_order(6)
    pairs = [order[i:i + 2] for i in range(0, len(order), 2)]
    assert all(sorted(p) == ["A", "B"] for p in pairs) and sum(p[0] == "A" for p in pairs) == 3
    # A costs 1.0, B 2.0; the machine slows down 10% per step, and one B step is hit by a 5x spike
    load = [1 + 0.1 * i for i in range(len(order))]
    run = [(s, (1.0 if s == "A" else 2.0) * f) for s, f in zip(order, load)]
    run[5] = (run[5][0], run[5][1] * 5)
    ratios = vs.pair_ratios(run)
    assert len(ratios) == 6 and all(0.45 < r < 0.56 for i, r in enumerate(ratios) if i != 2)
    s = vs.summarize(run)
    assert s["pairs"] == 6 and abs(s["median_pair_ratio"] - 0.5) < 0.03
    assert s["pair_ratio_q1"] <= s["median_pair_ratio"] <= s["pair_ratio_q3"]
    assert s["ratio_of_medians"] == pytest.approx(s["a"] / s["b"])
    assert vs.pair_ratios([("B", 4.0), ("A", 1.0)]) == [0.25]
    with pytest.raises(ValueError):
        vs.pair_ratios([("A", 1.0), ("B", 1.0), ("A", 1.0)])  # odd
    with pytest.raises(ValueError):
        vs.pair_ratios([("A", 1.0), ("A", 1.0)])  # a pair of one side


def test_vs_maxtext_interleaves_two_workers_abba_and_drops_the_warmup():
    vs = _bench_module("vs_maxtext")
    calls = []

    class Fake:
        def __init__(self, side, wall):
            self.side, self.wall = side, wall

        def step(self):
            calls.append(self.side)
            return {"wall_s": self.wall, "cpu_s": self.wall / 2, "loss": 1.0}

    run = vs.interleave(Fake("A", 3.0), Fake("B", 4.0), pairs=3, warmup_pairs=1)
    assert "".join(calls) == "ABBAABBA"
    assert [r["side"] for r in run] == vs.abba_order(4)[2:]
    assert vs.summarize([(r["side"], r["cpu_s"]) for r in run])["median_pair_ratio"] == 0.75


def test_vs_maxtext_cases_are_the_comparator_on_each_mesh():
    """The rows of docs/performance.md: the 46.4M Llama, fsdp=8 in float32 and bf16, fsdp=4 x tensor=2, and
    each side's defaults (MaxText then gets only the model, batch and length)."""
    import pytest

    from maxtrain import load_config
    from maxtrain.models import param_count
    vs = _bench_module("vs_maxtext")
    assert vs.select_cases("all") == ["fsdp8-f32", "fsdp8-bf16", "fsdp4-tp2-f32", "defaults"]  # the table's rows
    assert vs.select_cases("defaults,fsdp8-f32") == ["defaults", "fsdp8-f32"]
    with pytest.raises(vs.BenchError, match="unknown fsdp9"):
        vs.select_cases("fsdp9")
    for name, case in vs.CASES.items():
        cfg = load_config(case.config and os.path.join(ROOT, case.config), list(case.overrides))
        vs.check_mappable(cfg)
        assert round(param_count(cfg) / 1e6, 1) == 46.4 and (cfg.train.batch_size, cfg.train.seq_len) == (8, 512)
        if case.defaults:
            s = vs.maxtext_default_settings(cfg, 8, "cpu")
            assert not any(k.startswith(("ici_", "remat", "dtype", "weight_dtype", "attention", "opt")) for k in s)
        else:
            mesh = {"fsdp": 4, "tensor": 2} if "tp2" in name else {"fsdp": 8, "tensor": 1}
            assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, mesh["fsdp"], mesh["tensor"])
            s, _ = vs.maxtext_settings(cfg, mesh, 8, "cpu")
            # the translation of maxtrain's remat; the "-best" rows then set MaxText's own fastest
            remat = {"noremat": "minimal_with_context", "best": "minimal"}.get(name.rsplit("-", 1)[-1], "full")
            assert (s["remat_policy"], s["attention"], s["weight_dtype"]) == (remat, "dot_product", "float32")
            assert case.maxtext_set == (("remat_policy=minimal_with_context",) if name.endswith("-best") else ())
            assert s["dtype"] == ("bfloat16" if "bf16" in name else "float32")
            assert (s["ici_fsdp_parallelism"], s["ici_tensor_parallelism"], s["ici_data_parallelism"]) == (
                mesh["fsdp"], mesh["tensor"], 1)
        assert (s["base_emb_dim"], s["base_num_decoder_layers"], s["base_num_query_heads"], s["base_num_kv_heads"],
                s["base_mlp_dim"], s["vocab_size"], s["max_target_length"], s["per_device_batch_size"]) == (
                    512, 4, 8, 8, 1536, 32000, 512, 1)
        assert s["hardware"] == "cpu" and s["dataset_type"] == "synthetic" and not s["enable_checkpointing"]


def test_vs_maxtext_profiles_print_both_sides_op_time_by_category(tmp_path):
    """`--profile`: each side's traced steps (XLA:CPU per-op events) side by side by category."""
    import gzip
    vs = _bench_module("vs_maxtext")

    def trace(path, ops):
        os.makedirs(path)
        events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
        events += [{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": d, "name": n,
                    "args": {"hlo_op": n, "hlo_module": "jit_train_step", "device_ordinal": "0"}} for n, d in ops]
        with gzip.open(os.path.join(path, "perfetto_trace.json.gz"), "wt") as f:
            json.dump({"traceEvents": events}, f)

    trace(str(tmp_path / "a"), [("ynn_fusion.1", 3000), ("all-gather.2", 1000), ("while.4", 9000)])
    trace(str(tmp_path / "b"), [("ynn_fusion.7", 6000), ("wrapped_convert", 2000)])
    out = vs.format_profiles({"case": "x", "profile_steps": 2,
                              "profiles": {"maxtrain": str(tmp_path / "a"), "maxtext": str(tmp_path / "b")}})
    rows = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()[2:9]}
    assert rows["matmul"] == ["1.5", "3.0", "0.50"] and rows["all"] == ["2.0", "4.0", "0.50"], out
    assert rows["collective"][:2] == ["0.5", "0.0"] and rows["convert"][:2] == ["0.0", "1.0"], out
    assert "while.4" not in out and "ynn_fusion.7" in out


def test_cpu_efficiency_splits_the_step_against_the_matmul_peak():
    """bench/cpu_efficiency.py on a small model: the measured peak, the executed matmul FLOPs (at
    least the model's: full remat recomputes the forward) and a split that adds up to the step."""
    import pytest
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8" + FAST_COMPILE}
    small = ["model.vocab_size=256", "model.d_model=64", "model.d_ff=128", "model.n_layers=2", "model.n_heads=4",
             "model.n_kv_heads=4", "train.seq_len=32"]
    r = subprocess.run([sys.executable, "bench/cpu_efficiency.py", "configs/tiny.yaml", *small, "--steps", "2"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    f = json.loads(r.stdout.strip().splitlines()[-1])
    assert f["peak_gflops"] > 0 and f["step_s"] > 0 and f["recompute_ratio"] > 1.0
    assert f["matmul_s"] + f["other_s"] == pytest.approx(max(f["step_s"], f["matmul_s"]))
    assert f["efficiency"] == pytest.approx(f["model_gflops_per_step"] / f["step_s"] / f["peak_gflops"])


def test_cpu_efficiency_dots_show_which_bf16_products_xla_cpu_runs_in_bf16():
    """`--dots` (small here): a bf16 product runs as a bf16 dot only when it returns float32 with both
    operands contracting inner dimensions; `layers.dots`' form is one of those, `-> bf16` is not."""
    # in a child: the script imports its neighbours from bench/, which must not shadow packages here
    code = "import json, cpu_efficiency as ce; print(json.dumps(ce.dot_forms(m=64, k=32, n=48, iters=1)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.join(ROOT, "bench"),
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = {row["form"]: row["dot"] for row in json.loads(r.stdout.strip().splitlines()[-1])}
    assert got == {"float32 x @ w": "f32", "bf16 x @ w -> bf16": "f32", "bf16 x @ w -> float32": "bf16",
                   "bf16 x @ w -> float32 -> bf16 (layers.dots)": "bf16", "bf16 dx = g @ w.T -> float32": "f32",
                   "bf16 dw = x.T @ g -> float32": "f32"}, got


def test_startup_bench_times_every_command():
    r = subprocess.run([sys.executable, "bench/startup.py", "--repeats", "1"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    f = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"--help", "config typo", "--dry-run", "train: first log line"} <= set(f)
    assert all(v > 0 for v in f.values()), f  # the first log line was seen (not nan)


def test_fp8_bench_prints_the_gap_and_the_per_layer_statistics(tmp_path):
    small = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
             "train.seq_len=32"]
    r = subprocess.run([sys.executable, "bench/fp8.py", "--steps", "3", "--tail", "2", "--recipes", "float32,delayed",
                        "--out", str(tmp_path), *small], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    row = out["recipes"]["delayed"]
    assert set(out["recipes"]) == {"bf16", "float32", "delayed"}
    assert abs(row["final_gap"]) < 0.05 and abs(row["eval_gap"]) < 0.05 and "fp8_g_underflow" not in out["recipes"]["float32"]
    assert 0 <= row["fp8_g_underflow"] <= 1 and 0 <= row["fp8_x_saturation"] <= 1
    assert "    1 wq " in r.stdout and "    1 w_down " in r.stdout  # the per-layer table, both layers
    saved = json.loads((tmp_path / "fp8.json").read_text())
    assert len(saved["curves"]["delayed"]) == 3 and len(saved["recipes"]["delayed"]["layers"]) == 2 * 7
    assert (tmp_path / "fp8_loss.png").stat().st_size > 1000
