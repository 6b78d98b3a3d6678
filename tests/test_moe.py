"""Mixture of experts: against a per-token reference, dropless vs capacity, losses, sharded parity."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL, TINY
from maxtrain import load_config, train
from maxtrain.config import ConfigError, MoEConfig
from maxtrain.layers.moe import moe_mlp, route

D, E, F, T = 16, 4, 24, 40


def _params(seed=0, shared=0):
    r = np.random.default_rng(seed)
    p = {"router": r.normal(size=(D, E)), "w_gate": 0.3 * r.normal(size=(E, D, F)),
         "w_up": 0.3 * r.normal(size=(E, D, F)), "w_down": 0.3 * r.normal(size=(E, F, D))}
    if shared:
        p.update(shared_gate=0.3 * r.normal(size=(D, shared * F)), shared_up=0.3 * r.normal(size=(D, shared * F)),
                 shared_down=0.3 * r.normal(size=(shared * F, D)))
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)


def _x(seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(2, T // 2, D)), jnp.float32)


def _np_route(xt, router, moe, bias=None):
    """Routing in float64 numpy from the router logits: scores (softmax or sigmoid), the top-k experts by
    score, weights renormalised over the k chosen when k > 1 and the raw score when k = 1 (Switch).
    DeepSeek-V3's additions (`bias`, `moe.groups`, `norm_topk`, `routed_scale`): the experts chosen by
    score + bias within the `topk_groups` groups whose two best (score + bias) sum highest, weighted by
    their scores alone."""
    logits = xt.astype(np.float64) @ np.asarray(router, np.float64)
    if moe.router == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
    G, E = moe.groups, moe.num_experts
    rank = np.sort(choice.reshape(len(choice), G, E // G), -1)[..., -2:].sum(-1)  # G = 1: one group, all allowed
    best = np.argsort(-rank, axis=-1, kind="stable")[:, :moe.topk_groups]
    allowed = (np.arange(E)[None, None, :] // (E // G) == best[:, :, None]).any(1)
    experts = np.argsort(-np.where(allowed, choice, -np.inf), axis=-1, kind="stable")[:, :moe.top_k]
    weights = np.take_along_axis(scores, experts, -1)
    if moe.norm_topk if moe.norm_topk is not None else moe.top_k > 1:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * moe.routed_scale, experts


def _np_survivors(experts, num_experts, capacity, token_major=False):
    """GShard priority: every token's first choice, in token order, then every second choice, ...;
    each expert keeps the first `capacity` assignments it receives. A [T, K] bool array.
    `token_major`: all of token 0's choices, then token 1's, ... (the priority GShard avoids)."""
    T, K = experts.shape
    taken = np.zeros(num_experts, int)
    keep = np.zeros((T, K), bool)
    order = [(t, k) for t in range(T) for k in range(K)] if token_major else \
        [(t, k) for k in range(K) for t in range(T)]
    for t, k in order:
        e = experts[t, k]
        if taken[e] < capacity:
            taken[e] += 1
            keep[t, k] = True
    return keep


def _swiglu_np(x, g, u, d):
    g, u, d = (np.asarray(a, np.float64) for a in (g, u, d))
    h = x @ g
    return (h / (1 + np.exp(-h)) * (x @ u)) @ d


def _reference(x, p, moe, capacity=None, bias=None):
    """Token by token in float64 numpy: each kept assignment's weight times its expert's SwiGLU."""
    xt = np.asarray(x, np.float64).reshape(-1, D)
    w, e = _np_route(xt, p["router"], moe, bias)
    keep = np.ones_like(e, bool) if capacity is None else _np_survivors(e, E, capacity)
    out = np.zeros_like(xt)
    for t in range(len(xt)):
        for k in range(moe.top_k):
            if keep[t, k]:
                j = e[t, k]
                out[t] += w[t, k] * _swiglu_np(xt[t], p["w_gate"][j], p["w_up"][j], p["w_down"][j])
    if moe.shared_experts:
        out += _swiglu_np(xt, p["shared_gate"], p["shared_up"], p["shared_down"])
    return out.reshape(x.shape), keep


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_dropless_matches_numpy_routing(router, shared, top_k):
    moe = MoEConfig(num_experts=E, top_k=top_k, router=router, shared_experts=shared)
    p, x = _params(shared=shared), _x()
    y, stats = moe_mlp(x, p, moe, {})
    np.testing.assert_allclose(y, _reference(x, p, moe)[0], atol=1e-4, rtol=1e-4)
    assert float(stats["moe_dropped_frac"]) == 0.0
    w, e, _ = route(x.reshape(-1, D), p["router"], moe)
    w_np, e_np = _np_route(np.asarray(x).reshape(-1, D), p["router"], moe)
    np.testing.assert_array_equal(np.asarray(e), e_np)  # chosen experts, best first
    np.testing.assert_allclose(np.asarray(w), w_np, rtol=1e-5)
    y2, _ = moe_mlp(x, p, moe, {})
    np.testing.assert_array_equal(y, y2)  # routing is deterministic


@pytest.mark.parametrize("top_k,factor", [(2, 0.5), (2, 1.0), (1, 0.75), (3, 0.6)])
def test_capacity_keeps_the_gshard_priority_survivors(top_k, factor):
    """With a capacity that drops tokens, exactly the assignments GShard's top-1-first priority keeps
    survive (checked through the output, assignment by assignment, and the dropped fraction)."""
    import math
    moe = MoEConfig(num_experts=E, top_k=top_k, capacity_factor=factor)
    p, x = _params(seed=3), _x(seed=4)
    capacity = max(1, math.ceil(factor * T * top_k / E))
    want, keep = _reference(x, p, moe, capacity)
    assert (~keep).any()  # the capacity bites
    y, stats = moe_mlp(x, p, moe, {})
    np.testing.assert_allclose(y, want, atol=1e-4, rtol=1e-4)
    assert float(stats["moe_dropped_frac"]) == pytest.approx(1 - keep.mean(), abs=1e-6)
    # a token-order priority (instead of k-major) keeps another set: the test can tell them apart
    if top_k > 1:
        assert keep[:, 0].sum() > keep[:, -1].sum()
        e = _np_route(np.asarray(x, np.float64).reshape(-1, D), p["router"], moe)[1]
        assert (_np_survivors(e, E, capacity, token_major=True) != keep).any()


def test_capacity_agrees_with_dropless_when_nothing_drops():
    p, x = _params(), _x()
    dropless, _ = moe_mlp(x, p, MoEConfig(num_experts=E, top_k=2), {})
    roomy, stats = moe_mlp(x, p, MoEConfig(num_experts=E, top_k=2, capacity_factor=float(E)), {})
    np.testing.assert_allclose(roomy, dropless, atol=1e-5)
    assert float(stats["moe_dropped_frac"]) == 0.0


def test_aux_losses_balance_and_are_gradient_safe():
    moe = MoEConfig(num_experts=E, top_k=1)
    p = _params()
    x = jnp.abs(_x()) + 0.1  # positive inputs, so a large router column 0 wins for every token
    p_collapsed = {**p, "router": p["router"].at[:, 0].add(50.0)}

    def loss(params):
        _, stats = moe_mlp(x, params, moe, {})
        return stats["moe_aux_loss"] + stats["moe_z_loss"]

    _, balanced = moe_mlp(x, p, moe, {})
    _, collapsed = moe_mlp(x, p_collapsed, moe, {})
    assert float(collapsed["moe_aux_loss"]) == pytest.approx(E, rel=1e-3)  # f_0 = p_0 = 1
    assert float(collapsed["moe_imbalance"]) == pytest.approx(E)
    assert float(balanced["moe_aux_loss"]) < float(collapsed["moe_aux_loss"])
    grads = jax.grad(loss)(p_collapsed)  # experts 1..3 get no tokens: gradients stay finite
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["router"]).sum()) > 0


def test_per_device_routing_keeps_the_deepseek_choices():
    """Tokens sharded over the mesh route per device (`shard_map`, experts split over `expert`):
    DeepSeek-V3's biased, group-limited choice, weights from the scores alone, renormalised and
    scaled, and the shared expert, each token as the float64 numpy oracle routes it (dropless: a
    token's output does not depend on its neighbours), and the load the balancing reads, per expert,
    as the oracle counts it over all tokens."""
    from jax.sharding import AxisType, Mesh

    E8 = 8
    moe = MoEConfig(num_experts=E8, top_k=3, router="sigmoid", shared_experts=1, norm_topk=True, routed_scale=2.5,
                    groups=4, topk_groups=2, bias_update_rate=0.01)
    r = np.random.default_rng(5)
    p = {"router": r.normal(size=(D, E8)), "w_gate": 0.3 * r.normal(size=(E8, D, F)),
         "w_up": 0.3 * r.normal(size=(E8, D, F)), "w_down": 0.3 * r.normal(size=(E8, F, D)),
         "bias": 0.3 * r.normal(size=E8), "shared_gate": 0.3 * r.normal(size=(D, F)),
         "shared_up": 0.3 * r.normal(size=(D, F)), "shared_down": 0.3 * r.normal(size=(F, D))}
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
    x = jnp.asarray(r.normal(size=(4, 6, D)), jnp.float32)
    xt = np.asarray(x, np.float64).reshape(-1, D)
    want, _ = _reference(x, p, moe, bias=p["bias"])
    _, e = _np_route(xt, p["router"], moe, p["bias"])
    assert [set(r) for r in e] != [set(r) for r in _np_route(xt, p["router"], moe)[1]]  # the bias matters here
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    rules = {"batch": ["data", "expert"], "experts": "expert"}
    with jax.set_mesh(mesh):
        y, stats = jax.jit(lambda x, p: moe_mlp(x, p, moe, rules))(x, p)
    np.testing.assert_allclose(y, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(stats["moe_load"], np.bincount(e.ravel(), minlength=E8) / e.size, atol=1e-7)


MOE = SMALL + ["model.moe={num_experts: 4, top_k: 2}", "train.steps=3", "model.n_kv_heads=4"]


EP = ["mesh.data=1", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"]
NO_EP = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]  # expert=1: every device routes its own tokens


@pytest.mark.parametrize("variant, mesh", [([], EP), (["model.moe.capacity_factor=2.0"], EP),
                                           (["model.n_layers=4", "model.moe.every=2", "model.moe.shared_experts=1"], EP),
                                           ([], NO_EP), (["model.moe.capacity_factor=2.0"], NO_EP)])
def test_sharded_moe_training_matches_single_device(variant, mesh, tmp_path, one_device_run):
    ref = one_device_run(MOE + variant + ["mesh.data=1"])  # a variant's, whichever the mesh
    sharded = train(load_config(TINY, MOE + variant + [f"run_dir={tmp_path / 'b'}", *mesh]))
    np.testing.assert_allclose([r["loss"] for r in sharded.history], [r["loss"] for r in ref.history], rtol=2e-5)
    for key in ("moe_aux_loss", "moe_z_loss", "moe_dropped_frac", "moe_imbalance"):
        assert key in sharded.history[-1]
        np.testing.assert_allclose(sharded.history[-1][key], ref.history[-1][key], rtol=1e-4, atol=1e-6)
    w = sharded.state.params["layers"]["moe"]["w_gate"]
    assert w.sharding.shard_shape(w.shape)[1] == (2 if mesh == EP else 4)  # 4 experts over expert=2
    assert sharded.history[-1]["loss"] < sharded.history[0]["loss"]


def test_top1_router_learns_from_the_loss():
    """With top_k=1 the weight is the router's score (Switch): renormalised it would be exactly 1,
    and the language-model loss would give the router no gradient."""
    from maxtrain.config import MoEConfig
    from maxtrain.layers.moe import route

    moe = MoEConfig(num_experts=4, top_k=1)
    x = jax.random.normal(jax.random.key(0), (16, 8))
    w = jax.random.normal(jax.random.key(1), (8, 4))
    weights, experts, _ = route(x, w, moe)
    assert bool(jnp.all(weights < 1)) and bool(jnp.all(weights > 0))
    g = jax.grad(lambda w: jnp.sum(route(x, w, moe)[0] * jnp.arange(16.0)[:, None]))(w)
    assert float(jnp.abs(g).sum()) > 0


def test_moe_config_errors():
    with pytest.raises(ConfigError, match="top_k=5 must be between 1 and model.moe.num_experts=4"):
        load_config(TINY, ["model.moe={num_experts: 4, top_k: 5}"])
    with pytest.raises(ConfigError, match="n_layers=4 is not divisible by model.moe.every=3"):
        load_config(TINY, ["model.moe={num_experts: 4, every: 3}"])
    from maxtrain.step import make_setup
    cfg = load_config(TINY, ["model.moe={num_experts: 3}", "mesh.data=1", "mesh.expert=2", "mesh.fsdp=4"])
    with pytest.raises(ConfigError, match=r"dimension 1 \(experts=3\) does not divide into 2 shards"):
        make_setup(cfg)
    cfg = load_config(TINY, ["model.moe={num_experts: 4}", "mesh.data=1", "mesh.expert=2", "mesh.fsdp=4",
                             "sharding.activations.batch=[data, fsdp]"])
    with pytest.raises(ConfigError, match="add expert to sharding.activations.batch"):
        make_setup(cfg)


def test_moe_flops_count_active_experts_only():
    from maxtrain import models
    dense = load_config(TINY, [])
    moe = load_config(TINY, ["model.moe={num_experts: 8, top_k: 1}"])
    extra = 4 * 256 * 8  # router weights per layer x layers
    assert models.flops_per_token(moe, 128) == pytest.approx(models.flops_per_token(dense, 128) + 6 * extra)


def test_expert_load_is_logged_per_moe_layer_and_reported(tmp_path):
    """metrics.jsonl carries every MoE layer's load (max/mean tokens per expert), dropped fraction
    and router losses beside their means; TensorBoard gets them per layer; `maxtrain report` shows
    the last step's per layer."""
    import json

    from maxtrain.analysis import report
    from maxtrain.metrics import numeric_fields

    run = tmp_path / "run"
    train(load_config(TINY, MOE + [f"run_dir={run}", "model.n_layers=4", "model.moe.every=2",
                                   "model.moe.capacity_factor=0.5", "train.steps=2"]))
    last = json.loads((run / "metrics.jsonl").read_text().strip().splitlines()[-1])
    for key in ("moe_imbalance", "moe_dropped_frac", "moe_aux_loss", "moe_z_loss"):
        per_layer = last[key + "_per_layer"]
        assert len(per_layer) == 2  # 4 layers, every second one routed
        assert last[key] == pytest.approx(np.mean(per_layer), rel=1e-5)
    assert all(x >= 1.0 for x in last["moe_imbalance_per_layer"])  # max over mean tokens per expert
    assert max(last["moe_dropped_frac_per_layer"]) > 0  # capacity 0.5 drops assignments
    assert numeric_fields(last)["moe_imbalance_per_layer/1"] == last["moe_imbalance_per_layer"][1]
    text = report.text_report(report.load_runs([str(run)]))
    assert "MoE load per layer at step 2: max/mean tokens per expert " in text
