"""Context parallelism: ring attention against plain attention, forward and backward, and in training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL, TINY
from maxtrain import load_config, train
from maxtrain.config import MeshConfig
from maxtrain.layers.attention import attention
from maxtrain.mesh import build_mesh, use_mesh
from maxtrain.parallel.ring_attention import zigzag_order
from maxtrain.step import compile_train_step, make_setup

RULES = load_config(TINY, []).sharding.activations


def _qkv(B=2, L=32, H=4, G=2, K=8, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, L, H, K)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, L, G, K)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, L, G, K)), jnp.float32)
    seg = jnp.asarray(np.sort(r.integers(1, 4, (B, L)), axis=1), jnp.int32)
    return q, k, v, seg


@pytest.mark.parametrize("layout,window,use_seg,mesh", [
    ("zigzag", None, False, dict(data=2, sequence=4)),
    ("zigzag", 5, True, dict(data=2, sequence=4)),
    ("zigzag", None, True, dict(data=1, sequence=2, tensor=2, fsdp=2)),
    ("zigzag", 5, False, dict(data=1, sequence=2, tensor=2, fsdp=2)),
    ("contiguous", None, True, dict(data=2, sequence=4)),
    ("contiguous", 5, False, dict(data=1, sequence=2, tensor=2, fsdp=2)),
])
def test_ring_matches_xla_forward_and_backward(layout, window, use_seg, mesh):
    q, k, v, seg = _qkv()
    seg = seg if use_seg else None
    n = mesh["sequence"]
    order = zigzag_order(q.shape[1], n) if layout == "zigzag" else np.arange(q.shape[1])
    undo = np.argsort(order)

    def loss(impl, order):
        def f(q, k, v):
            s = None if seg is None else seg[:, order]
            o = attention(q[:, order], k[:, order], v[:, order], impl=impl, segment_ids=s, sliding_window=window,
                          rules=RULES, ring_layout=layout)[:, np.argsort(order)]
            return jnp.sum(o * jnp.cos(o)), o
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

    (_, ref_o), ref_g = loss("xla", np.arange(q.shape[1]))(q, k, v)
    with use_mesh(build_mesh(MeshConfig(**mesh))):
        (_, o), g = jax.jit(loss("ring", order))(q, k, v)
    assert (undo[order] == np.arange(len(order))).all()
    np.testing.assert_allclose(o, ref_o, atol=2e-6)
    for a, b in zip(g, ref_g):  # dq, dk, dv (GQA: dk/dv summed over the query heads of a group)
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_zigzag_order_balances_causal_work():
    order = zigzag_order(16, 4)  # 8 chunks of 2: device i holds chunks i and 7-i
    assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    visible = [sum(int(q) + 1 for q in block) for block in order.reshape(4, 4)]  # causal keys per device
    assert len(set(visible)) == 1


def test_ring_training_matches_single_device_and_uses_collective_permute(tmp_path):
    common = SMALL + ["train.steps=4", "model.attention=ring"]
    ref = train(load_config(TINY, common + [f"run_dir={tmp_path / 'a'}", "mesh.data=1"]), devices=jax.devices()[:1])
    cfg = load_config(TINY, common + [f"run_dir={tmp_path / 'b'}", "mesh.data=1", "mesh.fsdp=2", "mesh.sequence=2",
                                      "mesh.tensor=2"])
    ring = train(cfg)
    np.testing.assert_allclose([r["loss"] for r in ring.history], [r["loss"] for r in ref.history], rtol=2e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in ring.history], [r["grad_norm"] for r in ref.history],
                               rtol=1e-4)
    setup = make_setup(cfg)
    with use_mesh(setup.mesh):
        hlo = compile_train_step(setup)[0].as_text()
    assert "collective-permute" in hlo


def test_ring_allgather_variant_matches(tmp_path):
    common = SMALL + ["train.steps=2", "model.attention=ring_allgather"]
    ref = train(load_config(TINY, common + [f"run_dir={tmp_path / 'a'}", "mesh.data=1"]), devices=jax.devices()[:1])
    sp = train(load_config(TINY, common + [f"run_dir={tmp_path / 'b'}", "mesh.data=2", "mesh.sequence=4"]))
    np.testing.assert_allclose([r["loss"] for r in sp.history], [r["loss"] for r in ref.history], rtol=2e-5)


def test_zigzag_needs_two_chunks_per_device():
    from maxtrain.config import ConfigError
    cfg = load_config(TINY, SMALL + ["model.attention=ring", "train.seq_len=36", "mesh.data=2", "mesh.sequence=4"])
    with pytest.raises(ConfigError, match=r"train.seq_len=36 is not divisible by 2 x mesh.sequence=8"):
        make_setup(cfg)
    make_setup(load_config(TINY, SMALL + ["model.attention=ring", "train.seq_len=36", "mesh.data=2", "mesh.sequence=4",
                                          "model.ring_layout=contiguous"]))


@pytest.mark.parametrize("mesh", [["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
                                  ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]])
def test_qk_norm_model_sharded_matches_one_device(mesh, tmp_path, one_device_run):
    """Qwen3's QK-norm (`model.qk_norm`, head_dim not d_model / heads) trains sharded over data, fsdp
    and tensor, and pipelined, like one device."""
    common = SMALL + ["train.steps=3", "model.n_layers=4", "model.qk_norm=true", "model.head_dim=24"]
    ref = one_device_run(common + ["mesh.data=1"])  # the same run for both meshes
    got = train(load_config(TINY, common + [f"run_dir={tmp_path / 'b'}", *mesh]))
    np.testing.assert_allclose([r["loss"] for r in got.history], [r["loss"] for r in ref.history], rtol=2e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in got.history], [r["grad_norm"] for r in ref.history],
                               rtol=2e-5)
    assert got.state.params["layers"]["q_norm"].shape[-1] == 24
