"""Optimizers (maxtrain/optim.py): Muon's parameter split and its update against a NumPy
Newton-Schulz reference; Muon training sharded against one device, resumed exactly; bad input."""

import jax
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from conftest import SMALL, TINY
from maxtrain import load_config, models, train
from maxtrain.config import ConfigError, OptimConfig, MuonConfig
from maxtrain.optim import make_optimizer, muon_layout

NS = (3.4445, -4.7750, 2.0315)


def _axes(cfg):
    return models.get(cfg.model.name).logical_axes(cfg)


def test_muon_takes_the_layer_matrices_and_leaves_the_rest_to_adamw():
    cfg = load_config(TINY, ["model.moe={num_experts: 4, top_k: 2, every: 2}", "optim.name=muon"])
    dims = muon_layout(_axes(cfg))
    L = dims["layers"]
    assert L["wq"] == MuonDimensionNumbers((2,), (3, 4))  # embed -> heads x head_dim, per layer
    assert L["wo"] == MuonDimensionNumbers((2, 3), (4,))  # heads x head_dim -> embed
    assert L["moe"]["w_gate"] == MuonDimensionNumbers((2,), (3,))  # per layer and expert
    assert L["moe"]["w_down"] == MuonDimensionNumbers((2,), (3,))
    for leaf in (dims["embed"]["embedding"], dims["lm_head"]["kernel"], dims["final_norm"]["scale"],
                 L["attn_norm"], L["moe"]["router"]):
        assert leaf is None
    assert muon_layout(_axes(cfg), ["wq", "moe/w_"])["layers"]["wq"] is None  # optim.muon.adamw
    assert muon_layout(_axes(cfg), ["moe/w_"])["layers"]["moe"]["w_up"] is None


def _newton_schulz(g: np.ndarray, steps: int = 5) -> np.ndarray:
    x = g / (np.linalg.norm(g) + 1e-8)
    flip = x.shape[0] > x.shape[1]
    if flip:
        x = x.T
    a, b, c = NS
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if flip else x


def test_muon_update_is_newton_schulz_of_nesterov_momentum():
    """Three steps on a stacked q projection [2 layers, embed 8, heads 2, head_dim 3] and an
    embedding: the q update is, per layer, -lr (0.2 sqrt(max(8, 6)) NS5(m) + wd p) with m the
    bias-corrected Nesterov momentum; the embedding's is AdamW's."""
    lr, wd, beta = 0.1, 0.01, 0.95
    o = OptimConfig(name="muon", muon=MuonConfig(beta=beta), weight_decay=wd, clip_norm=None)
    axes = {"layers": {"wq": ("layers", "embed", "heads", "head_dim")}, "embed": {"embedding": ("vocab", "embed")}}
    rng = np.random.default_rng(0)
    params = {"layers": {"wq": rng.normal(size=(2, 8, 2, 3)).astype(np.float32)},
              "embed": {"embedding": rng.normal(size=(5, 8)).astype(np.float32)}}
    tx = make_optimizer(o, optax.constant_schedule(lr), axes)
    adam = optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=wd)
    state, adam_state = tx.init(params), adam.init(params["embed"])
    mu = np.zeros_like(params["layers"]["wq"])
    for k in range(1, 4):
        grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
        updates, state = jax.jit(tx.update)(grads, state, params)
        g = grads["layers"]["wq"]
        mu = beta * mu + (1 - beta) * g
        m_hat = beta * mu / (1 - beta ** (k + 1)) + (1 - beta) * g / (1 - beta ** k)
        want = np.stack([_newton_schulz(m_hat[i].reshape(8, 6)).reshape(8, 2, 3) for i in range(2)])
        want = -lr * (0.2 * np.sqrt(8) * want + wd * params["layers"]["wq"])
        np.testing.assert_allclose(updates["layers"]["wq"], want, rtol=2e-4, atol=1e-6)
        want_e, adam_state = adam.update(grads["embed"], adam_state, params["embed"])
        np.testing.assert_allclose(updates["embed"]["embedding"], want_e["embedding"], rtol=1e-5, atol=1e-7)
        params = optax.apply_updates(params, updates)


def _losses(result, key="loss"):
    return [r[key] for r in result.history]


MUON = SMALL + ["train.steps=3", "optim.name=muon"]


@pytest.mark.parametrize("mesh", [["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"], ["mesh.data=2", "mesh.fsdp=4"]])
def test_muon_sharded_matches_one_device(mesh, tmp_path):
    """The orthogonalisation sees whole matrices whatever their sharding (XLA gathers what the
    Newton-Schulz products need), so FSDP and tensor sharding change nothing but rounding."""
    one = train(load_config(TINY, MUON + [f"run_dir={tmp_path / 'one'}", "mesh.data=1"]), devices=jax.devices()[:1])
    sharded = train(load_config(TINY, MUON + [f"run_dir={tmp_path / 'sharded'}", *mesh]))
    np.testing.assert_allclose(_losses(sharded), _losses(one), rtol=1e-5)
    np.testing.assert_allclose(_losses(sharded, "grad_norm"), _losses(one, "grad_norm"), rtol=1e-4)
    assert _losses(one)[-1] < _losses(one)[0]


def test_muon_resumes_bitwise(tmp_path):
    mesh = ["mesh.data=2", "mesh.fsdp=4", "train.steps=4"]
    whole = train(load_config(TINY, MUON + mesh + [f"run_dir={tmp_path / 'whole'}"]))
    ck = tmp_path / "ck"
    train(load_config(TINY, MUON + mesh + [f"run_dir={tmp_path / 'a'}", f"checkpoint.dir={ck}", "checkpoint.every=2",
                                           "train.steps=2"]))
    resumed = train(load_config(TINY, MUON + mesh + [f"run_dir={tmp_path / 'b'}", f"checkpoint.resume_from={ck}/2"]))
    assert _losses(resumed) == _losses(whole)[2:]


@pytest.mark.parametrize("overrides,message", [
    (["optim.name=muom"], r"optim.name='muom' is not valid.*did you mean muon"),
    (["optim.name=muon", "optim.muon.ns_steps=0"], r"optim.muon needs ns_steps >= 1"),
    (["optim.name=muon", "optim.muon.beta=1.0"], r"0 <= beta < 1"),
])
def test_optimizer_config_errors(overrides, message):
    from maxtrain.train import make_setup

    with pytest.raises(ConfigError, match=message):
        make_setup(load_config(TINY, SMALL + overrides))


def test_muon_orthogonalises_whole_matrices_moved_onto_the_layer_axis():
    """The momentum's sharding moves, a mesh axis at a time, from the matrix dims onto the layer
    stack, so each device orthogonalises whole matrices of its own layers."""
    from jax.sharding import PartitionSpec as P

    from maxtrain.optim import whole_matrix_specs

    rules = {"embed": "fsdp", "heads": "tensor", "mlp": "tensor", "experts": "expert"}
    wq = ("layers", "embed", "heads", "head_dim")
    assert whole_matrix_specs(wq, (32, 64, 8, 16), rules, {"fsdp": 8, "tensor": 1}) == [
        P("fsdp", None, "tensor", None), P("fsdp", None, None, None)]
    assert whole_matrix_specs(wq, (32, 64, 8, 16), rules, {"fsdp": 4, "tensor": 2}) == [
        P("fsdp", None, "tensor", None), P(("fsdp", "tensor"), None, None, None)]
    # 6 layers take tensor's 2, not fsdp's 4: the matrices are gathered over fsdp
    assert whole_matrix_specs(wq, (6, 64, 8, 16), rules, {"fsdp": 4, "tensor": 2})[-1] == P("tensor", None, None, None)
    experts = ("layers", "experts", "embed", "expert_mlp")
    assert whole_matrix_specs(experts, (8, 4, 64, 32), rules, {"fsdp": 2, "expert": 2})[-1] == P(
        "fsdp", "expert", None, None)
    assert whole_matrix_specs(("layers", "embed", "mlp"), (5, 64, 32), rules, {"fsdp": 2}) == []  # 5 layers
