"""Pipeline schedules as data (maxtrain/parallel/schedules.py): every table is complete and
causal, and its bubble and activation peak are the textbook figures."""

import pytest

from maxtrain.parallel import schedules
from maxtrain.parallel.schedules import make_table, render, validate


@pytest.mark.parametrize("S, M", [(2, 2), (4, 4), (4, 8), (4, 16), (8, 8), (3, 7)])
def test_gpipe_and_1f1b_have_the_same_bubble_and_1f1b_bounds_the_activations(S, M):
    gpipe, one = make_table("gpipe", S, M), make_table("1f1b", S, M)
    for t in (gpipe, one):
        validate(t)
        assert t.length == 3 * M + 3 * (S - 1)  # F + a backward twice as long, and (S - 1) of each
        assert t.bubble() == pytest.approx((S - 1) / (M + S - 1))
    assert gpipe.peak_activations() == [M] * S  # every microbatch alive at the turn
    assert one.peak_activations() == [S - s for s in range(S)]  # at most S, not M


@pytest.mark.parametrize("S, M, R", [(4, 8, 2), (4, 16, 2), (2, 4, 3), (4, 16, 4)])
def test_interleaved_divides_the_bubble_by_the_chunks_per_stage(S, M, R):
    t = make_table("interleaved", S, M, R)
    validate(t)
    bubble = (S - 1) / R  # in whole-stage forwards, against M x 3 of work (Megatron's (S-1)/(R M))
    assert t.bubble() == pytest.approx(3 * bubble / (3 * M + 3 * bubble))
    assert t.bubble() < make_table("1f1b", S, M).bubble()
    assert t.peak_activations()[0] == min(2 * (S - 1) + (R - 1) * S + 1, M * R)  # its warm-up + 1


@pytest.mark.parametrize("S, M", [(4, 4), (4, 8), (4, 16), (8, 16), (2, 5)])
def test_zero_bubble_fills_the_bubble_with_weight_gradients_within_1f1b_memory(S, M):
    zb, one = make_table("zero_bubble", S, M), make_table("1f1b", S, M)
    validate(zb)
    assert zb.length == 3 * M + (S - 1)  # ZB-H1: a bubble of (S - 1)(F + B - W), a third of 1F1B's
    assert zb.bubble() < one.bubble()
    assert max(zb.peak_activations()) <= max(one.peak_activations())  # the device's peak is 1F1B's


def test_render_draws_a_row_per_stage():
    text = render(make_table("interleaved", 2, 4, 2))
    lines = text.splitlines()
    assert lines[0].startswith("interleaved: S=2 M=4 R=2") and "bubble" in lines[0]
    assert lines[1].startswith("stage 0 |") and "F0a" in lines[1] and "F0b" in lines[1] and len(lines) == 3


@pytest.mark.parametrize("name, S, M, R, message", [
    ("1f2b", 4, 8, 1, "unknown pipeline schedule '1f2b'"),
    ("1f1b", 4, 3, 1, "3 microbatches are fewer than the 4 pipeline stages"),
    ("interleaved", 4, 8, 1, "needs train.pipeline_repeats >= 2"),
    ("interleaved", 4, 6, 2, "use a multiple of 4"),
    ("zero_bubble", 4, 8, 2, "use train.pipeline_repeats=1"),
])
def test_schedules_that_cannot_run_say_why(name, S, M, R, message):
    assert message in schedules.check(name, S, M, R)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        make_table(name, S, M, R)


def test_validate_catches_a_backward_before_its_forward():
    t = make_table("1f1b", 2, 2)
    swapped = list(t.ticks)
    swapped[0], swapped[-1] = swapped[-1], swapped[0]
    with pytest.raises(AssertionError, match="before"):
        validate(schedules.Table(t.name, 2, 2, 1, tuple(swapped)))


def _rebuilt(table, edits):
    """`table` with operations (kind, microbatch, chunk) moved to (tick, stage), added there (a
    second copy) or dropped; ticks past the end extend the table."""
    placed = [[op.kind, op.microbatch, op.chunk, t, s]
              for t, row in enumerate(table.ticks) for s, op in enumerate(row) if op]
    for how, op, at in edits:
        if how == "add":
            placed.append([*op, *at])
            continue
        i = next(i for i, p in enumerate(placed) if tuple(p[:3]) == op)
        if how == "drop":
            placed.pop(i)
        else:
            placed[i][3:] = at
    rows = [[None] * table.stages for _ in range(max(p[3] for p in placed) + 1)]
    for k, m, v, t, s in placed:
        assert rows[t][s] is None, "the edit collides with another operation"
        rows[t][s] = schedules.Op(k, m, v)
    return schedules.Table(table.name, table.stages, table.microbatches, table.repeats, tuple(map(tuple, rows)),
                           table.aligned, table.whole_backward)


# S=2 M=2; 1f1b:        stage 0 | F0 F1 .  .  B0 W0 .  B1 W1     zero_bubble: stage 0 | F0 F1 .  B0 W0 B1 W1
#                       stage 1 | .  F0 B0 W0 F1 B1 W1 .  .                   stage 1 | .  F0 B0 F1 B1 W0 W1
#      1f1b (aligned):  stage 0 | F0 F1 .  B0 .  .  B1
#                       stage 1 | .  F0 B0 .  F1 B1 .
@pytest.mark.parametrize("name, aligned, edits, message", [
    ("1f1b", False, [("drop", ("W", 1, 0), None)], "missing"),
    ("1f1b", False, [("add", ("F", 0, 0), (9, 0))], "twice"),
    ("1f1b", False, [("move", ("W", 1, 1), (9, 0))], "on stage 0"),
    # unsplit, B(1, 0) waits for the whole backward of chunk 1, its W too (at 7, with B(1, 0))
    ("1f1b", False, [("move", ("W", 1, 1), (7, 1))], r"B.*microbatch=1, chunk=0.* before"),
    ("zero_bubble", False, [("move", ("W", 0, 0), (2, 0))], r"W.*microbatch=0, chunk=0.* before"),  # W before its B
    ("zero_bubble", False, [("move", ("F", 0, 1), (0, 1))], r"F.*microbatch=0, chunk=1.* before"),  # with chunk 0's F
    ("1f1b", True, [("move", ("F", 1, 1), (3, 1))], "mixes kinds"),  # F beside stage 0's B0 at tick 3
], ids=["missing", "twice", "other_stage", "unsplit_b_with_next_w", "w_before_b", "f_with_previous_f", "mixed_kinds"])
def test_validate_rejects_broken_tables(name, aligned, edits, message):
    """`validate` refuses a table that misses an operation, runs one twice or on another stage, runs
    one before what it needs, or (aligned) mixes kinds of operation in a tick."""
    table = make_table(name, 2, 2, 1, aligned)
    validate(table)
    with pytest.raises(AssertionError, match=message):
        validate(_rebuilt(table, edits))


def test_the_command_prints_every_schedule_and_refuses_bad_input(tmp_path, capsys):
    assert schedules.main(["--stages", "4", "--microbatches", "8", "--png", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert all(f"{n}: S=4 M=8" in out for n in schedules.SCHEDULES) and (tmp_path / "s.png").stat().st_size > 5000
    assert schedules.main(["--stages", "4", "--microbatches", "2"]) == 2
    assert capsys.readouterr().err.startswith("maxtrain: error: 2 microbatches are fewer than the 4")


CASES = [("gpipe", 2, 4, 2, False), ("1f1b", 4, 8, 1, False), ("1f1b", 3, 7, 1, False), ("interleaved", 2, 4, 2, False),
         ("interleaved", 4, 8, 2, False), ("zero_bubble", 4, 6, 1, False),
         ("1f1b", 4, 8, 1, True), ("interleaved", 2, 4, 2, True), ("zero_bubble", 4, 6, 1, True)]  # aligned


@pytest.mark.parametrize("name, S, M, R, aligned", CASES)
def test_lowered_slots_hold_each_message_until_its_reader(name, S, M, R, aligned):
    """Replays the lowered arrays on the host: every forward reads the activation its previous
    chunk sent, every backward the gradient its next chunk (or its loss) sent and the residuals its
    own forward saved; no slot is overwritten while it holds something not yet read; a 1F1B stage
    saves at most S forwards' residuals."""
    low = schedules.lower(make_table(name, S, M, R, aligned))
    split, last = name == "zero_bubble", S * R - 1
    held = [{"inbox": {}, "grads": {}, "saved": {}} for _ in range(S)]

    def put(s, buf, slot, key):
        assert slot not in held[s][buf], f"{buf} slot {slot} of stage {s} overwritten"
        held[s][buf][slot] = key

    for t, row in enumerate(low.table.ticks):
        arrivals = []
        for s, op in enumerate(row):
            kind = low.kind[t, s]
            if op is None or kind == schedules.IDLE:
                continue
            key = (op.microbatch, op.chunk)
            assert (low.microbatch[t, s], low.repeat[t, s], low.first[t, s]) == (op.microbatch, op.chunk // S,
                                                                                  op.chunk == 0)
            if op.kind == "F":
                if op.chunk:
                    assert held[s]["inbox"].pop(low.inbox_slot[t, s]) == key
                put(s, "saved", low.saved_slot[t, s], key)
                if op.chunk == last:
                    put(s, "grads", low.grads_slot[t, s], key)
                else:
                    arrivals.append(((s + 1) % S, "inbox", low.recv_inbox[t, (s + 1) % S], (op.microbatch, op.chunk + 1)))
            else:
                take = dict.pop if op.kind == "W" or not split else dict.get
                assert take(held[s]["saved"], low.saved_slot[t, s]) == key
                assert take(held[s]["grads"], low.grads_slot[t, s]) == key
                if op.kind == "B" and op.chunk:
                    arrivals.append(((s - 1) % S, "grads", low.recv_grads[t, (s - 1) % S], (op.microbatch, op.chunk - 1)))
        for s, buf, slot, key in arrivals:
            put(s, buf, slot, key)
    assert all(not b for h in held for b in h.values())
    if name == "1f1b":
        assert low.slots[2] == (2 * S - 1 if aligned else S)


@pytest.mark.parametrize("name, S, M, R, aligned", CASES)
def test_executed_schedule_matches_autodiff_and_its_table(name, S, M, R, aligned):
    """`pipeline.execute` on a small stack with per-layer statistics and a loss that reads them:
    the losses, the gradients of the layers, the loss's own parameters and the inputs equal
    autodiff of the same model run sequentially; the program's trace is the table (each stage
    ran what the table says, so its idle fraction is the table's bubble)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from maxtrain.parallel import pipeline

    def stack_fn(x, chunk, rows):
        def body(x, w):
            x = jnp.tanh(x @ w + rows["bias"][:, None])
            return x, jnp.mean(x ** 2)
        x, sq = jax.lax.scan(jax.checkpoint(body), x, chunk["w"])
        return x, {"sq": jnp.mean(sq)}

    def tail_fn(tp, y, stats, batch):
        return (jnp.sum((y @ tp["head"] - batch["t"]) ** 2) + 0.1 * stats["sq"],
                {"rows": jnp.float32(y.shape[0]), "sq": stats["sq"]})

    def sequential(layers, tp, x_M, rows_M, batch_M):
        """The loss and the statistic the loss sees (summed over microbatches), chunk by chunk in order."""
        total, sq_seen = 0.0, 0.0
        for m in range(M):
            x, sq = x_M[m], 0.0
            for v in range(S * R):
                x, st = stack_fn(x, jax.tree.map(lambda a: a[v // S, v % S], layers), jax.tree.map(lambda a: a[m], rows_M))
                sq = sq + st["sq"]
            total = total + tail_fn(tp, x, {"sq": sq / (S * R)}, jax.tree.map(lambda a: a[m], batch_M))[0]
            sq_seen = sq_seen + sq / (S * R)  # a microbatch's loss sees the mean over its S R chunk visits
        return total, sq_seen

    k = jax.random.split(jax.random.key(0), 5)
    layers = {"w": jax.random.normal(k[0], (R, S, 2, 8, 8)) / 3}
    tp = {"head": jax.random.normal(k[1], (8, 3))}
    x_M = jax.random.normal(k[2], (M, 4, 8))
    rows_M, batch_M = {"bias": jax.random.normal(k[3], (M, 4))}, {"t": jax.random.normal(k[4], (M, 4, 3))}
    low = schedules.lower(make_table(name, S, M, R, aligned))
    mesh = jax.make_mesh((S, 2), ("pipeline", "fsdp"), devices=jax.devices()[:2 * S],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)  # as the trainer's mesh
    with jax.set_mesh(mesh):
        staged = jax.device_put(layers, NamedSharding(mesh, P(None, "pipeline")))
        (total, stats), (d_layers, d_tail, d_x), trace = jax.jit(
            lambda *a: pipeline.execute(stack_fn, tail_fn, *a, low))(staged, tp, x_M, rows_M, batch_M)
        # 2.5 x the loss: the custom VJP must scale by its incoming cotangent (the trainer's is always 1)
        via_vjp = jax.jit(jax.grad(lambda l, t, x: 2.5 * pipeline.scheduled_loss(stack_fn, tail_fn, l, t, x, rows_M,
                                                                                 batch_M, low)[0], argnums=(0, 2)))
        g_layers, g_x = via_vjp(staged, tp, x_M)
        g_layers, g_x = jax.tree.map(lambda g: g / 2.5, (g_layers, g_x))
    (want, want_sq), (w_layers, w_tail, w_x) = jax.jit(jax.value_and_grad(sequential, argnums=(0, 1, 2), has_aux=True))(
        layers, tp, x_M, rows_M, batch_M)
    np.testing.assert_allclose(total, want, rtol=1e-5)
    assert float(stats["rows"]) == 4 * M
    np.testing.assert_allclose(stats["sq"], want_sq, rtol=1e-5)  # averaged over S R chunks, not S or R
    for got, ref in ((d_layers["w"], w_layers["w"]), (d_tail["head"], w_tail["head"]), (d_x, w_x),
                     (g_layers["w"], w_layers["w"]), (g_x, w_x)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    trace = np.asarray(trace)  # the branch each stage executed where it had an operation
    np.testing.assert_array_equal(trace, np.where(low.kind == schedules.IDLE, schedules.IDLE, low.branch).T)
    assert low.executed_idle(trace) == pytest.approx(low.table.bubble(), abs=1e-9)


@pytest.mark.parametrize("name, R", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)])
def test_aligned_tables_run_one_kind_per_tick_within_twice_the_peak(name, R):
    """Aligned (sequence-parallel stages): every tick one kind of operation on all stages, the
    table complete and causal, a stage's live activations within 2 x the unaligned peak - 1."""
    for S, M in ((2, 4), (4, 8), (4, 16)):
        plain, aligned = make_table(name, S, M, R), make_table(name, S, M, R, aligned=True)
        validate(aligned)
        assert aligned.aligned and aligned.whole_backward == (name != "zero_bubble")
        assert max(aligned.peak_activations()) <= 2 * max(plain.peak_activations()) - 1


def test_branch_shares_are_what_the_busiest_stage_runs():
    """A compiled step's cost model counts the executor's switch as the busiest stage runs it: for
    1F1B the last stage, M forwards with the loss and M whole backwards out of the table's ticks."""
    S, M = 4, 8
    low = schedules.lower(make_table("1f1b", S, M))
    shares = low.branch_shares()
    T = low.table.length
    assert sum(shares) == pytest.approx(1.0)
    assert shares[schedules.FORWARD_LOSS] == pytest.approx(M / T)
    assert shares[schedules.BACKWARD] == pytest.approx(M / T)
    assert shares[schedules.FORWARD] == 0 and shares[schedules.BACKWARD_WEIGHTS] == 0
    zb = schedules.lower(make_table("zero_bubble", S, M)).branch_shares()
    assert zb[schedules.BACKWARD_INPUT] == zb[schedules.BACKWARD_WEIGHTS] > 0 and zb[schedules.BACKWARD] == 0


def test_module_counts_a_switch_by_its_shares():
    from maxtrain.analysis.hlo import Module, parse

    hlo = """HloModule m

%b0 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ag = f32[4]{0} all-gather(%p), replica_groups={{0,1}}, dimensions={0}
}

%b1 (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%q), replica_groups={{0,1}}, to_apply=%b0
}

ENTRY %main (i: s32[], x: f32[4]) -> f32[4] {
  %i = s32[] parameter(0)
  %x = f32[4]{0} parameter(1)
  ROOT %c = f32[4]{0} conditional(%i, %x, %x), branch_computations={%b0, %b1}
}
"""
    module = parse(hlo)
    assert module.runs_per_step()["b0"] == 1 and module.runs_per_step()["b1"] == 1  # every branch, unweighted
    weighted = Module(module.computations, module.entry, branch_shares={2: [0.25, 0.75]})
    assert weighted.runs_per_step()["b0"] == 0.25 and weighted.runs_per_step()["b1"] == 0.75


# ---------------------------------------------------------------------------------------------------
# An independent model of the tables, written from what the module docstring and docs/parallelism.md
# ("Pipeline", "Schedules", "Sequence-parallel stages: aligned tables") promise. It imports nothing
# from `schedules` but `make_table` and the table's public data (`Table.ticks` of `Op`s), so a bug in
# the module's programs, dependencies, greedy simulation or aligned tie-breaking cannot hide in a
# helper both sides share. An operation is the tuple (kind, microbatch, chunk); chunk v runs on stage
# v mod S.


def _stage_program(name, S, M, R, s):
    """Stage s's operations in the order the docs give them."""
    split = name == "zero_bubble"  # only ZB-H1 splits a backward; its W's leave the program (deferred)

    def backward(m, v):
        return [("B", m, v)] + ([] if split else [("W", m, v)])

    if name == "gpipe":  # every forward, round the ring repeat by repeat, then every backward in reverse
        items = [(m, r * S + s) for r in range(R) for m in range(M)]
        return [("F", m, v) for m, v in items] + [op for m, v in reversed(items) for op in backward(m, v)]
    if name == "interleaved":  # groups of S microbatches chunk by chunk; going back, the last chunk first
        groups = [range(g * S, (g + 1) * S) for g in range(M // S)]
        fwd = [(m, r * S + s) for g in groups for r in range(R) for m in g]
        bwd = [(m, r * S + s) for g in groups for r in reversed(range(R)) for m in g]
        warmup = 2 * (S - s - 1) + (R - 1) * S
    else:  # 1f1b, zero_bubble: one chunk per stage, S - s - 1 forwards of warm-up
        fwd = bwd = [(m, s) for m in range(M)]
        warmup = S - s - 1
    warmup = min(warmup, len(fwd))
    program = [("F", m, v) for m, v in fwd[:warmup]]
    for k in range(len(fwd) - warmup):  # one forward, one backward
        program += [("F", *fwd[warmup + k])] + backward(*bwd[k])
    for m, v in bwd[len(fwd) - warmup:]:
        program += backward(m, v)
    return program


def _needs(op, chunks, b_after_b):
    """F after the previous chunk's F; B after its own F and the next chunk's backward (B when the
    backward is split or whole, its W when B and W are autodiff's one computation); W after its B."""
    kind, m, v = op
    if kind == "F":
        return [("F", m, v - 1)] if v else []
    if kind == "W":
        return [("B", m, v)]
    return [("F", m, v)] + ([] if v == chunks - 1 else [("B" if b_after_b else "W", m, v + 1)])


def _as_stage_rows(when, S):
    """{op: tick} as rows[t][s]."""
    rows = [[None] * S for _ in range(max(when.values()) + 1)]
    for op, t in when.items():
        assert rows[t][op[2] % S] is None, f"two operations on stage {op[2] % S} at tick {t}"
        rows[t][op[2] % S] = op
    return rows


def _greedy(programs, S, R):
    """gpipe, 1f1b, interleaved: every operation at the earliest tick after both the stage's previous
    operation and everything it needs (a fixed point, filled in program order, not a tick loop)."""
    when, nxt = {}, [0] * S
    while any(nxt[s] < len(programs[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while nxt[s] < len(programs[s]):
                op = programs[s][nxt[s]]
                needs = _needs(op, S * R, False)
                if not all(d in when for d in needs):
                    break
                prev = when[programs[s][nxt[s] - 1]] if nxt[s] else -1
                when[op] = max([prev] + [when[d] for d in needs]) + 1
                nxt[s], progressed = nxt[s] + 1, True
        assert progressed, "the documented programs deadlock"
    return _as_stage_rows(when, S)


def _zero_bubble(programs, S, cap):
    """ZB-H1: a stage runs its program's head (F or B) when what it needs is done, unless it is a
    forward that would pass `cap` alive while a W waits; else its oldest deferred W; else it idles."""
    queue, alive, when, t = [[] for _ in range(S)], [0] * S, {}, 0
    programs = [list(p) for p in programs]
    while any(programs) or any(queue):
        ran = []
        for s in range(S):
            head = programs[s][0] if programs[s] else None
            go = head is not None and all(when.get(d, t) < t for d in _needs(head, S, True))
            if go and head[0] == "F" and alive[s] >= cap and queue[s]:
                go = False
            op = programs[s].pop(0) if go else queue[s].pop(0) if queue[s] else None
            if op is not None:
                alive[s] += {"F": 1, "B": 0, "W": -1}[op[0]]
                if op[0] == "B":
                    queue[s].append(("W",) + op[1:])
                ran.append(op)
        for op in ran:
            when[op] = t
        t += 1
    return _as_stage_rows(when, S)


# The aligned rule (make_table's docstring, docs "aligned tables"): each tick runs ONE kind of
# operation, the kind the most stages are ready for; among kinds with equally many ready stages a
# backward B wins, then a forward F, then a deferred weight gradient W. Each stage keeps its
# program's order of forwards and of backwards; a forward waits while `cap` of its microbatches are
# alive (a stage holds at most twice the unaligned peak, less one); an unsplit backward is one B.
ALIGNED_ORDER = ("B", "F", "W")


def _aligned(programs, S, R, cap, split):
    """An aligned table by the rule above, tick by tick (`split`: B and W apart, zero-bubble's)."""
    queues = [{"F": [op for op in p if op[0] == "F"], "B": [op for op in p if op[0] == "B"], "W": []}
              for p in programs]
    alive, when, t = [0] * S, {}, 0
    while any(any(q.values()) for q in queues):
        ready = {k: [] for k in ALIGNED_ORDER}
        for s, q in enumerate(queues):
            for k in ("F", "B"):
                if q[k] and all(when.get(d, t) < t for d in _needs(q[k][0], S * R, True)):
                    if k == "B" or alive[s] < cap:
                        ready[k].append(s)
            if q["W"]:
                ready["W"].append(s)
        most = max(len(v) for v in ready.values())
        assert most, "the aligned rule deadlocks"
        kind = next(k for k in ALIGNED_ORDER if len(ready[k]) == most)
        for s in ready[kind]:
            op = queues[s][kind].pop(0)
            when[op] = t
            if kind == "F":
                alive[s] += 1
            elif kind == "B" and split:
                queues[s]["W"].append(("W",) + op[1:])
            else:
                alive[s] -= 1
        t += 1
    return _as_stage_rows(when, S)


def _alive_peak(rows, S, last):
    """Per stage, the most activations alive: from a forward until its `last` kind of operation."""
    alive, peak = [0] * S, [0] * S
    for row in rows:
        for s, op in enumerate(row):
            if op:
                alive[s] += op[0] == "F"
                peak[s] = max(peak[s], alive[s])
                alive[s] -= op[0] == last
    return peak


def _expected(name, S, M, R, aligned):
    programs = [_stage_program(name, S, M, R, s) for s in range(S)]
    if aligned:
        unaligned = _expected(name, S, M, R, False)
        peak = max(_alive_peak(unaligned, S, "W"))
        return _aligned(programs, S, R, 2 * peak - 1, split=name == "zero_bubble")
    if name == "zero_bubble":  # never more alive than 1F1B's first stage, S (M >= S)
        return _zero_bubble(programs, S, cap=S)
    return _greedy(programs, S, R)


def _rows(table):
    return [[None if op is None else (op.kind, op.microbatch, op.chunk) for op in row] for row in table.ticks]


MODEL_CASES = [(n, S, M, 1) for n in ("gpipe", "1f1b", "zero_bubble")
               for S, M in ((2, 2), (2, 3), (3, 4), (3, 7), (4, 8))]
MODEL_CASES += [("gpipe", 2, 3, 2), ("gpipe", 3, 3, 2), ("interleaved", 2, 2, 2), ("interleaved", 2, 4, 2),
                ("interleaved", 2, 4, 3), ("interleaved", 3, 6, 2), ("interleaved", 4, 8, 2), ("interleaved", 4, 4, 3)]


@pytest.mark.parametrize("aligned", [False, True], ids=["plain", "aligned"])
def test_every_table_is_the_documented_rule_run_tick_by_tick(aligned):
    """Each schedule's table, operation by operation, is the independent model's: the documented
    programs run greedily (or, aligned, one kind per tick by the documented tie-break), for
    several S, M and R."""
    for name, S, M, R in MODEL_CASES:
        table = make_table(name, S, M, R, aligned)
        assert (table.stages, table.microbatches, table.repeats, table.aligned) == (S, M, R, aligned)
        got, want = _rows(table), _expected(name, S, M, R, aligned)
        assert got == want, f"{name} S={S} M={M} R={R} aligned={aligned}: first difference at tick " \
            f"{next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"
        last = "B" if aligned and name != "zero_bubble" else "W"
        assert table.peak_activations() == _alive_peak(want, S, last)
        idle = sum(op is None for row in want for op in row)
        assert table.bubble() == pytest.approx(idle / (len(want) * S))


def _by_hand(stage_rows):
    """Tables written by hand, a string per stage, a token per tick: `.` idle, else kind,
    microbatch and (R > 1) the repeat as a letter, `F1b` = forward of microbatch 1 on the stage's
    second chunk (chunk S + s)."""
    S = len(stage_rows)
    cells = [row.split() for row in stage_rows]
    assert len({len(c) for c in cells}) == 1
    out = []
    for t in range(len(cells[0])):
        row = []
        for s in range(S):
            tok = cells[s][t]
            if tok == ".":
                row.append(None)
                continue
            r = ord(tok[-1]) - ord("a") if tok[-1].isalpha() else 0
            row.append((tok[0], int(tok[1:].rstrip("abcdef")), r * S + s))
        out.append(row)
    return out


PINNED = {
    # GPipe S=2 M=3: stage 0 forwards at ticks 0-2, stage 1 a tick later; stage 1's B2 waits for its F2
    # (tick 3), each W right after its B; stage 0's B2 needs stage 1's W2 (tick 5), so it runs at 6.
    ("gpipe", 2, 3, 1, False): ["F0 F1 F2 .  .  .  B2 W2 B1 W1 B0 W0",
                                ".  F0 F1 F2 B2 W2 B1 W1 B0 W0 .  ."],
    # 1F1B S=3 M=4: warm-ups of 2, 1, 0 forwards; then F, B, W alternate. Each op at the earliest tick
    # after the stage's previous op and what it needs: e.g. stage 1's B0 at 5 (stage 2's W0 at 4), its
    # F2 at 7, B1 at 8 (stage 2's W1 at 7); stage 0's B0 at 7 (stage 1's W0 at 6), ... 3M + 3(S-1) = 18.
    ("1f1b", 3, 4, 1, False): ["F0 F1 F2 .  .  .  .  B0 W0 F3 B1 W1 .  B2 W2 .  B3 W3",
                               ".  F0 F1 .  .  B0 W0 F2 B1 W1 F3 B2 W2 .  B3 W3 .  .",
                               ".  .  F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3 .  .  .  ."],
    # interleaved S=2 M=2 R=2: stage 0's warm-up 2(S-1) + (R-1)S = 4 is all its forwards (chunks 0
    # then 2), stage 1's is 2 (chunk 1), then F0b B0b W0b F1b B1b W1b; the backwards go the last chunk
    # first. Stage 0's B0b (chunk 2) waits for stage 1's W0b (chunk 3, tick 5); its B0a for W0a (10).
    ("interleaved", 2, 2, 2, False): ["F0a F1a F0b F1b .   .   B0b W0b .   B1b W1b B0a W0a B1a W1a",
                                      ".   F0a F1a F0b B0b W0b F1b B1b W1b B0a W0a B1a W1a .   ."],
    # aligned 1F1B S=2 M=2 (cap 2*2-1 = 3, a whole backward is one B): t0 F on stage 0; t1 F on both;
    # t2 stage 1 is ready for F1 and for B0 (one stage each): B first among equals; t3 stage 0's B0
    # against stage 1's F1: B again; t4 F1; t5, t6 the backwards of microbatch 1.
    ("1f1b", 2, 2, 1, True): ["F0 F1 .  B0 .  .  B1",
                              ".  F0 B0 .  F1 B1 ."],
    # aligned zero-bubble S=2 M=2 (its unaligned peak 2, cap 3): as above to t3 (B beats F and W, one
    # stage each), t4 both stages hold a W (two ready beat F's one), t5 F1, t6 B1 on stage 1, t7
    # stage 0's B1 against stage 1's W1: B first; t8 both W's.
    ("zero_bubble", 2, 2, 1, True): ["F0 F1 .  B0 W0 .  .  B1 W1",
                                     ".  F0 B0 .  W0 F1 B1 .  W1"],
}


@pytest.mark.parametrize("key", list(PINNED), ids=["-".join(map(str, k)) for k in PINNED])
def test_small_tables_are_the_hand_derived_ones(key):
    name, S, M, R, aligned = key
    assert _rows(make_table(name, S, M, R, aligned)) == _by_hand(PINNED[key])


def test_interleaved_stage_runs_groups_of_s_microbatches_chunk_by_chunk():
    """Megatron's virtual-stage order, written out for S=2 M=4 R=2: each stage runs microbatches 0, 1
    on its first chunk (a), then on its second (b), then 2, 3 likewise; backwards the last chunk first."""
    table = make_table("interleaved", 2, 4, 2)
    for s in range(2):
        labels = [op.label(2, 2) for row in table.ticks if (op := row[s]) is not None]
        assert [x for x in labels if x[0] == "F"] == "F0a F1a F0b F1b F2a F3a F2b F3b".split()
        assert [x for x in labels if x[0] == "B"] == "B0b B1b B0a B1a B2b B3b B2a B3a".split()
        assert all(op.chunk % 2 == s for row in table.ticks if (op := row[s]) is not None)


# docs/parallelism.md's numbers at S=4, M=16 (R=2 for interleaved): table length, bubble in percent,
# and each stage's peak of live activations.
DOCUMENTED = {
    ("1f1b", 1, False): (57, 15.8, [4, 3, 2, 1]),
    ("interleaved", 2, False): (105, 8.6, [11, 9, 7, 5]),
    ("zero_bubble", 1, False): (51, 5.9, [4, 4, 4, 4]),
    ("gpipe", 1, False): (57, 15.8, [16] * 4),
    ("1f1b", 1, True): (49, 34.7, None),
    ("interleaved", 2, True): (79, 19.0, None),
    ("zero_bubble", 1, True): (67, 28.4, None),
}


@pytest.mark.parametrize("key", list(DOCUMENTED), ids=["-".join(map(str, k)) for k in DOCUMENTED])
def test_tables_have_the_documented_lengths_bubbles_and_peaks(key):
    """The figures docs/parallelism.md prints; textbook bubbles; the aligned peak 2 x unaligned - 1."""
    name, R, aligned = key
    S, M = 4, 16
    table = make_table(name, S, M, R, aligned)
    length, bubble, peaks = DOCUMENTED[key]
    assert table.length == length and round(100 * table.bubble(), 1) == bubble
    if not aligned:
        assert table.peak_activations() == peaks
        # the textbook bubble (S - 1)/(M + S - 1), with R chunks (S - 1)/(R M + S - 1); ZB-H1 idles
        # S - 1 ticks beside 3M of work (F, B and W one tick each)
        textbook = (S - 1) / (3 * M + S - 1) if name == "zero_bubble" else (S - 1) / (R * M + S - 1)
        assert table.bubble() == pytest.approx(textbook)
    else:  # the cap is reached: twice the unaligned peak, less one (1F1B: 2S - 1)
        assert max(table.peak_activations()) == 2 * max(DOCUMENTED[(name, R, False)][2]) - 1


# ---------------------------------------------------------------------------------------------------
# Bookkeeping of the executors with R > 1 chunks per stage: which layer each chunk holds, and over
# how many visits the layers' statistics are averaged.


def _tanh_stack(x, chunk, rows):
    """A chunk of `tanh(x W + bias)` layers; statistics per visit: the mean square of every layer's
    output, the layer's own tag (which layer of the flat stack it is) and a 1 (counts visits)."""
    import jax
    import jax.numpy as jnp

    def body(x, p):
        x = jnp.tanh(x @ p["w"] + rows["bias"][:, None])
        return x, (jnp.mean(x ** 2), p["tag"])
    x, (sq, tag) = jax.lax.scan(body, x, chunk)
    return x, {"sq": jnp.mean(sq), "tag": jnp.mean(tag), "one": jnp.float32(1.0)}


def test_stage_specs_put_flat_layer_r_s_j_at_chunk_r_times_s_plus_s():
    """`[N, ...]` -> `[R, S, N/(S R), ...]`: staged [r, s, j] is flat layer (r S + s) N/(S R) + j."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from maxtrain.models.specs import ParamSpec
    from maxtrain.parallel.pipeline import stage_specs

    S, R, c = 2, 3, 2
    spec = ParamSpec((S * R * c, 3), ("layers", None),
                     lambda key, shape: jnp.arange(shape[0] * shape[1]).reshape(shape))
    staged = stage_specs({"w": spec}, S, R)["w"]
    assert staged.shape == (R, S, c, 3) and staged.axes == ("repeats", "stages", "layers", None)
    got = np.asarray(staged.init(jax.random.key(0), staged.shape))
    for r in range(R):
        for s in range(S):
            for j in range(c):
                np.testing.assert_array_equal(got[r, s, j], 3 * ((r * S + s) * c + j) + np.arange(3))


def test_gpipe_layers_with_repeats_match_the_flat_stack_and_average_statistics_per_visit():
    """`pipeline.pipeline_layers` (gpipe, and every schedule's evaluation) with S=2, R=3, M=4 (no two
    alike, so a divisor with a factor swapped or missing shows): the output equals the flat stack of
    N = S R c layers run on one device in flat order, and each statistic is its mean over the M S R
    (microbatch, chunk) visits. Oracle: numpy in float64, the whole batch through the N layers in
    order; a chunk's statistic is the mean over its c layers and every microbatch is equally large,
    so the visits' mean is the mean over layers of the mean over all rows."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from maxtrain.parallel import pipeline

    S, R, M, c, b, D = 2, 3, 4, 2, 2, 8
    N = S * R * c
    rng = np.random.default_rng(0)
    w = rng.normal(size=(N, D, D)).astype(np.float32) / 3
    tag = (np.arange(N) ** 2).astype(np.float32)  # distinct per layer, not symmetric about the middle
    x = rng.normal(size=(M * b, D)).astype(np.float32)
    bias = rng.normal(size=(M * b,)).astype(np.float32)

    h, sq = x.astype(np.float64), []
    for n in range(N):  # the flat stack, layer 0 first
        h = np.tanh(h @ w[n] + bias[:, None])
        sq.append(np.mean(h ** 2))
    want_stats = {"sq": np.mean(sq), "tag": np.mean(tag), "one": 1.0}

    staged = {"w": w.reshape(R, S, c, D, D), "tag": tag.reshape(R, S, c)}  # stage_specs' layout
    mesh = jax.make_mesh((S,), ("pipeline",), devices=jax.devices()[:S], axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        staged = jax.device_put(staged, NamedSharding(mesh, P(None, "pipeline")))
        y, stats = jax.jit(lambda x, layers, rows: pipeline.pipeline_layers(
            _tanh_stack, x, layers, rows, stages=S, repeats=R, microbatches=M))(x, staged, {"bias": bias})
    np.testing.assert_allclose(np.asarray(y), h, rtol=1e-5, atol=1e-6)
    rows_of = np.asarray(pipeline.split_microbatches(np.arange(M * b), M))  # microbatch m: rows m, m + M, ...
    np.testing.assert_array_equal(rows_of, np.arange(M * b).reshape(b, M).T)
    assert float(stats["one"]) == pytest.approx(1.0, abs=1e-6)  # M S R visits, each counted once
    for k in ("sq", "tag"):
        np.testing.assert_allclose(float(stats[k]), want_stats[k], rtol=1e-5)
