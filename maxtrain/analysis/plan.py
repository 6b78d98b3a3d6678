"""`maxtrain plan`: the parallelism for N devices, chosen from compiled programs.

For a config's model, global batch and sequence length (kept fixed), `candidates` enumerates the
layouts worth considering: meshes over data, fsdp, tensor (within a host, dividing the KV heads),
pipeline (dividing the layer stack, when the model supports it) and expert (MoE), remat policies,
gradient accumulation and, with a pipeline, microbatches. `plan` then

1. drops the candidates that cannot fit by `memory_bytes`: the exact sharded parameters and
   optimizer state, their gradients, the saved activations (`activation_bytes`) and the transient
   peak of one layer's backward, the gathered weights and the loss's logits (`working_bytes`);
2. orders the rest by `estimate_s`, a quick analytic step time (compute at the peak with the
   remat policy's recomputation and the pipeline's bubble; tensor-parallel, FSDP, data-parallel
   and stage traffic over NVLink or the network, partly hidden), the best of each kind of layout
   (tensor size or pipelined, remat policy) first;
3. compiles the `top` first for the target (more, up to twice as many, while none of them fits),
   then, for a layout over memory that predicts a better step than all that fit, its best sibling
   whose estimate, corrected by the compiled/estimated ratio, fits (`_refits`), and the layout as
   configured for comparison; ranks them by the schedule model's predicted
   step (`maxtrain.analysis.schedule`: exposed communication counted), keeping only those whose
   compiled memory fits.

Left out of the search: `model.remat=none`, context parallelism (`sequence`, which needs `model.attention=ring`),
the pipeline schedules other than 1F1B, circular repeats, FP8, `sharding.*` rules (the config's
are kept), and data parallelism across replicas beyond what fsdp x data already covers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
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


def _tensor_splits_length(cfg, c: Candidate) -> bool:
    """Whether the residual stream between blocks is split over `tensor` too (Megatron's sequence
    parallelism, `sharding.activations.length` naming `tensor`). Not inside a pipeline's stages: as
    compiled (70B, 64 H100s, pipeline=4 fsdp=2 tensor=4) a stage's memory is that of a residual
    kept whole over the tensor group."""
    if c.sizes["pipeline"] > 1:
        return False
    rule = cfg.sharding.activations.get("length")
    return "tensor" in (rule if isinstance(rule, (list, tuple)) else [rule])


def _tokens_per_microbatch(cfg, c: Candidate) -> float:
    """Tokens one replica (a data x fsdp x expert index) runs per microbatch."""
    s, t = c.sizes, cfg.train
    replicas = s["data"] * s["fsdp"] * s["expert"]
    return t.batch_size / c.grad_accum / replicas / (c.microbatches or 1) * t.seq_len


def activation_bytes(cfg, c: Candidate) -> float:
    """Saved activations per device (an estimate, bf16): per layer and token, what the remat policy
    keeps (full: the layer's input; save_dots: that, its projections' outputs and the attention
    output; none: those and the attention and MLP intermediates; the d_model-wide ones split over
    tensor only under sequence parallelism, the others always), for the tokens of one microbatch,
    times the layers of one stage and, with a 1F1B pipeline, the microbatches a stage holds at once."""
    m, s = cfg.model, c.sizes
    tp = s["tensor"]
    residual = m.d_model / (tp if _tensor_splits_length(cfg, c) else 1)
    qkv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
    d_ff = m.d_ff * (m.moe.top_k if m.moe is not None else 1)
    inner = (qkv + m.n_heads * m.head_dim + 3 * d_ff) / tp  # q, k, v, attention output, gate, up, h
    per_token = {"full": residual, "save_dots": 3 * residual + inner, "none": 4 * residual + 2 * inner}[c.remat]
    layers = m.n_layers / s["pipeline"]
    in_flight = min(s["pipeline"], c.microbatches or 1)
    return 2.0 * per_token * _tokens_per_microbatch(cfg, c) * layers * in_flight


def working_bytes(cfg, c: Candidate, layer_params: float) -> float:
    """The transient peak on top of the state and the saved activations (an estimate): one layer's
    backward (its recomputed intermediates and their gradients in bf16, the gathered input and the
    residual's float32 gradient), the gathered weights of the layers in flight (bf16, two with
    FSDP's prefetch, and one layer's float32 gradient before its reduce-scatter), and the float32
    logits and their gradient of a quarter of the microbatch's tokens (the one-pass loss's chunk).
    In a pipeline the whole stage's weights are gathered at once."""
    m, s = cfg.model, c.sizes
    tp = s["tensor"]
    tokens = _tokens_per_microbatch(cfg, c)
    qkv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
    d_ff = m.d_ff * (m.moe.top_k if m.moe is not None else 1)
    layer = tokens * (2 * 2 * (qkv + m.n_heads * m.head_dim + 3 * d_ff) / tp + (2 + 4 + 4) * m.d_model)
    if s["pipeline"] > 1:  # a stage's weights are gathered and cast to bf16 once per tick, all its layers
        weights = layer_params * m.n_layers / s["pipeline"] / tp / s["expert"] * 2
    else:
        weights = layer_params / tp / s["expert"] * ((2 * 2 + 4) if s["fsdp"] > 1 else 2)
    logits = tokens / 4 * m.vocab_size / tp * 4 * 2
    return layer + weights + logits


def memory_bytes(cfg, c: Candidate, params_bytes: int, opt_bytes: int, n_params: int) -> float:
    """Memory per device (an estimate): the exact sharded parameters and optimizer state, their
    gradients (the parameters' size), the saved activations and the transient working set."""
    m = cfg.model
    embeddings = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    layer_params = max(n_params - embeddings, 0) / m.n_layers
    return 2 * params_bytes + opt_bytes + activation_bytes(cfg, c) + working_bytes(cfg, c, layer_params)


def _crosses_hosts(sizes: dict, axis: str, per_host: int) -> bool:
    """Whether a mesh axis's groups span hosts (axes are laid out tensor innermost, data outermost)."""
    order = ("data", "pipeline", "fsdp", "expert", "sequence", "tensor")
    inner = 1
    for a in order[order.index(axis) + 1:]:
        inner *= sizes[a]
    return sizes[axis] * inner > per_host


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What `estimate_s` knows of the devices (`maxtrain.devices` figures for a GPU)."""
    peak_flops: float
    link_bytes_s: float  # within a host
    network_bytes_s: float  # between hosts, per device
    latency_s: float = 0.0  # one collective's fixed cost
    per_host: int = 8

    @classmethod
    def of(cls, device, peak_tflops: float | None, per_host: int) -> "Hardware":
        from maxtrain.devices import device_figures

        f = device_figures(device.device_kind)
        if f is None:  # fake CPU devices: no figures; the order is what matters
            return cls((peak_tflops or 1.0) * 1e12, 100e9, 100e9, 0.0, per_host)
        return cls((peak_tflops or f.peak_bf16_tflops) * 1e12, f.link_bytes_s, f.network_bytes_s,
                   f.link_latency_s, per_host)


def estimate_s(cfg, c: Candidate, flops_per_device: float, n_params: int, hw: Hardware) -> float:
    """A quick step time to order candidates before compiling (module docstring): compute (the
    model's FLOPs at the peak times the remat policy's recomputation, over the 1F1B pipeline's
    busy share); tensor-parallel traffic (the residual stream gathered and reduce-scattered, or
    all-reduced, twice per layer and pass), a third of it exposed; FSDP's weight gathers (bf16,
    forward and backward) and float32 gradient reduce-scatters once per microbatch, or per
    pipeline tick inside a pipeline, and data parallelism's gradient all-reduce, hidden behind
    compute up to three quarters of it; one activation per microbatch and stage boundary. Inside
    a pipeline the tensor traffic counts whole (as compiled, it is not hidden there). Every
    tensor-parallel collective also pays the latency of one, exposed: at small sizes that decides."""
    m, t, s = cfg.model, cfg.train, c.sizes
    link_bytes_s, network, per_host = hw.link_bytes_s, hw.network_bytes_s, hw.per_host
    busy, passes = 1.0, c.grad_accum
    if s["pipeline"] > 1:
        mb = c.microbatches or s["pipeline"]
        busy = mb / (mb + s["pipeline"] - 1)
        passes = c.grad_accum * (mb + s["pipeline"] - 1)
    compute = flops_per_device * RECOMPUTE[c.remat] / hw.peak_flops / busy
    tp = s["tensor"]
    replica_tokens = t.batch_size * t.seq_len / (s["data"] * s["fsdp"] * s["expert"])
    layer_passes = 4 if c.remat == "full" else 3  # forward, the recomputed forward, backward (x2)
    tp_bytes = 0.0 if tp == 1 else (4 * layer_passes * m.n_layers / s["pipeline"] * replica_tokens * m.d_model * 2
                                    * (tp - 1) / tp)
    tp_s = tp_bytes / (network if _crosses_hosts(s, "tensor", per_host) else link_bytes_s)
    tp_latency = 0.0 if tp == 1 else 4 * layer_passes * m.n_layers / s["pipeline"] * passes * hw.latency_s
    shard = n_params / (tp * s["pipeline"])  # the parameters one fsdp group gathers
    fsdp_s = 0.0
    if s["fsdp"] > 1:
        fsdp_s = passes * shard * (2 + 2 + 4) * (s["fsdp"] - 1) / s["fsdp"] / (
            network if _crosses_hosts(s, "fsdp", per_host) else link_bytes_s)
    dp_s = 0.0
    if s["data"] > 1:
        dp_s = 2 * shard / s["fsdp"] * 4 * (s["data"] - 1) / s["data"] / (
            network if _crosses_hosts(s, "data", per_host) else link_bytes_s)
    stage_s = 0.0
    if s["pipeline"] > 1:
        micro = _tokens_per_microbatch(cfg, c) * m.d_model * 2 / (tp if _tensor_splits_length(cfg, c) else 1)
        stage_s = 2 * passes * micro / (network if _crosses_hosts(s, "pipeline", per_host) else link_bytes_s)
    hidden = fsdp_s + dp_s
    exposed = max(hidden - 0.75 * compute, 0.1 * hidden)
    # inside a pipeline's stages (a shard_map) the tensor collectives compile synchronous
    return compute + (tp_s if s["pipeline"] > 1 else tp_s / 3) + tp_latency + exposed + stage_s


def plan(config_path: str, overrides: list[str], devices, *, top: int = 6, per_host: int = 8, progress=None,
         compile_all: bool = False, remats=REMATS, configured: bool = True) -> dict:
    """The search (module docstring) for the config at `config_path` with `overrides` on `devices`
    (real, fake CPU or described GPUs). Returns {"rows": compiled candidates, those that fit best
    first, "best": the best that fits or None, "configured": the config's own layout compiled (with
    `configured`; not a candidate: its figures are the baseline the pick is compared with),
    "considered", "kept" (fit the estimates), "compiled", "ranked_by" ("schedule model" on GPUs,
    "estimate" elsewhere), "seconds"}."""
    import jax

    from maxtrain import models
    from maxtrain.config import ConfigError, load_config
    from maxtrain.step import make_setup, memory_per_device, state_bytes_by_phase

    t0 = time.perf_counter()
    say = progress or (lambda line: None)
    cfg = load_config(config_path, overrides)  # its warnings once; the layouts' below are the same
    n = len(devices)
    model = models.get(cfg.model.name)
    limit, _ = memory_per_device(devices[0])
    hw = Hardware.of(devices[0], cfg.train.peak_tflops, per_host)
    every = candidates(cfg, n, per_host, "pipeline" in model.supports, remats)
    say(f"{len(every)} layouts of {n} devices to consider")
    kept, n_params = [], None
    with _quiet():
        for c in every:
            try:
                trial = load_config(config_path, [*overrides, *c.overrides()])
                setup = make_setup(trial, devices)
            except ConfigError:
                continue  # a layout the config cannot take (divisibility, the model's own checks)
            _, params, opt = max(state_bytes_by_phase(setup), key=lambda p: p[1] + p[2])  # the largest phase
            if n_params is None:
                n_params = int(sum(x.size for x in jax.tree.leaves(setup.abstract_state.params)))
            mem = memory_bytes(trial, c, params, opt, n_params)
            if limit and mem > limit:
                continue
            kept.append((estimate_s(trial, c, setup.flops_per_step / n, n_params, hw), c, trial, mem))
    kept = _diverse_first(kept)
    chosen = kept if compile_all else kept[:2 * top]  # beyond `top` only while nothing compiled fits
    total = len(chosen) if compile_all else min(top, len(kept))
    say(f"{len(kept)} fit the memory estimate; compiling {total}" + (" and the layout as configured" * configured))
    base = None
    if configured:
        with _quiet():
            base = _compiled_row(cfg, devices, limit, None, _configured_label(cfg, devices), [])
        say(f"[{base['layout']}] {_row_text(base)}")
    rows, done = [], set()

    def compile_one(est, c, trial, mem, tag):
        with _quiet():
            row = {**_compiled_row(trial, devices, limit, est, c.label(), c.overrides()), "memory_estimate_bytes": mem,
                   "kind": _kind(c)}
        rows.append(row)
        done.add(c)
        say(f"[{tag}] {c.label()}: {_row_text(row)}")

    for i, (est, c, trial, mem) in enumerate(chosen):
        if not compile_all and i >= top and any(r.get("fits") for r in rows):
            break
        compile_one(est, c, trial, mem, f"{i + 1}/{total}")
    if not compile_all and limit:
        for j, (est, c, trial, mem) in enumerate(_refits(rows, kept, done, limit, top // 2)):
            compile_one(est, c, trial, mem, f"refit {j + 1}")
    by_model = any(r.get("predicted_step_s") for r in rows)
    good = sorted((r for r in rows if r.get("fits")),
                  key=lambda r: (r["predicted_step_s"] if by_model else r["estimate_s"]) or float("inf"))
    best = good[0] if good else None
    if base is not None and base.get("fits") and (best is None or _better(base, best, by_model)):
        best = base  # the layout as configured already beats every candidate compiled: keep it
        say(f"the layout as configured predicts the best step of those compiled: {base['layout']}")
    return {"rows": good + [r for r in rows if not r.get("fits")], "best": best,
            "configured": base, "considered": len(every), "kept": len(kept), "compiled": len(rows),
            "ranked_by": "schedule model" if by_model else "estimate", "seconds": time.perf_counter() - t0}


def _kind(c: Candidate) -> tuple:
    """A kind of layout: its tensor size (or pipelined) and its remat policy."""
    s = c.sizes
    return (s["tensor"] if s["pipeline"] == 1 else "pipelined", c.remat)


def _refits(rows: list[dict], kept: list, done: set, limit: int, most: int) -> list:
    """Candidates to compile after the first: for each compiled layout over memory that predicts a
    better step than every one that fits (best first), the best-estimated layout of its kind not
    yet compiled whose memory estimate, corrected by that layout's compiled/estimated ratio, fits
    (its sibling with more accumulation or more FSDP, typically). At most `most`."""
    def key(r):
        return r.get("predicted_step_s") or r.get("estimate_s") or float("inf")

    best_fit = min((key(r) for r in rows if r.get("fits")), default=float("inf"))
    over = sorted((r for r in rows if not r.get("fits") and r.get("memory_bytes") and key(r) < best_fit), key=key)
    out = []
    for r in over if most > 0 else []:
        ratio = r["memory_bytes"] / r["memory_estimate_bytes"]
        sibling = next((item for item in sorted(kept, key=lambda x: x[0])
                        if item[1] not in done and item not in out and _kind(item[1]) == r["kind"]
                        and item[3] * ratio <= limit), None)
        if sibling is not None:
            out.append(sibling)
        if len(out) >= most:
            break
    return out


def _better(a: dict, b: dict, by_model: bool) -> bool:
    """Whether row `a` predicts a shorter step than row `b` (the schedule model's, else compiled memory)."""
    if by_model:
        return (a.get("predicted_step_s") or float("inf")) < (b.get("predicted_step_s") or float("inf"))
    return False  # without the schedule model a configured row has no estimate to compare


def _compiled_row(trial, devices, limit, est, label: str, overrides: list[str]) -> dict:
    """One layout compiled for `devices`: its memory (compiled) and the schedule model's figures; a
    layout XLA refuses is a row with its error, not the end of the plan."""
    from maxtrain.analysis.inspect import inspect_step

    t1 = time.perf_counter()
    try:
        r = inspect_step(trial, devices)
    except Exception as e:
        return {"layout": label, "overrides": overrides, "error": str(e).splitlines()[0][:200], "fits": False}
    mem = r["memory_per_device"]["total"] if r["memory_per_device"] else None
    sched, roof = r.get("schedule"), r.get("roofline")
    return {"layout": label, "overrides": overrides, "estimate_s": est, "memory_bytes": mem,
            "fits": bool(mem is not None and (not limit or mem <= limit)),
            "predicted_step_s": sched["predicted_step_s"] if sched else None,
            "exposed_collective_s": sched["exposed_collective_s"] if sched else None,
            "predicted_mfu": sched["predicted_mfu"] if sched else None,
            "bound_s": roof["step_s"] if roof else None, "compile_s": time.perf_counter() - t1}


def _configured_label(cfg, devices) -> str:
    """The config's own layout as a plan row names one (`mesh.*` resolved for these devices)."""
    from maxtrain.mesh import build_mesh

    try:
        shape = dict(build_mesh(cfg.mesh, devices).shape)
    except Exception:  # a mesh that does not divide the devices: the row's error says so
        shape = {}
    mesh = " ".join(f"{k}={v}" for k, v in shape.items() if v > 1) or "one device"
    extra = f" accum={cfg.train.grad_accum}" if cfg.train.grad_accum > 1 else ""
    return f"as configured: {mesh} remat={cfg.model.remat}{extra}"


@contextlib.contextmanager
def _quiet():
    """maxtrain's log at errors only: every layout's config and compile would repeat the same lines."""
    log = logging.getLogger("maxtrain")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _diverse_first(kept: list) -> list:
    """The candidates by estimate, but first the best of each kind of layout (its tensor size, or
    pipelined, and its remat policy), so that the compiled few do not all share one blind spot of
    the estimate."""
    kept = sorted(kept, key=lambda x: x[0])
    firsts, seen = [], set()
    for item in kept:
        kind = _kind(item[1])
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
    if r.get("estimate_s") is None:
        return f"{gib}{fits}" if "error" not in r else f"error: {r['error']}"
    return f"{gib}{fits}, estimate {1e3 * r['estimate_s']:,.1f} ms"


def plan_yaml(config_path: str, best: dict, out_path: str, overrides: list[str] = ()) -> str:
    """A config that `maxtrain train` reads: `base:` the planned config, the `overrides` the plan was
    given (the batch and length it planned for, among others), the best layout over both."""
    import yaml

    from maxtrain.config import set_dotted, parse_override

    base = os.path.relpath(os.path.abspath(config_path), os.path.dirname(os.path.abspath(out_path)))
    tree: dict = {"base": base}
    for o in [*overrides, *best["overrides"]]:
        set_dotted(tree, *parse_override(o))
    return f"# maxtrain plan: {best['layout']}\n" + yaml.safe_dump(tree, sort_keys=False)


def print_table(result: dict, file=sys.stdout) -> None:
    print(f"{'layout':64s} {'GiB/dev':>8s} {'predicted ms':>13s} {'exposed ms':>11s} {'MFU':>6s}  "
          f"(memory: compiled; predicted, exposed, MFU: the schedule model; ranked by {result['ranked_by']})",
          file=file)
    for r in ([result["configured"]] if result.get("configured") else []) + result["rows"]:
        if "error" in r:
            print(f"{r['layout']:64s} error: {r['error']}", file=file)
            continue
        gib = r["memory_bytes"] / 2**30 if r.get("memory_bytes") else float("nan")
        pred = f"{1e3 * r['predicted_step_s']:,.1f}" if r.get("predicted_step_s") else "-"
        exp = f"{1e3 * r['exposed_collective_s']:,.1f}" if r.get("exposed_collective_s") is not None else "-"
        mfu = f"{100 * r['predicted_mfu']:.1f}%" if r.get("predicted_mfu") else "-"
        print(f"{r['layout']:64s} {gib:8.1f} {pred:>13s} {exp:>11s} {mfu:>6s}{'' if r['fits'] else '  does not fit'}",
              file=file)
