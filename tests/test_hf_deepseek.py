"""Hugging Face interchange for DeepSeek-V3 (`model.name: deepseek`): attention, MoE layers and
logits match transformers' `DeepseekV3ForCausalLM`, round trips are exact, MTP layers are skipped
on import and dropped (with a warning) on export, bad inputs are one-line errors."""

import dataclasses
import json
import logging
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import ROOT, assert_one_slice_each, randomized_hf_model, tagged_tensors  # noqa: E402
from maxtrain import cli, forward, load_checkpoint  # noqa: E402
from maxtrain.config import ConfigError, load_config  # noqa: E402
from maxtrain.layers.moe import moe_mlp  # noqa: E402
from maxtrain.layers.rope import inv_frequencies  # noqa: E402
from maxtrain import convert  # noqa: E402
from maxtrain.models import get  # noqa: E402
from maxtrain.models.deepseek import hf as hf_deepseek, model as deepseek  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, rope_interleave=True,
              rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False)
CASES = {
    # the published layout: query latent, one dense layer then MoE, interleaved RoPE
    "q_lora": dict(q_lora_rank=32),
    # a full-rank query, every layer MoE, tied, weights not renormalised, 1 of 2 groups, another theta
    "no_q_lora_tied": dict(q_lora_rank=None, first_k_dense_replace=0, tie_word_embeddings=True, norm_topk_prob=False,
                           n_group=2, topk_group=1, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    # rotary dims already in halves (rope_interleave false): nothing permuted on import; the query's
    # latent as wide as the key/value's and v_head_dim == qk_rope_head_dim, so q_a_layernorm and
    # kv_a_layernorm, q_b_proj and kv_b_proj are of one shape (a swap runs, and must not match)
    "rope_halves": dict(q_lora_rank=16, v_head_dim=8, rope_interleave=False, num_experts_per_tok=3,
                        routed_scaling_factor=1.0),
}
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 12))
# config.json fields that define the model, compared after HF -> maxtrain -> HF
KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
        "first_k_dense_replace", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "rms_norm_eps",
        "tie_word_embeddings", "hidden_act", "attention_bias")


def _randomize_params(params, seed=0):
    """numpy params of the shapes of `params`, drawn as `randomized_hf_model` draws HF's: norm scales (keys
    holding "norm") 1 + 0.1 N(0, 1), the rest 0.1 N(0, 1); maxtrain too initialises norms to ones."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        r = rng.standard_normal(x.shape).astype(np.float32)
        return 1 + 0.1 * r if "norm" in jax.tree_util.keystr(path) else 0.1 * r

    return jax.tree_util.tree_map_with_path(draw, params)


def _hf_model(case, path=None, seed=0):
    """A random f32 DeepseekV3ForCausalLM of CASES[case] (eager attention), saved to `path` if given:
    weights of std 0.1 (so scores differ and routing is not a coin toss), norm scales 1 +- 0.1, and a
    non-zero correction bias, so choosing by scores + bias differs from choosing by scores."""
    torch.manual_seed(seed)
    model = randomized_hf_model(transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**COMMON, **CASES[case]}, attn_implementation="eager")).eval())
    if path is not None:
        model.save_pretrained(path, safe_serialization=True)
    return model


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _rel_err(ours, theirs):
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def _tensors(path):
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """CASES["q_lora"] saved once: (its directory, the torch model)."""
    path = tmp_path_factory.mktemp("hf") / "q_lora"
    return path, _hf_model("q_lora", path)


@pytest.mark.parametrize("case, rope_format", [("q_lora", "legacy"), ("no_q_lora_tied", "parameters"),
                                               ("rope_halves", "legacy")])
def test_logits_match_transformers_and_round_trips_are_exact(case, rope_format, tmp_path):
    hf = _hf_model(case, tmp_path / "hf")
    base = load_config(None, ["train.dtype=float32"])
    ck = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "ck"), base)
    cfg, params = load_checkpoint(ck)
    assert cfg.model.name == "deepseek" and cfg.model.mtp is None and cfg.model.moe.bias_update_rate == 0.001
    assert ("dense_layers" in params) == (CASES[case].get("first_k_dense_replace", 1) > 0)
    ours, theirs = np.asarray(forward(cfg, params, TOKENS)), _torch_logits(hf, TOKENS)
    # measured (XLA:CPU, f32): relative error (Frobenius) 5.5e-7 to 6.9e-7 over the cases, max abs
    # difference about 4e-6 on logits up to about 3
    assert _rel_err(ours, theirs) < 1e-5
    np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=1e-4)

    out = tmp_path / "export"
    convert.maxtrain_to_hf(ck, str(out), rope_format=rope_format)
    written = json.loads((out / "config.json").read_text())
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: written[k] for k in KEYS} == {k: original[k] for k in KEYS}
    assert written["rope_interleave"] is True and ("rope_parameters" in written) == (rope_format == "parameters")
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                                   output_loading_info=True)
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert back.config.rope_parameters["rope_theta"] == hf.config.rope_parameters["rope_theta"]
    if CASES[case].get("rope_interleave", True):  # HF -> maxtrain -> HF: every tensor bitwise
        a, b = _tensors(tmp_path / "hf"), _tensors(out)
        assert sorted(a) == sorted(b)
        for name in a:
            assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name
        for (name, x), (_, y) in zip(sorted(hf.state_dict().items()), sorted(back.eval().state_dict().items())):
            assert torch.equal(x, y), name
    else:  # exported with the rotary dims interleaved: the same model, not the same tensors
        assert written["rope_interleave"] and not original["rope_interleave"]
        np.testing.assert_allclose(_torch_logits(back.eval(), TOKENS), theirs, atol=2e-5, rtol=1e-4)
    # maxtrain -> HF -> maxtrain: bitwise
    again = convert.hf_to_maxtrain(str(out), str(tmp_path / "ck2"), base)
    cfg2, params2 = load_checkpoint(again)
    assert cfg2.model == cfg.model
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params2), jax.device_get(params))


def _layer_params(params, m, i):
    """HF layer i's maxtrain params (from `dense_layers` or `layers`)."""
    k = m.moe.first_dense
    stack, j = ("dense_layers", i) if i < k else ("layers", i - k)
    return jax.tree.map(lambda a: jnp.asarray(a[j]), params[stack])


def test_attention_and_moe_layers_match_transformers(hf_dir):
    """MLA (`deepseek.mla_out`) against DeepseekV3Attention (after its input norm) in a dense and a
    MoE layer, and the routed + shared experts (`moe_mlp`) against DeepseekV3MoE, on random inputs
    for which the correction bias and the group limit both change some token's experts."""
    path, hf = hf_dir
    m, params = convert.read_hf(str(path))
    B, L, D = 2, 12, m.d_model
    x = np.random.default_rng(1).standard_normal((B, L, D)).astype(np.float32)
    xt = torch.tensor(x)
    positions = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    inv_freq = inv_frequencies(m.mla.qk_rope_head_dim, m.rope_theta)
    mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        cos_sin = hf.model.rotary_emb(xt, torch.tensor(positions, dtype=torch.long))
    for i in (0, 2):  # the dense layer, the last MoE layer
        layer, p = hf.model.layers[i], _layer_params(params, m, i)
        with torch.no_grad():
            want, _ = layer.self_attn(layer.input_layernorm(xt), position_embeddings=cos_sin, attention_mask=mask)
        got = jax.jit(lambda x, p: deepseek.mla_out(x, p, m, {}, positions_BL=positions, segment_ids_BL=None,
                                                    inv_freq=inv_freq))(x, p)
        # measured (XLA:CPU, f32): relative error 2.4e-7
        assert _rel_err(np.asarray(got), want.numpy()) < 1e-5, i
        np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5, rtol=1e-4)

    for i in (1, 2):
        layer, p = hf.model.layers[i], _layer_params(params, m, i)["moe"]
        with torch.no_grad():
            want = layer.mlp(xt).numpy()
            logits = layer.mlp.gate(xt)[0].numpy()
        got, _ = jax.jit(lambda x, p: moe_mlp(x, p, m.moe, {}))(x, p)
        # measured (XLA:CPU, f32): relative error 1.6e-7
        assert _rel_err(np.asarray(got), want) < 1e-5, i
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-4)
        # the case is not trivial: the bias and the group limit each change some token's experts
        scores = 1 / (1 + np.exp(-logits))
        bias = np.asarray(p["bias"])
        assert _chosen(scores + bias, m.moe) != _chosen(scores, m.moe), "the bias changes nothing"
        assert _chosen(scores + bias, m.moe) != _chosen(scores + bias, m.moe, limit=False), "no group limit"


def _chosen(choice_TE, moe, limit=True):
    """Each token's set of top-k experts by `choice`, within its best `topk_groups` groups (ranked
    by the sum of their two best) when `limit`."""
    E, G = moe.num_experts, moe.groups
    if limit:
        grouped = choice_TE.reshape(-1, G, E // G)
        best = np.argsort(-np.sort(grouped, axis=-1)[..., -2:].sum(-1), axis=-1)[:, :moe.topk_groups]
        keep = np.zeros(grouped.shape[:2], bool)
        np.put_along_axis(keep, best, True, axis=1)
        choice_TE = np.where(np.repeat(keep, E // G, axis=1), choice_TE, -np.inf)
    return [frozenset(row) for row in np.argsort(-choice_TE, axis=-1)[:, :moe.top_k].tolist()]


# ---------------------------------------------------------------- which HF tensor is which param
# Host-only (numpy): each HF tensor filled with values no other tensor holds, converted, and found
# where the layout rules below (written out here, not read from hf_deepseek) put it.

LAYOUT_CASES = {**{case: {**COMMON, **kw, "model_type": "deepseek_v3"} for case, kw in CASES.items()},
                # two dense layers and three MoE layers: both stacks' orders seen
                "two_dense_three_moe": {**COMMON, **CASES["q_lora"], "model_type": "deepseek_v3",
                                        "num_hidden_layers": 5, "first_k_dense_replace": 2}}
LAYER_LEAVES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm", "self_attn.q_proj": "wq",
                "self_attn.q_a_proj": "wq_a", "self_attn.q_a_layernorm": "q_norm", "self_attn.q_b_proj": "wq_b",
                "self_attn.kv_a_proj_with_mqa": "wkv_a", "self_attn.kv_a_layernorm": "kv_norm",
                "self_attn.kv_b_proj": "wkv_b", "self_attn.o_proj": "wo"}
MLP_LEAVES = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
SHARED_LEAVES = {"gate_proj": "shared_gate", "up_proj": "shared_up", "down_proj": "shared_down"}
TOP_LEAVES = {"model.embed_tokens.weight": ("embed", "embedding"), "model.norm.weight": ("final_norm", "scale"),
              "lm_head.weight": ("lm_head", "kernel")}


def _leaf_of(name, m):
    """(key path, index) of the maxtrain param slice DeepSeek-V3 tensor `name` becomes: HF layer
    i < first_k_dense_replace is `dense_layers[i]` (its MLP `w_gate` ...), a later one `layers[i -
    first_k_dense_replace]`, its router, correction bias, experts (`[layer, expert]`) and shared
    experts in `layers.moe`."""
    if name in TOP_LEAVES:
        return TOP_LEAVES[name], ()
    i, rest, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|e_score_correction_bias)", name).groups()
    i, first = int(i), m.moe.first_dense
    if i < first:
        leaf = LAYER_LEAVES.get(rest) or MLP_LEAVES[re.fullmatch(r"mlp\.(\w+)", rest)[1]]
        return ("dense_layers", leaf), (i,)
    j = i - first
    if rest in LAYER_LEAVES:
        return ("layers", LAYER_LEAVES[rest]), (j,)
    if rest == "mlp.gate":
        return ("layers", "moe", "router" if kind == "weight" else "bias"), (j,)
    expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)", rest)
    if expert:
        return ("layers", "moe", MLP_LEAVES[expert[2]]), (j, int(expert[1]))
    return ("layers", "moe", SHARED_LEAVES[re.fullmatch(r"mlp\.shared_experts\.(\w+)", rest)[1]]), (j,)


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_every_hf_tensor_is_one_param_slice_and_converts_back(case):
    """DeepSeek-V3 -> maxtrain is a bijection of named tensors onto the model's param slices, and
    maxtrain -> DeepSeek-V3 its inverse: each HF tensor is found, whole (its rotary columns only
    reordered), in the slice the layout rules name (so no two tensors of one shape trade places:
    the two layer norms, q_a_layernorm / kv_a_layernorm, gate / up, routed / shared experts, dense /
    MoE layers), every element of every param came from exactly one HF element, the tree is the one
    the model initialises, and the export gives every tensor back bitwise."""
    hf = LAYOUT_CASES[case]
    m = convert.model_config_from_hf(hf)
    tensors = tagged_tensors(hf_deepseek.hf_shapes(m))
    params = hf_deepseek.params_from_hf(tensors.__getitem__, m, rope_interleave=hf["rope_interleave"])
    cfg = convert.config_with_model(load_config(None), m)
    want = jax.eval_shape(lambda: get(m.name).init(cfg, jax.random.key(0)))
    assert_one_slice_each(tensors, params, want, lambda name: _leaf_of(name, m))
    back = hf_deepseek.params_to_hf(params, m, rope_interleave=hf["rope_interleave"])
    assert sorted(back) == sorted(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and np.array_equal(back[name], t), name


def _proxy_config(*overrides):
    return load_config(os.path.join(ROOT, "configs", "deepseek-proxy.yaml"),
                       ["train.dtype=float32", "model.vocab_size=128", "model.d_model=64", "model.d_ff=96",
                        "model.mla={q_lora_rank: 32, kv_lora_rank: 16, qk_nope_head_dim: 16, qk_rope_head_dim: 8, "
                        "v_head_dim: 16}", *overrides])


def test_maxtrain_params_to_hf_and_back_are_bitwise_and_drop_mtp(tmp_path, caplog):
    """A maxtrain model (with MTP; every param drawn at random, norms and the bias included) -> HF:
    transformers' logits equal maxtrain's, the MTP params are dropped with a warning, and reading it
    back gives every other param bitwise."""
    cfg = _proxy_config()
    assert cfg.model.mtp is not None
    params = _randomize_params(jax.eval_shape(lambda: get("deepseek").init(cfg, jax.random.key(0))))
    with caplog.at_level(logging.WARNING, logger="maxtrain"):
        convert.write_hf(str(tmp_path / "hf"), params, cfg.model, rope_format="parameters")
    assert any("multi-token prediction" in r.getMessage() for r in caplog.records), caplog.text
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 0 and written["topk_method"] == "noaux_tc"
    assert sorted(_tensors(tmp_path / "hf")) == sorted(name for name, _ in hf_deepseek.hf_shapes(cfg.model))
    m, back = convert.read_hf(str(tmp_path / "hf"))
    assert m == dataclasses.replace(cfg.model, mtp=None, attention=m.attention, remat=m.remat, init_std=m.init_std)
    del params["mtp"]
    jax.tree.map(np.testing.assert_array_equal, back, params)

    no_mtp = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp=None))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    tokens = TOKENS % 128  # measured (XLA:CPU, f32): relative error 7.7e-7
    assert _rel_err(np.asarray(forward(no_mtp, params, tokens)), _torch_logits(hf, tokens)) < 1e-5


def test_cli_convert_both_ways(hf_dir, tmp_path, capsys):
    path, hf = hf_dir
    assert cli.main(["convert", "hf-to-maxtrain", str(path), str(tmp_path / "ck"), "train.dtype=float32"]) == 0
    assert "checkpoint.init_from=" in capsys.readouterr().out
    cfg, params = load_checkpoint(str(tmp_path / "ck"))
    assert cfg.model.name == "deepseek" and params["layers"]["moe"]["w_gate"].shape == (2, 8, 64, 24)
    assert cli.main(["convert", "maxtrain-to-hf", str(tmp_path / "ck"), str(tmp_path / "out"), "--dtype", "bfloat16",
                     "--rope-format", "parameters"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    header = convert.safetensors_header(str(tmp_path / "out" / "model.safetensors"))
    # the router and its correction bias stay float32 (as transformers keeps them), the rest is bf16
    f32 = {k for k, (dtype, _) in header.items() if dtype == "F32"}
    assert f32 == {f"model.layers.{i}.mlp.gate.{w}" for i in (1, 2) for w in ("weight", "e_score_correction_bias")}
    assert {dtype for k, (dtype, _) in header.items() if k not in f32} == {"BF16"}
    np.testing.assert_array_equal(_tensors(tmp_path / "out")["model.layers.1.mlp.gate.e_score_correction_bias"],
                                  _tensors(path)["model.layers.1.mlp.gate.e_score_correction_bias"])
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager",
                                                             dtype=torch.float32).eval()
    # every weight is the original rounded to bf16 (logits are no test: bf16 rounding flips some
    # tokens' experts), the router and bias the original itself
    theirs = back.state_dict()
    for name, x in hf.state_dict().items():
        want = x if name.endswith(("gate.weight", "e_score_correction_bias")) else x.to(torch.bfloat16).float()
        assert torch.equal(theirs[name], want), name


def _copy(path, dst, change=None, tensors=None):
    """A copy of the HF directory `path` with config.json keys changed (None: removed) and/or its
    tensors replaced by `tensors(dict) -> dict`."""
    from safetensors.numpy import save_file

    shutil.copytree(path, dst)
    if change:
        config = json.loads((dst / "config.json").read_text())
        config.update(change)
        (dst / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    if tensors:
        save_file(tensors(_tensors(dst)), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _assert_one_error(capsys, argv, *needles):
    code = cli.main(["convert", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("maxtrain: error:")]
    assert code == 2 and len(errors) == 1 and not any("Traceback" in line for line in err), err
    for needle in needles:
        assert needle in errors[0], errors[0]


YARN = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("change, needles", [
    ({"rope_scaling": YARN}, ("rope_scaling.type='yarn'", "YaRN")),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0}},
     ("rope_parameters.rope_type='yarn'", "YaRN")),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
     ("rope_parameters.rope_type='linear'",)),
    ({"num_key_value_heads": 2}, ("num_key_value_heads=2", "num_attention_heads=4")),
    ({"attention_bias": True}, ("attention_bias=true",)),
    ({"hidden_act": "gelu"}, ("hidden_act='gelu'",)),
    ({"scoring_func": "softmax"}, ("scoring_func='softmax'", "sigmoid")),
    ({"n_routed_experts": 6}, ("n_routed_experts=6 is not divisible by n_group=4",)),
    ({"topk_method": "greedy"}, ("topk_method='greedy'", "topk_group=2 < n_group=4")),
    ({"topk_method": "aux_free"}, ("topk_method='aux_free'",)),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, ("quantization_config", "bf16")),
    ({"q_lora_rank": "wide"}, ("q_lora_rank='wide'",)),
    ({"qk_rope_head_dim": 7}, ("qk_rope_head_dim=7",)),
    ({"first_k_dense_replace": 3}, ("first_k_dense_replace=3",)),
    ({"moe_layer_freq": 2}, ("moe_layer_freq=2",)),
    ({"num_experts_per_tok": 5}, ("num_experts_per_tok=5",)),
    ({"rope_interleave": "yes"}, ("rope_interleave='yes'",)),
    ({"kv_lora_rank": None}, ("has no kv_lora_rank",)),
    ({"model_type": "deepseek_v2"}, ("model_type='deepseek_v2' is not supported",)),
])
def test_bad_config_json_is_one_line_error(change, needles, hf_dir, tmp_path, capsys):
    bad = _copy(hf_dir[0], tmp_path / "hf", change=change)
    _assert_one_error(capsys, ["hf-to-maxtrain", str(bad), str(tmp_path / "ck")], "config.json", *needles)
    assert not (tmp_path / "ck").exists()


def _without(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


BAD_TENSORS = {
    "missing_expert": (_without("model.layers.2.mlp.experts.7.down_proj.weight"),
                       ("model.layers.2.mlp.experts.7.down_proj.weight missing",)),
    "missing_bias": (_without("model.layers.1.mlp.gate.e_score_correction_bias"),  # noaux_tc needs it
                     ("model.layers.1.mlp.gate.e_score_correction_bias missing",)),
    "wrong_shape": (lambda t: {**t, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": np.zeros((23, 64),
                                                                                                   np.float32)},
                    ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "(23, 64)", "(24, 64)")),
    "extra_expert": (lambda t: {**t, "model.layers.1.mlp.experts.8.up_proj.weight": np.zeros((24, 64), np.float32)},
                     ("unexpected tensor model.layers.1.mlp.experts.8.up_proj.weight",)),
    # a layer past num_hidden_layers that is not an MTP module (no eh_proj): config.json is wrong
    "extra_layer": (lambda t: {**t, "model.layers.3.input_layernorm.weight": np.ones(64, np.float32)},
                    ("unexpected tensor model.layers.3.input_layernorm.weight",)),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_bad_tensors_are_one_line_errors(case, hf_dir, tmp_path, capsys):
    tensors, needles = BAD_TENSORS[case]
    bad = _copy(hf_dir[0], tmp_path / "hf", tensors=tensors)
    _assert_one_error(capsys, ["hf-to-maxtrain", str(bad), str(tmp_path / "ck")], *needles)
    assert not (tmp_path / "ck").exists()


def _with_mtp_layer(t):
    """The tensors of a hub checkpoint's MTP module appended as layer 3 (as DeepSeek-V3's layer 61)."""
    layer = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in t.items()
             if k.startswith("model.layers.2.")}
    D = 64
    layer.update({"model.layers.3.eh_proj.weight": np.zeros((D, 2 * D), np.float32),
                  "model.layers.3.enorm.weight": np.ones(D, np.float32),
                  "model.layers.3.hnorm.weight": np.ones(D, np.float32),
                  "model.layers.3.shared_head.norm.weight": np.ones(D, np.float32),
                  "model.layers.3.shared_head.head.weight": np.zeros((256, D), np.float32),
                  "model.layers.3.embed_tokens.weight": np.zeros((256, D), np.float32)})
    return {**t, **layer}


def test_mtp_layers_are_skipped_on_import(hf_dir, tmp_path):
    m, params = convert.read_hf(str(hf_dir[0]))
    with_mtp = _copy(hf_dir[0], tmp_path / "hf", change={"num_nextn_predict_layers": 1}, tensors=_with_mtp_layer)
    m2, params2 = convert.read_hf(str(with_mtp))
    assert m2 == m and m2.mtp is None
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_greedy_topk_method_reads_a_missing_bias_as_zero(hf_dir, tmp_path):
    """`greedy` with topk_group == n_group routes as transformers does (no group limit either way);
    DeepSeek's code for it has no correction bias, so a checkpoint without one reads as zeros."""
    names = {f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)}
    greedy = _copy(hf_dir[0], tmp_path / "hf", change={"topk_method": "greedy", "topk_group": 4},
                   tensors=lambda t: {k: v for k, v in t.items() if k not in names})
    m, params = convert.read_hf(str(greedy))
    assert m.moe.groups == m.moe.topk_groups == 4 and m.moe.bias_update_rate > 0
    np.testing.assert_array_equal(params["layers"]["moe"]["bias"], np.zeros((2, 8), np.float32))
    with_bias = _copy(hf_dir[0], tmp_path / "hf2", change={"topk_method": "greedy", "topk_group": 4})
    _, params = convert.read_hf(str(with_bias))  # transformers uses one that is there: so does maxtrain
    np.testing.assert_array_equal(params["layers"]["moe"]["bias"][0],
                                  _tensors(hf_dir[0])["model.layers.1.mlp.gate.e_score_correction_bias"])


# The published DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3), less auto_map
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": YARN, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280,
}


def test_the_published_config_json():
    """As published (FP8, YaRN to 128K) DeepSeek-V3 is refused field by field; dequantized and
    without YaRN it is configs/deepseek-v3.yaml less its MTP module."""
    with pytest.raises(ConfigError, match="quantization_config"):
        convert.model_config_from_hf(PUBLISHED)
    with pytest.raises(ConfigError, match="rope_scaling.type='yarn'"):
        convert.model_config_from_hf({**PUBLISHED, "quantization_config": None})
    m = convert.model_config_from_hf({**PUBLISHED, "quantization_config": None, "rope_scaling": None})
    yaml = load_config(os.path.join(ROOT, "configs", "deepseek-v3.yaml")).model
    # (the yaml inherits llama3-8b's n_kv_heads, which MLA does not read; the converter sets n_heads)
    assert m == dataclasses.replace(yaml, mtp=None, n_kv_heads=m.n_heads, attention=m.attention, remat=m.remat,
                                    init_std=m.init_std, fused_norm=m.fused_norm)
    exported = hf_deepseek.hf_config_from_model(m, max_position=163840)
    assert {k: exported[k] for k in KEYS + ("topk_method", "scoring_func", "moe_layer_freq", "rope_theta")} == \
        {k: PUBLISHED[k] for k in KEYS + ("topk_method", "scoring_func", "moe_layer_freq", "rope_theta")}


def test_export_refusals():
    m = _proxy_config().model
    for change, needle in ((dict(router="softmax"), "model.moe.router='softmax'"),
                           (dict(shared_experts=0), "model.moe.shared_experts=0")):
        with pytest.raises(ConfigError, match=needle):
            convert.hf_config_from_model(dataclasses.replace(m, moe=dataclasses.replace(m.moe, **change)))
