"""The DeepSeek-V3-style family (`model.name: deepseek`): published sizes, routing against numpy,
aux-loss-free balancing, multi-token prediction against a truncation reference, sharded and
pipelined training against one device, flash attention against XLA, bitwise resume, config errors.
(Hugging Face parity: tests/test_hf_deepseek.py.)"""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, SMALL, TINY
from maxtrain import load_config, train
from maxtrain.config import ConfigError, MoEConfig, mla_attention_impl
from maxtrain.layers.moe import route
from maxtrain.models import deepseek, get

DS = SMALL + [
    "model.name=deepseek", "model.n_layers=3", "model.n_kv_heads=4", "train.steps=3",
    "model.mla={q_lora_rank: 16, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 8}",
    "model.moe={num_experts: 4, top_k: 2, shared_experts: 1, d_ff: 32, first_dense: 1, router: sigmoid, "
    "norm_topk: true, routed_scale: 1.5, groups: 2, topk_groups: 1, bias_update_rate: 0.01, aux_loss_coef: 0.001, "
    "z_loss_coef: 0.0}",
    "model.mtp={depth: 1, loss_weight: 0.3}",
]


def _config(name):
    return load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))


def _sizes(cfg):
    """(total, multi-token prediction modules', active per token without the input embedding)."""
    m = cfg.model
    shapes = jax.eval_shape(lambda k: get("deepseek").init(cfg, k), jax.random.key(0))
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))  # noqa: E731
    total, mtp = count(shapes), count(shapes.get("mtp", {}))
    e = m.moe
    idle = (m.n_layers - e.first_dense) * 3 * m.d_model * e.d_ff * (e.num_experts - e.top_k)
    return total, mtp, total - mtp - idle - m.vocab_size * m.d_model


def test_published_sizes():
    """DeepSeek-V3: 671B parameters, 37B active (arXiv:2412.19437), plus its MTP module (the hub's
    685B also counts the module's copies of the embedding and head: 1.85B); V2-Lite: 15.7B, 2.4B
    active (arXiv:2405.04434). Active counts leave out the input embedding (a lookup)."""
    total, mtp, active = _sizes(_config("deepseek-v3"))
    assert total - mtp == 671_026_419_200
    assert mtp + 2 * 129280 * 7168 == pytest.approx(14e9, rel=0.04)
    assert active == pytest.approx(37e9, rel=0.02)  # 36.63B
    total, mtp, active = _sizes(_config("deepseek-v2-lite"))
    assert (total, mtp) == (15_706_484_224, 0)
    assert active == pytest.approx(2.4e9, rel=0.03)  # 2.45B


def _np_route(x, router, bias, moe):
    """Routing in float64 numpy, written from the DeepSeek-V3 report: sigmoid scores; experts chosen
    by score + bias among the `topk_groups` groups whose two best (score + bias) sum highest; weights
    the chosen scores, renormalised, times routed_scale."""
    scores = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ router.astype(np.float64))))
    T, E = scores.shape
    G = moe.groups
    choice = scores + bias
    experts = np.zeros((T, moe.top_k), int)
    for t in range(T):
        groups = choice[t].reshape(G, E // G)
        rank = [np.sort(g)[-2:].sum() for g in groups]
        allowed = set(np.argsort(rank)[::-1][:moe.topk_groups])
        masked = [choice[t, e] if e // (E // G) in allowed else -np.inf for e in range(E)]
        experts[t] = np.argsort(masked, kind="stable")[::-1][:moe.top_k]
    w = np.take_along_axis(scores, experts, -1)
    return w / w.sum(-1, keepdims=True) * moe.routed_scale, experts


@pytest.mark.parametrize("groups,topk_groups", [(1, 1), (4, 2), (4, 1)])
def test_group_limited_biased_routing_matches_numpy(groups, topk_groups):
    r = np.random.default_rng(0)
    moe = MoEConfig(num_experts=16, top_k=3, router="sigmoid", norm_topk=True, routed_scale=2.5, groups=groups,
                    topk_groups=topk_groups, bias_update_rate=0.001)
    x, w, bias = r.normal(size=(64, 8)), r.normal(size=(8, 16)), 0.3 * r.normal(size=16)
    weights, experts, _ = route(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), moe,
                                jnp.asarray(bias, jnp.float32))
    want_w, want_e = _np_route(x, w, bias, moe)
    np.testing.assert_array_equal(np.sort(np.asarray(experts), -1), np.sort(want_e, -1))
    order = lambda e: np.argsort(e, -1)  # noqa: E731
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order(np.asarray(experts)), -1),
                               np.take_along_axis(want_w, order(want_e), -1), rtol=1e-5)
    if topk_groups < groups:  # every token's experts lie in its allowed groups only
        assert max(len(set(row // (16 // groups))) for row in np.asarray(experts)) <= topk_groups


def test_the_bias_chooses_but_does_not_weight():
    """Raising one expert's bias makes tokens choose it, but its weight stays the router's score."""
    moe = MoEConfig(num_experts=4, top_k=1, router="sigmoid", norm_topk=False, bias_update_rate=0.01)
    x = jax.random.normal(jax.random.key(0), (32, 8))
    w = jax.random.normal(jax.random.key(1), (8, 4))
    bias = jnp.asarray([0.0, 0.0, 10.0, 0.0])
    weights, experts, _ = route(x, w, moe, bias)
    assert bool(jnp.all(experts == 2))
    np.testing.assert_allclose(weights[:, 0], jax.nn.sigmoid(x @ w)[:, 2], rtol=1e-6)
    g = jax.grad(lambda b: jnp.sum(route(x, w, moe, b)[0]))(bias)
    assert float(jnp.abs(g).sum()) == 0.0  # outside the gradient


def test_balancing_bias_evens_a_skewed_router():
    """Iterating the update (bias += rate * sign(1/E - load)) on a router that sends most tokens to
    one expert brings every expert near the mean load, with no auxiliary loss."""
    E = 8
    moe = MoEConfig(num_experts=E, top_k=2, router="sigmoid", norm_topk=True, bias_update_rate=0.01)
    cfg = load_config(TINY, DS)
    m = dataclasses.replace(cfg.model, moe=moe)
    x = jnp.concatenate([jax.random.normal(jax.random.key(0), (512, 15)), jnp.ones((512, 1))], axis=1)
    w = jax.random.normal(jax.random.key(1), (16, E)).at[15].set(0.0).at[15, 0].set(3.0)  # expert 0 favoured

    def load(bias):
        _, experts, stats = route(x, w, moe, bias)
        return stats["moe_load"], float(stats["moe_imbalance"])

    params = {"layers": {"moe": {"bias": jnp.zeros((1, E))}}}
    before = load(params["layers"]["moe"]["bias"][0])[1]
    for _ in range(300):
        load_E, _ = load(params["layers"]["moe"]["bias"][0])
        params = deepseek.balance(params, load_E[None], m)
    after = load(params["layers"]["moe"]["bias"][0])[1]
    assert before > 2.0 and after < 1.2, (before, after)  # 2.17 -> 1.12
    assert float(params["layers"]["moe"]["bias"][0, 0]) < 0  # the favoured expert is held back


def test_mtp_loss_matches_a_truncation_reference():
    """Module 1's loss at position t predicts token t + 2 from the stack's hidden state at t and
    token t + 1's embedding. The reference builds that from the raw token sequence: tokens 1..L-1 as
    the module's inputs at positions 0..L-2 (causal attention: cutting the end changes nothing before
    it), scored against tokens 2..L."""
    from maxtrain.layers.norms import rms_norm
    from maxtrain.models.stack import runtime

    cfg = load_config(TINY, DS + ["model.moe.bias_update_rate=0.0"])
    m, rt = cfg.model, runtime(cfg)
    params = get("deepseek").init(cfg, jax.random.key(0))
    B, L = 2, 12
    tokens = jax.random.randint(jax.random.key(1), (B, L + 1), 0, m.vocab_size)

    @jax.jit
    def model_side(params, tokens):
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": jnp.ones((B, L))}
        x, rows = deepseek.embed(params, batch, m, rt)
        x, _ = jax.lax.scan(lambda h, p: deepseek.layer(h, p, rows, m, rt), x, params["layers"])
        return deepseek.mtp_loss(params, x, batch, m, rt)[0], x

    @jax.jit
    def reference(params, tokens, x):
        p = jax.tree.map(lambda a: a[0], params["mtp"])
        e = params["embed"]["embedding"][tokens[:, 1:L]]
        h = jnp.concatenate([rms_norm(e, p["enorm"], m.norm_eps), rms_norm(x[:, :L - 1], p["hnorm"], m.norm_eps)],
                            -1) @ p["proj"].reshape(2 * m.d_model, m.d_model)  # DeepSeek's eh_proj on the concatenation
        pos = jnp.broadcast_to(jnp.arange(L - 1)[None], (B, L - 1))
        h, _ = deepseek.moe_layer(h, p, m, {}, deepseek._context({"positions_BL": pos, "segment_ids_BL": None}, m))
        logp = jax.nn.log_softmax(rms_norm(h, p["final_norm"], m.norm_eps) @ params["lm_head"]["kernel"], -1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 2:, None], -1))

    got, x = model_side(params, tokens)
    want = reference(params, tokens, x)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_mtp_scores_only_targets_in_the_same_document():
    """Packed rows (loss_mask cleared where the target is in the next document, as packing makes
    it): module d at t counts where token t + d + 1 is in t's document."""
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 0]])  # 0: padding
    mask = (seg[:, :-1] == seg[:, 1:]).astype(jnp.float32)
    mask = jnp.concatenate([mask, jnp.zeros((1, 1))], axis=1) * (seg > 0)  # [1 1 1 0 1 1 0 0]
    np.testing.assert_array_equal(deepseek.mtp_positions(mask, seg, 1)[0], [1, 1, 0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(deepseek.mtp_positions(mask, seg, 2)[0], [1, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(deepseek.mtp_positions(mask, None, 1)[0], [1, 1, 0, 1, 1, 0, 0, 0])


def _history(result, key="loss"):
    return [r[key] for r in result.history]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"],
                                  ["mesh.data=2", "mesh.fsdp=2", "mesh.sequence=2", "model.attention=ring",
                                   "model.ring_layout=contiguous"]],
                         ids=["expert x fsdp x tensor", "data x fsdp x sequence ring"])
def test_sharded_training_matches_one_device(mesh, tmp_path):
    """Loss, MTP loss, grad norm and the balancing biases after three steps equal one device's."""
    one = train(load_config(TINY, DS + ["mesh.data=1", f"run_dir={tmp_path / 'a'}"]), devices=jax.devices()[:1])
    sharded = train(load_config(TINY, DS + ["mesh.data=1", *mesh, f"run_dir={tmp_path / 'b'}"]))
    for key in ("loss", "grad_norm", "mtp_loss", "moe_aux_loss"):
        np.testing.assert_allclose(_history(sharded, key), _history(one, key), rtol=5e-5)
    assert sharded.history[-1]["moe_bias_max_per_layer"] == one.history[-1]["moe_bias_max_per_layer"]
    bias = np.asarray(sharded.state.params["layers"]["moe"]["bias"])
    np.testing.assert_array_equal(bias, np.asarray(one.state.params["layers"]["moe"]["bias"]))
    # the bias moved by whole steps of the rate (the optimizer, its weight decay included, leaves it alone)
    assert np.abs(bias).max() > 0
    np.testing.assert_allclose(bias / 0.01, np.round(bias / 0.01), atol=1e-4)
    assert sharded.history[-1]["loss"] < sharded.history[0]["loss"]


@pytest.mark.slow
def test_pipelined_gradients_match_one_device():
    """mesh.pipeline=2 (1F1B): the dense layer before the stack and the MTP module after it run
    outside the stages; gradients equal one device's (balancing off: stages report no per-layer load)."""
    from test_pipeline import _grads

    common = DS + ["model.n_layers=5", "model.moe.bias_update_rate=0.0", "model.remat=none"]
    want, want_stats = _grads(load_config(TINY, common + ["mesh.data=1"]), jax.devices()[:1], accumulate=4)
    got, stats = _grads(load_config(TINY, common + ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
                                                    "train.microbatches=4"]))
    assert stats["nll_sum"] == pytest.approx(want_stats["nll_sum"], rel=2e-5)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * np.abs(w).max()), got, want)


@pytest.mark.slow
def test_flash_attention_matches_xla(tmp_path):
    """MLA's keys (nope + rope dims) and zero-padded values through the Pallas flash kernel
    (interpreted on CPU): the same losses as the XLA attention."""
    common = DS + ["mesh.data=1", "train.steps=2", "model.mtp=null", "model.mla.qk_nope_head_dim=48",
                   "model.mla.qk_rope_head_dim=16", "model.mla.v_head_dim=32"]  # query/key heads of 64
    xla = train(load_config(TINY, common + [f"run_dir={tmp_path / 'a'}"]), devices=jax.devices()[:1])
    flash = train(load_config(TINY, common + ["model.attention=flash", f"run_dir={tmp_path / 'b'}"]),
                  devices=jax.devices()[:1])
    np.testing.assert_allclose(_history(flash), _history(xla), rtol=2e-5)


def test_flash_with_heads_it_cannot_take_says_so_and_runs_xla(caplog):
    """DeepSeek-V3's 192-dim query/key heads: the flash kernels tile 64 or 128."""
    cfg = load_config(os.path.join(ROOT, "configs", "deepseek-v3.yaml"), ["model.attention=flash"])
    assert "this model runs XLA's attention" in caplog.text
    assert mla_attention_impl(cfg.model) == "xla"
    assert mla_attention_impl(load_config(TINY, DS + ["model.attention=flash", "model.mla.qk_nope_head_dim=56"]
                                               ).model) == "flash"


@pytest.mark.slow
def test_resume_is_bitwise_with_the_balancing_bias(tmp_path):
    """The bias is checkpointed with the params: a run resumed at step 2 continues exactly."""
    common = DS + ["mesh.data=1", "train.steps=3"]
    one = jax.devices()[:1]
    whole = train(load_config(TINY, common + [f"run_dir={tmp_path / 'whole'}"]), devices=one)
    ck = tmp_path / "ck"
    train(load_config(TINY, common + [f"run_dir={tmp_path / 'a'}", f"checkpoint.dir={ck}", "checkpoint.every=2",
                                      "train.steps=2"]), devices=one)
    resumed = train(load_config(TINY, common + [f"run_dir={tmp_path / 'b'}", f"checkpoint.resume_from={ck}/2"]),
                    devices=one)
    assert [r["step"] for r in resumed.history] == [3]
    for key in ("loss", "grad_norm", "mtp_loss", "moe_bias_min_per_layer"):
        assert _history(resumed, key) == _history(whole, key)[2:]
    np.testing.assert_array_equal(np.asarray(resumed.state.params["layers"]["moe"]["bias"]),
                                  np.asarray(whole.state.params["layers"]["moe"]["bias"]))


def test_proxy_config_trains_from_the_cli(tmp_path):
    """configs/deepseek-proxy.yaml through `maxtrain train`: metrics carry the MTP loss and every MoE
    layer's bias range, and `maxtrain report` shows the bias."""
    import json

    from maxtrain import cli
    from maxtrain.analysis import report

    run = tmp_path / "run"
    assert cli.main(["train", os.path.join(ROOT, "configs", "deepseek-proxy.yaml"), f"run_dir={run}",
                     "train.steps=2", "train.log_every=1", "data.kind=synthetic", "train.batch_size=8",
                     "train.seq_len=32", "mesh.data=1", "mesh.fsdp=-1"]) == 0
    last = json.loads((run / "metrics.jsonl").read_text().strip().splitlines()[-1])
    assert last["mtp_loss"] > 0
    assert len(last["moe_bias_max_per_layer"]) == 3  # 4 layers, the first dense
    assert "moe_load_per_layer" not in last
    assert "balancing bias range [" in report.text_report(report.load_runs([str(run)]))


@pytest.mark.parametrize("overrides, message", [
    (["model.mla={kv_lora_rank: 16}"], "model.mla is set for model.name='llama'"),
    (["model.name=deepseek", "model.moe={num_experts: 4}"], "model.name=deepseek needs model.mla"),
    (DS[len(SMALL):] + ["model.moe.groups=3"], "model.moe.groups=3 must divide model.moe.num_experts=4"),
    (DS[len(SMALL):] + ["model.moe.first_dense=3"], "model.moe.first_dense=3 must be below model.n_layers=3"),
    (DS[len(SMALL):] + ["mesh.pipeline=2", "mesh.data=4"], "bias_update_rate=0.01 with mesh.pipeline=2"),
    (DS[len(SMALL):] + ["model.mla.qk_rope_head_dim=7"], "an even qk_rope_head_dim"),
    (DS[len(SMALL):] + ["model.moe.top_k=3"], "model.moe.top_k=3 is more than the 2 experts of"),
])
def test_config_errors_are_one_line_and_exit_2(overrides, message, capsys, tmp_path):
    from maxtrain import cli

    code = cli.main(["train", TINY, f"run_dir={tmp_path / 'run'}", *SMALL, *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("maxtrain: error:") and "\n" not in err and message in err, err


def test_muon_orthogonalises_the_latent_projections():
    """Under optim.name=muon every MLA projection, the experts and the MTP projection are Muon
    matrices (the latent up-projections' rows are their rank); norms, the router, its bias, the
    embedding and the head stay on AdamW."""
    from maxtrain.optim import muon_layout

    cfg = load_config(TINY, DS + ["optim.name=muon"])
    layout = muon_layout(get("deepseek").logical_axes(cfg))
    on = {k for k, v in layout["layers"].items() if v is not None} | {
        "moe/" + k for k, v in layout["layers"]["moe"].items() if v is not None}
    assert {"wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "moe/w_gate", "moe/w_down", "moe/shared_up"} <= on
    assert not {"attn_norm", "q_norm", "kv_norm", "moe/router", "moe/bias"} & on
    assert layout["layers"]["wkv_b"].reduction_axis == (1,)  # [layers, kv_lora, heads, head_dim]
    assert layout["mtp"]["proj"] is not None and layout["embed"]["embedding"] is None


def test_the_balancing_bias_stays_float32_under_bf16_params():
    """Steps of 0.001 would round away on a bf16 bias of 0.5; the bias is kept in float32."""
    cfg = load_config(TINY, DS + ["train.param_dtype=bfloat16"])
    params = jax.eval_shape(lambda k: get("deepseek").init(cfg, k), jax.random.key(0))
    assert params["layers"]["moe"]["bias"].dtype == jnp.float32
    assert params["layers"]["moe"]["router"].dtype == jnp.bfloat16


def test_mtp_with_zigzag_ring_is_refused():
    from maxtrain.train import make_setup

    cfg = load_config(TINY, DS + ["mesh.data=1", "mesh.fsdp=4", "mesh.sequence=2", "model.attention=ring"])
    with pytest.raises(ConfigError, match="model.mtp with zig-zag ring attention"):
        make_setup(cfg)
