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
        return jnp.sum((y @ tp["head"] - batch["t"]) ** 2) + 0.1 * stats["sq"], {"rows": jnp.float32(y.shape[0])}

    def sequential(layers, tp, x_M, rows_M, batch_M):
        total = 0.0
        for m in range(M):
            x, sq = x_M[m], 0.0
            for v in range(S * R):
                x, st = stack_fn(x, jax.tree.map(lambda a: a[v // S, v % S], layers), jax.tree.map(lambda a: a[m], rows_M))
                sq = sq + st["sq"]
            total = total + tail_fn(tp, x, {"sq": sq / (S * R)}, jax.tree.map(lambda a: a[m], batch_M))[0]
        return total

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
        via_vjp = jax.jit(jax.grad(lambda l, t, x: pipeline.scheduled_loss(stack_fn, tail_fn, l, t, x, rows_M,
                                                                           batch_M, low)[0], argnums=(0, 2)))
        g_layers, g_x = via_vjp(staged, tp, x_M)
    want, (w_layers, w_tail, w_x) = jax.jit(jax.value_and_grad(sequential, argnums=(0, 1, 2)))(layers, tp, x_M, rows_M,
                                                                                             batch_M)
    np.testing.assert_allclose(total, want, rtol=1e-5)
    assert float(stats["rows"]) == 4 * M
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
