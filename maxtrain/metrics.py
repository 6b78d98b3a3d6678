"""FLOPs accounting, MFU, metric writers and the per-step progress display."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

from maxtrain.devices import device_figures

log = logging.getLogger("maxtrain")

def peak_tflops(device_kind: str, override: float | None = None) -> float | None:
    """Per-device peak for MFU: the config's `train.peak_tflops`, else the table
    (`maxtrain.devices`), else None."""
    if override:
        return override
    device = device_figures(device_kind)
    return device.peak_bf16_tflops if device else None


def throughput(step_time_s: float, tokens_per_step: int, flops_per_step: float, n_devices: int,
               peak: float | None) -> dict:
    """tokens/s, achieved model TFLOP/s per device and MFU for one step time."""
    tflops = flops_per_step / step_time_s / n_devices / 1e12
    return {
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_step / step_time_s,
        "tflops_per_device": tflops,
        "mfu": (tflops / peak) if peak else None,
    }


class JsonlWriter:
    """Appends one JSON object per line, flushed so a crash loses at most the current line."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._f = open(path, "a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible rather than null
    return v


def format_line(r: dict, total_steps: int) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
    line = (f"step {r['step']}/{total_steps} | loss {r['loss']:.4f} | grad_norm {r['grad_norm']:.3f} "
            f"| lr {r['lr']:.2e} | {r['tokens_per_s']:,.0f} tok/s | {r['step_time_s'] * 1e3:.1f} ms/step "
            f"| {r['tflops_per_device']:.3g} TFLOP/s/dev | mfu {mfu}")
    if r.get("data_wait_s"):
        line += f" | data wait {100 * r['data_wait_s'] / r['step_time_s']:.0f}%"
    if "eval_loss" in r:
        line += f" | eval_loss {r['eval_loss']:.4f} (ppl {r['eval_ppl']:.2f})"
    return line


class Progress:
    """A one-line progress bar on a terminal; silent when stderr is not a TTY."""

    def __init__(self, total: int, stream=None):
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self._start = time.perf_counter()

    def update(self, step: int, loss: float | None = None) -> None:
        if not self.enabled:
            return
        frac = step / max(self.total, 1)
        bar = "#" * int(30 * frac)
        elapsed = time.perf_counter() - self._start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        extra = f" loss {loss:.3f}" if loss is not None else ""
        self.stream.write(f"\r[{bar:<30}] {step}/{self.total}{extra} eta {eta:5.0f}s")
        self.stream.flush()

    def clear(self) -> None:
        """Erases the bar so a log line can take its place."""
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")


# ---------------------------------------------------------------- compiled-program accounting
# (the optimized HLO's collectives, custom calls and roofline: maxtrain.analysis.hlo)


def memory_breakdown(compiled) -> dict[str, int] | None:
    """Per-device bytes of the compiled program: arguments, outputs, temporaries, aliased, total."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
           "temporaries": int(m.temp_size_in_bytes), "aliased": int(m.alias_size_in_bytes)}
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    return out


def xla_flops(compiled) -> float | None:
    """FLOPs of one device's program as XLA's cost analysis counts them (a loop body once)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


# ---------------------------------------------------------------- where records go (process 0)

# record fields that describe speed rather than learning: one TensorBoard section for them
PERF_FIELDS = frozenset({"step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "data_wait_s", "ckpt_block_s",
                         "dispatch_s", "host_overhead_s", "pipeline_bubble"})


def numeric_fields(record: dict) -> dict[str, float]:
    """The record's numbers (bools as 0/1; nulls, strings and `step` left out) as floats; a list of
    numbers (a per-layer metric) as `KEY/0`, `KEY/1`, ..."""
    out = {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
    for k, v in record.items():
        if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            out.update({f"{k}/{i}": float(x) for i, x in enumerate(v)})
    return out


def tensorboard_tag(key: str) -> str:
    """TensorBoard section/name of a record field: the JSONL name, grouped by what it measures."""
    for prefix, section in (("eval_", "eval"), ("moe_", "moe"), ("mtp_", "train"), ("fp8_", "fp8"),
                            ("goodput", "goodput")):
        if key.startswith(prefix):
            return f"{section}/{key}"
    return f"{'perf' if key in PERF_FIELDS else 'train'}/{key}"


def _tensorboardx():
    """tensorboardX's (FileWriter, Summary proto, text summary), or None if it is not installed.

    tensorboardX imports torch at import time when torch is installed, only so that it can accept
    torch tensors (seconds of start-up and hundreds of MB per training process). We log Python
    floats, so torch is hidden while tensorboardX loads unless something already imported it."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError while this is in place
    try:
        from tensorboardX import FileWriter
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.summary import text
    except ImportError:
        return None
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return FileWriter, Summary, text


class MetricsSink:
    """Everywhere one metrics record goes on process 0: metrics.jsonl, TensorBoard scalars under
    run_dir/tb/, optionally Weights & Biases. The loop calls `write` once per logged record.

    A record's scalars go to TensorBoard as one event (one Summary holding every value, ~15x
    cheaper than a `add_scalar` per field), queued to tensorboardX's writer thread; a crash loses at
    most the last `flush_secs` of scalars, never JSONL lines.
    """

    def __init__(self, run_dir: str, tensorboard: bool = True, wandb: bool = False, wandb_project: str = "maxtrain",
                 config: dict | None = None, flush_secs: float = 10.0, run_id: str | None = None):
        self.jsonl = JsonlWriter(os.path.join(run_dir, "metrics.jsonl"))
        self.tb = None
        if tensorboard:
            tbx = _tensorboardx()
            if tbx is None:
                log.warning("tensorboardX is not installed: no TensorBoard scalars (pip install tensorboardX, "
                            "or set logging.tensorboard=false)")
            else:
                file_writer, self._summary, text = tbx
                self._text = text
                self.tb = file_writer(os.path.join(run_dir, "tb"), flush_secs=flush_secs)
                if config is not None:
                    import yaml

                    self.tb.add_summary(text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```"), 0)
                if run_id is not None:
                    self.tb.add_summary(text("run_id", run_id), 0)
        self.wandb = _wandb_run(run_dir, wandb_project, config) if wandb else None

    def write(self, record: dict) -> None:
        self.jsonl.write(record)
        values = numeric_fields(record)
        if self.tb is not None:
            value = self._summary.Value
            self.tb.add_summary(self._summary(value=[value(tag=tensorboard_tag(k), simple_value=v)
                                                     for k, v in values.items()]), record["step"])
            if isinstance(record.get("sample"), str):  # train.sample_every: the text under TEXT
                self.tb.add_summary(self._text("sample", record["sample"]), record["step"])
        if self.wandb is not None:
            self.wandb.log({tensorboard_tag(k): v for k, v in values.items()}, step=record["step"])

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(run_dir: str, project: str, config: dict | None):
    """A W&B run named after the run directory; resumes that run if the directory resumes."""
    import wandb

    name = os.path.basename(os.path.abspath(run_dir))
    return wandb.init(project=project, name=name, id=_wandb_id(run_dir), resume="allow", dir=run_dir, config=config)


def _wandb_id(run_dir: str) -> str:
    """The same W&B run id for every attempt of a run (kept in run_dir), so restarts continue one run."""
    path = os.path.join(run_dir, "wandb_id")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    import uuid

    run_id = uuid.uuid4().hex[:12]
    with open(path, "w") as f:
        f.write(run_id)
    return run_id


# ---------------------------------------------------------------- where the loop's time goes


class StepClock:
    """Host wall time between two records, split into what the loop did with it.

    The loop adds the seconds it waited for data, was blocked by checkpoint saves, spent in the
    call that dispatches the jitted step, and spent on other host work (batch assembly, metric
    fetch, writers, profiler). Whatever is left of the wall time is the host waiting on the
    device, i.e. the jitted step: with async dispatch, host work that overlaps the device's step
    costs nothing until it exceeds the step.
    """

    def __init__(self, step: int):
        self.t_last, self.last_step = time.perf_counter(), step
        self.data = self.ckpt = self.dispatch = self.host = 0.0

    def interval(self, step: int, now: float) -> dict:
        """The record fields for steps (last_step, step], ending at `now`; starts the next interval."""
        n = max(step - self.last_step, 1)
        out = {"step_time_s": (now - self.t_last) / n, "data_wait_s": self.data / n, "ckpt_block_s": self.ckpt,
               "dispatch_s": self.dispatch / n, "host_overhead_s": self.host / n}
        self.t_last, self.last_step = now, step
        self.data = self.ckpt = self.dispatch = self.host = 0.0
        return out

    def restart(self) -> None:
        """Time until now belongs to no step (evaluation)."""
        self.t_last = time.perf_counter()


def time_fractions(wall_s: float, dispatch_s: float, data_s: float, host_s: float, ckpt_s: float) -> dict[str, float]:
    """Fractions of wall time `wall_s` (all totals over the same steps): the jitted step is the rest."""
    wall = max(wall_s, 1e-12)
    parts = {"dispatch": dispatch_s / wall, "data": data_s / wall, "host": host_s / wall, "ckpt": ckpt_s / wall}
    return {"step": max(1.0 - sum(parts.values()), 0.0), **parts}


def record_time_totals(records: list[dict], first_step: int) -> tuple[float, float, float, float, float]:
    """(wall, dispatch, data, host, ckpt) seconds over consecutive records starting after `first_step`."""
    wall = dispatch = data = host = ckpt = 0.0
    prev = first_step
    for r in records:
        n, prev = r["step"] - prev, r["step"]
        wall += r.get("step_time_s", 0.0) * n
        dispatch += r.get("dispatch_s", 0.0) * n
        data += r.get("data_wait_s", 0.0) * n
        host += r.get("host_overhead_s", 0.0) * n
        ckpt += r.get("ckpt_block_s", 0.0)
    return wall, dispatch, data, host, ckpt


class TimeBreakdown:
    """Accumulates records into the step-time breakdown that the log shows every `every` steps
    (None: on every log line), over the steps since the previous breakdown."""

    def __init__(self, first_step: int, every: int | None):
        self.every, self.since = every, first_step
        self.records: list[dict] = []

    def add(self, record: dict) -> str | None:
        """Adds one record; returns the breakdown text when one is due, else None."""
        self.records.append(record)
        if self.every is not None and record["step"] - self.since < self.every:
            return None
        f = time_fractions(*record_time_totals(self.records, self.since))
        self.since, self.records = record["step"], []
        return "time: " + " ".join(f"{k} {100 * v:.0f}%" for k, v in f.items())


# ---------------------------------------------------------------- profiling


class ProfileWindow:
    """Traces steps [start_step, start_step + steps) of the loop (process 0 only).

    `tracer: jax` writes a jax.profiler trace (XPlane for TensorBoard's profile plugin / XProf, and
    a Perfetto JSON) to run_dir/profile/, then a device-memory profile (pprof) at the window's end;
    `tracer: nsys` brackets the window with cudaProfilerStart/Stop for
    `nsys profile --capture-range=cudaProfilerApi`. Every step in the window is a named step
    (StepTraceAnnotation) so the profilers can split the trace by step.
    """

    def __init__(self, cfg, run_dir: str, enabled: bool = True):
        self.cfg = cfg
        self.start = cfg.start_step if enabled else None
        self.last = (cfg.start_step or 0) + cfg.steps - 1
        self.dir = os.path.join(run_dir, "profile")
        self.active = False

    def run(self, step: int, fn, *args):
        """`fn(*args)` as `step` (the step count once it completes), traced if inside the window."""
        if self.start is None or not self.start <= step <= self.last:
            return fn(*args)
        if not self.active:
            self._begin(step)
        import jax

        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            out = fn(*args)
        if step == self.last:
            jax.block_until_ready(out)  # the trace must contain the device's work of the last step
            self.close()
        return out

    def _begin(self, step: int) -> None:
        import jax

        self.active = True
        if self.cfg.tracer == "nsys":
            _cuda_profiler("cudaProfilerStart")
        else:
            os.makedirs(self.dir, exist_ok=True)
            jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
        log.info("profiling steps %d-%d (%s)", step, self.last, self.cfg.tracer)

    def close(self) -> None:
        """Ends the window (also when the loop stops inside it)."""
        if not self.active:
            return
        import jax

        self.active = False
        if self.cfg.tracer == "nsys":
            _cuda_profiler("cudaProfilerStop")
            return
        jax.profiler.stop_trace()
        where = self.dir
        if self.cfg.memory_profile:
            path = os.path.join(self.dir, f"memory_step{self.last}.prof")
            jax.profiler.save_device_memory_profile(path)
            where += f" (memory: {os.path.basename(path)})"
        log.info("profile written to %s; see docs/profiling.md", where)


def _cuda_profiler(name: str) -> None:
    """cudaProfilerStart/Stop through the CUDA runtime that jax's CUDA plugin has loaded."""
    import ctypes

    for lib in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            rc = getattr(ctypes.CDLL(lib), name)()
        except OSError:
            continue
        if rc:
            log.warning("%s returned CUDA error %d", name, rc)
        return
    log.warning("profile.tracer=nsys: no CUDA runtime (libcudart) found; %s skipped", name)


def write_hlo(compiled, run_dir: str) -> str:
    """Writes the optimized HLO of a compiled step to run_dir/train_step.hlo.txt; returns the path."""
    path = os.path.join(run_dir, "train_step.hlo.txt")
    with open(path, "w") as f:
        f.write(compiled.as_text())
    return path
