"""Pipeline parallelism: the schedule, parity with the unpipelined run, composition, bad input."""

import functools

import jax
import numpy as np
import pytest

from conftest import SMALL, TINY
from maxtrain import load_config, train
from maxtrain.config import ConfigError
from maxtrain.parallel.pipeline import bubble_fraction, schedule
from maxtrain.parallel.schedules import make_table
from maxtrain.analysis.inspect import inspect_step
from maxtrain.step import make_setup

pytestmark = pytest.mark.slow  # pipeline schedules trained against one device: `-m "not slow"` leaves them out

COMMON = SMALL + ["train.steps=3", "model.n_layers=4"]


@pytest.mark.parametrize("S,M,R", [(2, 2, 1), (4, 4, 1), (2, 3, 2), (4, 6, 3)])
def test_schedule_runs_every_item_once_in_order_with_the_predicted_bubble(S, M, R):
    items = schedule(S, M, R)
    assert items.shape == (M * R + S - 1, S)
    for s in range(S):  # each stage runs every (microbatch, repeat) once, in order
        assert [i for i in items[:, s] if i >= 0] == list(range(M * R))
    when = {(i, s): t for t in range(items.shape[0]) for s in range(S) if (i := items[t, s]) >= 0}
    for (i, s), t in when.items():  # an item reaches a stage after the previous stage finished it...
        if s > 0:
            assert when[(i, s - 1)] == t - 1
        elif i >= M:  # ...and stage 0 only after the last stage finished its previous repeat
            assert when[(i - M, S - 1)] < t
    idle = float(np.mean(items < 0))
    assert idle == pytest.approx(bubble_fraction(S, M, R)) == pytest.approx((S - 1) / (M * R + S - 1))


def _losses(result, key="loss"):
    return [r[key] for r in result.history]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    return train(load_config(TINY, COMMON + [f"run_dir={run}", "mesh.data=1"]), devices=jax.devices()[:1])


@pytest.mark.parametrize("mesh", [
    ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "train.pipeline_repeats=2",
     "train.microbatches=4", "model.remat=save_dots", "train.pipeline_schedule=interleaved"],  # fsdp + tensor inside
    ["mesh.pipeline=4", "mesh.data=2", "train.microbatches=8", "model.remat=none"],  # 1f1b, the default
    ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "train.microbatches=4",
     "train.pipeline_schedule=zero_bubble"],
    ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.sequence=2", "model.attention=ring",
     "train.pipeline_schedule=gpipe"],
    ["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", "train.pipeline_repeats=2", "train.microbatches=4",
     "train.pipeline_remat=true", "model.remat=none", "train.pipeline_schedule=gpipe"],  # each visit recomputed
    ["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", "train.pipeline_repeats=2", "train.microbatches=4",
     "train.pipeline_remat=true", "model.remat=none", "train.pipeline_schedule=interleaved"],
    # the composition, ring attention's shard_map nested in the pipeline's; microbatches
    # default to the stage count
])
def test_pipelined_training_matches_one_device(mesh, reference, tmp_path):
    cfg = load_config(TINY, COMMON + [f"run_dir={tmp_path / 'run'}", *mesh])
    result = train(cfg)
    np.testing.assert_allclose(_losses(result), _losses(reference), rtol=2e-5)
    np.testing.assert_allclose(_losses(result, "grad_norm"), _losses(reference, "grad_norm"), rtol=2e-5)
    w = result.state.params["layers"]["wq"]  # [repeats, stages, layers per chunk, ...]
    assert w.shape[:3] == (cfg.train.pipeline_repeats, cfg.mesh.pipeline, 4 // (cfg.mesh.pipeline *
                                                                                  cfg.train.pipeline_repeats))
    assert w.sharding.shard_shape(w.shape)[1] == 1  # each stage holds only its own layers
    assert result.history[-1]["pipeline_bubble"] == pytest.approx(make_table(
        cfg.train.pipeline_schedule, cfg.mesh.pipeline, cfg.train.microbatches or cfg.mesh.pipeline,
        cfg.train.pipeline_repeats).bubble())


def test_pipelined_moe_with_expert_parallelism_trains(tmp_path):
    moe = ["model.moe={num_experts: 4, top_k: 2}", "model.n_kv_heads=4"]
    ref = train(load_config(TINY, COMMON + moe + [f"run_dir={tmp_path / 'a'}", "mesh.data=1"]),
                devices=jax.devices()[:1])
    pp = train(load_config(TINY, COMMON + moe + [f"run_dir={tmp_path / 'b'}", "mesh.pipeline=2", "mesh.data=1",
                                                 "mesh.expert=2", "mesh.fsdp=2"]))
    assert _losses(pp)[0] == pytest.approx(_losses(ref)[0], rel=2e-5)  # same init, same forward
    # router losses are averaged per microbatch (as with grad_accum): later steps agree closely, not bitwise
    np.testing.assert_allclose(_losses(pp), _losses(ref), rtol=2e-3)
    assert pp.history[-1]["moe_dropped_frac"] == 0.0


def test_pipeline_memory_and_collectives():
    flat = inspect_step(load_config(TINY, COMMON + ["mesh.data=1"]), devices=jax.devices()[:1])
    gpipe = ["mesh.data=1", "mesh.pipeline=4", "train.microbatches=4", "train.pipeline_schedule=gpipe"]
    piped = inspect_step(load_config(TINY, COMMON + gpipe), devices=jax.devices()[:4])
    layer_bytes = 4 * 3 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64 // 2 * 64)  # fp32 weights + 2 moments, roughly
    assert flat["memory_per_device"]["arguments"] - piped["memory_per_device"]["arguments"] > layer_bytes
    assert piped["collectives"]["collective-permute"]["count"] > 0  # stage-to-stage transfer
    assert piped["pipeline_bubble"] == pytest.approx(3 / 7)
    remat = inspect_step(load_config(TINY, COMMON + gpipe + ["train.pipeline_remat=true"]), devices=jax.devices()[:4])
    # a stage keeps one [microbatch, seq, d_model] input per visit instead of its layers' residuals
    assert remat["memory_per_device"]["temporaries"] < piped["memory_per_device"]["temporaries"] / 2


@pytest.mark.parametrize("overrides,message", [
    (["mesh.pipeline=3", "mesh.data=1"], r"n_layers=4 is not divisible by mesh.pipeline x train.pipeline_repeats = 3x1"),
    (["mesh.pipeline=2", "train.pipeline_repeats=4"], r"= 2x4; choose them so their product divides 4"),
    (["mesh.pipeline=4", "train.microbatches=2"], r"train.microbatches=2 is fewer than the 4 pipeline stages"),
    (["mesh.pipeline=2", "train.microbatches=3"], r"batch_size=16 / train.grad_accum=1 is not divisible by "
                                                  r"train.microbatches=3"),
    (["mesh.pipeline=-1", "mesh.data=2"], r"mesh.pipeline must be an explicit size"),
    (["mesh.pipeline=2", "train.pipeline_schedule=1f1f"], r"'1f1f' is not a schedule; did you mean 1f1b\? choose "
                                                          r"one of gpipe, 1f1b, interleaved, zero_bubble"),
    (["mesh.pipeline=2", "train.pipeline_schedule=interleaved"], r"needs train.pipeline_repeats >= 2"),
    (["mesh.pipeline=2", "train.pipeline_repeats=2", "train.microbatches=3", "train.pipeline_schedule=interleaved"],
     r"microbatches=3, .* in groups of the 2 stages; use a multiple of 2"),
    (["mesh.pipeline=2", "train.pipeline_repeats=2"], r"1f1b schedule runs one chunk per stage; use "
                                                      r"train.pipeline_repeats=1 or the interleaved schedule"),
])
def test_pipeline_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_setup(load_config(TINY, COMMON + overrides))


def test_pipeline_microbatch_must_divide_over_the_stage_data_parallelism():
    cfg = load_config(TINY, COMMON + ["mesh.pipeline=2", "mesh.data=4", "train.microbatches=8"])
    with pytest.raises(ConfigError, match=r"a pipeline microbatch has 2 sequences .* 4-way data parallelism"):
        make_setup(cfg)


def test_checkpoints_move_between_pipeline_layouts(reference, tmp_path):
    """A run saved pipelined resumes unpipelined and vice versa (layer stacks reshaped on restore,
    Adam moments included), continuing like the uninterrupted run; a pipelined checkpoint exports
    flat."""
    from maxtrain.checkpoint import load_checkpoint, saved_config
    from maxtrain.config import unpipelined

    layouts = {
        "pipelined": ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "train.pipeline_repeats=2",
                      "train.microbatches=4", "train.pipeline_schedule=interleaved"],
        "flat": ["mesh.data=8"],
        "deep": ["mesh.pipeline=4", "mesh.data=2", "train.microbatches=8"],
    }
    for saved, resumed in (("pipelined", "flat"), ("flat", "deep"), ("deep", "pipelined")):
        ck = tmp_path / f"ck_{saved}"
        train(load_config(TINY, COMMON + [f"run_dir={tmp_path / saved}", "train.steps=2", f"checkpoint.dir={ck}",
                                          "checkpoint.every=2", *layouts[saved]]))
        result = train(load_config(TINY, COMMON + [f"run_dir={tmp_path / (saved + resumed)}",
                                                   f"checkpoint.resume_from={ck}/2", *layouts[resumed]]))
        assert result.start_step == 2 and [r["step"] for r in result.history] == [3]
        np.testing.assert_allclose(_losses(result), _losses(reference)[-1:], rtol=1e-4)
        np.testing.assert_allclose(_losses(result, "grad_norm"), _losses(reference, "grad_norm")[-1:], rtol=1e-3)

    path = str(tmp_path / "ck_pipelined")
    cfg, staged = load_checkpoint(path)
    assert staged["layers"]["wq"].shape[:3] == (2, 2, 1)
    flat_cfg, flat = load_checkpoint(path, unpipelined(saved_config(path)))
    assert flat_cfg.mesh.pipeline == 1 and flat["layers"]["wq"].shape[0] == 4
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a).reshape(np.shape(b)), b),
                 staged["layers"], jax.device_get(flat["layers"]))


def test_relayout_accepts_only_the_same_layer_stack():
    from maxtrain.checkpoint import relayout_dims

    assert relayout_dims("params/layers/wq", (4, 64, 4, 16), (2, 2, 1, 64, 4, 16)) == 3  # flat -> S=2, R=2
    assert relayout_dims("params/layers/wq", (1, 4, 1, 64, 4, 16), (4, 64, 4, 16)) == 3  # S=4 -> flat
    assert relayout_dims("opt_state/0/mu/layers/wq", (1, 2, 2, 64), (1, 4, 1, 64)) == 1  # S=2 -> S=4
    assert relayout_dims("params/layers/wq", (4, 64, 8, 8), (4, 64, 4, 16)) is None  # heads regrouped
    assert relayout_dims("params/layers/wq", (4, 64, 4, 16), (2, 2, 1, 64, 8, 8)) is None
    assert relayout_dims("params/layers/wq", (4, 64, 4, 16), (2, 2, 2, 64, 4, 16)) is None  # 4 vs 8 layers
    assert relayout_dims("params/embed/embedding", (128, 64), (2, 64, 64)) is None  # not a layer stack


def _grads(cfg, devices=None, accumulate: int = 1):
    """The summed loss's gradients, with layer stacks flat `[n_layers, ...]`, and the loss sums: for
    `accumulate` > 1, summed over that many microbatches of the batch (rows m, m+k, ...)."""
    from maxtrain.data import make_source
    from maxtrain.mesh import use_mesh
    from maxtrain.step import make_grads_fn, split_microbatches, init_state, put_batch

    setup = make_setup(cfg, devices)
    with use_mesh(setup.mesh):
        state = init_state(setup, 0)
        batch = put_batch(make_source(cfg).batch(0), setup.batch_sharding)
        fn = jax.jit(make_grads_fn(cfg, setup.model))
        parts = [batch] if accumulate == 1 else [jax.tree.map(lambda x: x[k], split_microbatches(batch, accumulate))
                                                 for k in range(accumulate)]
        outs = [fn(state.params, None, b) for b in parts]
    grads = jax.tree.map(lambda *g: sum(np.asarray(x, np.float64) for x in g), *[o[0] for o in outs])
    stats = jax.tree.map(lambda *g: sum(np.asarray(x, np.float64) for x in g), *[o[2] for o in outs])
    moe = cfg.model.moe
    n = (cfg.model.n_layers - moe.first_dense) // moe.every if moe else cfg.model.n_layers
    grads["layers"] = jax.tree.map(lambda a: a.reshape(n, *a.shape[3:]) if cfg.mesh.pipeline > 1 else a,
                                   grads["layers"])
    return grads, stats


GRAD_LAYOUTS = {  # schedule x layout: every schedule on at least one layout with fsdp and tensor inside
    "1f1b pipeline=4 x data=2": ["mesh.pipeline=4", "mesh.data=2", "train.microbatches=8"],
    "1f1b pipeline=2 x fsdp=2 x tensor=2": ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
                                            "train.microbatches=4"],
    "interleaved pipeline=2 x fsdp=2 x tensor=2": ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
                                                   "train.microbatches=4", "train.pipeline_repeats=2",
                                                   "train.pipeline_schedule=interleaved", "model.remat=save_dots"],
    "zero_bubble pipeline=4 x fsdp=2": ["mesh.pipeline=4", "mesh.data=1", "mesh.fsdp=2", "train.microbatches=8",
                                        "train.pipeline_schedule=zero_bubble"],
    "1f1b (aligned) pipeline=2 x fsdp=2 x sequence=2, ring attention": [
        "mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.sequence=2", "model.attention=ring"],
    "1f1b pipeline=2 x fsdp=2 x tensor=2, length over tensor (70B's Megatron sequence parallelism)": [
        "mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "sharding.activations.length=[sequence,tensor]"],
    "zero_bubble (aligned) pipeline=2 x sequence=2 x tensor=2": [
        "mesh.pipeline=2", "mesh.data=1", "mesh.sequence=2", "mesh.tensor=2", "train.microbatches=4",
        "train.pipeline_schedule=zero_bubble"],
    "zero_bubble pipeline=2 x fsdp=2 x tensor=2, stage remat": [
        "mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "train.microbatches=4",
        "train.pipeline_schedule=zero_bubble", "train.pipeline_remat=true", "model.remat=none"],
}


@functools.cache
def _one_device_grads():
    """The reference of every layout below, computed once per test worker (read, never changed)."""
    return _grads(load_config(TINY, COMMON + ["mesh.data=1"]), jax.devices()[:1])


@pytest.mark.parametrize("name", list(GRAD_LAYOUTS))
def test_scheduled_gradients_match_one_device(name):
    """The hand-scheduled backward's gradients, leaf by leaf, equal autodiff's on one device."""
    mesh = GRAD_LAYOUTS[name]
    want, want_stats = _one_device_grads()
    got, stats = _grads(load_config(TINY, COMMON + mesh))
    assert stats["tokens"] == want_stats["tokens"]
    assert stats["nll_sum"] == pytest.approx(want_stats["nll_sum"], rel=2e-5)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * np.abs(w).max()), got, want)


@functools.cache
def _one_device_moe_grads():
    """The reference of both schedules below, computed once per test worker (read, never changed)."""
    moe = ["model.moe={num_experts: 4, top_k: 2}", "model.n_kv_heads=4"]
    return _grads(load_config(TINY, COMMON + moe + ["mesh.data=1"]), jax.devices()[:1], accumulate=4)[0]


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_scheduled_moe_with_expert_parallelism_matches_one_device(schedule):
    """pipeline x expert: a scheduled pipeline computes each microbatch's router losses from that
    microbatch's statistics (as Megatron's 1F1B does), so one device accumulating the same
    microbatches is the reference; gradients, router balance loss included, match it."""
    moe = ["model.moe={num_experts: 4, top_k: 2}", "model.n_kv_heads=4"]
    want = _one_device_moe_grads()
    got, _ = _grads(load_config(TINY, COMMON + moe + ["mesh.pipeline=2", "mesh.data=1", "mesh.expert=2",
                                                      "mesh.fsdp=2", "train.microbatches=4",
                                                      f"train.pipeline_schedule={schedule}"]))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * np.abs(w).max()), got, want)


# XLA:CPU's older emitters (tests/conftest.py) give this run's resumed steps grad norms that differ from
# the uninterrupted run's in the last bit, though both compile to the same optimized HLO: bitwise resume
# is promised on XLA's default emitters, so the test runs on them.
@pytest.mark.default_codegen
def test_scheduled_run_resumes_bitwise(tmp_path):
    """A 1F1B run saved at step 2 and resumed continues exactly like the uninterrupted run."""
    mesh = ["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", "train.microbatches=4", "train.steps=4"]
    whole = train(load_config(TINY, COMMON + mesh + [f"run_dir={tmp_path / 'whole'}"]))
    ck = tmp_path / "ck"
    train(load_config(TINY, COMMON + mesh + [f"run_dir={tmp_path / 'a'}", f"checkpoint.dir={ck}",
                                             "checkpoint.every=2", "train.steps=2"]))
    resumed = train(load_config(TINY, COMMON + mesh + [f"run_dir={tmp_path / 'b'}", f"checkpoint.resume_from={ck}/2"]))
    assert [r["step"] for r in resumed.history] == [3, 4]
    assert _losses(resumed) == _losses(whole)[2:]
    assert _losses(resumed, "grad_norm") == _losses(whole, "grad_norm")[2:]


@pytest.mark.parametrize("overrides", [["train.pipeline_schedule=zb"], ["train.pipeline_schedule=interleaved"],
                                       ["train.microbatches=3", "train.pipeline_repeats=2",
                                        "train.pipeline_schedule=interleaved"]])
def test_bad_schedule_is_one_line_and_exit_2(overrides, capsys, tmp_path):
    from maxtrain import cli

    code = cli.main(["train", TINY, f"run_dir={tmp_path}", "mesh.pipeline=2", *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len([e for e in err if e.startswith("maxtrain: error:")]) == 1, err
    assert not any("Traceback" in e for e in err)


def test_1f1b_keeps_s_not_m_microbatches_of_activations():
    """S=4, M=16: the temporaries that grow with the microbatch (the activations a schedule keeps)
    grow under 1F1B by well under half of GPipe's (4 of 16 microbatches alive, plus what every
    schedule holds per sequence: the embedded batch and its gradient)."""
    def growth(schedule):
        temps = [inspect_step(load_config(TINY, COMMON + [
            "mesh.data=1", "mesh.pipeline=4", "train.microbatches=16", "train.seq_len=64", "model.remat=none",
            f"train.batch_size={b}", f"train.pipeline_schedule={schedule}"]), devices=jax.devices()[:4])
            ["memory_per_device"]["temporaries"] for b in (16, 32)]
        return temps[1] - temps[0]

    ratio = growth("1f1b") / growth("gpipe")
    assert 0.15 < ratio <= 4 / 16 + 0.15, ratio  # the bound: S/M + 15% (measured 0.380)
