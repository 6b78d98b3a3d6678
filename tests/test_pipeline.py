"""Pipeline parallelism: the schedule, parity with the unpipelined run, composition, bad input."""

import jax
import numpy as np
import pytest

from conftest import SMALL, TINY
from maxtrain import load_config, train
from maxtrain.config import ConfigError
from maxtrain.parallel.pipeline import bubble_fraction, schedule
from maxtrain.analysis.inspect import inspect_step
from maxtrain.train import make_setup

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
     "train.microbatches=4", "model.remat=save_dots"],  # circular, fsdp + tensor inside the stages
    ["mesh.pipeline=4", "mesh.data=2", "train.microbatches=8", "model.remat=none"],
    ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.sequence=2", "model.attention=ring"],
    ["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", "train.pipeline_repeats=2", "train.microbatches=4",
     "train.pipeline_remat=true", "model.remat=none"],  # each stage visit recomputed in the backward
    # the composition, ring attention's shard_map nested in the pipeline's; microbatches
    # default to the stage count
])
def test_pipelined_training_matches_one_device(mesh, reference, tmp_path):
    cfg = load_config(TINY, COMMON + [f"run_dir={tmp_path / 'run'}", *mesh])
    result = train(cfg)
    np.testing.assert_allclose(_losses(result), _losses(reference), rtol=2e-5)
    np.testing.assert_allclose(_losses(result, "grad_norm"), _losses(reference, "grad_norm"), rtol=1e-4)
    w = result.state.params["layers"]["wq"]  # [repeats, stages, layers per chunk, ...]
    assert w.shape[:3] == (cfg.train.pipeline_repeats, cfg.mesh.pipeline, 4 // (cfg.mesh.pipeline *
                                                                                  cfg.train.pipeline_repeats))
    assert w.sharding.shard_shape(w.shape)[1] == 1  # each stage holds only its own layers
    assert result.history[-1]["pipeline_bubble"] == pytest.approx(
        bubble_fraction(cfg.mesh.pipeline, cfg.train.microbatches or cfg.mesh.pipeline, cfg.train.pipeline_repeats))


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
    piped = inspect_step(load_config(TINY, COMMON + ["mesh.data=1", "mesh.pipeline=4", "train.microbatches=4"]),
                         devices=jax.devices()[:4])
    layer_bytes = 4 * 3 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64 // 2 * 64)  # fp32 weights + 2 moments, roughly
    assert flat["memory_per_device"]["arguments"] - piped["memory_per_device"]["arguments"] > layer_bytes
    assert piped["collectives"]["collective-permute"]["count"] > 0  # stage-to-stage transfer
    assert piped["pipeline_bubble"] == pytest.approx(3 / 7)
    remat = inspect_step(load_config(TINY, COMMON + ["mesh.data=1", "mesh.pipeline=4", "train.microbatches=4",
                                                      "train.pipeline_remat=true"]), devices=jax.devices()[:4])
    # a stage keeps one [microbatch, seq, d_model] input per visit instead of its layers' residuals
    assert remat["memory_per_device"]["temporaries"] < piped["memory_per_device"]["temporaries"] / 2


@pytest.mark.parametrize("overrides,message", [
    (["mesh.pipeline=3", "mesh.data=1"], r"n_layers=4 is not divisible by mesh.pipeline x train.pipeline_repeats = 3x1"),
    (["mesh.pipeline=2", "train.pipeline_repeats=4"], r"= 2x4; choose them so their product divides 4"),
    (["mesh.pipeline=4", "train.microbatches=2"], r"train.microbatches=2 is fewer than the 4 pipeline stages"),
    (["mesh.pipeline=2", "train.microbatches=3"], r"batch_size=16 / train.grad_accum=1 is not divisible by "
                                                  r"train.microbatches=3"),
    (["mesh.pipeline=-1", "mesh.data=2"], r"mesh.pipeline must be an explicit size"),
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
                      "train.microbatches=4"],
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
