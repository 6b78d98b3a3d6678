"""The training loop: learning, metrics contract, sharding parity, accumulation, remat, determinism."""

import json
import os

import jax
import numpy as np
import pytest
import yaml

from conftest import SMALL, TINY
from maxtrain import load_config, train

FIELDS = {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu"}


def assert_params_close(a, b):
    """Adam divides by sqrt(v): near-zero gradients (packed rows mask tokens out, so a few weights see
    almost none) turn float-rounding differences into updates of up to ~lr/25 in single elements
    over a few steps; a real bug moves parameters by ~lr (1e-2) per step instead."""
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-3),
                 jax.device_get(a), jax.device_get(b))


def _train(overrides, devices=None):
    return train(load_config(TINY, overrides), devices=devices)


def test_default_config_learns_and_writes_metrics(tmp_path):
    run_dir = tmp_path / "tiny"
    # the default job itself (text data, byte tokens, packing), shortened
    result = _train([f"run_dir={run_dir}", "train.steps=12", "train.log_every=4", "train.batch_size=8",
                     "train.seq_len=128", "optim.warmup_steps=4", "data.max_bytes=400000"])
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 4, 8, 12]
    for r in lines:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["mfu"] is None  # CPU has no known peak
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.5
    assert lines[0]["loss"] < np.log(384) + 1
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["train"]["steps"] == 12 and resolved["model"]["head_dim"] == 32
    assert load_config(run_dir / "config.yaml").train.steps == 12  # the resolved config reloads
    assert result.history == lines


MESHES = {
    "data8": ["mesh.data=8"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8"],
    "fsdp4_tensor2": ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"],
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "fsdp2_sequence2_tensor2": ["mesh.data=1", "mesh.fsdp=2", "mesh.sequence=2", "mesh.tensor=2"],
    # Megatron sequence parallelism (configs/llama3-70b.yaml): the residual stream split along length over tensor
    "fsdp4_tensor2_sp": ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "sharding.activations.length=[sequence, tensor]"],
}
# wq is [layers=2, embed=64, heads=4, head_dim=16]: embed splits over fsdp, heads over tensor
EXPECTED_WQ_SHARD = {
    "data8": (2, 64, 4, 16),
    "fsdp8": (2, 8, 4, 16),
    "fsdp4_tensor2": (2, 16, 2, 16),
    "data2_fsdp2_tensor2": (2, 32, 2, 16),
    "fsdp2_sequence2_tensor2": (2, 32, 2, 16),
    "fsdp4_tensor2_sp": (2, 16, 2, 16),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref")
    return _train(SMALL + [f"run_dir={run}", "train.steps=5", "mesh.data=1"], devices=jax.devices()[:1])


def _spec(x):
    return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sharding_parity_with_single_device(mesh, reference, small_overrides):
    result = _train(small_overrides + ["train.steps=5"] + MESHES[mesh])
    ref_losses = [r["loss"] for r in reference.history]
    losses = [r["loss"] for r in result.history]
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in result.history],
                               [r["grad_norm"] for r in reference.history], rtol=1e-4)
    params = result.state.params
    assert len(params["layers"]["wq"].sharding.device_set) == 8
    wq = params["layers"]["wq"]
    assert _spec(wq) == (None, "fsdp", "tensor", None)  # the default rules
    assert wq.sharding.shard_shape(wq.shape) == EXPECTED_WQ_SHARD[mesh]
    assert {s.data.shape for s in wq.addressable_shards} == {EXPECTED_WQ_SHARD[mesh]}
    if "tensor" in mesh:
        assert _spec(params["layers"]["w_down"])[1] == "tensor"  # row-parallel input dim
        assert _spec(params["lm_head"]["kernel"])[1] == "tensor"  # vocab-parallel head
    if "fsdp" in mesh:  # ZeRO-3: Adam moments sharded like their params
        mu = result.state.opt_state[1][0].mu["layers"]["w_gate"]
        assert _spec(mu) == _spec(params["layers"]["w_gate"])
    assert_params_close(result.state.params, reference.state.params)


def test_grad_accumulation_matches(small_overrides):
    base = small_overrides + ["train.steps=3", "train.batch_size=8", "mesh.data=1", "mesh.fsdp=2",
                              "mesh.tensor=4", "model.n_kv_heads=4"]
    one = _train(base + ["train.grad_accum=1"])
    acc = _train(base + ["train.grad_accum=4"])
    np.testing.assert_allclose([r["loss"] for r in acc.history], [r["loss"] for r in one.history], rtol=2e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in acc.history],
                               [r["grad_norm"] for r in one.history], rtol=1e-4)
    assert_params_close(acc.state.params, one.state.params)


def _loss_grads(cfg, devices=None):
    """Gradient of the summed loss on the first (packed, irregular) batch of `cfg`'s data, at its initial params."""
    from maxtrain.data.synthetic import SyntheticSource
    from maxtrain.loss import model_loss
    from maxtrain.step import init_state, make_setup
    setup = make_setup(cfg, devices)
    params = init_state(setup, cfg.seed).params
    batch = jax.device_put(SyntheticSource(cfg).batch(0), setup.batch_sharding)
    return jax.device_get(jax.jit(jax.grad(lambda p, b: model_loss(setup.model, p, b, cfg, 0.0)[0]))(params, batch))


@pytest.fixture(scope="module")
def no_remat(tmp_path_factory):
    """The `model.remat=none` run and gradients that both policies below are compared against, once per
    test worker (read, never changed)."""
    overrides = SMALL + [f"run_dir={tmp_path_factory.mktemp('no_remat') / 'run'}", "model.remat=none"]
    return _train(overrides + ["train.steps=2"]), _loss_grads(load_config(TINY, overrides))


@pytest.mark.parametrize("policy", ["full", "save_dots"])
def test_remat_policies_match_no_remat(policy, small_overrides, no_remat):
    """Same losses over steps, and the same gradients of every parameter (remat only changes what the
    backward recomputes)."""
    none, g_none = no_remat
    other = _train(small_overrides + ["train.steps=2", f"model.remat={policy}"])
    np.testing.assert_allclose([r["loss"] for r in other.history], [r["loss"] for r in none.history], rtol=1e-6)
    g_other = _loss_grads(load_config(TINY, small_overrides + [f"model.remat={policy}"]))
    # float32 rounding: the recomputed forward sums in another order (seen: 1.2e-8 on an element of 3.5e-4
    # whose tensor's largest is 0.08); a remat that recomputed anything else is off by orders more
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max()),
                 g_other, g_none)


def test_bitwise_deterministic(small_overrides):
    a = _train(small_overrides + ["train.steps=3", "mesh.fsdp=4", "mesh.data=2"])
    b = _train(small_overrides + ["train.steps=3", "mesh.fsdp=4", "mesh.data=2"])
    assert [r["loss"] for r in a.history] == [r["loss"] for r in b.history]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a.state.params), jax.device_get(b.state.params))


def test_bf16_compute_and_z_loss(small_overrides):
    result = _train(small_overrides + ["train.steps=4", "train.dtype=bfloat16", "train.z_loss=1e-4"])
    assert result.state.params["layers"]["wq"].dtype == np.float32  # f32 masters
    assert all("z_loss" in r and r["z_loss"] > 0 for r in result.history)
    assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_warmup_cosine_lr(small_overrides):
    result = _train(small_overrides + ["train.steps=10", "optim.warmup_steps=4", "optim.lr=1e-2",
                                       "optim.min_lr_ratio=0.1"])
    lrs = [r["lr"] for r in result.history]
    np.testing.assert_allclose(lrs[:4], [2.5e-3, 5e-3, 7.5e-3, 1e-2], rtol=1e-5)
    assert lrs[-1] == pytest.approx(1e-3, rel=1e-4)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))


def test_first_adam_step_moves_every_weight_by_the_first_lr_against_its_gradient(small_overrides):
    """Step 1 of Adam with bias correction, decay and clipping off: m/sqrt(v) = g/|g|, so every
    parameter moves by exactly lr_1 (here 1e-2 / 4 warmup steps) against its gradient's sign."""
    import jax.numpy as jnp
    from maxtrain.loss import model_loss
    from maxtrain.step import compile_train_step, init_state, make_setup

    cfg = load_config(TINY, small_overrides + ["mesh.data=1", "optim.weight_decay=0", "optim.clip_norm=null",
                                               "optim.warmup_steps=4", "optim.eps=1e-30"])
    setup = make_setup(cfg, jax.devices()[:1])
    state = init_state(setup, 0)
    before = jax.device_get(state.params)
    r = np.random.default_rng(0)
    batch = {"inputs": r.integers(0, 128, (16, 32)).astype(np.int32),
             "targets": r.integers(0, 128, (16, 32)).astype(np.int32),
             "loss_mask": np.ones((16, 32), np.float32), "segment_ids": np.ones((16, 32), np.int32),
             "positions": np.tile(np.arange(32, dtype=np.int32), (16, 1))}
    grads = jax.device_get(jax.grad(lambda p: model_loss(setup.model, p, batch, cfg, 0.0)[0])(state.params))
    step, _ = compile_train_step(setup)
    state, metrics = step(state, jax.device_put(batch, setup.batch_sharding))
    assert float(metrics["lr"]) == pytest.approx(2.5e-3, rel=1e-6)
    for (path, g), (_, b), (_, a) in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                         jax.tree_util.tree_flatten_with_path(before)[0],
                                         jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]):
        want = b - 2.5e-3 * np.sign(g)
        np.testing.assert_allclose(a, want, rtol=0, atol=1e-6, err_msg=jax.tree_util.keystr(path))
        assert (np.abs(a - b) > 2e-3).mean() > 0.95, jax.tree_util.keystr(path)  # rows of unseen tokens stay


def test_a_train_state_larger_than_the_devices_is_refused_before_allocating(capsys, tmp_path):
    from maxtrain import cli
    code = cli.main(["train", TINY, "model.vocab_size=100000000000", f"run_dir={tmp_path / 'r'}",
                     f"checkpoint.dir={tmp_path / 'ck'}"])
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("maxtrain: error:")]
    assert code == 2 and len(errors) == 1, errors
    assert "the train state needs" in errors[0] and "TiB per device" in errors[0] and "mesh.fsdp" in errors[0]
    assert not (tmp_path / "ck").exists()  # refused before checkpoint.dir (or anything) is touched


@pytest.mark.parametrize("key, needle", [("run_dir", "run_dir {p} cannot be created"),
                                         ("checkpoint.dir", "checkpoint.dir {p} is not usable")])
def test_an_unusable_output_directory_is_one_line(capsys, tmp_path, key, needle):
    from maxtrain import cli
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "sub"  # under a regular file: cannot be created
    args = ["train", TINY, "train.steps=1", f"run_dir={tmp_path / 'run'}", f"{key}={bad}"]
    code = cli.main(args)
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("maxtrain: error:")]
    assert code == 2 and len(errors) == 1 and needle.format(p=bad) in errors[0] and "Traceback" not in err, err
