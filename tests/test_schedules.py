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
