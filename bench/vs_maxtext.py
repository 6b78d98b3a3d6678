"""maxtrain against MaxText on the same Llama, mesh and batch, stepped in alternation: time, CPU time, memory.

    bash bench/maxtext_env.sh            # once: MaxText 0.2.5 in a Python 3.12 venv, on maxtrain's jax
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/vs_maxtext.py --cases all

    python bench/vs_maxtext.py CONFIG [KEY=VALUE ...] [--pairs N] [--warmup-pairs N] \\
        [--maxtext-python PATH] [--maxtext-set KEY=VALUE ...] [--log-dir DIR]

Both sides run as long-lived workers, each compiled once and then stepping on command: maxtrain's in
this interpreter (its own `compile_train_step`, state and batches), MaxText's in MaxText's
interpreter (--maxtext-python, $MAXTEXT_PYTHON, or the venv `bench/maxtext_env.sh` makes), where
this same file builds MaxText's config with `pyconfig` through `train.initialize`, its state with
`train_utils.setup_train_loop` (synthetic data), jits its own `train.train_step` with
`train_utils.jit_train_and_eval_step` and compiles it ahead of time. No MaxText code is copied here,
only called. The driver alternates the two step by step, A B B A A B B A ... (A maxtrain, B
MaxText), so both see the same machine load; each step replies its wall seconds and its process's
CPU seconds (all threads). Reported per side: median wall and CPU seconds per step; between them the
ratio of medians and the median of the per-pair ratios (each adjacent A/B pair, with its quartiles),
and compiled memory per device (arguments + temporaries).

The maxtrain config is translated to MaxText keys (`maxtext_settings`): llama dims, sequence
length, global batch, dtypes, remat policy, attention, optimizer and mesh (maxtrain's
data/fsdp/tensor/sequence/expert axes -> MaxText's ici_*_parallelism). What cannot be matched
exactly is printed under the table. Both sides count parameters and the global batch; a mismatch
is an error. `--cases` runs the rows of the comparison in docs/performance.md (`CASES`): the
comparator Llama (46.4M parameters) on fsdp=8 in float32 and in bf16, on fsdp=4 x tensor=2, and
with each side's defaults (only model, batch and length set on either side).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHILD_ENV = dict(os.environ)  # as started: this process later hides accelerators from itself
MIB = 2**20
# where bench/maxtext_env.sh puts MaxText's venv unless told otherwise
DEFAULT_MAXTEXT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "maxtrain", "maxtext-venv")

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
             "cudnn": "cudnn_flash_jax", "flash": "cudnn_flash_jax", "flash_mosaic": "cudnn_flash_jax"}
# maxtrain mesh axis -> MaxText ICI parallelism key (maxtrain's sequence axis is context parallelism)
MESH = {"data": "ici_data_parallelism", "fsdp": "ici_fsdp_parallelism", "tensor": "ici_tensor_parallelism",
        "sequence": "ici_context_parallelism", "expert": "ici_expert_parallelism",
        "pipeline": "ici_pipeline_parallelism"}
# the Llama-3.1 RoPE scaling MaxText implements (fixed in its LLaMARotaryEmbedding)
MAXTEXT_LLAMA31_ROPE = (8.0, 1.0, 4.0, 8192)


class BenchError(Exception):
    """A one-line reason the comparison cannot run."""


# ------------------------------------------------------------------ the cases of docs/performance.md

# the comparator: a 46.4M-parameter Llama (untied 32000-token embeddings, 4 layers of 512/1536, no GQA)
COMPARATOR = ("model.vocab_size=32000", "model.d_model=512", "model.n_layers=4", "model.n_heads=8",
              "model.n_kv_heads=8", "model.d_ff=1536", "train.seq_len=512", "train.batch_size=8")
MATCHED = ("data.kind=synthetic", "model.attention=xla", "model.remat=full", "mesh.data=1")
F32 = ("train.dtype=float32", "train.param_dtype=float32")


class Case(NamedTuple):
    title: str
    config: str | None  # None: maxtrain's built-in defaults
    overrides: tuple[str, ...]
    defaults: bool = False  # MaxText too keeps its defaults: only model, batch and length are set
    maxtext_set: tuple[str, ...] = ()  # MaxText keys over the translated ones (as --maxtext-set)


CASES = {
    "fsdp8-f32": Case("fsdp=8, float32", "configs/tiny.yaml", COMPARATOR + MATCHED + ("mesh.fsdp=8",) + F32),
    "fsdp8-bf16": Case("fsdp=8, bf16 activations, f32 params", "configs/tiny.yaml",
                       COMPARATOR + MATCHED + ("mesh.fsdp=8", "train.dtype=bfloat16", "train.param_dtype=float32")),
    "fsdp4-tp2-f32": Case("fsdp=4 x tensor=2, float32", "configs/tiny.yaml",
                          COMPARATOR + MATCHED + ("mesh.fsdp=4", "mesh.tensor=2") + F32),
    "defaults": Case("each side's defaults (only model, batch, length set)", None, COMPARATOR, defaults=True),
    # each side's fastest remat (not in `all`): maxtrain saves everything, MaxText its fastest documented
    # policy, "minimal_with_context" (every named projection and the attention context)
    "fsdp8-f32-noremat": Case("fsdp=8, float32, no remat (MaxText: minimal_with_context)", "configs/tiny.yaml",
                              COMPARATOR + MATCHED + ("mesh.fsdp=8", "model.remat=none") + F32),
    "fsdp8-bf16-noremat": Case("fsdp=8, bf16, no remat (MaxText: minimal_with_context)", "configs/tiny.yaml",
                               COMPARATOR + MATCHED + ("mesh.fsdp=8", "model.remat=none", "train.dtype=bfloat16",
                                                       "train.param_dtype=float32")),
    # each side's fastest policy on the 2-core test machine (docs/performance.md): maxtrain saves the
    # projections' outputs, MaxText every named projection and the attention context
    "fsdp8-f32-best": Case("fsdp=8, float32, each side's fastest remat (save_dots / minimal_with_context)",
                           "configs/tiny.yaml", COMPARATOR + MATCHED + ("mesh.fsdp=8", "model.remat=save_dots") + F32,
                           maxtext_set=("remat_policy=minimal_with_context",)),
    "fsdp8-bf16-best": Case("fsdp=8, bf16, each side's fastest remat (save_dots / minimal_with_context)",
                            "configs/tiny.yaml", COMPARATOR + MATCHED + (
                                "mesh.fsdp=8", "model.remat=save_dots", "train.dtype=bfloat16",
                                "train.param_dtype=float32"),
                            maxtext_set=("remat_policy=minimal_with_context",)),
}
TABLE = ("fsdp8-f32", "fsdp8-bf16", "fsdp4-tp2-f32", "defaults")  # `--cases all`: the table's rows


def select_cases(spec: str) -> list[str]:
    """`all` (the table's rows) or comma-separated names of CASES, in the order given."""
    names = list(TABLE) if spec == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        raise BenchError(f"--cases {spec!r}: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose all or some of {', '.join(CASES)}")
    return names


# ------------------------------------------------------------------ interleaving and its statistics

def abba_order(n_pairs: int) -> list[str]:
    """The side of each of 2 * n_pairs steps, A B B A A B B A ...: every adjacent pair holds one step of
    each, and each side goes first in half the pairs (so neither always runs after the other)."""
    return ["AB"[(i + 1) // 2 % 2] for i in range(2 * n_pairs)]


def pair_ratios(run: list[tuple[str, float]]) -> list[float]:
    """A/B of each adjacent pair of steps (0-1, 2-3, ...) of `run`, a list of (side, value) in the order run."""
    if len(run) % 2:
        raise ValueError(f"an odd number of steps ({len(run)}) has no pairs")
    out = []
    for (s1, v1), (s2, v2) in zip(run[::2], run[1::2]):
        if {s1, s2} != {"A", "B"}:
            raise ValueError(f"a pair must hold one step of each side, got {s1}{s2}")
        a, b = (v1, v2) if s1 == "A" else (v2, v1)
        out.append(a / b)
    return out


def summarize(run: list[tuple[str, float]]) -> dict:
    """Medians of each side, their ratio A/B, and the median (with quartiles) of the per-pair ratios."""
    a = [v for s, v in run if s == "A"]
    b = [v for s, v in run if s == "B"]
    ratios = pair_ratios(run)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"a": statistics.median(a), "b": statistics.median(b),
            "ratio_of_medians": statistics.median(a) / statistics.median(b),
            "median_pair_ratio": statistics.median(ratios), "pair_ratio_q1": q1, "pair_ratio_q3": q3,
            "pairs": len(ratios)}


# ------------------------------------------------------------------ the translation

def load_maxtrain_config(config: str | None, overrides: list[str]):
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


def _hardware(device_kind: str) -> str:
    return "cpu" if device_kind == "cpu" else ("tpu" if "tpu" in device_kind.lower() else "gpu")


# what every MaxText run here needs, whatever is compared: no checkpoints, logs or cloud services
MAXTEXT_RUN = {"dataset_type": "synthetic", "enable_checkpointing": False, "enable_tensorboard": False,
               "jax_cache_dir": "", "skip_jax_distributed_system": True}


def maxtext_shape_settings(cfg, n_devices: int) -> dict:
    """MaxText keys for the model, global batch and sequence length of `cfg`: nothing else."""
    m, t = cfg.model, cfg.train
    return {
        "decoder_block": "llama2", "vocab_size": m.vocab_size, "base_emb_dim": m.d_model,
        "base_num_decoder_layers": m.n_layers, "base_num_query_heads": m.n_heads,
        "base_num_kv_heads": m.n_kv_heads, "head_dim": m.head_dim, "base_mlp_dim": m.d_ff,
        "normalization_layer_epsilon": m.norm_eps, "rope_max_timescale": int(m.rope_theta),
        "logits_via_embedding": m.tie_embeddings, "max_target_length": t.seq_len,
        # MaxText: per device, per accumulation step
        "per_device_batch_size": t.batch_size / (t.grad_accum * n_devices),
    }


def maxtext_default_settings(cfg, n_devices: int, device_kind: str) -> dict:
    """MaxText on its own defaults (mesh, dtypes, remat, attention, optimizer) for the model, batch and
    length of `cfg`: the "each side's defaults" row."""
    return {**maxtext_shape_settings(cfg, n_devices), "hardware": _hardware(device_kind), **MAXTEXT_RUN}


def maxtext_settings(cfg, mesh: dict[str, int], n_devices: int, device_kind: str) -> tuple[dict, list[str]]:
    """MaxText config keys equivalent to `cfg` on `mesh`, and notes on what differs."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    if m.attention == "auto":  # what maxtrain runs there (maxtrain.layers.attention.auto_attention)
        m = dataclasses.replace(m, attention="flash_mosaic" if _hardware(device_kind) == "gpu" else "xla")
    notes = []
    s = {
        **maxtext_shape_settings(cfg, n_devices), "scan_layers": True,
        "remat_policy": maxtext_remat(m), "attention": ATTENTION.get(m.attention, "dot_product"),
        "gradient_accumulation_steps": t.grad_accum, "dtype": t.dtype, "weight_dtype": t.param_dtype,
        "z_loss_multiplier": t.z_loss, "dropout_rate": 0.0, "enable_dropout": False,
        "opt_type": "adamw", "learning_rate": o.lr, "adam_b1": o.b1, "adam_b2": o.b2, "adam_eps": o.eps,
        "adam_weight_decay": o.weight_decay, "gradient_clipping_threshold": o.clip_norm or 0.0,
        "steps": t.steps, "warmup_steps_fraction": min(o.warmup_steps / max(t.steps, 1), 1.0),
        "learning_rate_final_fraction": o.min_lr_ratio,
        "hardware": _hardware(device_kind), **MAXTEXT_RUN,
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
    notes.append("data: maxtrain uses the config's data source; MaxText its synthetic batches "
                 "(random tokens, one segment per row)")
    return s, notes


# ------------------------------------------------------------------ the driver (this interpreter)

def find_maxtext_python(arg: str | None) -> str:
    """MaxText's interpreter: --maxtext-python, $MAXTEXT_PYTHON, else bench/maxtext_env.sh's venv."""
    path = arg or os.environ.get("MAXTEXT_PYTHON")
    if not path:
        venv = os.environ.get("MAXTEXT_VENV") or DEFAULT_MAXTEXT_VENV
        default = os.path.join(venv, "bin", "python")
        if os.path.isfile(default):
            return default
    resolved = path and (shutil.which(path) or (path if os.path.isfile(path) else None))
    if not resolved:
        raise BenchError("MaxText interpreter not found; run `bash bench/maxtext_env.sh`, or set MAXTEXT_PYTHON "
                         "or pass --maxtext-python" + (f" (got {path!r})" if path else ""))
    return resolved


class Worker:
    """One side as a child process that compiles once, then runs one step per `step()` (a line protocol:
    the child's first line is {"ready": figures}; each "step" is answered by one JSON line)."""

    def __init__(self, name: str, cmd: list[str], env: dict, log_path: str, cwd: str | None = None):
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env, cwd=cwd, bufsize=1)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            self._log.flush()
            with open(self.log_path) as f:
                last = [ln for ln in f.read().splitlines() if ln.strip()][-1:] or ["(no output)"]
            raise BenchError(f"{self.name} worker exited ({rc}; log {self.log_path}): {last[0]}")
        msg = json.loads(line)
        if "error" in msg:
            raise BenchError(f"{self.name} worker: {msg['error']} (log {self.log_path})")
        return msg

    def ready(self) -> dict:
        return self._read()["ready"]

    def step(self) -> dict:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self._read()

    def profile(self, directory: str, steps: int) -> dict:
        """`steps` more steps under jax.profiler, written to `directory` (a Perfetto trace)."""
        self.proc.stdin.write(f"profile {steps} {directory}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def interleave(a: Worker, b: Worker, pairs: int, warmup_pairs: int, progress=None) -> list[dict]:
    """Steps the two workers A B B A ...; returns the timed steps (after the warm-up pairs) in order,
    each {"side": "A"|"B", "wall_s", "cpu_s", "loss"}."""
    run = []
    for i, side in enumerate(abba_order(warmup_pairs + pairs)):
        r = (a if side == "A" else b).step()
        if i >= 2 * warmup_pairs:
            run.append({"side": side, **r})
        if progress:
            progress(i, side, r)
    return run


def run_case(name: str, case: Case, python: str, pairs: int, warmup_pairs: int, extra: list[str],
             log_dir: str, profile_dir: str | None = None, profile_steps: int = 2) -> dict:
    """One row: both workers up, the params and batch checked equal, then the interleaved steps; with
    `profile_dir`, then `profile_steps` more steps of each side (one side at a time) traced into
    profile_dir/NAME.maxtrain and profile_dir/NAME.maxtext, each summarised by bench/trace_summary.py."""
    config = None if case.config is None else os.path.join(ROOT, case.config)  # CASES: relative to the repo
    cfg, n_params = load_maxtrain_config(config, list(case.overrides))
    check_mappable(cfg)
    cmd = [sys.executable, os.path.abspath(__file__), "--maxtrain-worker",
           *(["--config", config] if config else []), "--", *case.overrides]
    a = Worker("maxtrain", cmd, CHILD_ENV, os.path.join(log_dir, f"{name}.maxtrain.log"), cwd=ROOT)
    b = None
    try:
        ours = a.ready()
        if case.defaults:
            settings, notes = maxtext_default_settings(cfg, ours["n_devices"], ours["device_kind"]), []
        else:
            settings, notes = maxtext_settings(cfg, ours["mesh"], ours["n_devices"], ours["device_kind"])
        env = {k: v for k, v in CHILD_ENV.items() if k != "PYTHONPATH"}  # our path is not MaxText's
        env.setdefault("DECOUPLE_GCLOUD", "TRUE")  # no Google Cloud clients needed (MaxText's own switch)
        args = [f"{k}={_cli_value(v)}" for k, v in settings.items()] + list(case.maxtext_set) + list(extra)
        b = Worker("MaxText", [python, os.path.abspath(__file__), "--maxtext-worker", "--", *args], env,
                   os.path.join(log_dir, f"{name}.maxtext.log"), cwd=tempfile.gettempdir())
        theirs = b.ready()
        if theirs["global_batch"] != cfg.train.batch_size or theirs["seq_len"] != cfg.train.seq_len:
            raise BenchError(f"MaxText trains {theirs['global_batch']} x {theirs['seq_len']} tokens, "
                             f"maxtrain {cfg.train.batch_size} x {cfg.train.seq_len}")
        if theirs["params"] != n_params:
            raise BenchError(f"parameter counts differ: maxtrain {n_params:,}, MaxText {theirs['params']:,}")
        if theirs["jax"] != ours["jax"]:
            notes.append(f"jax differs: maxtrain {ours['jax']}, MaxText {theirs['jax']} (bench/maxtext_env.sh "
                         f"installs maxtrain's)")

        def progress(i, side, r):
            print(f"  {name} step {i + 1:>3}/{2 * (warmup_pairs + pairs)} {'maxtrain' if side == 'A' else 'MaxText ':<8} "
                  f"wall {r['wall_s']:.3f} s  cpu {r['cpu_s']:.2f} s  loss {r['loss']:.4f}", file=sys.stderr, flush=True)

        run = interleave(a, b, pairs, warmup_pairs, progress)
        profiles = {}
        if profile_dir:
            for side, worker in (("maxtrain", a), ("maxtext", b)):
                path = os.path.abspath(os.path.join(profile_dir, f"{name}.{side}"))
                worker.profile(path, profile_steps)
                profiles[side] = path
    finally:
        a.close()
        if b is not None:
            b.close()
    return {"case": name, "title": case.title, "config": case.config, "overrides": list(case.overrides),
            "params": n_params, "tokens_per_step": cfg.train.batch_size * cfg.train.seq_len,
            "maxtrain": ours, "maxtext": theirs, "maxtext_settings": settings, "notes": notes,
            "wall": summarize([(r["side"], r["wall_s"]) for r in run]),
            "cpu": summarize([(r["side"], r["cpu_s"]) for r in run]), "steps": run,
            "profiles": profiles, "profile_steps": profile_steps}


def maxtrain_revision() -> str:
    """maxtrain's commit, and the files under maxtrain/ that differ from it (they change what is measured)."""
    def git(*a):
        return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True).stdout
    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    dirty = [ln[3:] for ln in git("status", "--porcelain", "--", "maxtrain", "kernels").splitlines() if ln.strip()]
    return head + (f" + uncommitted changes to {', '.join(dirty)}" if dirty else "")


def _cli_value(v) -> str:
    """A value as MaxText's OmegaConf command line reads it back."""
    if isinstance(v, str):
        return v if v else "''"
    return repr(v)


def format_profiles(r: dict, top: int = 30) -> str:
    """Both sides' traced steps by op category, side by side, then each side's most costly ops."""
    import importlib.util  # by path: bench/ on sys.path would put its scripts' names before packages
    spec = importlib.util.spec_from_file_location("trace_summary", os.path.join(HERE, "trace_summary.py"))
    trace_summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace_summary)
    n = max(r["profile_steps"], 1)
    sums = {}
    for side, path in r["profiles"].items():
        try:
            events = trace_summary.read_events(trace_summary.find_trace(path))
        except (OSError, ValueError) as e:  # FileNotFoundError included: the timed results still print
            return f"profile: {side}'s trace unreadable: {e}"
        s = trace_summary.summarize(events)
        if s:
            sums[side] = next(iter(s.values()))
    if len(sums) < 2:
        return "profile: no per-op events in the traces"
    ms = lambda us: us / 1e3 / n  # noqa: E731 - per step and device, milliseconds
    cats = sorted(set(sums["maxtrain"]["by_category"]) | set(sums["maxtext"]["by_category"]),
                  key=lambda c: -sums["maxtrain"]["by_category"].get(c, 0.0))
    lines = [f"== {r['case']}: op time per step and device, ms ({n} traced steps each; traces in "
             f"{os.path.dirname(r['profiles']['maxtrain'])})",
             f"{'category':<12} {'maxtrain':>9} {'MaxText':>9} {'ratio':>6}"]
    for c in cats + ["all"]:
        a = sums["maxtrain"]["kernel_us"] if c == "all" else sums["maxtrain"]["by_category"].get(c, 0.0)
        b = sums["maxtext"]["kernel_us"] if c == "all" else sums["maxtext"]["by_category"].get(c, 0.0)
        lines.append(f"{c:<12} {ms(a):9.1f} {ms(b):9.1f} {a / b if b else float('nan'):6.2f}")
    for side in ("maxtrain", "maxtext"):
        s = sums[side]
        lines.append(f"-- {side}: the {top} most costly ops (ms/step, runs/step)")
        for op, us in sorted(s["by_name"].items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {ms(us):8.2f} {s['runs'][op] // n:4d}  {op}")
    return "\n".join(lines)


def mem_mib(side: dict) -> tuple[float, float, float]:
    """Compiled MiB per device: arguments + temporaries, and each."""
    m = side["memory_breakdown"]
    return (m["arguments"] + m["temporaries"]) / MIB, m["arguments"] / MIB, m["temporaries"] / MIB


def format_case(r: dict) -> str:
    """The lines printed for one case: per side and the ratios."""
    w, c = r["wall"], r["cpu"]
    ours, theirs = r["maxtrain"], r["maxtext"]
    lines = [f"== {r['case']}: {r['title']}",
             f"params {r['params']:,} (both)  |  maxtrain mesh {ours['mesh']}, MaxText mesh {theirs['mesh']}  |  "
             f"jax {ours['jax']} / {theirs['jax']}, MaxText {theirs['maxtext']}  |  {w['pairs']} timed pairs (ABBA)"]
    head = (f"{'framework':<10} {'compile s':>9} {'step s':>8} {'CPU s/step':>10} {'MiB/dev':>8} {'(args':>7} "
            f"{'+ temp)':>8} {'tokens/s':>9} {'loss':>8} {'peak RSS MiB':>12}")
    lines += [head, "-" * len(head)]
    for name, side, wall, cpu in (("maxtrain", ours, w["a"], c["a"]), ("MaxText", theirs, w["b"], c["b"])):
        total, args, temp = mem_mib(side)
        last = [s for s in r["steps"] if s["side"] == ("A" if name == "maxtrain" else "B")][-1]
        rss = f"{last['max_rss_mib']:>12,.0f}" if "max_rss_mib" in last else f"{'n/a':>12}"
        lines.append(f"{name:<10} {side['compile_s']:>9.2f} {wall:>8.3f} {cpu:>10.2f} {total:>8.1f} {args:>7.1f} "
                     f"{temp:>8.1f} {r['tokens_per_step'] / wall:>9,.0f} {last['loss']:>8.4f} {rss}")
    mem = mem_mib(ours)[0] / mem_mib(theirs)[0]
    lines.append(f"maxtrain / MaxText: memory {mem:.3f}  |  wall: ratio of medians {w['ratio_of_medians']:.3f}, "
                 f"median pair ratio {w['median_pair_ratio']:.3f} (quartiles {w['pair_ratio_q1']:.3f}-"
                 f"{w['pair_ratio_q3']:.3f})  |  CPU: ratio of medians {c['ratio_of_medians']:.3f}, median pair "
                 f"ratio {c['median_pair_ratio']:.3f} ({c['pair_ratio_q1']:.3f}-{c['pair_ratio_q3']:.3f})")
    lines.append(f"maxtrain: remat={ours['remat']} dtype={ours['dtype']}  |  MaxText: remat_policy={theirs['remat']} "
                 f"dtype={theirs['dtype']} attention={theirs['attention']}"
                 + ("  (MaxText's defaults but model, batch, length)" if r["case"] == "defaults" else ""))
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def markdown_table(results: list[dict]) -> str:
    """The rows of docs/performance.md: memory, wall and CPU seconds per step, their ratios."""
    head = ("| case | maxtrain MiB/device (args + temp) | MaxText MiB/device (args + temp) | memory ratio | "
            "maxtrain s/step wall (CPU) | MaxText s/step wall (CPU) | wall: ratio of medians | "
            "wall: median pair ratio (quartiles) | CPU: ratio of medians | CPU: median pair ratio (quartiles) |")
    lines = [head, "|" + " --- |" * 10]
    for r in results:
        (ta, aa, pa), (tb, ab, pb) = mem_mib(r["maxtrain"]), mem_mib(r["maxtext"])
        w, c = r["wall"], r["cpu"]
        lines.append(f"| {r['title']} | {ta:.1f} ({aa:.1f} + {pa:.1f}) | {tb:.1f} ({ab:.1f} + {pb:.1f}) | "
                     f"{ta / tb:.2f} | {w['a']:.2f} ({c['a']:.1f}) | {w['b']:.2f} ({c['b']:.1f}) | "
                     f"{w['ratio_of_medians']:.2f} | {w['median_pair_ratio']:.2f} ({w['pair_ratio_q1']:.2f}-"
                     f"{w['pair_ratio_q3']:.2f}) | {c['ratio_of_medians']:.2f} | {c['median_pair_ratio']:.2f} "
                     f"({c['pair_ratio_q1']:.2f}-{c['pair_ratio_q3']:.2f}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", help="maxtrain config (or use --cases)")
    p.add_argument("overrides", nargs="*", help="maxtrain KEY=VALUE overrides")
    p.add_argument("--cases", help=f"run these rows instead of CONFIG: all ({', '.join(TABLE)}), or some of "
                                   f"{', '.join(CASES)}")
    p.add_argument("--pairs", type=int, default=8, help="timed A/B pairs, run A B B A ... (default 8)")
    p.add_argument("--warmup-pairs", type=int, default=1, help="untimed pairs first (default 1)")
    p.add_argument("--maxtext-python", help="MaxText's interpreter (default: $MAXTEXT_PYTHON, else "
                                            "bench/maxtext_env.sh's venv)")
    p.add_argument("--maxtext-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra MaxText config key (wins over the translated ones); repeatable")
    p.add_argument("--log-dir", help="the workers' logs (default: a temporary directory)")
    p.add_argument("--json", help="also write the results (every step) to this file")
    p.add_argument("--profile", metavar="DIR", help="after the timed pairs, trace --profile-steps more steps of "
                                                    "each side into DIR and print where each side's time goes, "
                                                    "by op category and by op (bench/trace_summary.py)")
    p.add_argument("--profile-steps", type=int, default=2)
    args = p.parse_args(argv)
    try:
        if args.cases and (args.config or args.overrides):
            raise BenchError("give either CONFIG [KEY=VALUE ...] or --cases, not both")
        if not args.cases and not args.config:
            raise BenchError("give a maxtrain CONFIG, or --cases all")
        if args.pairs < 1 or args.warmup_pairs < 0:
            raise BenchError("--pairs must be >= 1 and --warmup-pairs >= 0")
        names = select_cases(args.cases) if args.cases else ["config"]
        cases = {n: CASES[n] for n in names} if args.cases else {
            "config": Case(f"{args.config} {' '.join(args.overrides)}".strip(), os.path.abspath(args.config),
                           tuple(args.overrides))}
        python = find_maxtext_python(args.maxtext_python)
        log_dir = args.log_dir or tempfile.mkdtemp(prefix="vs_maxtext_")
        os.makedirs(log_dir, exist_ok=True)
        results = []
        revision = maxtrain_revision()
        print(f"maxtrain {revision}", flush=True)
        for name, case in cases.items():
            print(f"{name}: starting both workers (logs in {log_dir})", file=sys.stderr, flush=True)
            results.append(run_case(name, case, python, args.pairs, args.warmup_pairs, args.maxtext_set, log_dir,
                                    args.profile, args.profile_steps))
            results[-1]["maxtrain_revision"] = revision
            print(format_case(results[-1]))
            print(flush=True)
            if results[-1]["profiles"]:
                print(format_profiles(results[-1]), flush=True)
    except BenchError as e:
        print(f"maxtrain: error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps([{k: v for k, v in r.items() if k != "steps"} for r in results]))
    return 0


# ------------------------------------------------------------------ the workers

def _protocol_stream():
    """The real stdout, kept for protocol lines; fd 1 then points at stderr so that whatever the
    libraries print lands in the log, not in the protocol."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return out


def _serve(proto, step) -> None:
    """Answers each "step" line on stdin with one JSON line, and "profile N DIR" (N steps traced by
    jax.profiler into DIR) with one; ends at "quit" or end of input."""
    i = 0
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd.startswith("profile "):
            import jax
            _, n, directory = cmd.split(" ", 2)
            with jax.profiler.trace(directory, create_perfetto_trace=True):
                steps = [step(i + k) for k in range(int(n))]
            i += int(n)
            proto.write(json.dumps({"profiled": directory, "steps": steps}) + "\n")
            continue
        if cmd != "step":
            proto.write(json.dumps({"error": f"unknown command {cmd!r}"}) + "\n")
            continue
        proto.write(json.dumps(step(i)) + "\n")
        i += 1


def _timed(fn):
    """(result of fn(), wall seconds, CPU seconds of this process, all threads)."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def _max_rss_mib() -> float:
    """This process's peak resident memory (on a CPU backend the devices' buffers live there too)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(body) -> int:
    proto = _protocol_stream()
    try:
        body(proto)
    except Exception as e:  # reported to the driver in one line; the traceback goes to the log
        import traceback
        traceback.print_exc()
        proto.write(json.dumps({"error": f"{type(e).__name__}: {e}".splitlines()[0]}) + "\n")
        return 1
    return 0


def maxtrain_worker(argv: list[str]) -> int:
    """maxtrain's side: the config's compiled train step, stepped on command."""
    p = argparse.ArgumentParser(prog="vs_maxtext.py --maxtrain-worker")
    p.add_argument("--config")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    def body(proto):
        import jax

        from maxtrain import load_config
        from maxtrain.data import make_source
        from maxtrain.mesh import use_mesh
        from maxtrain.metrics import memory_breakdown
        from maxtrain.models import param_count
        from maxtrain.step import compile_train_step, init_state, make_setup, put_batch

        cfg = load_config(args.config, args.overrides)
        setup = make_setup(cfg)
        source = make_source(cfg)
        with use_mesh(setup.mesh):
            state = init_state(setup, cfg.seed)
            compiled, compile_s = compile_train_step(setup)
            proto.write(json.dumps({"ready": {
                "compile_s": round(compile_s, 3), "memory_breakdown": memory_breakdown(compiled),
                "model_flops_per_step": setup.flops_per_step, "params": param_count(cfg),
                "global_batch": cfg.train.batch_size, "seq_len": cfg.train.seq_len,
                "mesh": {k: int(v) for k, v in setup.mesh.shape.items() if v > 1},
                "n_devices": setup.mesh.size, "device_kind": jax.devices()[0].device_kind,
                "remat": cfg.model.remat, "dtype": cfg.train.dtype, "jax": jax.__version__}}) + "\n")
            holder = [state]

            def step(i):
                batch = put_batch(source.batch(i), setup.batch_sharding)
                jax.block_until_ready(batch)

                def run():
                    out = compiled(holder[0], batch)
                    return jax.block_until_ready(out)
                (holder[0], metrics), wall, cpu = _timed(run)
                return {"wall_s": wall, "cpu_s": cpu, "loss": float(metrics["loss"]), "max_rss_mib": _max_rss_mib()}

            _serve(proto, step)

    return _worker(body)


def maxtext_worker(argv: list[str]) -> int:
    """MaxText's side, in MaxText's venv (imports only MaxText and its dependencies): its own train
    step for MaxText KEY=VALUE settings, compiled ahead of time, stepped on command."""
    p = argparse.ArgumentParser(prog="vs_maxtext.py --maxtext-worker")
    p.add_argument("settings", nargs="*")
    args = p.parse_args(argv)

    def body(proto):
        import jax
        from flax import nnx
        from flax.linen import partitioning as nn_partitioning
        import maxtext
        from maxtext.trainers.pre_train import train
        from maxtext.utils import max_utils, maxtext_utils, sharding, train_utils

        base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
        out_dir = tempfile.mkdtemp(prefix="vs_maxtext_run_")
        try:
            cli = ["train.py", base_yml, "run_name=vs_maxtext", f"base_output_directory={out_dir}", *args.settings]
            config, recorder = train.initialize(cli)
            (_, _, state_mesh_shardings, _, mesh, _, _, _, _, _, train_state) = train_utils.setup_train_loop(
                config, recorder)
            _, params, _ = nnx.split(train_state.model, nnx.Param, ...)
            n_params = int(max_utils.calculate_num_params_from_pytree(params))
            jit_model, state = nnx.split(train_state)
            params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
                config, state_mesh_shardings)
            p_train_step, _ = train_utils.jit_train_and_eval_step(
                config, jit_model, mesh, state, state_mesh_shardings, train.train_step,
                params_shardings=params_shardings)
            with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
                shaped_batch = maxtext_utils.get_shaped_batch(
                    config, batch_sharding=sharding.get_input_data_sharding(config, mesh))
                t0 = time.perf_counter()
                compiled = p_train_step.lower(state, shaped_batch).compile()
                compile_s = time.perf_counter() - t0
                mem = compiled.memory_analysis()
                breakdown = {"arguments": int(mem.argument_size_in_bytes), "outputs": int(mem.output_size_in_bytes),
                             "temporaries": int(mem.temp_size_in_bytes), "aliased": int(mem.alias_size_in_bytes)}
                breakdown["total"] = (breakdown["arguments"] + breakdown["outputs"] + breakdown["temporaries"]
                                      - breakdown["aliased"])
                tflops_per_device, _, _ = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
                proto.write(json.dumps({"ready": {
                    "compile_s": round(compile_s, 3), "memory_breakdown": breakdown,
                    "model_flops_per_step": float(tflops_per_device) * 1e12 * jax.device_count(),
                    "params": n_params, "global_batch": int(config.global_batch_size_to_train_on),
                    "seq_len": int(config.max_target_length),
                    "mesh": {k: int(v) for k, v in mesh.shape.items() if v > 1},
                    "remat": config.remat_policy, "dtype": str(config.dtype), "attention": config.attention,
                    "jax": jax.__version__, "maxtext": _maxtext_version()}}) + "\n")
                holder = [state]

                def step(i):
                    batch = train.make_synthetic_batch(config, shaped_batch, seed=i)
                    jax.block_until_ready(batch)

                    def run():
                        return jax.block_until_ready(compiled(holder[0], batch))
                    (holder[0], metrics), wall, cpu = _timed(run)
                    return {"wall_s": wall, "cpu_s": cpu, "loss": float(metrics["scalar"]["learning/loss"]),
                            "max_rss_mib": _max_rss_mib()}

                _serve(proto, step)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)

    return _worker(body)


def _maxtext_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("maxtext")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    role = sys.argv[1:2]
    rest = [a for a in sys.argv[2:] if a != "--"]
    if role == ["--maxtrain-worker"]:
        sys.exit(maxtrain_worker(rest))
    if role == ["--maxtext-worker"]:
        sys.exit(maxtext_worker(rest))
    sys.exit(main())
