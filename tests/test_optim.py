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
def test_muon_sharded_matches_one_device(mesh, tmp_path, one_device_run):
    """The orthogonalisation sees whole matrices whatever their sharding (XLA gathers what the
    Newton-Schulz products need), so FSDP and tensor sharding change nothing but rounding."""
    one = one_device_run(MUON + ["mesh.data=1"])  # the same run for both meshes
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
    from maxtrain.step import make_setup

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


# ---------------------------------------------------------------- Muon's documented options, by a NumPy oracle
#
# One optimizer over matrices of every orientation (fan_in = the rows, `embed` or a latent; fan_out
# = the other named axes), stacked along layers, experts and pipeline stages, and over the leaves
# the docs keep on AdamW. The oracle below is written from docs/config.md alone: Nesterov momentum
# with `beta`, the quintic Newton-Schulz iteration with the documented coefficients, the update
# scale (`rms_scale` x sqrt(max(fan_in, fan_out)), or for 0 the original sqrt(max(1, fan_out / fan_in))),
# decoupled weight decay and the step's learning rate; AdamW written out in NumPy. It shares
# nothing with maxtrain.optim or optax's Muon: each matrix is cut out of its stack by hand, with
# the fans named per leaf below, not by `muon_dims`.

# name: (logical axes, shape, fan_in axes, fan_out axes); the remaining axes stack independent matrices
MUON_LEAVES = {
    "attn/wq": (("layers", "embed", "heads", "head_dim"), (2, 4, 2, 5), (1,), (2, 3)),  # 4 -> 10, per layer
    "attn/wo": (("layers", "heads", "head_dim", "embed"), (2, 2, 5, 4), (1, 2), (3,)),  # 10 -> 4
    "mlp/w_up": (("embed", "mlp"), (6, 3), (0,), (1,)),  # one matrix, 6 -> 3
    "mlp/w_down": (("mlp", "embed"), (3, 6), (0,), (1,)),  # 3 -> 6
    "moe/w_gate": (("layers", "experts", "embed", "expert_mlp"), (2, 3, 4, 7), (2,), (3,)),  # per layer and expert
    "pipe/w": (("stages", "layers", "embed", "mlp"), (2, 1, 5, 2), (2,), (3,)),  # per stage
    "mla/wkv_b": (("layers", "kv_lora", "heads", "head_dim"), (1, 3, 2, 4), (1,), (2, 3)),  # a latent's rows
}
# the docs' AdamW leaves: embeddings, head, norms (no decay), routers, biases
ADAMW_LEAVES = {
    "embed/embedding": (("vocab", "embed"), (5, 4)),
    "lm_head/kernel": (("embed", "vocab"), (4, 5)),
    "attn/norm": (("layers", "norm"), (2, 4)),
    "moe/router": (("layers", "embed", None), (2, 4, 3)),
    "moe/bias": (("layers", None), (2, 3)),
    "mla/heads_bias": (("layers", "heads", "head_dim"), (2, 2, 5)),
}


def _nest(flat: dict) -> dict:
    out = {}
    for path, v in flat.items():
        a, b = path.split("/")
        out.setdefault(a, {})[b] = v
    return out


def _flat(tree: dict) -> dict:
    return {f"{a}/{b}": v for a, sub in tree.items() for b, v in sub.items()}


def _ns_oracle(m: np.ndarray, steps: int, eps: float) -> np.ndarray:
    """Quintic Newton-Schulz on one matrix (float64), on its wide orientation, from m / (|m|_F + eps)."""
    x = m / (np.linalg.norm(m) + eps)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    a, b, c = NS
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def _per_matrix(fn, x: np.ndarray, fan_in: tuple, fan_out: tuple) -> np.ndarray:
    """`fn` on every [fan_in, fan_out] matrix of `x`, the other axes stacking them."""
    stack = [d for d in range(x.ndim) if d not in fan_in + fan_out]
    order = stack + list(fan_in) + list(fan_out)
    y = np.transpose(x, order)
    n_in, n_out = int(np.prod([x.shape[d] for d in fan_in])), int(np.prod([x.shape[d] for d in fan_out]))
    mats = y.reshape(-1, n_in, n_out)
    out = np.stack([fn(m) for m in mats]).reshape(y.shape)
    return np.transpose(out, np.argsort(order))


def _lr(count):
    return 0.05 * (count + 1)  # a different learning rate every step: each part must use its own step's


@pytest.mark.parametrize("overrides", [
    # the original scale: sqrt(2.5) for 4 -> 10, sqrt(2) for 3 -> 6, 1 for 10 -> 4; a path substring kept on AdamW
    ["optim.muon.rms_scale=0", "optim.muon.adamw=[moe/w_]"],
    ["optim.muon.rms_scale=0.2", "optim.muon.nesterov=false", "optim.muon.ns_steps=3", "optim.muon.beta=0.8",
     "optim.muon.adamw=[mlp/w_d]"],
])
def test_muon_step_matches_a_numpy_oracle(overrides):
    o = load_config(None, ["optim.name=muon", "optim.weight_decay=0.1", "optim.b1=0.8", "optim.b2=0.9",
                           "optim.clip_norm=null", *overrides]).optim
    m = o.muon
    keep = [path for path in MUON_LEAVES if any(k in path for k in m.adamw)]
    assert keep == {"moe/w_": ["moe/w_gate"], "mlp/w_d": ["mlp/w_down"]}[m.adamw[0]]
    axes = _nest({**{k: v[0] for k, v in MUON_LEAVES.items()}, **{k: v[0] for k, v in ADAMW_LEAVES.items()}})
    rng = np.random.default_rng(1)
    shapes = {**{k: v[1] for k, v in MUON_LEAVES.items()}, **{k: v[1] for k, v in ADAMW_LEAVES.items()}}
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    tx = make_optimizer(o, _lr, axes)
    state = tx.init(_nest(params))
    step = jax.jit(tx.update)
    p = {k: v.astype(np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    for k in range(1, 4):
        grads = {name: rng.normal(size=s).astype(np.float32) for name, s in shapes.items()}
        got, state = step(_nest(grads), state, _nest({n: v.astype(np.float32) for n, v in p.items()}))
        got = _flat(jax.device_get(got))
        lr = _lr(k - 1)
        for name, g in grads.items():
            g = g.astype(np.float64)
            if name in MUON_LEAVES and name not in keep:
                _, _, fan_in, fan_out = MUON_LEAVES[name]
                mu[name] = m.beta * mu[name] + (1 - m.beta) * g
                if m.nesterov:  # optax's bias-corrected Nesterov: the next step's momentum, this step's gradient
                    look = m.beta * mu[name] / (1 - m.beta ** (k + 1)) + (1 - m.beta) * g / (1 - m.beta ** k)
                else:
                    look = mu[name] / (1 - m.beta ** k)
                n_in = np.prod([g.shape[d] for d in fan_in])
                n_out = np.prod([g.shape[d] for d in fan_out])
                scale = m.rms_scale * np.sqrt(max(n_in, n_out)) if m.rms_scale else np.sqrt(max(1, n_out / n_in))
                ortho = _per_matrix(lambda x: _ns_oracle(x, m.ns_steps, o.eps), look, fan_in, fan_out)
                want = -lr * (scale * ortho + o.weight_decay * p[name])
            else:  # AdamW, decoupled decay off the norm scales
                mu[name] = o.b1 * mu[name] + (1 - o.b1) * g
                nu[name] = o.b2 * nu[name] + (1 - o.b2) * g * g
                m_hat, v_hat = mu[name] / (1 - o.b1 ** k), nu[name] / (1 - o.b2 ** k)
                decay = 0.0 if name.endswith("norm") else o.weight_decay
                want = -lr * (m_hat / (np.sqrt(v_hat) + o.eps) + decay * p[name])
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"{name} at step {k}")
            p[name] = p[name] + got[name].astype(np.float64)


def _schedule_oracle(s: int, lr: float, warmup: int, end_step: int, ratio: float, kind: str) -> float:
    """docs/config.md's schedule at count s: linear from 0 over `warmup`, then `kind` down to
    lr * ratio at `end_step` (optim.decay_steps, null: train.steps), flat after it."""
    if s < warmup:
        return lr * s / warmup
    if kind == "constant":
        return lr
    frac = min(s - warmup, end_step - warmup) / (end_step - warmup)
    shape = 0.5 * (1 + np.cos(np.pi * frac)) if kind == "cosine" else 1 - frac
    return lr * (ratio + (1 - ratio) * shape)


@pytest.mark.parametrize("overrides, end_step", [
    (["optim.decay_steps=null"], 20),  # null: decay reaches its floor at train.steps
    (["optim.decay_steps=12"], 12),
    (["optim.decay_steps=null", "optim.schedule=linear"], 20),
    (["optim.decay_steps=10", "optim.schedule=linear", "optim.warmup_steps=0"], 10),  # 0: no warmup at all
    (["optim.schedule=constant"], None),
])
def test_schedule_follows_the_documented_formula(overrides, end_step):
    from maxtrain.optim import make_schedule

    cfg = load_config(None, ["train.steps=20", "optim.lr=0.5", "optim.warmup_steps=4", "optim.min_lr_ratio=0.1",
                             *overrides])
    o = cfg.optim
    schedule = make_schedule(o, cfg.train.steps)
    got = [float(schedule(s)) for s in range(0, 25)]
    want = [_schedule_oracle(s, o.lr, o.warmup_steps, end_step, o.min_lr_ratio, o.schedule) for s in range(0, 25)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_clip_norm_null_leaves_gradients_alone_and_a_value_clips_their_global_norm(clip):
    """One AdamW step with a large epsilon, so the update depends on the gradient's size:
    -lr (g' / (|g'| + eps) + wd p) with g' = g min(1, clip / |g|_global) (null: g' = g)."""
    o = load_config(None, ["optim.eps=1.0", "optim.weight_decay=0.0", f"optim.clip_norm={clip or 'null'}"]).optim
    rng = np.random.default_rng(3)
    params = {"a": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    grads = {"a": 3 * rng.normal(size=(4, 3)).astype(np.float32), "b": 3 * rng.normal(size=(5,)).astype(np.float32)}
    tx = make_optimizer(o, optax.constant_schedule(0.1), {"a": ("embed", "mlp"), "b": ("mlp",)})
    got, _ = tx.update(grads, tx.init(params), params)
    norm = np.sqrt(sum(np.sum(np.square(g.astype(np.float64))) for g in grads.values()))
    assert norm > 5  # the clip at 1 bites
    factor = 1.0 if clip is None else min(1.0, clip / norm)
    for k, g in grads.items():
        g = g.astype(np.float64) * factor
        np.testing.assert_allclose(got[k], -0.1 * g / (np.abs(g) + 1.0), rtol=1e-5, err_msg=k)


def test_deepseek_leaves_its_bias_routers_and_norms_to_adamw():
    """The docs' AdamW set on a real model with latents, a balancing bias and MTP: embeddings, head,
    norms (kv_norm, the MTP module's enorm/hnorm), routers and the bias; the latent up-projections
    are matrices whose rows are the latent rank."""
    cfg = load_config(None, ["model.name=deepseek", "model.vocab_size=64", "model.d_model=16", "model.n_layers=2",
                             "model.n_heads=2", "model.d_ff=24", "model.mtp={depth: 1}",
                             "model.mla={q_lora_rank: 6, kv_lora_rank: 6, qk_nope_head_dim: 4, qk_rope_head_dim: 2, "
                             "v_head_dim: 4}", "model.moe={num_experts: 4, top_k: 2, d_ff: 8, bias_update_rate: 0.01}"])
    dims = jax.tree_util.tree_leaves_with_path(muon_layout(_axes(cfg)), is_leaf=lambda x: x is None or isinstance(
        x, MuonDimensionNumbers))
    adamw = {jax.tree_util.keystr(p) for p, d in dims if d is None}
    assert adamw == {"['embed']['embedding']", "['lm_head']['kernel']", "['final_norm']['scale']",
                     *(f"['layers']['{n}']" for n in ("attn_norm", "mlp_norm", "kv_norm", "q_norm")),
                     "['layers']['moe']['router']", "['layers']['moe']['bias']",
                     *(f"['mtp']['{n}']" for n in ("attn_norm", "mlp_norm", "kv_norm", "q_norm", "enorm", "hnorm",
                                                   "final_norm")), "['mtp']['moe']['router']"}, adamw
    L = muon_layout(_axes(cfg))["layers"]
    assert L["wkv_b"] == MuonDimensionNumbers((1,), (2, 3)) and L["wq_b"] == MuonDimensionNumbers((1,), (2, 3))


def _adamw_oracle(p, g, m, v, t, lr, o, wd):
    """One AdamW step in float64 (t: this parameter's update count, from 1)."""
    m = o.b1 * m + (1 - o.b1) * g
    v = o.b2 * v + (1 - o.b2) * g * g
    mh, vh = m / (1 - o.b1 ** t), v / (1 - o.b2 ** t)
    return p - lr * (mh / (np.sqrt(vh) + o.eps) + wd * p), m, v


def test_a_frozen_group_holds_no_moments_until_it_learns_then_starts_like_a_new_parameter():
    """optim.groups frozen_until=2 on `w`: the optimizer built for updates 0 and 1 holds no moments
    for it (no leaf of its shape), updates it by exactly 0 and leaves its gradient out of the
    clipping norm; from update 2 (`carry_over` into the optimizer built for step 2) it gets AdamW
    with its own count from 1 and zero moments, on the run's learning-rate schedule, while `e`
    carries on uninterrupted: four updates against a float64 NumPy AdamW, the optimizer built
    afresh for each (as a run resumed at that step builds it)."""
    from maxtrain.optim import carry_over

    wd, clip = 0.01, 0.5
    o = OptimConfig(weight_decay=wd, clip_norm=clip, eps=1e-6, groups=[{"params": "^w", "frozen_until": 2}])
    schedule = optax.linear_schedule(0.1, 0.01, 10)
    axes = {"w": ("embed", "mlp"), "e": ("vocab", "embed")}
    rng = np.random.default_rng(7)
    params = {"w": rng.normal(size=(3, 5)).astype(np.float32), "e": rng.normal(size=(4, 3)).astype(np.float32)}
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(4)]
    tx = make_optimizer(o, schedule, axes, step=0)
    state = tx.init(params)
    assert not any(x.shape == (3, 5) for x in jax.tree.leaves(state))  # no moments for the frozen w
    assert sum(x.shape == (4, 3) for x in jax.tree.leaves(state)) == 2  # e's mu and nu
    ref = {k: (v.astype(np.float64), np.zeros(v.shape), np.zeros(v.shape), 0) for k, v in params.items()}
    p = params
    for t, g in enumerate(grads):
        tx = make_optimizer(o, schedule, axes, step=t)  # built afresh each update, as a run resumed there is
        if jax.tree.structure(state) != jax.tree.structure(tx.init(p)):
            assert t == 2  # the layout changes where the phase does, and only there
            state = carry_over(state, tx.init(p))
            assert sum(x.shape == (3, 5) for x in jax.tree.leaves(state)) == 2  # w's moments, from now on
        updates, state = tx.update(g, state, p)
        p = optax.apply_updates(p, updates)
        active = [k for k in g if k == "e" or t >= 2]
        norm = np.sqrt(sum(np.sum(np.square(g[k].astype(np.float64))) for k in active))
        factor = min(1.0, clip / norm)
        for k in active:
            q, m, v, n = ref[k]
            q, m, v = _adamw_oracle(q, g[k] * factor, m, v, n + 1, float(schedule(t)), o, wd)
            ref[k] = (q, m, v, n + 1)
        if t < 2:
            np.testing.assert_array_equal(p["w"], params["w"])  # exactly frozen
        for k in p:
            np.testing.assert_allclose(p[k], ref[k][0], rtol=2e-5, atol=1e-6, err_msg=f"{k} after update {t}")


def test_groups_without_a_frozen_one_keep_the_optimizer_layout_of_earlier_runs():
    """A checkpoint of a run with optim.groups (lr_scale, rows) and no frozen group resumes across
    the change that built the optimizer per phase: the same state leaves as before (clip, AdamW's
    counts, the groups' count), so its optimizer state restores."""
    o = OptimConfig(groups=[{"params": "^e", "lr_scale": 2.0, "rows_from": 2, "rows_until": 3}])
    axes = {"w": ("embed", "mlp"), "e": ("vocab", "embed")}
    params = {"w": np.ones((3, 5), np.float32), "e": np.ones((4, 3), np.float32)}
    state = make_optimizer(o, optax.constant_schedule(0.1), axes).init(params)
    counts = [jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_flatten_with_path(state)[0] if v.ndim == 0]
    assert counts == ["[1][0].count", "[1][2].count", "[2].count"]


def test_muon_trains_with_a_frozen_group(tmp_path):
    """Muon sees only the parameters of its phase's part (the frozen ones arrive masked): a run
    with the layers frozen for two steps trains and changes phase, resumed bitwise across it."""
    common = SMALL + ["optim.name=muon", "optim.groups=[{params: ^embed/, lr_scale: 2}, {params: ., frozen_until: 2}]"]
    whole = train(load_config(TINY, common + ["train.steps=4", f"run_dir={tmp_path / 'w'}", "checkpoint.every=1", "checkpoint.keep=4",
                                              f"checkpoint.dir={tmp_path / 'ck'}"]), devices=jax.devices()[:2])
    rest = train(load_config(TINY, common + ["train.steps=4", f"run_dir={tmp_path / 'b'}", "checkpoint.every=0",
                                             f"checkpoint.resume_from={tmp_path / 'ck' / '1'}",
                                             f"checkpoint.dir={tmp_path / 'ck2'}"]), devices=jax.devices()[:2])
    assert [r["loss"] for r in rest.history] == [r["loss"] for r in whole.history[1:]]
    assert np.isfinite(whole.history[-1]["loss"])
