"""The deepseek family's KV-cached decoder (`maxtrain.models.deepseek.decode`): prefill logits equal
the training forward's, decoding token by token against the latent cache equals prefilling the whole
sequence, greedy generation equals transformers' `DeepseekV3ForCausalLM.generate`, and the cache is
MLA's latent one."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, randomized_hf_model
from maxtrain import forward, load_config
from maxtrain.generate import forward_cached, generate_tokens, init_cache
from maxtrain.layers.norms import rms_norm
from maxtrain.layers.rope import apply_rope, inv_frequencies
from maxtrain.models import get

MLA = "model.mla={q_lora_rank: %s, kv_lora_rank: 16, qk_nope_head_dim: 16, qk_rope_head_dim: 8, v_head_dim: 12}"
# 8 narrow experts in 4 groups, top-2 from the best 2 groups, a shared expert, routed_scale 2.5 and a
# balancing bias: every part of DeepSeek-V3's routing is in play (and is shown to matter below)
MOE = ("model.moe={num_experts: 8, top_k: 2, shared_experts: 1, d_ff: 24, first_dense: %d, router: sigmoid, "
       "norm_topk: true, routed_scale: 2.5, groups: 4, topk_groups: 2, bias_update_rate: 0.001}")
CASES = {
    # a query latent, one dense layer then two MoE layers, MTP params (which the decoder ignores)
    "q_lora": [MLA % 32, MOE % 1],
    # a full-rank query
    "no_q_lora": [MLA % "null", MOE % 1, "model.mtp=null"],
    # a full-rank query, every layer MoE (no dense_layers), tied embeddings
    "no_q_lora_all_moe_tied": [MLA % "null", MOE % 0, "model.mtp=null", "model.tie_embeddings=true"],
}


def _config(case):
    return load_config(os.path.join(ROOT, "configs", "deepseek-proxy.yaml"),
                       ["train.dtype=float32", "model.vocab_size=128", "model.d_model=64", "model.d_ff=96",
                        "model.n_layers=3", "model.n_heads=4", *CASES[case]])


def _random_params(cfg, seed=0):
    """float32 params of `cfg`'s model, every leaf drawn afresh (distinct values everywhere): norm
    scales 1 + 0.1 N(0, 1), the rest (the balancing bias included) 0.1 N(0, 1)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: get(cfg.model.name).init(cfg, jax.random.key(0)))

    def draw(path, x):
        r = rng.standard_normal(x.shape).astype(np.float32)
        return 1 + 0.1 * r if "norm" in jax.tree_util.keystr(path) else 0.1 * r

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _decoder(m):
    """`forward_cached` (through the registry, as `maxtrain generate` calls it) jitted for model `m`."""
    return jax.jit(lambda params, tokens, cache, start: forward_cached(params, tokens, cache, start, m))


@pytest.fixture(scope="module", params=list(CASES))
def model(request):
    cfg = _config(request.param)
    return request.param, cfg, _random_params(cfg)


TOKENS = np.random.default_rng(1).integers(0, 128, (2, 12)).astype(np.int32)


def test_prefill_logits_are_the_training_forwards(model):
    case, cfg, params = model
    m = cfg.model
    assert ("dense_layers" in params) == (m.moe.first_dense > 0) and ("wq_a" in params["layers"]) == (case == "q_lora")
    assert ("mtp" in params) == (case == "q_lora") and np.abs(params["layers"]["moe"]["bias"]).min() > 0
    want = np.asarray(forward(cfg, params, TOKENS))
    run = _decoder(m)
    got, _ = run(params, TOKENS, init_cache(m, 2, 16, jnp.float32), 0)
    # measured (XLA:CPU, f32): max abs difference 1.7e-6 to 2.3e-6 on logits up to about 3
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    if case != "q_lora":
        return
    # the comparison sees the routing: without the balancing bias, or without the group limit, the
    # decoder's logits are not the training forward's (the bias and the group limit each change the
    # experts some token is sent to)
    moe = params["layers"]["moe"]
    no_bias = {**params, "layers": {**params["layers"], "moe": {**moe, "bias": np.zeros_like(moe["bias"])}}}
    assert np.abs(np.asarray(run(no_bias, TOKENS, init_cache(m, 2, 16, jnp.float32), 0)[0]) - want).max() > 1e-3
    ungrouped = dataclasses.replace(m, moe=dataclasses.replace(m.moe, groups=1, topk_groups=1))
    got, _ = _decoder(ungrouped)(params, TOKENS, init_cache(m, 2, 16, jnp.float32), 0)
    assert np.abs(np.asarray(got) - want).max() > 1e-3


def test_decoding_token_by_token_equals_prefilling_the_sequence(model):
    """Prefill of 5 tokens (the expanded attention), then one token at a time (the absorbed one) at
    positions 5..11 of a cache longer than the sequence: the logits of the whole-sequence prefill."""
    case, cfg, params = model
    m = cfg.model
    run = _decoder(m)
    want, full = run(params, TOKENS, init_cache(m, 2, 16, jnp.float32), 0)
    logits, cache = run(params, TOKENS[:, :5], init_cache(m, 2, 16, jnp.float32), 0)
    parts = [logits]
    for t in range(5, 12):
        logits, cache = run(params, TOKENS[:, t:t + 1], cache, t)
        parts.append(logits)
    # measured (XLA:CPU, f32): max abs difference 1.5e-6 to 2.6e-6 on logits up to about 3
    np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in parts], 1), np.asarray(want),
                               atol=1e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), cache, full)


def test_the_cache_is_the_latent_one(model):
    """`[N, B, S, R]` normed latents and `[N, B, S, P]` rotated rope keys (no per-head keys or
    values); a prefill writes its positions only, the first layer's being what its input gives."""
    case, cfg, params = model
    m, a = cfg.model, cfg.model.mla
    shapes = jax.eval_shape(lambda: init_cache(m, 2, 16, jnp.float32))
    assert jax.tree.map(lambda x: x.shape, shapes) == {"c": (3, 2, 16, a.kv_lora_rank),
                                                       "k_rope": (3, 2, 16, a.qk_rope_head_dim)}
    per_token = sum(x.size for x in jax.tree.leaves(shapes)) // (2 * 16)
    assert per_token == m.n_layers * (a.kv_lora_rank + a.qk_rope_head_dim) \
        < m.n_layers * m.n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
    _, cache = _decoder(m)(params, TOKENS[:, :7], init_cache(m, 2, 16, jnp.float32), 0)
    c, k_rope = np.asarray(cache["c"]), np.asarray(cache["k_rope"])
    assert (c[:, :, 7:] == 0).all() and (k_rope[:, :, 7:] == 0).all() and (c[:, :, :7] != 0).all()
    first = params["dense_layers"] if m.moe.first_dense else params["layers"]
    p = jax.tree.map(lambda x: x[0], first)
    h = rms_norm(jnp.asarray(params["embed"]["embedding"])[TOKENS[:, :7]], p["attn_norm"], m.norm_eps)
    ckv = h @ p["wkv_a"]
    positions = np.broadcast_to(np.arange(7), (2, 7))
    want_k_rope = apply_rope(ckv[:, :, None, a.kv_lora_rank:], positions,
                             inv_frequencies(a.qk_rope_head_dim, m.rope_theta))[:, :, 0]
    np.testing.assert_allclose(c[0, :, :7], rms_norm(ckv[..., :a.kv_lora_rank], p["kv_norm"], m.norm_eps),
                               atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(k_rope[0, :, :7], want_k_rope, atol=1e-6, rtol=1e-5)


# A small random DeepSeek-V3: a query latent, one dense layer then two MoE layers, 8 experts in 4
# groups (top-2 of the best 2), a shared expert, routed_scaling_factor 2.5, value heads narrower
# than the query/key heads
HF = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
          qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
          n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
          rope_interleave=True, rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False)


def test_greedy_generation_equals_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from maxtrain import convert

    torch.manual_seed(0)
    hf = randomized_hf_model(transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**HF, attn_implementation="eager")).eval())
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    m, params = convert.read_hf(str(tmp_path / "hf"))
    assert m.name == "deepseek" and np.abs(params["layers"]["moe"]["bias"]).min() > 0
    hf.generation_config.eos_token_id = None  # 8 new tokens whatever they are
    rng = np.random.default_rng(2)
    for prompt in (rng.integers(0, 256, (3, 6)), rng.integers(0, 256, (1, 1))):  # a batch; a prompt of one token
        prompt = prompt.astype(np.int32)
        ours = np.asarray(generate_tokens(params, prompt, jax.random.key(0), m=m, new_tokens=8))
        with torch.no_grad():
            theirs = hf.generate(torch.tensor(prompt, dtype=torch.long), attention_mask=torch.ones(prompt.shape),
                                 max_new_tokens=8, do_sample=False, pad_token_id=0).numpy()
        assert theirs.shape == ours.shape == (prompt.shape[0], prompt.shape[1] + 8)
        np.testing.assert_array_equal(ours, theirs)
