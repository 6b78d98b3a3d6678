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
from maxtrain.train import compile_train_step, make_setup

RULES = load_config(TINY, []).sharding.activations


def _qkv(B=2, L=32, H=4, G=2, K=8, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, L, H, K)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, L, G, K)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, L, G, K)), jnp.float32)
    seg = jnp.asarray(np.sort(r.integers(1, 4, (B, L)), axis=1), jnp.int32)
    return q, k, v, seg


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("use_seg", [False, True])
@pytest.mark.parametrize("mesh", [dict(data=2, sequence=4), dict(data=1, sequence=2, tensor=2, fsdp=2)])
def test_ring_matches_xla_forward_and_backward(window, use_seg, mesh):
    q, k, v, seg = _qkv()
    seg = seg if use_seg else None

    def loss(impl):
        def f(q, k, v):
            o = attention(q, k, v, impl=impl, segment_ids=seg, sliding_window=window, rules=RULES)
            return jnp.sum(o * jnp.cos(o)), o
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

    (_, ref_o), ref_g = loss("xla")(q, k, v)
    with use_mesh(build_mesh(MeshConfig(**mesh))):
        (_, o), g = jax.jit(loss("ring"))(q, k, v)
    np.testing.assert_allclose(o, ref_o, atol=2e-6)
    for a, b in zip(g, ref_g):  # dq, dk, dv (GQA: dk/dv summed over the query heads of a group)
        np.testing.assert_allclose(a, b, atol=2e-5)


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
