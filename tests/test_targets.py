"""Compiling for a GPU this machine lacks (`maxtrain.targets`): `maxtrain inspect --target`,
`bench/kernel_bench.py --target`, and the kernels choosing compiled code for the mesh's devices.

The compiling tests need jax's CUDA plugin and ptxas, which `.ci/run` installs into a directory of
its own (`MAXTRAIN_CUDA_PLUGIN`, put on PYTHONPATH of a subprocess only, so the rest of the suite
runs on a plain CPU jax); without it they skip, saying so. The error paths run everywhere."""

import json
import os
import subprocess
import sys

import jax
import pytest

from conftest import ROOT, SMALL, TINY
from maxtrain import cli, load_config, targets
from maxtrain.kernels import HopperBlocks

pytestmark = pytest.mark.slow  # compiles for GPUs with XLA's CUDA compiler: `-m "not slow"` leaves them out

PLUGIN = os.environ.get("MAXTRAIN_CUDA_PLUGIN")
needs_plugin = pytest.mark.skipif(not (PLUGIN and os.path.isdir(PLUGIN)),
                                  reason="MAXTRAIN_CUDA_PLUGIN (a directory holding jax's CUDA plugin, "
                                         "installed by .ci/run) is not set")


def _run(*argv, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    env["PYTHONPATH"] = os.pathsep.join([PLUGIN, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


def _rows(stdout):
    """The last line's JSON: bench/kernel_bench.py's rows (none may be an error), or inspect's object."""
    out = json.loads(stdout.strip().splitlines()[-1])
    if isinstance(out, list):
        assert not [r for r in out if "error" in r], [r for r in out if "error" in r]
    return out


def test_on_gpu_follows_the_context_mesh_devices():
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    assert not targets.on_gpu() and targets.compute_capability() == ""
    with jax.set_mesh(jax.make_mesh((8,), ("x",))):
        assert not targets.on_gpu()  # CPU devices in context: still not a GPU
    h200 = AbstractDevice(device_kind=targets.TARGETS["h200"].device_kind, num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=h200)):
        assert targets.on_gpu() and targets.compute_capability() == "9.0"
    assert not targets.on_gpu()


def test_target_without_the_cuda_plugin_is_one_line_error(monkeypatch, capsys):
    from jax.experimental import topologies

    def missing(**_):
        raise NotImplementedError("topology not implemented for cuda")
    monkeypatch.setattr(topologies, "get_topology_desc", missing)
    assert cli.main(["inspect", "--target", "h200", TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("maxtrain: error: --target h200")
    assert f"jax-cuda12-plugin=={targets.plugin_version()}" in err and targets.PTXAS_WHEEL in err


@pytest.mark.parametrize("argv, message", [
    (["--target", "h300"], "did you mean"),
    (["--target", "h100", "--devices", "12"], "12 devices do not fill hosts of 8 GPUs"),
])
def test_bad_target_is_one_line_error(argv, message, capsys):
    assert cli.main(["inspect", *argv, TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


# d_model 256 / 4 heads: head dim 64, which the Mosaic GPU kernels take
ATTN = SMALL + ["model.d_model=256", "model.d_ff=512", "train.dtype=bfloat16"]


@needs_plugin
@pytest.mark.parametrize("attention", ["flash_mosaic", "flash", "xla"])
def test_inspect_compiles_for_two_h200s_without_a_gpu(attention):
    r = _run("-m", "maxtrain.cli", "inspect", "--target", "h200", "--devices", "2", "--json", TINY, *ATTN,
             f"model.attention={attention}", "mesh.data=2")
    assert r.returncode == 0, r.stderr[-3000:]
    out = _rows(r.stdout)
    assert out["device_kind"] == "NVIDIA H200" and out["devices"] == 2
    assert out["device_memory"] == int(0.75 * targets.TARGETS["h200"].memory_bytes)  # jax's default share
    assert 0 < out["memory_per_device"]["total"] < out["device_memory"]
    assert out["collectives"]["all-reduce"]["count"] > 0  # data parallel gradients across the two GPUs


@needs_plugin
def test_overlap_options_reach_the_gpu_compile_and_hide_communication():
    """The mechanism on a small program (8 H100s, FSDP): the GPU compile gets the overlap options
    (`train.gpu_overlap`), and the schedule model reads less exposed communication from the program
    compiled with them than without; its step is the compute stream plus that exposure, no shorter
    than the roofline's bound; `auto` attention is reported with its reason."""
    def inspect(*extra):
        r = _run("-m", "maxtrain.cli", "inspect", "--target", "h100", "--devices", "8", "--json", TINY, *ATTN,
                 "model.attention=auto", "model.head_dim=64", "mesh.data=1", "mesh.fsdp=8", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        return _rows(r.stdout)

    on, off = inspect(), inspect("train.gpu_overlap=false")
    from maxtrain.step import GPU_OVERLAP_OPTIONS

    assert set(GPU_OVERLAP_OPTIONS) <= set(on["compiler_options"]) and not set(GPU_OVERLAP_OPTIONS) & set(off["compiler_options"])
    assert on["attention"].startswith("flash_mosaic (auto: compute capability 9.0")
    for r in (on, off):
        s = r["schedule"]
        assert s["predicted_step_s"] == pytest.approx(s["compute_s"] + s["exposed_collective_s"])
        assert s["predicted_step_s"] >= r["roofline"]["step_s"] * (1 - 1e-9) and s["exposed"]
        assert 0 < s["predicted_mfu"] <= r["roofline"]["mfu_ceiling"] * (1 + 1e-9)
    assert on["schedule"]["exposed_collective_s"] < off["schedule"]["exposed_collective_s"]


@needs_plugin
def test_inspect_target_refuses_cudnn_in_one_line():
    r = _run("-m", "maxtrain.cli", "inspect", "--target", "h200", "--devices", "1", TINY, *ATTN,
             "model.attention=cudnn", "mesh.data=1")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("maxtrain: error: model.attention=cudnn cannot be compiled")


@needs_plugin
def test_fused_cross_entropy_peak_memory_at_128k_vocab_for_h200():
    """Issue 6's memory target, as XLA's CUDA compiler assigns buffers for an H200 (8k tokens,
    vocab 128256, d_model 2048, forward+backward): the fused projection + cross-entropy
    (`train.cross_entropy=fused`) at least 4x below XLA's. Given the bf16 logits, the chunked
    kernel's floor is the logits and their gradient, half of XLA's program."""
    r = _run("bench/kernel_bench.py", "--target", "h200", "--only", "ce")
    assert r.returncode == 0, r.stderr[-3000:]
    mem = {(row["kernel"], row["impl"].split(" ")[0]): row["memory_bytes"] for row in _rows(r.stdout)}
    assert "N=8192 V=128256 D=2048" in r.stdout
    ours, xla = mem[("linear+cross-entropy", "ours")], mem[("linear+cross-entropy", "xla")]
    assert ours and xla and xla >= 4 * ours, (ours, xla)
    ours, xla = mem[("cross-entropy(logits)", "ours")], mem[("cross-entropy(logits)", "xla")]
    logits_and_grad = 2 * 8192 * 128256 * 2
    assert ours < 1.01 * logits_and_grad and xla > 1.9 * ours, (ours, xla)


@needs_plugin
@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_kernels_compile_for_sm90(head_dim):
    """Every Pallas kernel through ptxas for sm_90a at its default tiles: the Triton ones as XLA
    compiles them (flash forward, dQ, dK/dV; cross-entropy; add+RMSNorm) spill nothing, nor do the
    Mosaic GPU ones at head dim 64 (configs/llama3-1b.yaml's); at 128 dK/dV's spill stays small."""
    r = _run("bench/kernel_bench.py", "--target", "h200", "--only", "registers", "--default-tiles",
             "--head-dim", str(head_dim))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["kernel"]: row for row in _rows(r.stdout)}
    assert set(rows) == {"mosaic forward", "mosaic dq", "mosaic dkdv", "triton flash_attention_fwd",
                         "triton flash_attention_bwd_dq", "triton flash_attention_bwd_dkdv",
                         "triton cross_entropy_fwd", "triton cross_entropy_bwd", "triton rms_norm_fwd",
                         "triton rms_norm_bwd"}, sorted(rows)
    blocks = HopperBlocks.for_head_dim(head_dim)
    for name, row in rows.items():
        assert row["registers"] is not None, row
        if name.startswith("mosaic"):
            assert row["tiles"] == f"k={blocks.k} bwd_q={blocks.bwd_q} stages={blocks.stages}"
    limit = {"mosaic dkdv": 64} if head_dim == 128 else {}
    for name, row in rows.items():
        assert row["spill_bytes"] <= limit.get(name, 0), row


@needs_plugin
def test_sequence_parallel_keeps_weight_gradients_sharded():
    """Megatron sequence parallelism (`length: [sequence, tensor]`, as configs/llama3-70b.yaml)
    compiled for 8 H100s (fsdp=4 x tensor=2): the blocks keep heads and MLP width split over
    tensor (`block_length`), so weight gradients leave by reduce-scatter, not all-reduced whole.
    Giving `tensor` to the blocks' length too is what the model did before, and fails this."""
    def collectives(*extra):
        r = _run("-m", "maxtrain.cli", "inspect", "--target", "h100", "--devices", "8", "--json", TINY, *ATTN,
                 "train.seq_len=128", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2",
                 "sharding.activations.length=[sequence, tensor]", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        out = _rows(r.stdout)
        return out["collectives"], 2 * out["params"]  # bf16 compute copies of the weights

    sp, weight_bytes = collectives()
    assert sp["reduce-scatter"]["count"] > 0
    # the only all-to-alls move the embedding lookup (read where the table is stored, D split over
    # fsdp) to the activation layout and its cotangent back: the float32 [B, L, D] once each way
    B, L, D = 16, 128, 256
    assert sp["all-to-all"]["bytes"] <= 2 * 4 * B * L * D / 8, sp
    assert sp["all-reduce"]["bytes"] < 0.5 * weight_bytes, (sp, weight_bytes)
    old, _ = collectives("sharding.activations.block_length=[sequence, tensor]")
    assert old["all-reduce"]["bytes"] > 0.75 * weight_bytes, (old, weight_bytes)


@needs_plugin
@pytest.mark.parametrize("attention, kernel", [("flash_mosaic", "mosaic_gpu_v2")])  # Triton: the same _flash_fwd
def test_save_dots_keeps_the_flash_residuals(attention, kernel):
    """`model.remat=save_dots` keeps the flash forward's output and log-sum-exp (named in
    kernels/flash.py): per layer and step the kernels run three times (forward, dQ, dK/dV), where
    `remat=full` runs the forward again in the backward pass."""
    def kernels(remat):
        r = _run("-m", "maxtrain.cli", "inspect", "--target", "h200", "--devices", "1", "--json", TINY, *ATTN,
                 f"model.attention={attention}", "mesh.data=1", f"model.remat={remat}")
        assert r.returncode == 0, r.stderr[-3000:]
        return _rows(r.stdout)["custom_calls"].get(kernel, 0)

    layers = 2  # SMALL's model.n_layers
    assert kernels("save_dots") == 3 * layers
    assert kernels("full") == 4 * layers


@needs_plugin
def test_inspect_prints_the_roofline_of_the_h200_step():
    """The step compiled for an H200 at the GPU's speed of light (`maxtrain.analysis.hlo.roofline`): the
    flash kernels are found by shape and counted as the matmuls they run (forward 2, dQ 3, dK/dV 4
    per score, causal), 9/6 of the model's attention FLOPs, and the bound gives an MFU ceiling."""
    shape = ["train.seq_len=256", "train.batch_size=2"]  # a multiple of the kernels' 128-row tiles: no padding
    r = _run("-m", "maxtrain.cli", "inspect", "--target", "h200", "--devices", "1", "--json", TINY, *ATTN, *shape,
             "model.attention=flash_mosaic", "mesh.data=1", "model.remat=save_dots")
    assert r.returncode == 0, r.stderr[-3000:]
    roof = _rows(r.stdout)["roofline"]
    assert roof["peak_flops"] == 989e12 and roof["bandwidth"] == targets.TARGETS["h200"].bandwidth_bytes_s
    assert set(roof["by_category_s"]) >= {"matmul", "attention", "fusion"}
    cfg = load_config(TINY, ATTN + shape)
    m, L = cfg.model, cfg.train.seq_len
    model_attention = 3 * m.n_layers * 4 * m.n_heads * m.head_dim * (L + 1) / 2 * cfg.train.batch_size * L
    assert roof["by_category_flops"]["attention"] == pytest.approx(1.5 * model_attention, rel=1e-9)
    assert 0 < roof["mfu_ceiling"] < 1 and roof["step_s"] >= roof["compute_s"] > 0
    text = _run("-m", "maxtrain.cli", "inspect", "--target", "h200", "--devices", "1", TINY, *ATTN,
                "model.attention=flash_mosaic", "mesh.data=1")
    assert "roofline          step >= " in text.stdout and "MFU <= " in text.stdout, text.stdout[-2000:]
    assert "schedule model    step ~ " in text.stdout and "MFU ~ " in text.stdout, text.stdout[-2000:]
    assert "GEMMs by operand precision: bf16 " in text.stdout, text.stdout[-2000:]


@needs_plugin
def test_fp8_projections_compile_to_fp8_gemms_for_h100():
    """configs/llama3-1b.yaml with `train.fp8.recipe=tensorwise` compiled for 8 H100s: every
    projection GEMM, forward and backward, has FP8 operands (none left in bf16 or dequantized into
    a bf16 GEMM: their FLOPs are exactly the projections'), the output head stays bf16, the
    roofline prices FP8 GEMMs at the FP8 peak, and the step's bound drops."""
    config = os.path.join(ROOT, "configs", "llama3-1b.yaml")

    def inspect(*extra):  # the GPU overlap options do not change GEMM operand types: compiled without them
        r = _run("-m", "maxtrain.cli", "inspect", "--target", "h100", "--devices", "8", "--json", config,
                 "train.gpu_overlap=false", *extra)  # (as before they existed), their pipelining peels loops
        assert r.returncode == 0, r.stderr[-3000:]
        return _rows(r.stdout)

    bf16, fp8 = inspect(), inspect("train.fp8.recipe=tensorwise")
    cfg = load_config(config)
    m, tokens = cfg.model, cfg.train.batch_size * cfg.train.seq_len // 8
    weights = m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.d_ff
    gemms = fp8["roofline"]["gemms"]
    assert gemms["fp8"]["kernels"] == 21  # per layer: 7 projections forward, 14 backward (dgrad, wgrad)
    assert gemms["fp8"]["runs"] == 21 * m.n_layers
    assert gemms["fp8"]["flops"] == 6 * m.n_layers * weights * tokens
    assert set(gemms) == {"fp8", "bf16"} and "fp8" not in bf16["roofline"]["gemms"]
    assert gemms["bf16"]["flops"] == bf16["roofline"]["gemms"]["bf16"]["flops"] - gemms["fp8"]["flops"]
    fp8_s, same_flops_bf16_s = gemms["fp8"]["seconds"], gemms["fp8"]["flops"] / 989e12
    assert fp8_s < 0.6 * same_flops_bf16_s  # at the 1,979 TFLOP/s FP8 peak (some GEMMs memory-bound)
    assert fp8["roofline"]["step_s"] < 0.92 * bf16["roofline"]["step_s"]
    # the FSDP all-gathers move the projection weights in FP8
    assert fp8["collectives"]["all-gather"]["bytes"] < 0.6 * bf16["collectives"]["all-gather"]["bytes"]


@needs_plugin
def test_fp8_on_a100_is_one_line_error():
    r = _run("-m", "maxtrain.cli", "inspect", "--target", "a100", "--devices", "1", TINY, "train.fp8.recipe=tensorwise")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("maxtrain: error: train.fp8.recipe=tensorwise: NVIDIA A100")


@needs_plugin
def test_plan_pruning_picks_the_exhaustive_best_for_h100s():
    """`maxtrain plan`'s pruning, checked honestly: every layout of a small model on 2 H100s is
    compiled and ranked by the schedule model; the layout the planner would pick from its top 2 by
    the quick estimate is within 2% of the exhaustive best."""
    script = f"""
import json, jax
jax.config.update("jax_platforms", "cpu")
from maxtrain.analysis.plan import plan
from maxtrain.targets import target_devices
overrides = {ATTN + ["train.batch_size=2", "train.seq_len=256", "model.attention=xla"]!r}
r = plan({TINY!r}, overrides, target_devices("h100", 2, per_host=2), per_host=2, compile_all=True, remats=("full",),
         configured=False)
print(json.dumps(r))
"""
    r = _run("-c", script)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    rows = [row for row in result["rows"] if row.get("fits")]
    assert result["ranked_by"] == "schedule model" and len(rows) >= 4 and result["compiled"] == result["kept"]
    best = min(row["predicted_step_s"] for row in rows)
    assert result["best"]["predicted_step_s"] == best
    for row in rows:  # the memory estimate that prunes before compiling, against the compiled figure
        assert 0.5 <= row["memory_estimate_bytes"] / row["memory_bytes"] <= 1.25, row
    by_estimate = sorted(rows, key=lambda row: row["estimate_s"])[:2]
    pick = min(row["predicted_step_s"] for row in by_estimate)
    assert pick <= 1.02 * best, ([row["layout"] for row in by_estimate], result["best"]["layout"])
