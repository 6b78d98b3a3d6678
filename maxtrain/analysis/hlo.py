"""The optimized HLO of a compiled step as data, and what it must cost on a GPU.

`parse(compiled.as_text())` reads the module into computations of instructions (the functions
below take the text or, to parse a large module once, the parsed `Module`); `runs_per_step`
says how often each executed computation runs (a while loop's body by XLA's
`known_trip_count`, or its condition's bound where XLA dropped the count, nested loops
multiplying; fused computations are part of their fusion).
On that:

- `collective_stats`: per collective kind, ops per step and their result bytes per device;
- `custom_call_counts`: how often each custom-call target (Pallas kernel, cuDNN, cuBLAS) runs;
- `roofline`: every kernel of the step at the speed of light of a GPU target, the larger of its
  FLOPs at the tensor-core peak and its HBM bytes at the memory bandwidth, and every collective
  at the link bandwidth. Their sum is a lower bound on the step time: no schedule of this
  program on that GPU runs faster, so `model FLOPs / (bound x peak)` is a ceiling on MFU, and
  the kernels with the largest bounds are where the time must go.

Bytes are those a kernel must move: a fusion that reads a dynamic slice of a stacked buffer (the
scanned layers' weights or saved activations) reads the slice, and one that updates a slice in
place writes the update, not the whole buffer. FLOPs are the matmuls' (dots inside fusions,
cuBLAS calls) and, for our flash attention kernels, the matmuls they run (recognised from their
operand shapes, counted causal); other custom calls count their bytes only.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\dm\d(?:fn)?)?)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NAME = re.compile(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPERAND = re.compile(r"%([\w.\-]+)")
_TRIP_COUNT = re.compile(r"known_trip_count\W+n\W+(\d+)")
# instructions that launch nothing (or nothing worth counting)
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
         "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-done", "send-done",
         "recv-done", "async-done", "async-update", "all-gather-done", "all-reduce-done",
         "collective-permute-done", "reduce-scatter-done", "all-to-all-done", "recv", "get-dimension-size", "domain", "fusion-done"}
# a kernel XLA fused: `fusion`, or an asynchronous one (`fusion-start`, whose `fusion-done` is free)
_FUSIONS = {"fusion", "fusion-start"}
_SLICES = {"dynamic-slice", "slice"}
GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__cudnn$matmul")
FLASH_CALLS = ("mosaic_gpu_v2", "mosaic_gpu", "__gpu$xla.gpu.triton")


# ---------------------------------------------------------------- the module as data


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    shape: str  # the result type, e.g. `bf16[8,128]{1,0}` or a tuple `(f32[8]{0}, s32[])`
    operands: tuple[str, ...]
    attributes: str  # the text after the operand list
    root: bool = False
    arguments: str = ""  # the operand list as written (a parameter's holds its number)

    def attribute(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=%?([\w.\-$]+)", self.attributes)
        return m.group(1) if m else None


@dataclasses.dataclass
class Module:
    computations: dict[str, dict[str, Instruction]]  # name -> instructions by name, in order
    entry: str
    # conditionals with this many branches run branch i this share of the times they run (a
    # pipeline schedule's switch, `schedules.Lowered.branch_shares`); others count every branch
    branch_shares: dict = dataclasses.field(default_factory=dict)

    def root(self, computation: str) -> Instruction:
        body = self.computations[computation]
        return next((i for i in body.values() if i.root), list(body.values())[-1])

    def runs_per_step(self) -> dict[str, float]:
        """Executed (not fused) computations -> times each runs per step. A loop without a known
        trip count counts once; each branch of a conditional counts as taken, unless
        `branch_shares` says how often each is."""
        runs: dict[str, int] = {}

        def visit(comp: str, k: int, depth: int) -> None:
            if comp not in self.computations or depth > 32:
                return
            runs[comp] = runs.get(comp, 0) + k
            for inst in self.computations[comp].values():
                for sub, times in self.called(inst, comp):
                    visit(sub, k * times, depth + 1)

        visit(self.entry, 1, 0)
        return runs

    def trip_count(self, inst: Instruction, comp: str | None = None) -> int:
        """How often a while loop runs its body: its `known_trip_count`, else read from its condition
        (`i < c` or `i <= c`, directly or in the root fusion, on the tuple element the loop starts at
        a constant: XLA drops the known count of a loop it peeled, e.g. gradient accumulation's
        after its first iteration was split off), else 1."""
        m = _TRIP_COUNT.search(inst.attributes)
        if m:
            return int(m.group(1))
        bound = self._loop_bound(inst.attribute("condition"))
        if bound is None:
            return 1
        index, limit, direction = bound
        start = self._tuple_constant(comp, inst.operands[0], index) if comp and inst.operands else None
        start = 0 if start is None else start
        n = {"LT": limit - start, "LE": limit - start + 1, "GT": start - limit, "GE": start - limit + 1,
             "NE": abs(limit - start)}.get(direction, 1)
        return max(n, 1)

    def _loop_bound(self, cond: str | None):
        """(tuple index, constant, direction) of a loop condition `get-tuple-element(param, index=k)
        DIR constant` (either side; with the constant first the direction is turned round), looking
        into the root fusion (its parameter N is the fusion's operand N); None when the condition is
        anything else."""
        outer = self.computations.get(cond or "")
        if not outer:
            return None
        body, root, fusion = outer, self.root(cond), None
        if root.opcode == "fusion":
            inner = root.attribute("calls")
            if inner not in self.computations:
                return None
            body, fusion, root = self.computations[inner], root, self.root(inner)
        if root.opcode != "compare" or len(root.operands) != 2:
            return None
        a, b = (body.get(o) for o in root.operands)
        direction = root.attribute("direction")
        if a is not None and a.opcode == "constant" and b is not None:
            a, b = b, a
            direction = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}.get(direction, direction)
        if a is None or b is None or b.opcode != "constant":
            return None
        if fusion is not None:  # the compared parameter is one of the fusion's operands
            if a.opcode != "parameter" or not a.arguments.strip().isdigit():
                return None
            n = int(a.arguments.strip())
            a = outer.get(fusion.operands[n]) if n < len(fusion.operands) else None
        if a is None or a.opcode != "get-tuple-element":
            return None
        try:
            return int(a.attribute("index") or 0), int(b.arguments.strip()), direction
        except ValueError:
            return None

    def _tuple_constant(self, comp: str, tuple_name: str, index: int) -> int | None:
        """The integer constant element `index` of the tuple `tuple_name` in `comp` (through copies)."""
        body = self.computations.get(comp, {})
        t = body.get(tuple_name)
        if t is None or t.opcode != "tuple" or index >= len(t.operands):
            return None
        inst = body.get(t.operands[index])
        while inst is not None and inst.opcode in ("copy", "bitcast") and inst.operands:
            inst = body.get(inst.operands[0])
        if inst is None or inst.opcode != "constant":
            return None
        try:
            return int(inst.arguments.strip())
        except ValueError:
            return None

    def called(self, inst: Instruction, comp: str | None = None) -> list[tuple[str, float]]:
        """The computations a control-flow instruction runs, each with the times it runs per run of
        the instruction (in computation `comp`): a while loop's body and condition its `trip_count`, a
        call's once, a conditional's branches their `branch_shares` (else each once)."""
        if inst.opcode == "while":
            n = self.trip_count(inst, comp)
            return [(c, n) for c in (inst.attribute("body"), inst.attribute("condition")) if c]
        if inst.opcode == "call":
            return [(inst.attribute("to_apply"), 1)] if inst.attribute("to_apply") else []
        if inst.opcode != "conditional":
            return []
        branches = re.search(r"branch_computations=\{([^}]*)\}", inst.attributes)
        names = (_OPERAND.findall(branches.group(1)) if branches else
                 [inst.attribute("true_computation"), inst.attribute("false_computation")])
        shares = self.branch_shares.get(len(names), [1] * len(names))
        return [(b, share) for b, share in zip(names, shares) if b and share]


def _balanced(text: str) -> tuple[str, str]:
    """`(...)rest` -> (inside the outer parentheses, rest)."""
    depth = 0
    for i, c in enumerate(text):
        depth += (c == "(") - (c == ")")
        if depth == 0:
            return text[1:i], text[i + 1:]
    return text[1:], ""


def _instruction(line: str) -> Instruction | None:
    m = _NAME.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        inner, rest = _balanced(rest)
        shape = f"({inner})"
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"\s*([\w\-]+)\(", rest)
    if not op:
        return None
    args, attributes = _balanced(rest[op.end(1):])
    return Instruction(m.group(2), op.group(1), shape, tuple(_OPERAND.findall(args)), attributes, bool(m.group(1)),
                       args)


def parse(hlo_text: "str | Module") -> Module:
    """An optimized HLO module's text (`compiled.as_text()`) as a `Module` (a Module as it is)."""
    if isinstance(hlo_text, Module):
        return hlo_text
    computations: dict[str, dict[str, Instruction]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" "):
            h = _HEADER.match(line.strip())
            if h:
                current = h.group(2)
                computations[current] = {}
                entry = current if h.group(1) else entry
            continue
        if current is not None and "=" in line:
            inst = _instruction(line)
            if inst is not None:
                computations[current][inst.name] = inst
    return Module(computations, entry)


# ---------------------------------------------------------------- shapes


def shape_dims(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array in a result type: [(dtype, dims)] (a tuple gives several)."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(shape)]


def shape_bytes(shape: str) -> int:
    return sum(math.prod(dims) * _DTYPE_BYTES.get(dtype, 4) for dtype, dims in shape_dims(shape))


def _shape_of(module: Module, comp: str, name: str) -> str:
    inst = module.computations[comp].get(name)
    return inst.shape if inst is not None else ""


# ---------------------------------------------------------------- collectives and custom calls


def collective_kind(inst: Instruction) -> str | None:
    op = inst.opcode.removesuffix("-start")
    return op if op in COLLECTIVES else None


def collective_stats(hlo_text: str | Module) -> dict[str, dict[str, int]]:
    """Collectives of an optimized HLO module: per kind, ops executed per step and their result bytes.

    Bytes are the op's result size per device (for all-gather the gathered array, for
    reduce-scatter the scattered shard); ops in loops count per iteration.
    """
    module = parse(hlo_text)
    stats = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES}
    for comp, k in module.runs_per_step().items():
        for inst in module.computations[comp].values():
            kind = collective_kind(inst)
            if kind:
                stats[kind]["count"] += k
                stats[kind]["bytes"] += k * _result_bytes(inst)
    return {kind: {key: int(round(v)) for key, v in row.items()} for kind, row in stats.items()}


def _result_bytes(inst: Instruction) -> int:
    """A collective's result bytes per device. An async start returns its operands too:
    all-gather/reduce-scatter/all-to-all-start `((operands), results)` or `(operands..., results...)`,
    collective-permute-start `(operand, result, u32[], u32[])`; all-reduce-start its results only."""
    if inst.opcode.endswith("-start") and inst.shape.startswith("(") and inst.opcode != "all-reduce-start":
        parts = _tuple_elements(inst.shape)
        parts = parts[1:2] if inst.opcode == "collective-permute-start" else parts[len(parts) // 2:]
        return sum(shape_bytes(p) for p in parts)
    return shape_bytes(inst.shape)


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple type `(a, (b, c), d)` -> ["a", "(b, c)", "d"]."""
    inner, parts, depth, start = shape.strip()[1:-1], [], 0, 0
    for i, c in enumerate(inner):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    return [p.strip() for p in parts if p.strip()]


def custom_call_counts(hlo_text: str | Module) -> dict[str, int]:
    """Custom calls of an optimized HLO module (Pallas kernels, cuDNN, cuBLAS, ...), per target:
    the number run per step, loops counted per iteration. Most frequent first."""
    module = parse(hlo_text)
    counts: dict[str, int] = {}
    for comp, k in module.runs_per_step().items():
        for inst in module.computations[comp].values():
            for target in _call_targets(module, inst):
                counts[target] = counts.get(target, 0) + k
    return {t: int(round(n)) for t, n in sorted(counts.items(), key=lambda kv: -kv[1])}


def _fused_body(module: Module, inst: Instruction) -> str | None:
    """The computation a fusion kernel runs (None for any other instruction)."""
    called = inst.attribute("calls") if inst.opcode in _FUSIONS else None
    return called if called in module.computations else None


def _call_targets(module: Module, inst: Instruction, depth: int = 0) -> list[str]:
    """The custom calls an instruction runs: itself, or those inside it when it is a fusion (XLA
    wraps a custom call whose operands are slices of a loop's stacked buffers in a
    `dynamic-slice-fusion`)."""
    target = _call_target(inst)
    if target is not None:
        return [target]
    called = _fused_body(module, inst)
    if called is None or depth >= 8:
        return []
    return [t for i in module.computations[called].values() for t in _call_targets(module, i, depth + 1)]


def _call_target(inst: Instruction) -> str | None:
    if inst.opcode != "custom-call":
        return None
    m = re.search(r'custom_call_target="([^"]+)"', inst.attributes)
    return m.group(1) if m else None


# ---------------------------------------------------------------- bytes and FLOPs of one kernel


def _users(body: dict[str, Instruction]) -> dict[str, list[Instruction]]:
    """Instruction name -> the instructions of `body` that take it as an operand."""
    users: dict[str, list[Instruction]] = {}
    for inst in body.values():
        for o in inst.operands:
            users.setdefault(o, []).append(inst)
    return users


def _fused_operand_bytes(body: dict[str, Instruction], users: dict[str, list[Instruction]], index: int,
                         full: int) -> int:
    """Bytes a fusion reads of operand `index`: a parameter only sliced inside (through bitcasts)
    reads the slices, one updated in place (operand 0 of a dynamic-update-slice) reads nothing."""
    param = next((i for i in body.values() if i.opcode == "parameter" and i.arguments.strip() == str(index)), None)
    if param is None:
        return full
    total, frontier, seen = 0, [param.name], set()
    while frontier:
        name = frontier.pop()
        if name in seen:
            continue
        seen.add(name)
        for u in users.get(name, []):
            if u.opcode == "bitcast":
                frontier.append(u.name)
            elif u.opcode in _SLICES and u.operands[0] == name:
                total += shape_bytes(u.shape)
            elif u.opcode == "dynamic-update-slice" and u.operands[0] == name:
                continue  # written in place: the update is counted as the output
            else:
                return full
    return min(total, full)


def _written_bytes(module: Module, comp: str, fused: str | None, inst: Instruction) -> int:
    """Bytes a kernel writes: its result, but only the update of an in-place dynamic-update-slice."""
    if fused is None:
        if inst.opcode == "dynamic-update-slice" and len(inst.operands) > 1:
            return shape_bytes(_shape_of(module, comp, inst.operands[1]))
        if _call_target(inst) in GEMM_CALLS:  # (result, workspace): the workspace stays in L2
            dtype, dims = shape_dims(inst.shape)[0]
            return math.prod(dims) * _DTYPE_BYTES.get(dtype, 4)
        return shape_bytes(inst.shape)
    root = module.root(fused)
    outputs = [module.computations[fused][o] for o in root.operands] if root.opcode == "tuple" else [root]
    total = 0
    for out in outputs:
        while out.opcode == "bitcast" and out.operands and out.operands[0] in module.computations[fused]:
            out = module.computations[fused][out.operands[0]]
        if out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
            total += shape_bytes(_shape_of(module, fused, out.operands[1]))
        else:
            total += shape_bytes(out.shape)
    return total


def _matmul_flops(module: Module, comp: str, inst: Instruction, contracting) -> float:
    """2 x result elements x contracted size: `contracting` finds the lhs contracting dims in the
    instruction's attributes (as HLO writes them for a dot, or in a cuBLAS/cuDNN backend config)."""
    out = shape_dims(inst.shape)
    lhs = shape_dims(_shape_of(module, comp, inst.operands[0])) if inst.operands else []
    m = contracting.search(inst.attributes)
    if not out or not lhs or not m:
        return 0.0
    dims = [int(d) for d in re.findall(r"\d+", m.group(1))]
    return 2.0 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in dims)


_DOT_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _flash_flops(module: Module, comp: str, inst: Instruction) -> float:
    """Our flash attention kernels (Triton or Mosaic GPU), recognised by shape: q `[B, L, H, D]`
    and k `[B, S, KV, D]` in, and out (o, lse) for the forward (2 matmuls per score), dQ like q
    (3: S, dP, dS K) or (dK, dV) like k (4: S, dP, dV, dK); causal, so (S + 1) / 2S of the scores,
    at the length the kernel runs (padded to its tiles)."""
    ins = [shape_dims(_shape_of(module, comp, o)) for o in inst.operands[:2]]
    if len(ins) < 2 or not ins[0] or not ins[1]:
        return 0.0
    (_, q), (_, k) = ins[0][0], ins[1][0]
    if len(q) != 4 or len(k) != 4 or q[0] != k[0] or q[3] != k[3] or q[2] % k[2]:
        return 0.0
    outs = [d for _, d in shape_dims(inst.shape)]
    B, L, H, D = q
    S = k[1]
    if len(outs) == 2 and outs[0] == q and len(outs[1]) == 3:
        matmuls = 2
    elif outs == [q]:
        matmuls = 3
    elif len(outs) == 2 and outs[0] == k and outs[1] == k:
        matmuls = 4
    else:
        return 0.0
    return 2.0 * matmuls * B * H * L * S * D * (S + 1) / (2 * S)


def _kernel_flops(module: Module, comp: str, inst: Instruction, depth: int = 0) -> float:
    if inst.opcode == "dot":
        return _matmul_flops(module, comp, inst, _DOT_CONTRACTING)
    target = _call_target(inst)
    if target in GEMM_CALLS:
        return _matmul_flops(module, comp, inst, _GEMM_CONTRACTING)
    if target in FLASH_CALLS:
        return _flash_flops(module, comp, inst)
    called = _fused_body(module, inst)
    if called is not None and depth < 8:
        return sum(_kernel_flops(module, called, i, depth + 1) for i in module.computations[called].values())
    return 0.0


def _kernel_bytes(module: Module, comp: str, inst: Instruction) -> int:
    called = _fused_body(module, inst)
    body = module.computations.get(called, {})
    users = _users(body) if called is not None else {}
    read = 0
    for index, name in enumerate(inst.operands):
        full = shape_bytes(_shape_of(module, comp, name))
        if called is not None:
            read += _fused_operand_bytes(body, users, index, full)
        elif inst.opcode in _SLICES and index == 0:
            read += shape_bytes(inst.shape)
        elif inst.opcode == "dynamic-update-slice" and index == 0:
            continue
        else:
            read += full
    return read + _written_bytes(module, comp, called, inst)


def _category(module: Module, comp: str, inst: Instruction, flops: float) -> str:
    targets = _call_targets(module, inst)
    if any(t in FLASH_CALLS for t in targets) and flops:
        return "attention"
    if targets:
        return "matmul" if any(t in GEMM_CALLS for t in targets) else "custom call"
    if flops:
        return "matmul"
    if inst.opcode in ("copy", "transpose", "copy-start"):
        return "copy"
    return "fusion"


# ---------------------------------------------------------------- collectives on the wire


def replica_groups(inst: Instruction) -> list[list[int]]:
    """The device groups of a collective, from any of XLA's spellings: `{{0,1},{2,3}}`, the iota
    form `[G,S]<=[dims]T(perm)`, or the mesh form `mesh['a'=4,'b'=2] {'b'}` (groups along the
    named axes; `device_ids=([dims]T(perm))` orders the devices)."""
    a = inst.attributes
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                  r"\s*\{([^}]*)\}", a)
    if m:
        axes = [(n, int(v)) for n, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        sizes = [v for _, v in axes]
        ids = (_iota_ids(m.group(2), m.group(3)) if m.group(2) else np.arange(math.prod(sizes))).reshape(sizes)
        grouped = {n for n in re.findall(r"'([^']+)'", m.group(4))}
        order = [i for i, (n, _) in enumerate(axes) if n not in grouped] + \
                [i for i, (n, _) in enumerate(axes) if n in grouped]
        size = math.prod(v for n, v in axes if n in grouped)
        return ids.transpose(order).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", a)
    if m:
        group = int(m.group(1).split(",")[-1])
        return _iota_ids(m.group(2), m.group(3)).reshape(-1, group).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\"?\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", a)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return []


def _iota_ids(dims: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list `[dims]T(perm)`: arange reshaped to `dims`, transposed by `perm`."""
    shape = [int(x) for x in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(x) for x in perm.split(",")]) if perm else ids


def wire_bytes(kind: str, result_bytes: int, group: int) -> float:
    """Bytes one device sends for a collective over `group` devices (ring algorithms)."""
    if kind == "collective-permute":
        return float(result_bytes)
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    if kind == "all-gather":
        return result_bytes * share
    if kind == "reduce-scatter":
        return result_bytes * group * share  # the result is the shard: the operand is group times it
    if kind == "all-reduce":
        return 2 * result_bytes * share
    return result_bytes * share  # all-to-all


# ---------------------------------------------------------------- the roofline


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One instruction of the step at the speed of light of a target."""
    name: str
    category: str  # matmul, attention, fusion, copy, custom call, collective
    runs: int  # per step
    flops: float  # per run
    bytes: float  # per run: HBM bytes for kernels, bytes sent for collectives
    seconds: float  # per run, the lower bound
    bound: str  # "compute", "memory" or "network"
    op: str = ""  # where in the model it comes from (`op_name`: fwd/bwd and the op_name's tail)
    precision: str = ""  # a matmul's operand type: "fp8" (an FP8 GEMM), "bf16", "f32", ...


@dataclasses.dataclass(frozen=True)
class Roofline:
    kernels: tuple[Kernel, ...]
    peak_flops: float
    bandwidth: float

    def seconds(self, category: str | None = None) -> float:
        return sum(k.seconds * k.runs for k in self.kernels if category in (None, k.category))

    def flops(self, category: str | None = None) -> float:
        return sum(k.flops * k.runs for k in self.kernels if category in (None, k.category))

    @property
    def compute_s(self) -> float:
        """Kernels (everything but collectives), one after another."""
        return sum(k.seconds * k.runs for k in self.kernels if k.category != "collective")

    @property
    def step_s(self) -> float:
        """The step time no schedule beats: kernels serialised, collectives at best fully overlapped."""
        return max(self.compute_s, self.seconds("collective"))

    def mfu_ceiling(self, model_flops_per_device: float) -> float:
        return model_flops_per_device / (self.step_s * self.peak_flops) if self.step_s else 0.0

    def summary(self, model_flops_per_device: float | None = None, top: int = 8) -> dict:
        cats = ("matmul", "attention", "fusion", "copy", "custom call", "collective")
        return {
            "step_s": self.step_s,
            "peak_flops": self.peak_flops,
            "bandwidth": self.bandwidth,
            "mfu_ceiling": None if model_flops_per_device is None else self.mfu_ceiling(model_flops_per_device),
            "compute_s": self.compute_s,
            "by_category_s": {c: self.seconds(c) for c in cats if self.seconds(c)},
            "by_category_flops": {c: self.flops(c) for c in cats if self.flops(c)},
            "kernels_per_step": sum(k.runs for k in self.kernels if k.category != "collective"),
            "flops_per_step": self.flops(),
            "hbm_bytes_per_step": sum(k.bytes * k.runs for k in self.kernels if k.category != "collective"),
            "top": [dataclasses.asdict(k) for k in self.ranked()[:top]],
            "top_memory_bound": [dataclasses.asdict(k) for k in self.ranked("memory")[:top]],
            "gemms": self.gemms(),
        }

    def gemms(self) -> dict:
        """The matmul kernels by operand precision: kernels in the program, their runs per step,
        FLOPs per step, seconds at the roofline (FP8 GEMMs at the FP8 peak), and where in the
        model they come from (`op`)."""
        out: dict[str, dict] = {}
        for k in self.kernels:
            if k.category != "matmul":
                continue
            row = out.setdefault(k.precision or "other",
                                 {"kernels": 0, "runs": 0, "flops": 0.0, "seconds": 0.0, "ops": []})
            if k.op and k.op not in row["ops"]:
                row["ops"].append(k.op)
            row["kernels"] += 1
            row["runs"] += k.runs
            row["flops"] += k.flops * k.runs
            row["seconds"] += k.seconds * k.runs
        return out

    def ranked(self, bound: str | None = None) -> list[Kernel]:
        """Kernels by their share of the step's bound, largest first (only `bound`-bound ones)."""
        return sorted((k for k in self.kernels if bound in (None, k.bound)), key=lambda k: -k.seconds * k.runs)


def roofline(hlo_text: str | Module, *, peak_flops: float, bandwidth: float, link_bandwidth: float,
             network_bandwidth: float | None = None, devices_per_host: int = 8,
             fp8_peak_flops: float | None = None) -> Roofline:
    """Every kernel and collective of an optimized HLO module at a GPU's speed of light.

    `peak_flops`: dense bf16 tensor-core FLOP/s (matmuls with float32 operands at half of it, as
    TF32); `fp8_peak_flops`: dense FP8 FLOP/s for GEMMs whose operands are FP8 (None: twice
    `peak_flops`, as on Hopper and Blackwell); `bandwidth`: HBM bytes/s; `link_bandwidth`: bytes/s
    one GPU sends over NVLink; `network_bandwidth`: bytes/s per GPU between hosts (collectives
    whose group spans hosts).
    """
    peaks = {"f32": peak_flops / 2, "fp8": fp8_peak_flops or 2 * peak_flops}
    module = parse(hlo_text)
    kernels = []
    for comp, runs in module.runs_per_step().items():
        for inst in module.computations[comp].values():
            if inst.opcode in _FREE:
                continue
            kind = collective_kind(inst) or ("collective-permute" if inst.opcode == "send" else None)
            if kind is not None:
                groups = replica_groups(inst)
                group = max((len(g) for g in groups), default=1)
                moved = (shape_bytes(_shape_of(module, comp, inst.operands[0])) if inst.opcode == "send"
                         else _result_bytes(inst))
                sent = wire_bytes(kind, moved, group)
                spans = any(len({d // devices_per_host for d in g}) > 1 for g in groups)
                bw = network_bandwidth if spans and network_bandwidth else link_bandwidth
                kernels.append(Kernel(inst.name, "collective", runs, 0.0, sent, sent / bw, "network", op_name(inst)))
                continue
            flops = _kernel_flops(module, comp, inst)
            nbytes = _kernel_bytes(module, comp, inst)
            precision = _precision(module, comp, inst) if flops else ""
            t_flops = flops / peaks.get(precision, peak_flops)
            t_bytes = nbytes / bandwidth
            kernels.append(Kernel(inst.name, _category(module, comp, inst, flops), runs, flops, float(nbytes),
                                  max(t_flops, t_bytes), "compute" if t_flops >= t_bytes else "memory",
                                  op_name(inst), precision))
    return Roofline(tuple(kernels), peak_flops, bandwidth)


def gpu_roofline(hlo_text: str | Module, device_kind: str, *, peak_tflops: float | None = None,
                 devices_per_host: int = 8) -> Roofline | None:
    """`roofline` with the data-sheet figures of a GPU `maxtrain.devices` lists with a memory
    bandwidth (by device kind, as a real or a described device reports it); None for others."""
    from maxtrain.devices import device_figures

    device = device_figures(device_kind)
    if device is None or device.hbm_bytes_s is None:
        return None
    peak = peak_tflops or device.peak_bf16_tflops
    fp8 = device.peak_fp8_tflops * peak / device.peak_bf16_tflops if device.peak_fp8_tflops else peak
    return roofline(hlo_text, peak_flops=peak * 1e12, bandwidth=device.hbm_bytes_s,
                    link_bandwidth=device.link_bytes_s, network_bandwidth=device.network_bytes_s,
                    devices_per_host=devices_per_host, fp8_peak_flops=fp8 * 1e12)


def op_name(inst: Instruction) -> str:
    """Where in the model a kernel comes from: "fwd" or "bwd" (transposed) and the last three
    parts of its jax op_name, e.g. `bwd closed_call/checkpoint/mul`."""
    m = re.search(r'op_name="([^"]*)"', inst.attributes)
    if not m:
        return ""
    path = m.group(1)
    return ("bwd " if "transpose(" in path else "fwd ") + "/".join(path.split("/")[-3:])


def _precision(module: Module, comp: str, inst: Instruction, depth: int = 0) -> str:
    """A matmul kernel's left operand type, "fp8" for either FP8 format: of the dot inside a
    fusion (a dot fed by a convert from FP8 is a bf16 GEMM: dequantized, not FP8), or of a
    cuBLAS/cuDNN call's first operand."""
    called = _fused_body(module, inst)
    if called is not None and depth < 8:
        for i in module.computations[called].values():
            if i.opcode in ("dot", "custom-call") or _fused_body(module, i) is not None:
                p = _precision(module, called, i, depth + 1)
                if p:
                    return p
        return ""
    if inst.opcode != "dot" and _call_target(inst) not in GEMM_CALLS:
        return ""
    lhs = shape_dims(_shape_of(module, comp, inst.operands[0])) if inst.operands else []
    if not lhs:
        return ""
    return "fp8" if lhs[0][0].startswith("f8") else lhs[0][0]
