"""The compiled step's schedule, simulated: how long it should take on its GPUs, and how much of its
communication the program leaves exposed.

The roofline (`maxtrain.analysis.hlo.roofline`) prices every kernel and collective but assumes every
collective hides behind compute. A scheduled GPU program (`compiled.as_text()`, `is_scheduled=true`)
says more: each computation lists its instructions in the order one compute stream runs them, and
an asynchronous collective is a `*-start` / `*-done` pair, in flight on its own stream between the
two. `predict` replays that order:

- one **compute stream** runs the kernels one after another, each at its roofline time (the larger
  of its FLOPs at the tensor-core peak and its HBM bytes at the memory bandwidth);
- one **collective stream** runs the collectives in the order they start, each for its link time
  (`hlo.wire_bytes` over NVLink within a host, over the network when its group spans hosts, per
  `maxtrain.devices`) plus a fixed latency; a collective starts when it is issued and the stream
  is free;
- a `*-done` waits for its collective: the compute stream idles until the collective ends, and
  that wait is the collective's **exposed** time. A synchronous collective (no start/done pair) is
  exposed whole. Only the kernels issued between a start and its done can hide it.
- a while loop runs its body (and condition) `known_trip_count` times, each iteration replayed
  on its own (XLA never lets a start and its done straddle computations); a called computation
  runs inline; a conditional runs each branch for its share of the times it runs (a pipeline
  schedule's switch, `Module.branch_shares`), else every branch, as the roofline counts them.

So `step_s = compute_s + exposed_s` exactly, and it is never below the roofline's bound of the same
program when nothing is exposed. What it cannot see: kernel launch gaps and the time between
kernels, kernels running below their roofline (cuBLAS reaches 80-90% of peak, elementwise
fusions less of the bandwidth), collectives contending with each other or with other jobs on the
network, stragglers, a loop's collectives delaying one its caller started before the loop, and
asynchronous copies or fusions overlapping compute (counted on the compute stream).
"""

from __future__ import annotations

import dataclasses

from maxtrain.analysis.hlo import Instruction, Module, Roofline, collective_kind, op_name, parse, replica_groups

# opcodes that end an asynchronous collective started earlier in the same computation
_DONES = {f"{kind}-done" for kind in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                                      "collective-permute")} | {"async-done", "send-done", "recv-done"}


@dataclasses.dataclass(frozen=True)
class Exposure:
    """One collective instruction's time on the critical path, per step."""
    name: str
    kind: str  # all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute
    op: str  # where in the model (`hlo.op_name`: fwd/bwd and the op_name's tail)
    runs: float  # per step
    seconds: float  # exposed per step (all runs)
    of_s: float  # the collective's own time per step (all runs)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The schedule model's step: `step_s = compute_s + exposed_s`."""
    step_s: float
    compute_s: float  # kernels on the compute stream
    collective_s: float  # every collective's link time plus latency, per step
    exposed_s: float  # the compute stream waiting on collectives
    exposures: tuple[Exposure, ...]  # exposed collectives, most exposed first
    peak_flops: float

    def mfu(self, model_flops_per_device: float) -> float:
        return model_flops_per_device / (self.step_s * self.peak_flops) if self.step_s else 0.0

    def exposed_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.exposures:
            out[e.kind] = out.get(e.kind, 0.0) + e.seconds
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def summary(self, model_flops_per_device: float | None = None, top: int = 8) -> dict:
        return {
            "predicted_step_s": self.step_s,
            "compute_s": self.compute_s,
            "collective_s": self.collective_s,
            "exposed_collective_s": self.exposed_s,
            "exposed_share": self.exposed_s / self.step_s if self.step_s else 0.0,
            "predicted_mfu": None if model_flops_per_device is None else self.mfu(model_flops_per_device),
            "exposed_by_kind_s": self.exposed_by_kind(),
            "exposed": [dataclasses.asdict(e) for e in self.exposures[:top]],
        }


@dataclasses.dataclass
class _Span:
    """One run of a computation: its duration on the compute stream and what it contains."""
    duration: float = 0.0
    compute: float = 0.0
    exposed: float = 0.0
    collective: float = 0.0
    by: dict = dataclasses.field(default_factory=dict)  # collective name -> [exposed, own time] per run

    def add(self, other: "_Span", times: float) -> None:
        self.duration += times * other.duration
        self.compute += times * other.compute
        self.exposed += times * other.exposed
        self.collective += times * other.collective
        for name, (exposed, own) in other.by.items():
            row = self.by.setdefault(name, [0.0, 0.0])
            row[0] += times * exposed
            row[1] += times * own


def collective_latency_s(inst: Instruction, *, devices_per_host: int, link_latency_s: float,
                         network_latency_s: float) -> float:
    """The fixed cost of one collective: the network's when its group spans hosts, NVLink's else."""
    spans = any(len({d // devices_per_host for d in g}) > 1 for g in replica_groups(inst))
    return network_latency_s if spans else link_latency_s


def simulate(module: Module, seconds: dict[str, float], *, collective_latency=None) -> _Span:
    """Replays the entry computation (see the module docstring). `seconds`: each kernel's and each
    collective's time per run by instruction name (instructions not in it take no time; a
    collective's entry is its `*-start` or its synchronous instruction); `collective_latency(inst)`
    adds a fixed cost to each collective (None: none)."""
    memo: dict[str, _Span] = {}

    def run(comp: str, depth: int) -> _Span:
        if comp in memo:
            return memo[comp]
        span, t, stream_free, pending = _Span(), 0.0, 0.0, {}
        for inst in module.computations.get(comp, {}).values():
            kind = collective_kind(inst) or _p2p_kind(inst)
            if kind is not None:
                own = seconds.get(inst.name, 0.0) + (collective_latency(inst) if collective_latency else 0.0)
                start = max(t, stream_free)
                stream_free = start + own
                span.collective += own
                row = span.by.setdefault(inst.name, [0.0, 0.0])
                row[1] += own
                if inst.opcode.endswith("-start") or inst.opcode in ("send", "recv"):
                    pending[inst.name] = stream_free
                else:  # synchronous: the compute stream waits for it
                    row[0] += stream_free - t
                    span.exposed += stream_free - t
                    t = stream_free
            elif inst.opcode in _DONES:
                start = next((o for o in inst.operands if o in pending), None)
                if start is not None:
                    end = pending.pop(start)
                    if end > t:
                        span.by[start][0] += end - t
                        span.exposed += end - t
                        t = end
            elif depth < 32 and inst.opcode in ("while", "call", "conditional"):
                for sub, times in module.called(inst, comp):
                    inner = run(sub, depth + 1)
                    span.add(inner, times)
                    t += times * inner.duration
            else:
                own = seconds.get(inst.name, 0.0)
                span.compute += own
                t += own
        span.duration = t
        memo[comp] = span
        return span

    return run(module.entry, 0)


def _p2p_kind(inst: Instruction) -> str | None:
    """A pipeline's send/recv pair (XLA's decomposed collective-permute) as a collective-permute."""
    return "collective-permute" if inst.opcode in ("send", "recv") else None


def _producer_op(module: Module, comp: str, inst: Instruction) -> str:
    """Where a collective without its own op_name comes from: its first operand's (through
    bitcasts, copies and tuples), e.g. the gradient fusion a reduce-scatter reduces."""
    body = module.computations[comp]
    frontier, seen = list(inst.operands), set()
    while frontier:
        name = frontier.pop(0)
        if name in seen or name not in body:
            continue
        seen.add(name)
        where = op_name(body[name])
        if where:
            return where
        frontier.extend(body[name].operands)
    return ""


def predict(hlo_text: str | Module, roof: Roofline, *, devices_per_host: int = 8, link_latency_s: float = 0.0,
            network_latency_s: float = 0.0) -> Prediction:
    """The schedule model of a compiled GPU step: its kernels' and collectives' times from `roof`
    (the same program's `hlo.roofline`), replayed in the program's order (`simulate`)."""
    module = parse(hlo_text)
    seconds = {k.name: k.seconds for k in roof.kernels}
    latency = None
    if link_latency_s or network_latency_s:
        def latency(inst):
            return collective_latency_s(inst, devices_per_host=devices_per_host, link_latency_s=link_latency_s,
                                        network_latency_s=network_latency_s)
    span = simulate(module, seconds, collective_latency=latency)
    kinds = {k.name: k for k in roof.kernels if k.category == "collective"}
    runs = module.runs_per_step()
    where = {name: comp for comp in runs for name in module.computations[comp]}
    exposures = []
    for name, (exposed, own) in span.by.items():
        inst = module.computations[where[name]][name] if name in where else None
        kind = (collective_kind(inst) or _p2p_kind(inst)) if inst is not None else ""
        op = (kinds[name].op if name in kinds else "") or (_producer_op(module, where[name], inst) if inst else "")
        exposures.append(Exposure(name, kind or "", op, runs.get(where.get(name), 0), exposed, own))
    exposures.sort(key=lambda e: -e.seconds)
    return Prediction(span.duration, span.compute, span.collective, span.exposed,
                      tuple(e for e in exposures if e.seconds > 0), roof.peak_flops)
