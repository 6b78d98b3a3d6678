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
from maxtrain.config import ConfigError, MoEConfig
from maxtrain.models.deepseek.config import mla_attention_impl
from maxtrain.layers.moe import route
from maxtrain.models import get
from maxtrain.models.deepseek import model as deepseek

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
    params = _random_params(cfg, seed=0)  # every norm its own random scale: enorm and hnorm differ
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


# ---------------------------------------------------------------- the whole family against numpy
#
# The oracle below is written from the DeepSeek-V2/V3 reports (and, for the MTP input order, the
# released checkpoints' `eh_proj` as vLLM and SGLang apply it: cat([enorm(embedding), hnorm(hidden)])),
# in float64 numpy, importing nothing of maxtrain.models or maxtrain.layers: it shares only the
# parameter names and their documented layouts (`[nope, rope]` query/key dims, `[nope, value]`
# from wkv_b, `[latent, rope key]` from wkv_a, MTP `proj[0]` the embedding half). Every parameter is
# drawn at random and separately (each norm scale 1 +- 0.3, a different draw per norm and layer), so
# no two parameters of one shape can trade places unnoticed.

PARITY = [
    "model.name=deepseek", "model.vocab_size=64", "model.d_model=32", "model.n_layers=3", "model.n_heads=2",
    "model.n_kv_heads=2", "model.d_ff=24", "model.tie_embeddings=false", "train.dtype=float32", "model.remat=none",
    # q_lora_rank = kv_lora_rank: q_norm and kv_norm have one shape; nope, rope and value dims all differ
    "model.mla={q_lora_rank: 12, kv_lora_rank: 12, qk_nope_head_dim: 6, qk_rope_head_dim: 4, v_head_dim: 8}",
    "model.moe={num_experts: 8, top_k: 3, shared_experts: 1, d_ff: 8, first_dense: 1, router: sigmoid, "
    "norm_topk: true, routed_scale: 2.5, groups: 4, topk_groups: 2, bias_update_rate: 0.01, aux_loss_coef: 0.05, "
    "z_loss_coef: 0.002}",
    "model.mtp={depth: 2, loss_weight: 0.3}",
]
# a full-rank query, two dense layers, tied head, weights not renormalised, no group limit, no bias
PARITY_B = PARITY + [
    "model.mla={q_lora_rank: null, kv_lora_rank: 10, qk_nope_head_dim: 4, qk_rope_head_dim: 6, v_head_dim: 5}",
    "model.moe={num_experts: 4, top_k: 2, shared_experts: 0, d_ff: 8, first_dense: 2, router: sigmoid, "
    "norm_topk: false, routed_scale: 1.0, groups: 1, topk_groups: 1, bias_update_rate: 0.0, aux_loss_coef: 0.05, "
    "z_loss_coef: 0.002}",
    "model.mtp={depth: 1, loss_weight: 0.7}", "model.tie_embeddings=true",
]


def _random_params(cfg, seed):
    """The family's params with every leaf redrawn (norm scales 1 +- 0.3, the balancing bias +- 0.1,
    weights of std 0.25, the embedding of std 1), leaf by leaf from one seeded generator."""
    r = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda k: get("deepseek").init(cfg, k), jax.random.key(0))

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            a = 1 + 0.3 * r.standard_normal(leaf.shape)
        elif "bias" in name:
            a = 0.1 * r.standard_normal(leaf.shape)
        elif "embedding" in name:
            a = r.standard_normal(leaf.shape)
        else:
            a = 0.25 * r.standard_normal(leaf.shape)
        return jnp.asarray(a, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _np_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def _np_silu(x):
    return x / (1 + np.exp(-x))


def _np_rope(x, pos, theta):
    """Rotate-half RoPE: pair (i, i + P/2) of the last axis turned by pos * theta^(-2i/P); x [B, L, H, P]."""
    P = x.shape[-1]
    angle = pos[:, :, None, None] * theta ** (-np.arange(0, P, 2) / P)
    x1, x2 = x[..., :P // 2], x[..., P // 2:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1)


def _np_mla(x, p, m, pos, seg):
    """Multi-head latent attention (DeepSeek-V2 §2.1): q from a normed latent (or directly), k_nope and
    v from the normed kv latent, one rotary key shared by every head, scores over the nope and rope
    dims scaled by (nope + rope)^-1/2, causal within a document."""
    a, eps = m.mla, m.norm_eps
    N, P, R = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
    h = _np_rms(x, p["attn_norm"], eps)
    if "wq" in p:
        q = np.einsum("bld,dhk->blhk", h, p["wq"])
    else:
        q = np.einsum("blq,qhk->blhk", _np_rms(h @ p["wq_a"], p["q_norm"], eps), p["wq_b"])
    ckv = h @ p["wkv_a"]
    kv = np.einsum("blr,rhk->blhk", _np_rms(ckv[..., :R], p["kv_norm"], eps), p["wkv_b"])
    k_nope, v = kv[..., :N], kv[..., N:]
    q_rope = _np_rope(q[..., N:], pos, m.rope_theta)
    k_rope = _np_rope(ckv[:, :, None, R:], pos, m.rope_theta)[:, :, 0]  # [B, L, P]: no head axis
    s = np.einsum("bihk,bjhk->bhij", q[..., :N], k_nope) + np.einsum("bihk,bjk->bhij", q_rope, k_rope)
    s = s / np.sqrt(N + P)
    L = x.shape[1]
    ok = np.tril(np.ones((L, L), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    s = np.where(ok[:, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("biha,had->bid", np.einsum("bhij,bjha->biha", w, v), p["wo"])


def _np_choose(scores, bias, moe):
    """DeepSeek-V3 routing (§2.1.2): experts chosen by score + bias (bias 0 without balancing) among the
    `topk_groups` groups whose two best (score + bias) sum highest; weighted by their scores alone,
    renormalised when norm_topk says so (null: when top_k > 1), times routed_scale. (weights, experts)."""
    T, E = scores.shape
    G, K = moe.groups, moe.top_k
    choice = scores + (0.0 if bias is None else bias)
    experts = np.zeros((T, K), int)
    for t in range(T):
        rank = np.sort(choice[t].reshape(G, E // G), -1)[:, -2:].sum(-1)
        groups = np.argsort(-rank, kind="stable")[:moe.topk_groups]
        allowed = np.isin(np.arange(E) // (E // G), groups)
        experts[t] = np.argsort(-np.where(allowed, choice[t], -np.inf), kind="stable")[:K]
    w = np.take_along_axis(scores, experts, -1)
    if moe.norm_topk if moe.norm_topk is not None else K > 1:
        w = w / w.sum(-1, keepdims=True)
    return w * moe.routed_scale, experts


def _np_swiglu(x, g, u, d):
    return (_np_silu(x @ g) * (x @ u)) @ d


def _np_moe(x, p, moe, bias):
    """Routed experts (sigmoid router) plus the shared ones, and the router statistics: load (share of
    assignments per expert), Switch balance loss E sum f p (p: the scores normalised per token), z-loss."""
    B, L, D = x.shape
    xt = x.reshape(-1, D)
    logits = xt @ p["router"]
    scores = 1 / (1 + np.exp(-logits))
    w, e = _np_choose(scores, bias, moe)
    y = np.zeros_like(xt)
    for t in range(len(xt)):
        for k in range(moe.top_k):
            j = e[t, k]
            y[t] += w[t, k] * _np_swiglu(xt[t], p["w_gate"][j], p["w_up"][j], p["w_down"][j])
    if moe.shared_experts:
        y += _np_swiglu(xt, p["shared_gate"], p["shared_up"], p["shared_down"])
    load = np.bincount(e.ravel(), minlength=moe.num_experts) / e.size
    prob = np.mean(scores / scores.sum(-1, keepdims=True), 0)
    lse = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
    stats = {"load": load, "aux": moe.num_experts * np.sum(load * prob), "z": np.mean(lse ** 2)}
    return y.reshape(B, L, D), stats


def _np_moe_layer(x, p, m, pos, seg, bias=None):
    x = x + _np_mla(x, p, m, pos, seg)
    y, stats = _np_moe(_np_rms(x, p["mlp_norm"], m.norm_eps), p["moe"], m.moe, bias)
    return x + y, stats


def _np_xent(logits, targets):
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1)[..., 0]


def _np_family(params, batch, m):
    """(logits, MoE layers' stats, MTP loss, the MoE losses of the MTP modules' layers) in numpy.

    MTP (DeepSeek-V3 §2.2): module k (from 1) at position t takes module k-1's hidden state (k = 1:
    the main stack's, before the final norm) and the embedding of token t + k, i.e. targets[t + k - 1];
    h' = eh_proj [enorm(embedding); hnorm(hidden)]; one more layer; its own final norm, the shared
    head; scored against token t + k + 1 = targets[t + k] where that target counts (loss_mask) and is
    in t's document. The loss: the modules' mean of masked-mean cross-entropies."""
    P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    inputs, targets, mask, seg, pos = (np.asarray(batch[k]) for k in
                                       ("inputs", "targets", "loss_mask", "segment_ids", "positions"))
    B, L = inputs.shape
    emb, eps, D = P["embed"]["embedding"], m.norm_eps, m.d_model
    head = emb.T if m.tie_embeddings else P["lm_head"]["kernel"]
    x = emb[inputs]
    for i in range(m.moe.first_dense):
        p = jax.tree.map(lambda a: a[i], P["dense_layers"])
        x = x + _np_mla(x, p, m, pos, seg)
        x = x + _np_swiglu(_np_rms(x, p["mlp_norm"], eps), p["w_gate"], p["w_up"], p["w_down"])
    stats = []
    for i in range(m.n_layers - m.moe.first_dense):
        p = jax.tree.map(lambda a: a[i], P["layers"])
        x, s = _np_moe_layer(x, p, m, pos, seg, p["moe"].get("bias"))
        stats.append(s)
    logits = _np_rms(x, P["final_norm"]["scale"], eps) @ head
    h, losses, mtp_stats = x, [], []
    for k in range(1, m.mtp.depth + 1):
        p = jax.tree.map(lambda a: a[k - 1], P["mtp"])
        nxt = np.concatenate([targets[:, k - 1:], np.zeros((B, k - 1), int)], 1)  # past the end: masked below
        cat = np.concatenate([_np_rms(emb[nxt], p["enorm"], eps), _np_rms(h, p["hnorm"], eps)], -1)
        h, s = _np_moe_layer(cat @ p["proj"].reshape(2 * D, D), p, m, pos, seg)
        mtp_stats.append(s)
        nll = _np_xent(_np_rms(h, p["final_norm"], eps) @ head, np.concatenate([targets[:, k:], targets[:, :k]], 1))
        valid = np.zeros((B, L))
        valid[:, :L - k] = mask[:, k:] * (seg[:, k:] == seg[:, :L - k])
        losses.append(np.sum(nll * valid) / max(valid.sum(), 1.0))
    return logits, stats, np.mean(losses), mtp_stats


def _packed_batch(m, seed, B=2, L=10):
    """Row 0 one document; row 1 two (6 + 4 tokens, positions restarting), a target past a document's
    end masked (as packing does) and one more masked at random."""
    r = np.random.default_rng(seed)
    tokens = r.integers(0, m.vocab_size, (B, L + 1))
    seg = np.asarray([[1] * L, [1] * 6 + [2] * (L - 6)], np.int32)
    pos = np.asarray([list(range(L)), list(range(6)) + list(range(L - 6))], np.int32)
    mask = np.ones((B, L), np.float32)
    mask[1, 5] = 0.0  # its target is the next document's first token
    mask[0, 3] = 0.0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask, "segment_ids": seg,
            "positions": pos}


@pytest.fixture(scope="module", params=["v3", "full_rank_q"])
def family_vs_numpy(request):
    """(cfg, params, batch, the family's public apply (logits, aux), the numpy oracle's results)."""
    cfg = load_config(TINY, PARITY if request.param == "v3" else PARITY_B)
    params = _random_params(cfg, seed=7)
    batch = _packed_batch(cfg.model, seed=8)
    logits, aux = jax.jit(lambda p, b: get("deepseek").apply(p, b, cfg))(params, jax.tree.map(jnp.asarray, batch))
    return cfg, params, batch, (np.asarray(logits), jax.device_get(aux)), _np_family(params, batch, cfg.model)


def test_family_logits_match_a_numpy_oracle(family_vs_numpy):
    """MLA, the dense layers first, routed + shared experts with group-limited biased routing, the
    final norm and head: logits against the numpy oracle, on packed rows (per-document positions)."""
    cfg, params, batch, (logits, _), (want, _, _, _) = family_vs_numpy
    # measured (XLA:CPU, f32 against f64): relative error about 1e-6
    assert np.linalg.norm(logits - want) / np.linalg.norm(want) < 2e-5
    np.testing.assert_allclose(logits, want, rtol=1e-3, atol=1e-4)


def test_family_routing_is_not_trivial(family_vs_numpy):
    """The oracle's case exercises what it pins: the bias and the group limit each change some token's
    experts in the MoE layers (v3), so neither can be dropped or misapplied unnoticed."""
    cfg, params, batch, _, _ = family_vs_numpy
    m = cfg.model
    if m.moe.bias_update_rate == 0:
        assert "bias" not in params["layers"]["moe"]  # value 0: no bias at all
        return
    P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = P["embed"]["embedding"][np.asarray(batch["inputs"])].reshape(-1, m.d_model)
    changed_by_bias = changed_by_groups = 0
    for i in range(m.n_layers - m.moe.first_dense):
        s = 1 / (1 + np.exp(-_np_rms(x, P["layers"]["mlp_norm"][i], m.norm_eps) @ P["layers"]["moe"]["router"][i]))
        b = P["layers"]["moe"]["bias"][i]
        chosen = lambda moe, bias: [set(r) for r in _np_choose(s, bias, moe)[1]]  # noqa: E731
        changed_by_bias += chosen(m.moe, b) != chosen(m.moe, None)
        changed_by_groups += chosen(m.moe, b) != chosen(dataclasses.replace(m.moe, groups=1, topk_groups=1), b)
    assert changed_by_bias and changed_by_groups


def test_mtp_loss_and_objective_match_a_numpy_oracle(family_vs_numpy):
    """The MTP loss (`mtp_loss`: which embedding and which target each depth uses, enorm on the
    embedding and hnorm on the hidden state, the concatenation's order, module k chained on module
    k-1, per-document masking, the mean over depths) and the objective the model adds (aux loss):
    aux_loss_coef x balance + z_loss_coef x z of the stack's MoE layers (their mean) and of the MTP
    modules' (their mean), plus mtp.loss_weight x the MTP loss."""
    cfg, params, batch, (_, aux), (_, stats, mtp, mtp_stats) = family_vs_numpy
    moe = cfg.model.moe
    np.testing.assert_allclose(aux["metrics"]["mtp_loss"], mtp, rtol=2e-5)
    moe_loss = lambda st: (moe.aux_loss_coef * np.mean([s["aux"] for s in st])  # noqa: E731
                           + moe.z_loss_coef * np.mean([s["z"] for s in st]))
    want = moe_loss(stats) + cfg.model.mtp.loss_weight * mtp + moe_loss(mtp_stats)
    np.testing.assert_allclose(aux["loss"], want, rtol=2e-5)
    np.testing.assert_allclose(aux["metrics"]["moe_aux_loss"], np.mean([s["aux"] for s in stats]), rtol=2e-5)
    np.testing.assert_allclose(aux["metrics"]["moe_z_loss"], np.mean([s["z"] for s in stats]), rtol=2e-5)
    np.testing.assert_allclose(aux["metrics"]["moe_imbalance_per_layer"],  # max load over the mean load, 1/E
                               [moe.num_experts * s["load"].max() for s in stats], rtol=1e-6)


def test_balancing_moves_each_layers_bias_by_its_own_load(family_vs_numpy):
    """The per-layer load the family reports (`moe_load_per_layer`, layer i at row i) equals the
    oracle's share of assignments per expert, and `balance` moves layer i's bias by
    bias_update_rate x sign(1/E - load_i): towards underloaded experts, 0 where the load is exact."""
    cfg, params, batch, (_, aux), (_, stats, _, _) = family_vs_numpy
    moe = cfg.model.moe
    if moe.bias_update_rate == 0:
        assert not any(k.startswith("moe_load") for k in aux["metrics"])  # nothing to balance
        return
    load = aux["metrics"]["moe_load_per_layer"]
    np.testing.assert_allclose(load, [s["load"] for s in stats], atol=1e-7)
    new = get("deepseek").balance(params, load, cfg)
    bias = np.asarray(params["layers"]["moe"]["bias"], np.float64)
    want = bias + moe.bias_update_rate * np.sign(1.0 / moe.num_experts - np.asarray([s["load"] for s in stats]))
    np.testing.assert_allclose(new["layers"]["moe"]["bias"], want, atol=1e-7)
    np.testing.assert_array_equal(new["layers"]["moe"]["router"], params["layers"]["moe"]["router"])


def test_balance_update_by_hand():
    """Three layers, four experts, loads chosen by hand: over 1/4 -> bias down by the rate, under ->
    up, exactly 1/4 -> unchanged; each layer by its own row."""
    cfg = load_config(TINY, PARITY + ["model.n_layers=4", "model.moe.num_experts=4", "model.moe.groups=2",
                                      "model.moe.topk_groups=1", "model.moe.top_k=2", "model.moe.bias_update_rate=0.5"])
    bias = jnp.asarray([[0.0, 1.0, -1.0, 2.0], [0.5, 0.5, 0.5, 0.5], [3.0, 0.0, 0.0, -3.0]], jnp.float32)
    load = jnp.asarray([[0.5, 0.25, 0.125, 0.125], [0.0, 0.0, 0.5, 0.5], [0.25, 0.25, 0.25, 0.25]], jnp.float32)
    new = get("deepseek").balance({"layers": {"moe": {"bias": bias}}}, load, cfg)["layers"]["moe"]["bias"]
    np.testing.assert_array_equal(new, [[-0.5, 1.0, -0.5, 2.5], [1.0, 1.0, 0.0, 0.0], [3.0, 0.0, 0.0, -3.0]])


@pytest.mark.parametrize("norm_topk", [None, True, False])
@pytest.mark.parametrize("top_k", [1, 3])
def test_norm_topk_and_routed_scale_match_numpy(norm_topk, top_k):
    """`model.moe.norm_topk`: null renormalises only for top_k > 1, true and false as said, for either
    top_k; routed_scale multiplies after; with biased group-limited choice (numpy oracle above)."""
    r = np.random.default_rng(top_k)
    moe = MoEConfig(num_experts=8, top_k=top_k, router="sigmoid", norm_topk=norm_topk, routed_scale=1.7, groups=4,
                    topk_groups=2, bias_update_rate=0.01)
    x, w, bias = r.normal(size=(24, 6)), r.normal(size=(6, 8)), 0.2 * r.normal(size=8)
    weights, experts, _ = route(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), moe,
                                jnp.asarray(bias, jnp.float32))
    want_w, want_e = _np_choose(1 / (1 + np.exp(-(x @ w))), bias, moe)
    np.testing.assert_array_equal(np.sort(np.asarray(experts), -1), np.sort(want_e, -1))
    by_expert = lambda w_, e_: np.take_along_axis(w_, np.argsort(e_, -1), -1)  # noqa: E731
    np.testing.assert_allclose(by_expert(np.asarray(weights), np.asarray(experts)), by_expert(want_w, want_e),
                               rtol=1e-5)
    renormalised = norm_topk if norm_topk is not None else top_k > 1
    assert np.allclose(np.asarray(weights).sum(-1), 1.7, rtol=1e-5) == renormalised


def _history(result, key="loss"):
    return [r[key] for r in result.history]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"],
                                  ["mesh.data=2", "mesh.fsdp=2", "mesh.sequence=2", "model.attention=ring",
                                   "model.ring_layout=contiguous"]],
                         ids=["expert x fsdp x tensor", "data x fsdp x sequence ring"])
def test_sharded_training_matches_one_device(mesh, tmp_path, one_device_run):
    """Loss, MTP loss, grad norm and the balancing biases after three steps equal one device's."""
    one = one_device_run(DS + ["mesh.data=1"])  # the same run for every mesh
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
    (["model.mla={kv_lora_rank: 16}"], "model.mla is a key of model.name=deepseek, not of model.name=llama"),
    (["model.moe={num_experts: 4, groups: 2}"], "model.moe.groups is set for model.name=llama, whose MoE layers"),
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
    from maxtrain.step import make_setup

    cfg = load_config(TINY, DS + ["mesh.data=1", "mesh.fsdp=4", "mesh.sequence=2", "model.attention=ring"])
    with pytest.raises(ConfigError, match="model.mtp with zig-zag ring attention"):
        make_setup(cfg)
