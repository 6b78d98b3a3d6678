"""Pipeline schedules as data: which operation every stage runs at every tick, the bubble and the
activation memory read off that table, and its lowering (`lower`) to the per-tick index arrays the
SPMD program of `maxtrain.parallel.pipeline.execute` runs.

An operation is `F` (a microbatch's forward through one chunk of layers), `B` (its backward to the
chunk's input: the gradient the previous stage waits for) or `W` (the gradient of the chunk's
weights, which nothing downstream waits for). Chunk v lives on stage v mod S: with R =
`train.pipeline_repeats` chunks per stage a microbatch goes round the ring of stages R times (the
placement of `pipeline.stage_specs`). Every operation takes one tick (a full backward, B then W,
is twice a forward, the usual cost model), and an operation may start once the operations it needs
finished at an earlier tick: F(m, v) after F(m, v-1); B(m, v) after F(m, v) and the next chunk's
backward (the last chunk's after its own forward: the loss); W(m, v) after B(m, v). Only the
zero-bubble schedule splits a backward: elsewhere B and W are one computation (autodiff's), and
the input gradient leaves after both.

Each schedule is a program per stage, an ordered list of operations, run greedily (`simulate`):

- `gpipe`: every forward, then every backward in reverse (each B followed by its W): all M
  microbatches' activations are alive on every stage at the turn;
- `1f1b` (PipeDream-Flush, Narayanan et al. 2021, Megatron's default): S - s - 1 forwards of warm-up
  on stage s, then one forward and one backward alternately: at most S - s microbatches alive;
- `interleaved` (Megatron's interleaved 1F1B, R > 1 chunks per stage, M a multiple of S): the
  forwards in groups of S microbatches chunk by chunk, a warm-up of 2 (S - s - 1) + (R - 1) S, then
  1F1B over the virtual stages: the bubble shrinks by R;
- `zero_bubble` (ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
  arXiv:2401.10241): 1F1B's forwards and input-gradient backwards, with each weight gradient W
  deferred into the ticks where the stage would wait, never past 1F1B's activation peak.

`bubble` and `peak_activations` are read off the table; `render` draws it as text, `plot` as a PNG
(`python -m maxtrain.parallel.schedules --png docs/pipeline_schedules.png`). `lower` assigns the
buffer slots and gives the arrays `maxtrain.parallel.pipeline.execute` runs (training with
`train.pipeline_schedule` other than gpipe, whose backward is autodiff's).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# numpy is imported where a table is lowered: `maxtrain.config` validates schedules with `check`
# before anything heavy is imported (a config mistake answers at once)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # "F", "B" (input gradient) or "W" (weight gradient)
    microbatch: int
    chunk: int  # virtual stage v; it runs on stage v % S

    def label(self, stages: int, repeats: int) -> str:
        r = self.chunk // stages
        return f"{self.kind}{self.microbatch}" + (chr(ord("a") + r) if repeats > 1 else "")


@dataclasses.dataclass(frozen=True)
class Table:
    name: str
    stages: int
    microbatches: int
    repeats: int
    ticks: tuple  # ticks[t][s]: the Op stage s runs at tick t, or None (idle)
    # aligned: every tick's operations are of one kind (see `make_table`); whole_backward: B is a
    # microbatch's whole backward (one tick, no W operations), as aligned unsplit tables run it
    aligned: bool = False
    whole_backward: bool = False

    @property
    def length(self) -> int:
        """Ticks until the last operation ends; a tick is one chunk's forward, so with R chunks per
        stage it is 1/R of a one-chunk schedule's (compare bubbles, not lengths, across R)."""
        return len(self.ticks)

    def bubble(self) -> float:
        """Idle stage-ticks over all stage-ticks until the last operation ends."""
        idle = sum(op is None for row in self.ticks for op in row)
        return idle / (self.length * self.stages)

    def peak_activations(self) -> list[int]:
        """Per stage, the most (microbatch, chunk) activations alive at once: from a forward until
        the weight gradient that last needs them."""
        alive, peak = [0] * self.stages, [0] * self.stages
        last = "B" if self.whole_backward else "W"
        for row in self.ticks:
            for s, op in enumerate(row):
                if op is None:
                    continue
                alive[s] += op.kind == "F"
                peak[s] = max(peak[s], alive[s])
                alive[s] -= op.kind == last
        return peak


def _deps(op: Op, chunks: int, split: bool) -> list[Op]:
    """What `op` waits for. Unsplit (`split=False`), a backward is one computation whose input
    gradient leaves with its weight gradient (autodiff's), so the next B waits for the W too."""
    if op.kind == "F":
        return [] if op.chunk == 0 else [Op("F", op.microbatch, op.chunk - 1)]
    if op.kind == "B":
        later = [] if op.chunk == chunks - 1 else [Op("B" if split else "W", op.microbatch, op.chunk + 1)]
        return [Op("F", op.microbatch, op.chunk)] + later
    return [Op("B", op.microbatch, op.chunk)]


def simulate(name: str, programs: list[list[Op]], stages: int, microbatches: int, repeats: int,
             defer_weights: bool = False, caps: list[int] | None = None) -> Table:
    """Runs each stage's program in order, an operation as soon as its dependencies finished at an
    earlier tick. `defer_weights`: a stage's W operations leave the program and wait in a queue,
    run when the next F/B cannot (it waits on another stage, or a forward would pass the stage's
    activation cap `caps[s]`), and at the end."""
    S, chunks = stages, stages * repeats
    done: dict[Op, int] = {}
    programs = [list(p) for p in programs]
    pending: list[list[Op]] = [[] for _ in range(S)]
    alive = [0] * S
    rows = []
    total = sum(len(p) for p in programs)
    if defer_weights:  # each B leaves its W to the queue
        total += sum(op.kind == "B" for p in programs for op in p)
    while len(done) < total:
        t = len(rows)
        if t > 4 * total + 8:
            raise RuntimeError(f"pipeline schedule {name} deadlocks (S={S}, M={microbatches}, R={repeats})")
        row = []
        for s in range(S):
            head = programs[s][0] if programs[s] else None
            ready = head is not None and all(done.get(d, t) < t for d in _deps(head, chunks, defer_weights))
            if ready and head.kind == "F" and caps is not None and alive[s] >= caps[s] and pending[s]:
                ready = False  # a forward now would pass the activation cap: free one first
            if ready:
                op = programs[s].pop(0)
            elif pending[s]:
                op = pending[s].pop(0)
            else:
                op = None
            if op is not None:
                alive[s] += (op.kind == "F") - (op.kind == "W")
                if defer_weights and op.kind == "B":
                    pending[s].append(Op("W", op.microbatch, op.chunk))
            row.append(op)
        for op in row:
            if op is not None:
                done[op] = t
        rows.append(tuple(row))
    return Table(name, S, microbatches, repeats, tuple(rows))


_PRIORITY = {"B": 0, "F": 1, "W": 2}  # an aligned tick's kind, among equally many ready stages


def simulate_aligned(name: str, programs: list[list[Op]], stages: int, microbatches: int, repeats: int,
                     cap: int, split: bool) -> Table:
    """An aligned table (`make_table`): each stage keeps its program's order of forwards and of
    backwards, but not their interleaving. At each tick the kind of operation most stages are
    ready for runs (a backward first among equals, then a forward, then a deferred weight
    gradient), on every stage ready for it; a forward waits while `cap` microbatches are alive
    on its stage. Unsplit (`split=False`), B is the whole backward."""
    S, chunks = stages, stages * repeats
    fwd = [[op for op in p if op.kind == "F"] for p in programs]
    bwd = [[op for op in p if op.kind == "B"] for p in programs]
    pending: list[list[Op]] = [[] for _ in range(S)]
    done: dict[Op, int] = {}
    alive = [0] * S
    total = sum(len(p) for p in fwd) + sum(len(p) for p in bwd) * (2 if split else 1)  # F, B (and W)
    rows = []
    while len(done) < total:  # every tick runs an operation (or raises), so this ends
        t = len(rows)
        ready = {"F": [], "B": [], "W": []}
        for s in range(S):
            if fwd[s] and alive[s] < cap and all(done.get(d, t) < t for d in _deps(fwd[s][0], chunks, True)):
                ready["F"].append(fwd[s][0])
            if bwd[s] and all(done.get(d, t) < t for d in _deps(bwd[s][0], chunks, True)):
                ready["B"].append(bwd[s][0])
            if pending[s]:
                ready["W"].append(pending[s][0])
        kind = min(ready, key=lambda k: (-len(ready[k]), _PRIORITY[k]))
        if not ready[kind]:  # nothing runs now, so nothing ever will
            raise RuntimeError(f"aligned pipeline schedule {name} deadlocks (S={S}, M={microbatches}, "
                               f"R={repeats}, cap={cap})")
        row: list = [None] * S
        for op in ready[kind]:
            s = op.chunk % S
            row[s] = op
            (fwd if kind == "F" else bwd if kind == "B" else pending)[s].pop(0)
            if kind == "F":
                alive[s] += 1
            elif kind == "B" and split:
                pending[s].append(Op("W", op.microbatch, op.chunk))
            else:
                alive[s] -= 1
        for op in ready[kind]:
            done[op] = t
        rows.append(tuple(row))
    return Table(name, S, microbatches, repeats, tuple(rows), aligned=True, whole_backward=not split)


def validate(table: Table) -> None:
    """Raises if the table runs an operation twice, misses one, or runs one before what it needs."""
    S, M, R = table.stages, table.microbatches, table.repeats
    split = table.name == "zero_bubble"
    when: dict[Op, int] = {}
    for t, row in enumerate(table.ticks):
        for s, op in enumerate(row):
            if op is None:
                continue
            if op in when or op.chunk % S != s:
                raise AssertionError(f"{op} twice or on stage {s}")
            when[op] = t
    want = {Op(k, m, v) for k in ("FB" if table.whole_backward else "FBW") for m in range(M) for v in range(S * R)}
    if set(when) != want:
        raise AssertionError(f"missing {sorted(want - set(when), key=str)[:3]}")
    if table.aligned and any(len({op.kind for op in row if op}) > 1 for row in table.ticks):
        raise AssertionError("an aligned table mixes kinds of operation in a tick")
    for op, t in when.items():
        late = [d for d in _deps(op, S * R, split or table.whole_backward) if when[d] >= t]
        if late:
            raise AssertionError(f"{op} at tick {t} before {late}")


def _items(S: int, M: int, R: int, s: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of stage s in the order the items go round the ring: repeat, then microbatch."""
    return [(m, r * S + s) for r in range(R) for m in range(M)]


def _gpipe(S: int, M: int, R: int) -> list[list[Op]]:
    programs = []
    for s in range(S):
        items = _items(S, M, R, s)
        back = [op for m, v in reversed(items) for op in (Op("B", m, v), Op("W", m, v))]
        programs.append([Op("F", m, v) for m, v in items] + back)
    return programs


def _one_f_one_b(fwd: list[tuple[int, int]], bwd: list[tuple[int, int]], warmup: int, split: bool) -> list[Op]:
    """`warmup` forwards, then a forward and a backward alternately, then the remaining backwards."""
    warmup = min(warmup, len(fwd))

    def backward(m, v):
        return [Op("B", m, v)] + ([] if split else [Op("W", m, v)])

    program = [Op("F", m, v) for m, v in fwd[:warmup]]
    for k in range(len(fwd) - warmup):
        program += [Op("F", *fwd[warmup + k])] + backward(*bwd[k])
    for m, v in bwd[len(fwd) - warmup:]:
        program += backward(m, v)
    return program


def _interleaved_order(S: int, M: int, R: int, s: int, backward: bool) -> list[tuple[int, int]]:
    """Megatron's virtual-stage order: microbatches in groups of S, each group through every chunk
    of this stage (the last chunk first going backward)."""
    chunks = range(R - 1, -1, -1) if backward else range(R)
    return [(m, r * S + s) for g in range(M // S) for r in chunks for m in range(g * S, (g + 1) * S)]


def programs_for(name: str, S: int, M: int, R: int) -> list[list[Op]]:
    if name == "gpipe":
        return _gpipe(S, M, R)
    if name in ("1f1b", "zero_bubble"):
        return [_one_f_one_b(_items(S, M, 1, s), _items(S, M, 1, s), S - s - 1, split=name == "zero_bubble")
                for s in range(S)]
    if name == "interleaved":
        return [_one_f_one_b(_interleaved_order(S, M, R, s, False), _interleaved_order(S, M, R, s, True),
                             2 * (S - s - 1) + (R - 1) * S, split=False) for s in range(S)]
    raise ValueError(f"unknown pipeline schedule {name!r}")


def check(name: str, S: int, M: int, R: int) -> str | None:
    """Why `name` cannot schedule S stages, M microbatches and R chunks per stage (None: it can)."""
    if name not in SCHEDULES:
        return f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
    if M < S:
        return f"{M} microbatches are fewer than the {S} pipeline stages; use at least {S}"
    if name == "interleaved" and R < 2:
        return "the interleaved schedule needs train.pipeline_repeats >= 2 (virtual stages per device)"
    if name == "interleaved" and M % S:
        return f"the interleaved schedule runs microbatches in groups of the {S} stages; use a multiple of {S}"
    if name in ("1f1b", "zero_bubble") and R > 1:
        return f"the {name} schedule runs one chunk per stage; use train.pipeline_repeats=1 or the interleaved schedule"
    return None


def make_table(name: str, stages: int, microbatches: int, repeats: int = 1, aligned: bool = False) -> Table:
    """The schedule's table for S stages, M microbatches and R chunks per stage.

    `aligned`: the same programs re-timed so that all stages run the same kind of operation at a
    tick (forwards, backwards or weight gradients; a stage with nothing of that kind waits). The
    SPMD program then takes one branch on every device at each tick, which collectives that span
    the whole mesh need (sequence parallelism's collective-permutes). An unsplit schedule's
    backward is one B there (no W ticks), and a tick is as long as its kind's operation. A hop in
    either direction takes a tick of its own kind, so microbatches stay alive about twice as long:
    a stage holds at most twice the unaligned table's peak, less one (1F1B: 2S - 1, not S)."""
    problem = check(name, stages, microbatches, repeats)
    if problem:
        raise ValueError(problem)
    programs = programs_for(name, stages, microbatches, repeats)
    if aligned:
        # a hop now takes a tick of its own kind each way, so a microbatch stays alive about twice as
        # long: cap a stage at twice the unaligned schedule's peak, less one (1F1B: 2S - 1)
        peak = max(make_table(name, stages, microbatches, repeats).peak_activations())
        return simulate_aligned(name, programs, stages, microbatches, repeats, 2 * peak - 1,
                                split=name == "zero_bubble")
    if name == "zero_bubble":  # ZB-H1: no stage keeps more alive than 1F1B's first stage (the device's peak)
        cap = max(make_table("1f1b", stages, microbatches, repeats).peak_activations())
        return simulate(name, programs, stages, microbatches, repeats, defer_weights=True, caps=[cap] * stages)
    return simulate(name, programs, stages, microbatches, repeats)


# What a stage executes at a tick (`Lowered.kind`): the table's operation, with the forward of the
# last chunk also running the loss (its gradient starts that microbatch's backward).
IDLE, FORWARD, FORWARD_LOSS, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHTS = range(6)


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A table as `[ticks, stages]` int arrays, and the buffer slots each stage needs.

    A stage holds three buffers of slots: `inbox` (forward messages that arrived and wait for
    their forward), `grads_in` (gradients that arrived, or the loss's, waiting for their backward)
    and `saved` (a forward's residuals, kept until the backward that needs them last). Slots are
    assigned here, on the host, so the device program only indexes: a slot is reused as soon as
    its reader ran, and each buffer has as many slots as its most crowded stage holds at once.

    Unsplit schedules (every one but zero_bubble) run a microbatch's whole backward, input and
    weight gradient, at the table's B; their W ticks execute nothing (the table's cost model counts
    a backward as two forwards; the executor does that work in one tick).

    In an aligned table every stage executes the tick's operation (`branch`), so each device takes
    the same branch; a stage with nothing of that kind runs it on a zero gradient or discards the
    forward, and `kind` says what each stage really does."""
    table: Table
    kind: np.ndarray  # IDLE ... BACKWARD_WEIGHTS: what the stage does
    branch: np.ndarray  # what the stage executes: its kind, or in an aligned table the tick's (see `lower`)
    microbatch: np.ndarray
    repeat: np.ndarray  # the chunk's repeat r = chunk // S: which of the stage's R chunks
    first: np.ndarray  # 1 where the op is on chunk 0: its forward reads the embedded batch, its backward writes dx
    inbox_slot: np.ndarray  # FORWARD*: where its input waits (chunk > 0)
    saved_slot: np.ndarray  # FORWARD* write, BACKWARD* read the residuals there
    grads_slot: np.ndarray  # BACKWARD*: where its output gradient waits; FORWARD_LOSS: where it puts it
    recv_inbox: np.ndarray  # where the forward message arriving at the end of the tick goes (-1: none)
    recv_grads: np.ndarray  # where the gradient arriving at the end of the tick goes (-1: none)
    slots: tuple  # (inbox, grads_in, saved) slot counts

    def branch_shares(self) -> list[float]:
        """Per branch of the executor's switch (IDLE ... BACKWARD_WEIGHTS), the share of ticks the
        busiest stage (the most operations; the last, which runs the loss, among equals) takes it:
        what one device executes, which a compiled step's cost model counts for the switch
        (`maxtrain.analysis.hlo.Module.branch_shares`) instead of every branch at every tick.
        Waiting for slower stages is the bubble, reported beside it."""
        import numpy as np

        work = (self.branch != IDLE).sum(axis=0)
        s = max(range(self.table.stages), key=lambda k: (work[k], k))
        return [float(np.mean(self.branch[:, s] == b)) for b in range(BACKWARD_WEIGHTS + 1)]

    def executed_idle(self, trace: np.ndarray) -> float:
        """The idle fraction of an executed program's trace (`[stages, ticks]` of kinds), counting a
        W tick of an unsplit schedule as busy (its work ran with the B before it), as the table does."""
        import numpy as np

        in_table = np.asarray([[op is not None for op in row] for row in self.table.ticks]).T
        busy = (trace != IDLE) | (in_table & (self.kind.T == IDLE))
        return float(1.0 - busy.mean())


class _Slots:
    """A stage's buffer: the lowest free slot on `take`, freed by `give`."""

    def __init__(self):
        self.free, self.size, self.held = [], 0, {}

    def take(self, key) -> int:
        if self.free:
            slot = self.free.pop(0)
        else:
            slot, self.size = self.size, self.size + 1
        self.held[key] = slot
        return slot

    def give(self, key) -> int:
        slot = self.held.pop(key)
        self.free.append(slot)
        self.free.sort()
        return slot


def lower(table: Table) -> Lowered:
    """The table as the index arrays the SPMD program runs (see `Lowered`)."""
    import numpy as np

    S, R = table.stages, table.repeats
    last = S * R - 1
    split = table.name == "zero_bubble"  # W runs the weight half; unsplit, B runs the whole backward
    T = table.length
    arr = {k: np.full((T, S), -1, np.int32) for k in ("microbatch", "repeat", "inbox_slot", "saved_slot",
                                                      "grads_slot", "recv_inbox", "recv_grads")}
    kind = np.zeros((T, S), np.int32)
    first = np.zeros((T, S), np.int32)
    inbox, grads_in, saved = ([_Slots() for _ in range(S)] for _ in range(3))
    for t, row in enumerate(table.ticks):
        sends = []  # (receiving stage, buffer, key) of the messages this tick's operations send
        for s, op in enumerate(row):
            if op is None:
                continue
            m, v = op.microbatch, op.chunk
            key = (m, v)
            arr["microbatch"][t, s], arr["repeat"][t, s], first[t, s] = m, v // S, v == 0
            if op.kind == "F":
                kind[t, s] = FORWARD_LOSS if v == last else FORWARD
                if v > 0:
                    arr["inbox_slot"][t, s] = inbox[s].give(key)
                arr["saved_slot"][t, s] = saved[s].take(key)
                if v == last:
                    arr["grads_slot"][t, s] = grads_in[s].take(key)
                else:
                    sends.append(((s + 1) % S, "inbox", (m, v + 1)))
            elif op.kind == "B":
                kind[t, s] = BACKWARD_INPUT if split else BACKWARD
                arr["saved_slot"][t, s] = saved[s].held[key] if split else saved[s].give(key)
                arr["grads_slot"][t, s] = grads_in[s].held[key] if split else grads_in[s].give(key)
                if v > 0:
                    sends.append(((s - 1) % S, "grads", (m, v - 1)))
            elif split:
                kind[t, s] = BACKWARD_WEIGHTS
                arr["saved_slot"][t, s] = saved[s].give(key)
                arr["grads_slot"][t, s] = grads_in[s].give(key)
        for r, buffer, key in sends:
            if buffer == "inbox":
                arr["recv_inbox"][t, r] = inbox[r].take(key)
            else:
                arr["recv_grads"][t, r] = grads_in[r].take(key)
    sizes = tuple(max(b.size for b in bufs) for bufs in (inbox, grads_in, saved))
    branch = kind.copy()
    if table.aligned:  # every stage executes the tick's operation; those without one discard it
        branch[:] = kind.max(axis=1, keepdims=True)  # a forward tick with a loss: FORWARD_LOSS for all
    return Lowered(table, kind, branch, first=first, slots=sizes, **arr)


def render(table: Table) -> str:
    """The table as text: a row per stage, a column per tick (`.` idle)."""
    S, R = table.stages, table.repeats
    cells = [[(op.label(S, R) if op else ".") for op in row] for row in table.ticks]
    width = max(len(c) for row in cells for c in row) + 1
    lines = [f"{table.name}: S={S} M={table.microbatches} R={R}, {table.length} ticks, bubble "
             f"{100 * table.bubble():.1f}%, peak activations per stage {table.peak_activations()}"]
    for s in range(S):
        lines.append(f"stage {s} |" + "".join(row[s].rjust(width) for row in cells))
    return "\n".join(lines)


def plot(tables: list[Table], path: str) -> None:
    """The tables as one PNG: a row of coloured cells per stage (F blue, B orange, W green)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}
    longest = max(t.length for t in tables)
    fig, axes = plt.subplots(len(tables), 1, figsize=(min(0.32 * longest + 2, 40), 1.0 + 0.55 * sum(
        t.stages for t in tables)), squeeze=False)
    for ax, table in zip(axes[:, 0], tables):
        for t, row in enumerate(table.ticks):
            for s, op in enumerate(row):
                if op is None:
                    continue
                shade = 1.0 - 0.35 * (op.chunk // table.stages) / max(table.repeats - 1, 1)
                ax.add_patch(plt.Rectangle((t, table.stages - 1 - s), 1, 1, color=colors[op.kind], alpha=shade))
                ax.text(t + 0.5, table.stages - 0.5 - s, op.label(table.stages, table.repeats), ha="center",
                        va="center", fontsize=6, color="white")
        ax.set_xlim(0, longest)
        ax.set_ylim(0, table.stages)
        ax.set_yticks([table.stages - 0.5 - s for s in range(table.stages)], [f"stage {s}" for s in range(table.stages)])
        ax.set_title(f"{table.name} (S={table.stages}, M={table.microbatches}, R={table.repeats}): bubble "
                     f"{100 * table.bubble():.1f}%, peak activations {table.peak_activations()}", fontsize=9)
        ax.set_xlabel("tick")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Print (and plot) pipeline schedule tables.")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="chunks per stage for the interleaved schedule")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--png", help="also draw the tables into this PNG")
    args = ap.parse_args(argv)
    tables = []
    for name in args.schedules.split(","):
        R = args.repeats if name == "interleaved" else 1
        problem = check(name, args.stages, args.microbatches, R)
        if problem:
            print(f"maxtrain: error: {problem}", file=sys.stderr)
            return 2
        tables.append(make_table(name, args.stages, args.microbatches, R))
        print(render(tables[-1]) + "\n")
    if args.png:
        plot(tables, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
