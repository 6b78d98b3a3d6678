"""maxtrain against MaxText on the same Llama, mesh and batch: compile, step time, memory, MFU.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python bench/vs_maxtext.py configs/tiny.yaml mesh.data=1 mesh.fsdp=8 [--steps N] \\
        [--maxtext-python /opt/maxtext-venv/bin/python] [--maxtext-set KEY=VALUE ...]

maxtrain's side is `bench/step.py` run as a subprocess (its last line is JSON). MaxText's side runs
in MaxText's own interpreter (MaxText needs Python >= 3.12; `pip install maxtext` in a separate
venv; --maxtext-python or $MAXTEXT_PYTHON names it): this same file, started there with
`--maxtext-driver`, builds MaxText's config with `pyconfig` through `train.initialize`, sets up the
state with `train_utils.setup_train_loop` (synthetic data), jits MaxText's `train.train_step` with
`train_utils.jit_train_and_eval_step`, compiles it ahead of time and times it on MaxText's
synthetic batches. No MaxText code is copied here, only called.

The maxtrain config is translated to MaxText keys (`maxtext_settings`): llama dims, sequence
length, global batch, dtypes, remat policy, attention, optimizer and mesh (maxtrain's
data/fsdp/tensor/sequence/expert axes -> MaxText's ici_*_parallelism). What cannot be matched
exactly is printed under the table. Both sides count parameters and the global batch; a mismatch
is an error. MFU uses one FLOP count for both (maxtrain's analytic model FLOPs); MaxText's own
estimate is printed beside it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_ENV = dict(os.environ)  # as started: this process later hides accelerators from itself
MIB = 2**20

# maxtrain remat policy -> nearest MaxText remat_policy. MaxText always wraps a layer in
# jax.checkpoint; with no remat the closest is to save every named projection and the attention
# context ("minimal_with_context"). maxtrain's save_dots keeps dots without batch dimensions: the
# projections, not the attention matmuls, which is MaxText's "minimal"; with our flash kernels it
# also keeps their output (`maxtrain.kernels.residuals.RESIDUAL_NAMES`), as "minimal_with_context".
REMAT = {"full": "full", "save_dots": "minimal", "none": "minimal_with_context"}
FLASH_KERNELS = ("flash", "flash_mosaic")


def maxtext_remat(m) -> str:
    """The MaxText remat_policy nearest to maxtrain's `model.remat` with `model.attention`."""
    if m.remat == "save_dots" and m.attention in FLASH_KERNELS:
        return "minimal_with_context"
    return REMAT[m.remat]
# maxtrain attention -> MaxText attention kernel
ATTENTION = {"xla": "dot_product", "ring_allgather": "dot_product", "ring": "dot_product",
             "cudnn": "cudnn_flash_jax", "flash": "cudnn_flash_jax"}
# maxtrain mesh axis -> MaxText ICI parallelism key (maxtrain's sequence axis is context parallelism)
MESH = {"data": "ici_data_parallelism", "fsdp": "ici_fsdp_parallelism", "tensor": "ici_tensor_parallelism",
        "sequence": "ici_context_parallelism", "expert": "ici_expert_parallelism",
        "pipeline": "ici_pipeline_parallelism"}
# the Llama-3.1 RoPE scaling MaxText implements (fixed in its LLaMARotaryEmbedding)
MAXTEXT_LLAMA31_ROPE = (8.0, 1.0, 4.0, 8192)


class BenchError(Exception):
    """A one-line reason the comparison cannot run."""


# ------------------------------------------------------------------ maxtrain side (this interpreter)

def run_maxtrain(config: str, overrides: list[str], steps: int) -> dict:
    """Runs bench/step.py; returns its JSON plus the resolved mesh, device count and device kind."""
    cmd = [sys.executable, os.path.join(HERE, "step.py"), config, *overrides, "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=CHILD_ENV)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        reason = tail[0].removeprefix("maxtrain: error: ")
        raise BenchError(f"bench/step.py failed (exit {proc.returncode}): {reason}")
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    for line in lines:  # "mesh {'data': 1, ...} on 8 x cpu"
        m = re.match(r"mesh (\{.*\}) on (\d+) x (.+)$", line)
        if m:
            result.update(mesh=ast.literal_eval(m.group(1)), n_devices=int(m.group(2)), device_kind=m.group(3))
    if "mesh" not in result:
        raise BenchError("bench/step.py printed no 'mesh ... on N x DEVICE' line")
    return result


def load_maxtrain_config(config: str, overrides: list[str]):
    """The maxtrain Config, and its parameter count computed abstractly on the host CPU."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process never takes the accelerator from the children
    from maxtrain import load_config
    from maxtrain.config import ConfigError
    from maxtrain.models import param_count
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        raise BenchError(str(e)) from None
    return cfg, param_count(cfg)


def check_mappable(cfg) -> None:
    """Raises for maxtrain features this comparison does not translate to MaxText."""
    if cfg.model.name != "llama":
        raise BenchError(f"model.name={cfg.model.name!r}: only llama is translated to MaxText")
    if cfg.model.moe is not None:
        raise BenchError("model.moe is not mapped to MaxText's MoE settings; compare dense models")
    if cfg.model.sliding_window is not None:
        raise BenchError("model.sliding_window is not mapped to MaxText; compare full attention")
    if cfg.mesh.pipeline != 1:
        raise BenchError("mesh.pipeline other than 1 is not mapped to MaxText's pipeline settings")


def maxtext_settings(cfg, mesh: dict[str, int], n_devices: int, device_kind: str) -> tuple[dict, list[str]]:
    """MaxText config keys equivalent to `cfg` on `mesh`, and notes on what differs."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    notes = []
    micro = t.batch_size / (t.grad_accum * n_devices)  # MaxText: per device, per accumulation step
    hardware = "cpu" if device_kind == "cpu" else ("tpu" if "tpu" in device_kind.lower() else "gpu")
    s = {
        "decoder_block": "llama2", "vocab_size": m.vocab_size, "base_emb_dim": m.d_model,
        "base_num_decoder_layers": m.n_layers, "base_num_query_heads": m.n_heads,
        "base_num_kv_heads": m.n_kv_heads, "head_dim": m.head_dim, "base_mlp_dim": m.d_ff,
        "normalization_layer_epsilon": m.norm_eps, "rope_max_timescale": int(m.rope_theta),
        "logits_via_embedding": m.tie_embeddings, "scan_layers": True,
        "remat_policy": maxtext_remat(m), "attention": ATTENTION.get(m.attention, "dot_product"),
        "max_target_length": t.seq_len, "per_device_batch_size": micro,
        "gradient_accumulation_steps": t.grad_accum, "dtype": t.dtype, "weight_dtype": t.param_dtype,
        "z_loss_multiplier": t.z_loss, "dropout_rate": 0.0, "enable_dropout": False,
        "opt_type": "adamw", "learning_rate": o.lr, "adam_b1": o.b1, "adam_b2": o.b2, "adam_eps": o.eps,
        "adam_weight_decay": o.weight_decay, "gradient_clipping_threshold": o.clip_norm or 0.0,
        "steps": t.steps, "warmup_steps_fraction": min(o.warmup_steps / max(t.steps, 1), 1.0),
        "learning_rate_final_fraction": o.min_lr_ratio,
        "hardware": hardware, "dataset_type": "synthetic", "enable_checkpointing": False,
        "enable_tensorboard": False, "jax_cache_dir": "", "skip_jax_distributed_system": True,
    }
    for axis, key in MESH.items():
        s[key] = mesh.get(axis, 1)
    for key in ("dcn_data_parallelism", "dcn_fsdp_parallelism", "dcn_tensor_parallelism",
                "dcn_context_parallelism", "dcn_expert_parallelism", "dcn_pipeline_parallelism"):
        s[key] = 1
    if m.rope_scaling is not None:
        s["rope_type"] = "llama3.1"
        r = m.rope_scaling
        if (r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position) != MAXTEXT_LLAMA31_ROPE:
            notes.append(f"RoPE scaling: MaxText's llama3.1 RoPE fixes factor/low/high/original = "
                         f"{MAXTEXT_LLAMA31_ROPE}, maxtrain has {r.factor}/{r.low_freq_factor}/"
                         f"{r.high_freq_factor}/{r.original_max_position} (constants only, same cost)")
    if m.remat != "full":
        notes.append(f"remat: maxtrain {m.remat!r} -> MaxText {maxtext_remat(m)!r} (MaxText always remats a layer; "
                     f"it saves only named tensors, so norms/softmax are recomputed)")
    if m.attention not in ("xla", "ring_allgather"):
        notes.append(f"attention: maxtrain {m.attention!r} -> MaxText {s['attention']!r}")
    if t.cross_entropy != "xla":
        notes.append(f"cross entropy: maxtrain {t.cross_entropy!r}; MaxText computes full logits (num_vocab_tiling=1)")
    if t.dtype != "float32":
        notes.append("logits: maxtrain accumulates the output projection in float32; MaxText "
                     "(logits_dot_in_fp32=false) in the compute dtype")
    notes.append("data: maxtrain step.py uses the config's data source; MaxText its synthetic batches "
                 "(random tokens, one segment per row)")
    return s, notes


def find_maxtext_python(arg: str | None) -> str:
    """The MaxText interpreter from --maxtext-python or $MAXTEXT_PYTHON, checked to exist."""
    path = arg or os.environ.get("MAXTEXT_PYTHON")
    resolved = path and (shutil.which(path) or (path if os.path.isfile(path) else None))
    if not resolved:
        raise BenchError("MaxText interpreter not found; set MAXTEXT_PYTHON or pass --maxtext-python"
                         + (f" (got {path!r})" if path else ""))
    return resolved


def run_maxtext(python: str, settings: dict, extra: list[str], steps: int, log_path: str) -> dict:
    """Runs this file's MaxText driver in MaxText's interpreter; returns its JSON line."""
    env = {k: v for k, v in CHILD_ENV.items() if k != "PYTHONPATH"}  # our path is not MaxText's
    env.setdefault("DECOUPLE_GCLOUD", "TRUE")  # no Google Cloud clients needed (MaxText's own switch)
    args = [f"{k}={_cli_value(v)}" for k, v in settings.items()] + list(extra)
    cmd = [python, os.path.abspath(__file__), "--maxtext-driver", "--steps", str(steps), "--", *args]
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                              cwd=tempfile.gettempdir())
        log.write(proc.stdout)
    last = proc.stdout.strip().splitlines()[-1:] if proc.stdout else []
    if proc.returncode != 0 or not last or not last[0].startswith("{"):
        with open(log_path) as f:
            err = [ln for ln in f.read().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise BenchError(f"MaxText driver failed (exit {proc.returncode}; log {log_path}): {err[0]}")
    return json.loads(last[0])


def _cli_value(v) -> str:
    """A value as MaxText's OmegaConf command line reads it back."""
    if isinstance(v, str):
        return v if v else "''"
    return repr(v)


def mfu(flops_per_step: float, step_time_s: float, n_devices: int, peak: float | None) -> float | None:
    return flops_per_step / step_time_s / n_devices / 1e12 / peak if peak else None


def format_table(rows: list[tuple[str, dict]], tokens_per_step: int, flops: float, n_devices: int,
                 peak: float | None) -> str:
    """One line per framework: compile s, median step ms, memory MiB/device, tokens/s, MFU."""
    head = f"{'framework':<10} {'compile s':>9} {'step ms':>9} {'MiB/dev':>9} {'tokens/s':>10} {'MFU':>7}"
    lines = [head, "-" * len(head)]
    for name, r in rows:
        u = mfu(flops, r["step_time_s"], n_devices, peak)
        mem = r.get("memory_per_device_bytes")
        lines.append(f"{name:<10} {r['compile_s']:>9.2f} {1e3 * r['step_time_s']:>9.1f} "
                     f"{(mem / MIB if mem is not None else float('nan')):>9.1f} "
                     f"{tokens_per_step / r['step_time_s']:>10,.0f} {('n/a' if u is None else f'{100 * u:.1f}%'):>7}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="maxtrain KEY=VALUE overrides")
    p.add_argument("--steps", type=int, default=10, help="timed steps after 2 warm-up steps (both sides)")
    p.add_argument("--maxtext-python", help="MaxText's interpreter (default: $MAXTEXT_PYTHON)")
    p.add_argument("--maxtext-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra MaxText config key (wins over the translated ones); repeatable")
    p.add_argument("--log", help="MaxText driver log file (default: a temporary file)")
    args = p.parse_args(argv)
    try:
        python = find_maxtext_python(args.maxtext_python)
        cfg, n_params = load_maxtrain_config(args.config, args.overrides)
        check_mappable(cfg)
        ours = run_maxtrain(args.config, args.overrides, args.steps)
        settings, notes = maxtext_settings(cfg, ours["mesh"], ours["n_devices"], ours["device_kind"])
        log_path = args.log or tempfile.mkstemp(prefix="vs_maxtext_", suffix=".log")[1]
        theirs = run_maxtext(python, settings, args.maxtext_set, args.steps, log_path)
        tokens = cfg.train.batch_size * cfg.train.seq_len
        if theirs["global_batch"] != cfg.train.batch_size or theirs["seq_len"] != cfg.train.seq_len:
            raise BenchError(f"MaxText trains {theirs['global_batch']} x {theirs['seq_len']} tokens, "
                             f"maxtrain {cfg.train.batch_size} x {cfg.train.seq_len}")
        if theirs["params"] != n_params:
            raise BenchError(f"parameter counts differ: maxtrain {n_params:,}, MaxText {theirs['params']:,}")
    except BenchError as e:
        print(f"maxtrain: error: {e}", file=sys.stderr)
        return 2
    import jax
    from maxtrain.metrics import peak_tflops
    peak = peak_tflops(ours["device_kind"], cfg.train.peak_tflops)
    flops = ours["model_flops_per_step"]
    print(f"config {args.config} {' '.join(args.overrides)}")
    print(f"mesh {ours['mesh']} on {ours['n_devices']} x {ours['device_kind']}  |  MaxText mesh {theirs['mesh']}")
    print(f"params {n_params:,} (both)  |  global batch {cfg.train.batch_size} x {cfg.train.seq_len} tokens  |  "
          f"median of {args.steps} steps after 2 warm-up")
    print(f"jax: maxtrain {jax.__version__}, MaxText {theirs['maxtext']} on jax {theirs['jax']}")
    print(f"model FLOPs/step {flops:.4g} (maxtrain's, used for MFU)  |  "
          f"MaxText's own estimate {theirs['model_flops_per_step']:.4g}")
    print()
    print(format_table([("maxtrain", ours), ("MaxText", theirs)], tokens, flops, ours["n_devices"], peak))
    print()
    mb = theirs["memory_breakdown"]
    print("MaxText memory/device MiB: " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in mb.items()))
    print(f"MaxText settings: remat_policy={settings['remat_policy']} attention={settings['attention']} "
          f"dtype={settings['dtype']} (log: {log_path})")
    for n in notes:
        print(f"note: {n}")
    print(json.dumps({"params": n_params, "maxtrain": ours, "maxtext": theirs, "maxtext_settings": settings}))
    return 0


# ------------------------------------------------------------------ MaxText side (MaxText's interpreter)

def maxtext_driver(argv: list[str]) -> int:
    """Compiles and times MaxText's own train step for MaxText KEY=VALUE settings; prints one JSON line.

    Runs inside MaxText's venv: imports only MaxText and its dependencies.
    """
    p = argparse.ArgumentParser(prog="vs_maxtext.py --maxtext-driver")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("settings", nargs="*")
    args = p.parse_args(argv)

    import jax
    from flax import nnx
    from flax.linen import partitioning as nn_partitioning
    import maxtext
    from maxtext.trainers.pre_train import train
    from maxtext.utils import max_utils, maxtext_utils, sharding, train_utils

    base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    out_dir = tempfile.mkdtemp(prefix="vs_maxtext_run_")
    cli = ["train.py", base_yml, "run_name=vs_maxtext", f"base_output_directory={out_dir}", *args.settings]
    config, recorder = train.initialize(cli)
    (_, _, state_mesh_shardings, _, mesh, _, _, _, _, _, train_state) = train_utils.setup_train_loop(config, recorder)
    _, params, _ = nnx.split(train_state.model, nnx.Param, ...)
    n_params = int(max_utils.calculate_num_params_from_pytree(params))
    jit_model, state = nnx.split(train_state)
    params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_mesh_shardings)
    p_train_step, _ = train_utils.jit_train_and_eval_step(
        config, jit_model, mesh, state, state_mesh_shardings, train.train_step, params_shardings=params_shardings)

    with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
        shaped_batch = maxtext_utils.get_shaped_batch(
            config, batch_sharding=sharding.get_input_data_sharding(config, mesh))
        t0 = time.perf_counter()
        compiled = p_train_step.lower(state, shaped_batch).compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        times, metrics = [], None
        for i in range(args.steps + 2):
            batch = train.make_synthetic_batch(config, shaped_batch, seed=i)
            jax.block_until_ready(batch)
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
            if i >= 2:
                times.append(time.perf_counter() - t0)

    breakdown = None
    if mem is not None:
        breakdown = {"arguments": int(mem.argument_size_in_bytes), "outputs": int(mem.output_size_in_bytes),
                     "temporaries": int(mem.temp_size_in_bytes), "aliased": int(mem.alias_size_in_bytes)}
        breakdown["total"] = (breakdown["arguments"] + breakdown["outputs"] + breakdown["temporaries"]
                              - breakdown["aliased"])
    tflops_per_device, _, _ = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
    step_time = statistics.median(times)
    print(json.dumps({
        "compile_s": round(compile_s, 3),
        "step_time_s": step_time,
        "tokens_per_s": config.global_batch_size_to_train_on * config.max_target_length / step_time,
        "memory_per_device_bytes": breakdown["total"] if breakdown else None,
        "memory_breakdown": breakdown,
        "model_flops_per_step": float(tflops_per_device) * 1e12 * jax.device_count(),
        "params": n_params,
        "global_batch": int(config.global_batch_size_to_train_on),
        "seq_len": int(config.max_target_length),
        "mesh": {k: int(v) for k, v in mesh.shape.items() if v > 1},
        "loss": float(metrics["scalar"]["learning/loss"]),
        "jax": jax.__version__,
        "maxtext": _maxtext_version(),
    }), flush=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    return 0


def _maxtext_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("maxtext")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    if sys.argv[1:2] == ["--maxtext-driver"]:
        sys.exit(maxtext_driver([a for a in sys.argv[2:] if a != "--"]))
    sys.exit(main())
