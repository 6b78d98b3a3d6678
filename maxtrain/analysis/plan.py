"""`maxtrain plan`: the parallelism for N devices, chosen from compiled programs.

For a config's model, global batch and sequence length (kept fixed), `candidates` enumerates the
layouts worth considering: meshes over data, fsdp, tensor (within a host, dividing the KV heads),
pipeline (dividing the layer stack, when the model supports it) and expert (MoE), remat policies,
gradient accumulation and, with a pipeline, microbatches. `plan` then

1. drops the candidates whose train state cannot fit (exact, from the abstract sharded state) or
   whose saved activations cannot (`activation_bytes`, an estimate with slack);
2. orders the rest by `estimate_s`, a quick analytic step time (model FLOPs at the peak, times the
   remat policy's recomputation, over the pipeline's busy share, plus the tensor-parallel traffic),
   the best of each kind of layout (tensor size, pipelined or not, remat policy) first;
3. compiles the `top` first for the target (more, up to twice as many, while none of them fits)
   and ranks them by the schedule model's predicted step (`maxtrain.analysis.schedule`: exposed
   communication counted), keeping only those whose compiled memory fits.

Left out of the search: `model.remat=none`, context parallelism (`sequence`, which needs `model.attention=ring`),
the pipeline schedules other than 1F1B, circular repeats, FP8, and data parallelism across
replicas beyond what fsdp x data already covers.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time

REMATS = ("full", "save_dots")  # `none` rarely fits at scale and its memory is the hardest to estimate
RECOMPUTE = {"full": 4 / 3, "save_dots": 1.05, "none": 1.0}  # forward+backward FLOPs over 3x forward


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: tuple[tuple[str, int], ...]  # (axis, size) for every axis
    remat: str
    grad_accum: int = 1
    microbatches: int | None = None  # pipeline only

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    def overrides(self) -> list[str]:
        out = [f"mesh.{k}={v}" for k, v in self.mesh] + [f"model.remat={self.remat}",
                                                         f"train.grad_accum={self.grad_accum}"]
        if self.microbatches is not None:
            out += [f"train.microbatches={self.microbatches}", "train.pipeline_schedule=1f1b"]
        return out

    def label(self) -> str:
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh if v > 1) or "one device"
        extra = f" accum={self.grad_accum}" if self.grad_accum > 1 else ""
        extra += f" micro={self.microbatches}" if self.microbatches else ""
        return f"{mesh} remat={self.remat}{extra}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg, n: int, per_host: int, supports_pipeline: bool, remats=REMATS) -> list[Candidate]:
    """Every layout of `n` devices the search considers for `cfg` (module docstring)."""
    m, t = cfg.model, cfg.train
    experts = m.moe.num_experts if m.moe is not None else 1
    tensors = [d for d in _divisors(min(per_host, n)) if m.n_kv_heads % d == 0 and m.n_heads % d == 0]
    pipes = [d for d in _divisors(n) if d <= 16 and m.stack_length() % d == 0] if supports_pipeline else [1]
    out = []
    for tensor, pipe in itertools.product(tensors, pipes):
        for expert in [d for d in _divisors(n // (tensor * pipe)) if experts % d == 0] if n % (tensor * pipe) == 0 else []:
            rest = n // (tensor * pipe * expert)
            for fsdp in _divisors(rest):
                data = rest // fsdp
                replicas = data * fsdp * expert  # the batch axes
                for accum in (1, 2, 4, 8, 16, 32, 64):
                    if t.batch_size % (accum * replicas):
                        continue
                    micro_options = [None]
                    if pipe > 1:
                        per_step = t.batch_size // accum
                        micro_options = [mb for mb in (pipe, 2 * pipe, 4 * pipe) if per_step % (mb * replicas) == 0]
                    mesh = (("data", data), ("pipeline", pipe), ("fsdp", fsdp), ("expert", expert),
                            ("sequence", 1), ("tensor", tensor))
                    for remat, micro in itertools.product(remats, micro_options):
                        out.append(Candidate(mesh, remat, accum, micro))
    return out


def activation_bytes(cfg, c: Candidate) -> float:
    """Saved activations per device (an estimate, bf16): per layer and token, what the remat policy
    keeps (full: the layer's input; save_dots: its projections' outputs; none: those and the
    attention and MLP intermediates), for the tokens of one microbatch on one device, times the
    layers of one stage and, with a 1F1B pipeline, the microbatches a stage holds at once."""
    m, t, s = cfg.model, cfg.train, c.sizes
    replicas = s["data"] * s["fsdp"] * s["expert"]
    seqs = t.batch_size / c.grad_accum / replicas / (c.microbatches or 1)
    tokens = seqs * t.seq_len / s["tensor"]  # the residual stream is split over tensor (sequence parallel)
    qkv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
    d_ff = m.d_ff * (m.moe.top_k if m.moe is not None else 1)
    per_token = {"full": m.d_model,
                 "save_dots": m.d_model + (qkv + m.d_model + 3 * d_ff + m.n_heads * m.head_dim) / 1,
                 "none": 3 * m.d_model + 2 * (qkv + 3 * d_ff + m.n_heads * m.head_dim)}[c.remat]
    layers = m.n_layers / s["pipeline"]
    in_flight = min(s["pipeline"], c.microbatches or 1)
    return 2.0 * per_token * tokens * layers * in_flight


def estimate_s(cfg, c: Candidate, flops_per_device: float, peak_flops: float, link_bytes_s: float) -> float:
    """A quick step time to order candidates before compiling: the model's FLOPs at the peak times
    the remat policy's recomputation, over the 1F1B pipeline's busy share, plus the tensor-parallel
    gathers and reduce-scatters of the residual stream (4 per layer forward and backward)."""
    m, t, s = cfg.model, cfg.train, c.sizes
    busy = 1.0
    if s["pipeline"] > 1:
        mb = c.microbatches or s["pipeline"]
        busy = mb / (mb + s["pipeline"] - 1)
    compute = flops_per_device * RECOMPUTE[c.remat] / peak_flops / busy
    tokens = t.batch_size * t.seq_len / (s["data"] * s["fsdp"] * s["expert"] * s["pipeline"])
    tp = s["tensor"]
    comm = 0.0 if tp == 1 else 8 * m.n_layers / s["pipeline"] * 2 * tokens * m.d_model * (tp - 1) / tp / link_bytes_s
    return compute + comm


def plan(config_path: str, overrides: list[str], devices, *, top: int = 6, per_host: int = 8, progress=None,
         compile_all: bool = False, remats=REMATS) -> dict:
    """The search (module docstring) for the config at `config_path` with `overrides` on `devices`
    (real, fake CPU or described GPUs). Returns {"rows": compiled candidates, those that fit best
    first, "best": the best that fits or None, "considered", "kept" (fit the estimates), "compiled",
    "ranked_by" ("schedule model" on GPUs, "estimate" elsewhere), "seconds"}."""
    from maxtrain import models
    from maxtrain.analysis.inspect import inspect_step
    from maxtrain.config import ConfigError, load_config
    from maxtrain.devices import device_figures
    from maxtrain.step import make_setup, memory_per_device, state_bytes_per_device

    t0 = time.perf_counter()
    say = progress or (lambda line: None)
    cfg = load_config(config_path, overrides)
    n = len(devices)
    model = models.get(cfg.model.name)
    limit, _ = memory_per_device(devices[0])
    figures = device_figures(devices[0].device_kind)
    peak = (cfg.train.peak_tflops or (figures.peak_bf16_tflops if figures else 1.0)) * 1e12
    link = figures.link_bytes_s if figures else 100e9
    every = candidates(cfg, n, per_host, "pipeline" in model.supports, remats)
    say(f"{len(every)} layouts of {n} devices to consider")
    kept = []
    for c in every:
        try:
            trial = load_config(config_path, [*overrides, *c.overrides()])
            setup = make_setup(trial, devices)
        except ConfigError:
            continue  # a layout the config cannot take (divisibility, the model's own checks)
        params, opt = state_bytes_per_device(setup)
        if limit and params + opt + activation_bytes(trial, c) > 1.1 * limit:
            continue
        kept.append((estimate_s(trial, c, setup.flops_per_step / n, peak, link), c, trial))
    kept = _diverse_first(kept)
    chosen = kept if compile_all else kept[:2 * top]  # beyond `top` only while nothing compiled fits
    total = len(chosen) if compile_all else min(top, len(kept))
    say(f"{len(kept)} fit the memory estimate; compiling {total}")
    rows = []
    for i, (est, c, trial) in enumerate(chosen):
        if not compile_all and i >= top and any(r.get("fits") for r in rows):
            break
        t1 = time.perf_counter()
        try:
            r = inspect_step(trial, devices)
        except Exception as e:  # a layout XLA refuses is a row, not the end of the plan
            rows.append({"layout": c.label(), "overrides": c.overrides(), "error": str(e).splitlines()[0][:200],
                         "fits": False})
            say(f"[{i + 1}/{total}] {c.label()}: error {rows[-1]['error']}")
            continue
        mem = r["memory_per_device"]["total"] if r["memory_per_device"] else None
        sched, roof = r.get("schedule"), r.get("roofline")
        row = {"layout": c.label(), "overrides": c.overrides(), "estimate_s": est, "memory_bytes": mem,
               "fits": bool(mem is not None and (not limit or mem <= limit)),
               "predicted_step_s": sched["predicted_step_s"] if sched else None,
               "exposed_collective_s": sched["exposed_collective_s"] if sched else None,
               "predicted_mfu": sched["predicted_mfu"] if sched else None,
               "bound_s": roof["step_s"] if roof else None, "compile_s": time.perf_counter() - t1}
        rows.append(row)
        say(f"[{i + 1}/{total}] {c.label()}: {_row_text(row)}")
    by_model = any(r.get("predicted_step_s") for r in rows)
    good = sorted((r for r in rows if r.get("fits")),
                  key=lambda r: r["predicted_step_s"] if by_model else r["estimate_s"])
    return {"rows": good + [r for r in rows if not r.get("fits")], "best": good[0] if good else None,
            "considered": len(every), "kept": len(kept), "compiled": len(rows),
            "ranked_by": "schedule model" if by_model else "estimate", "seconds": time.perf_counter() - t0}


def _diverse_first(kept: list) -> list:
    """The candidates by estimate, but first the best of each kind of layout (tensor size, pipelined
    or not, remat policy), so that the compiled few do not all share one blind spot of the estimate
    (it knows the tensor-parallel traffic and the pipeline bubble, not FSDP's or the stages')."""
    kept = sorted(kept, key=lambda x: x[0])
    firsts, seen = [], set()
    for item in kept:
        s = item[1].sizes
        kind = (s["tensor"], s["pipeline"] > 1, item[1].remat)
        if kind not in seen:
            seen.add(kind)
            firsts.append(item)
    return firsts + [item for item in kept if item not in firsts]


def _row_text(r: dict) -> str:
    gib = f"{r['memory_bytes'] / 2**30:.1f} GiB" if r.get("memory_bytes") else "? GiB"
    fits = "" if r["fits"] else " (does not fit)"
    if r.get("predicted_step_s"):
        return (f"{gib}{fits}, predicted {1e3 * r['predicted_step_s']:,.1f} ms (exposed "
                f"{1e3 * r['exposed_collective_s']:,.1f} ms), MFU ~ {100 * r['predicted_mfu']:.1f}%")
    return f"{gib}{fits}, estimate {1e3 * r['estimate_s']:,.1f} ms"


def plan_yaml(config_path: str, best: dict, out_path: str) -> str:
    """A config that `maxtrain train` reads: `base:` the planned config, the best layout over it."""
    lines = [f"# maxtrain plan: {best['layout']}",
             f"base: {os.path.relpath(os.path.abspath(config_path), os.path.dirname(os.path.abspath(out_path)))}"]
    tree: dict = {}
    for o in best["overrides"]:
        key, value = o.split("=", 1)
        section, name = key.split(".", 1)
        tree.setdefault(section, {})[name] = value
    for section, values in tree.items():
        lines.append(f"{section}:")
        lines += [f"  {k}: {v}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def print_table(result: dict, file=sys.stdout) -> None:
    print(f"{'layout':58s} {'GiB/dev':>8s} {'predicted ms':>13s} {'exposed ms':>11s} {'MFU':>6s}  "
          f"(memory: compiled; predicted, exposed, MFU: the schedule model; ranked by {result['ranked_by']})",
          file=file)
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['layout']:58s} error: {r['error']}", file=file)
            continue
        gib = r["memory_bytes"] / 2**30 if r.get("memory_bytes") else float("nan")
        pred = f"{1e3 * r['predicted_step_s']:,.1f}" if r.get("predicted_step_s") else "-"
        exp = f"{1e3 * r['exposed_collective_s']:,.1f}" if r.get("exposed_collective_s") is not None else "-"
        mfu = f"{100 * r['predicted_mfu']:.1f}%" if r.get("predicted_mfu") else "-"
        print(f"{r['layout']:58s} {gib:8.1f} {pred:>13s} {exp:>11s} {mfu:>6s}{'' if r['fits'] else '  does not fit'}",
              file=file)
