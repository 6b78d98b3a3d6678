"""Hugging Face interchange: logits match transformers' implementation, round trips are exact."""

import json
import re

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import assert_one_slice_each, randomized_hf_model, tagged_tensors  # noqa: E402
from maxtrain import cli, forward, load_checkpoint  # noqa: E402
from maxtrain.config import ConfigError, load_config  # noqa: E402
from maxtrain import convert  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, rms_norm_eps=1e-5, max_position_embeddings=64)
CASES = {
    "gqa_untied": dict(model="llama", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0),
    "tied_llama3_scaling": dict(model="llama", num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
    "mistral_window": dict(model="mistral", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                           sliding_window=5, head_dim=16),
    # Qwen3: QK-norm, head_dim not d_model / heads (24 x 4 heads on d_model 64), tied and untied
    "qwen3_tied": dict(model="qwen3", num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0,
                       head_dim=24, rms_norm_eps=1e-6),
    "qwen3_untied": dict(model="qwen3", num_key_value_heads=1, tie_word_embeddings=False, rope_theta=10000.0,
                         head_dim=16),
    # Mixtral: every MLP a top-2 of 4 experts (maxtrain's dropless MoE, weights in its expert layout)
    "mixtral_top2": dict(model="mixtral", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1000000.0,
                         num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "mixtral_window": dict(model="mixtral", num_key_value_heads=1, tie_word_embeddings=False, rope_theta=10000.0,
                           num_local_experts=3, num_experts_per_tok=2, sliding_window=5),
    # Qwen3-MoE: QK-norm and experts of their own width; every layer routed (and as many key/value
    # heads as query heads, so q, k and v are all of one shape), or every second
    "qwen3_moe": dict(model="qwen3_moe", num_key_value_heads=4, tie_word_embeddings=False, rope_theta=1000000.0,
                      head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True),
    "qwen3_moe_sparse_step2_top1": dict(model="qwen3_moe", num_key_value_heads=1, tie_word_embeddings=True,
                                        rope_theta=10000.0, num_experts=3, num_experts_per_tok=1,
                                        moe_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=2),
}
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def _hf_config(case):
    """CASES[case] as a config.json dict (model_type named)."""
    kw = dict(CASES[case])
    return {**COMMON, **kw, "model_type": kw.pop("model")}


def _hf_model(case, path):
    kw = dict(CASES[case])
    kind = kw.pop("model")
    cls_cfg, cls = (getattr(transformers, name) for name in HF_CLASSES[kind])
    torch.manual_seed(0)
    model = randomized_hf_model(cls(cls_cfg(**{**COMMON, **kw}, attn_implementation="eager")).eval())
    model.save_pretrained(path, safe_serialization=True)
    return model


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


TOKENS = np.random.default_rng(0).integers(0, 96, (2, 12))


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_maxtrain_matches_transformers_and_round_trips(case, tmp_path):
    hf = _hf_model(case, tmp_path / "hf")
    base = load_config(None, ["train.dtype=float32"])
    step_dir = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "ck"), base)
    cfg, params = load_checkpoint(step_dir)
    assert cfg.model.tie_embeddings == CASES[case]["tie_word_embeddings"]
    ours = np.asarray(forward(cfg, params, TOKENS))
    np.testing.assert_allclose(ours, _torch_logits(hf, TOKENS), atol=2e-5, rtol=1e-4)

    for fmt in ("legacy", "parameters"):
        out = tmp_path / f"export_{fmt}"
        convert.maxtrain_to_hf(str(tmp_path / "ck"), str(out), rope_format=fmt)
        written = json.loads((out / "config.json").read_text())
        assert ("rope_parameters" in written) == (fmt == "parameters")
        back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        theirs = back.state_dict()
        assert sorted(theirs) == sorted(hf.state_dict())
        for name, a in hf.state_dict().items():  # every weight distinct (randomized_hf_model): a swap cannot pass
            assert torch.equal(a, theirs[name]), name
        np.testing.assert_allclose(_torch_logits(back, TOKENS), _torch_logits(hf, TOKENS), atol=0, rtol=0)
        again = convert.hf_to_maxtrain(str(out), str(tmp_path / f"ck_{fmt}"), base)
        _, params2 = load_checkpoint(again)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(params2), jax.device_get(params))


# ---------------------------------------------------------------- which HF tensor is which param
# Host-only (numpy): each HF tensor filled with values no other tensor holds, converted, and found
# where the layout rules below (written out here, not read from hf_llama) put it.

LAYOUT_CASES = {**{case: _hf_config(case) for case in CASES},
                # more than one block of decoder_sparse_step layers: the blocks' order and the dense
                # sublayers' places are seen (the parity cases have one block)
                "qwen3_moe_step2_4_layers": {**_hf_config("qwen3_moe"), "num_hidden_layers": 4,
                                             "decoder_sparse_step": 2},
                "qwen3_moe_step3_6_layers": {**_hf_config("qwen3_moe"), "num_hidden_layers": 6,
                                             "decoder_sparse_step": 3,
                                             "intermediate_size": 40}}  # dense MLPs as wide as experts
ATTN_LEAVES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm", "self_attn.q_proj": "wq",
               "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
               "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}
# Llama / Qwen3 MLPs and Qwen3-MoE experts; Mixtral's experts compute w2(silu(w1 x) * w3 x)
MLP_LEAVES = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down", "w1": "w_gate", "w3": "w_up",
              "w2": "w_down"}
TOP_LEAVES = {"model.embed_tokens.weight": ("embed", "embedding"), "model.norm.weight": ("final_norm", "scale"),
              "lm_head.weight": ("lm_head", "kernel")}


def _leaf_of(name, m):
    """(key path, index) of the maxtrain param slice HF tensor `name` becomes: layers stacked on a
    leading axis; a MoE model's in blocks of `moe.every` HF layers (`[block, sublayer]`), the block's
    last layer routed (HF: layer i with i + 1 a multiple of decoder_sparse_step), its router and
    experts in `layers.moe` (`[block]`, `[block, expert]`), the other sublayers' MLPs in `layers.dense`."""
    if name in TOP_LEAVES:
        return TOP_LEAVES[name], ()
    i, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name).groups()
    every = m.moe.every if m.moe is not None else 1
    block, sub = divmod(int(i), every)
    at = (block, sub) if m.moe is not None else (block,)
    if rest in ATTN_LEAVES:
        return ("layers", ATTN_LEAVES[rest]), at
    expert = re.fullmatch(r"(?:mlp|block_sparse_moe)\.(?:gate|experts\.(\d+)\.(\w+))", rest)
    if expert:
        assert sub == every - 1, f"{name}: HF layer {i} is not a routed one"
        if expert[1] is None:
            return ("layers", "moe", "router"), (block,)
        return ("layers", "moe", MLP_LEAVES[expert[2]]), (block, int(expert[1]))
    leaf = MLP_LEAVES[re.fullmatch(r"mlp\.(\w+)", rest)[1]]
    assert m.moe is None or sub < every - 1, f"{name}: HF layer {i} is a routed one"
    return (("layers", "dense", leaf) if m.moe is not None else ("layers", leaf)), at


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_every_hf_tensor_is_one_param_slice_and_converts_back(case):
    """HF -> maxtrain is a bijection of named tensors onto the model's param slices, and
    maxtrain -> HF its inverse: each HF tensor is found, whole, in the slice the layout rules name
    (so no two tensors of one shape trade places: norms, q/k/v, gate/up, experts, layers, blocks),
    every element of every param came from exactly one HF element (nothing dropped or duplicated),
    the tree is the one the model initialises, and the export gives every tensor back bitwise."""
    from maxtrain.models import get

    m = convert.model_config_from_hf(LAYOUT_CASES[case])
    tensors = tagged_tensors(convert.hf_shapes(m))
    params = convert.params_from_hf(tensors.__getitem__, m)
    cfg = convert.config_with_model(load_config(None), m)
    want = jax.eval_shape(lambda: get(m.name).init(cfg, jax.random.key(0)))
    assert_one_slice_each(tensors, params, want, lambda name: _leaf_of(name, m))
    back = convert.params_to_hf(params, m)
    assert sorted(back) == sorted(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and np.array_equal(back[name], t), name


def test_cli_convert_and_train_from_converted(tmp_path, capsys):
    _hf_model("gqa_untied", tmp_path / "hf")
    assert cli.main(["convert", "hf-to-maxtrain", str(tmp_path / "hf"), str(tmp_path / "ck"),
                     "train.dtype=float32"]) == 0
    assert "checkpoint.init_from=" in capsys.readouterr().out
    from maxtrain import train
    cfg, _ = load_checkpoint(str(tmp_path / "ck"))
    run = train(load_config(None, [f"run_dir={tmp_path / 'run'}", "train.steps=2", "train.batch_size=8",
                                   "train.seq_len=16", "train.dtype=float32", "data.kind=synthetic",
                                   "model.vocab_size=96", "model.d_model=64", "model.n_layers=2",
                                   "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=112",
                                   f"checkpoint.init_from={tmp_path / 'ck'}"]))
    assert run.start_step == 0 and len(run.history) == 2
    # a params-only checkpoint cannot be resumed from (it has no optimizer state)
    assert cli.main(["train", "configs/tiny.yaml", f"run_dir={tmp_path / 'r2'}", "model.vocab_size=96",
                     "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                     "model.d_ff=112", "data.kind=synthetic", f"checkpoint.resume_from={tmp_path / 'ck'}"]) == 2
    assert "holds params only" in capsys.readouterr().err
    assert cli.main(["convert", "maxtrain-to-hf", str(tmp_path / "ck"), str(tmp_path / "out"),
                     "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_bad_hf_inputs(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        convert.read_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type='gpt2' is not supported"):
        convert.read_hf(str(tmp_path))


def test_newer_rope_parameters_form_reads():
    hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    m = convert.model_config_from_hf(hf)
    assert m.rope_theta == 500000.0 and m.rope_scaling.factor == 32.0
    legacy = dict(hf, rope_theta=500000.0, rope_scaling=hf["rope_parameters"])
    del legacy["rope_parameters"]
    assert convert.model_config_from_hf(legacy) == m


# ---------------------------------------------------------------- hostile or damaged inputs and outputs
# Tiny models written by hand (numpy + safetensors), so each case takes a fraction of a second.

TINY_HF = dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
               tie_word_embeddings=False, hidden_act="silu")


def _tiny_shapes():
    V, D, F, H, G, K = 64, 16, 32, 2, 1, 8
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (H * K, D), p + "self_attn.k_proj.weight": (G * K, D),
                       p + "self_attn.v_proj.weight": (G * K, D), p + "self_attn.o_proj.weight": (D, H * K),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
    return shapes


def _write_tiny_hf(path, config=None, shapes=None):
    """A tiny Llama HF directory: config.json (TINY_HF unless given) and model.safetensors."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in (shapes or _tiny_shapes()).items()}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(TINY_HF if config is None else config))
    return path


def _convert_errors(capsys, *argv):
    """(exit code, the `maxtrain: error:` lines, all of stderr) of `maxtrain convert ...`."""
    code = cli.main(["convert", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err), err
    return code, [line for line in err if line.startswith("maxtrain: error:")], err


def _assert_one_error(capsys, argv, *needles):
    code, errors, err = _convert_errors(capsys, *argv)
    assert code == 2 and len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.fixture
def tiny_ckpt(tmp_path):
    """A params-only maxtrain checkpoint converted from the tiny HF model."""
    convert.hf_to_maxtrain(str(_write_tiny_hf(tmp_path / "hf")), str(tmp_path / "ck"), load_config(None))
    return tmp_path / "ck"


def test_maxtrain_to_hf_refuses_a_non_empty_output_or_a_file(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _assert_one_error(capsys, ["maxtrain-to-hf", str(tiny_ckpt), str(out)], str(out), "not empty")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    (tmp_path / "file").write_text("mine")
    for direction, src in (("maxtrain-to-hf", tiny_ckpt), ("hf-to-maxtrain", tmp_path / "hf")):
        _assert_one_error(capsys, [direction, str(src), str(tmp_path / "file")], "file", "is not a directory")
        assert (tmp_path / "file").read_text() == "mine"


def test_maxtrain_to_hf_into_an_empty_directory_still_works(tiny_ckpt, tmp_path):
    (tmp_path / "out").mkdir()
    files = convert.maxtrain_to_hf(str(tiny_ckpt), str(tmp_path / "out"))
    assert files == ["README.md", "config.json", "model.safetensors"]  # README: no tokenizer
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == files


def test_a_failed_maxtrain_to_hf_leaves_no_output(tiny_ckpt, tmp_path, monkeypatch):
    import safetensors.flax

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.flax, "save_file", half_written)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(OSError, match="No space"):
        convert.maxtrain_to_hf(str(tiny_ckpt), str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUT, no temporary sibling


def test_a_failed_hf_to_maxtrain_save_is_an_error_and_leaves_no_output(tmp_path, capsys, monkeypatch):
    from maxtrain.checkpoint import Checkpointer

    monkeypatch.setattr(Checkpointer, "save", lambda self, *a, **k: 0.0)  # as a save that failed and logged it
    hf = _write_tiny_hf(tmp_path / "hf")
    _assert_one_error(capsys, ["hf-to-maxtrain", str(hf), str(tmp_path / "ck")], str(tmp_path / "ck"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_hf_to_maxtrain_output_holds_only_the_checkpoint(tiny_ckpt):
    assert sorted(p.name for p in tiny_ckpt.iterdir()) == ["0"]
    assert sorted(p.name for p in tiny_ckpt.parent.iterdir()) == ["ck", "hf"]  # no temporary sibling left
    cfg, params = load_checkpoint(str(tiny_ckpt))
    assert cfg.model.vocab_size == 64 and params["layers"]["wq"].shape == (2, 16, 2, 8)


def _reshaped(name, shape):
    return {**_tiny_shapes(), name: shape}


@pytest.mark.parametrize("name, shape, want", [
    ("model.embed_tokens.weight", (65, 16), (64, 16)),
    ("lm_head.weight", (64, 15), (64, 16)),
    ("model.norm.weight", (17,), (16,)),
    ("model.layers.0.input_layernorm.weight", (8,), (16,)),
    ("model.layers.1.post_attention_layernorm.weight", (16, 1), (16,)),
    ("model.layers.1.self_attn.q_proj.weight", (24, 16), (16, 16)),
    ("model.layers.0.self_attn.k_proj.weight", (16, 16), (8, 16)),
    ("model.layers.1.self_attn.v_proj.weight", (8, 8), (8, 16)),
    ("model.layers.0.self_attn.o_proj.weight", (16, 24), (16, 16)),
    ("model.layers.1.mlp.gate_proj.weight", (33, 16), (32, 16)),
    ("model.layers.0.mlp.up_proj.weight", (16, 32), (32, 16)),
    ("model.layers.1.mlp.down_proj.weight", (32, 16), (16, 32)),
])
def test_tensor_shapes_must_match_config_json(name, shape, want, tmp_path, capsys):
    hf = _write_tiny_hf(tmp_path / "hf", shapes=_reshaped(name, shape))
    _assert_one_error(capsys, ["hf-to-maxtrain", str(hf), str(tmp_path / "ck")], name, str(shape), str(want))
    assert not (tmp_path / "ck").exists()


def test_missing_and_unexpected_tensors(tmp_path, capsys):
    shapes = _tiny_shapes()
    del shapes["model.layers.1.mlp.up_proj.weight"]
    hf = _write_tiny_hf(tmp_path / "missing", shapes=shapes)
    _assert_one_error(capsys, ["hf-to-maxtrain", str(hf), str(tmp_path / "ck")],
                      "model.layers.1.mlp.up_proj.weight", "missing")
    for extra in ("model.layers.2.input_layernorm.weight", "model.extra.weight"):
        hf = _write_tiny_hf(tmp_path / extra, shapes={**_tiny_shapes(), extra: (16,)})
        _assert_one_error(capsys, ["hf-to-maxtrain", str(hf), str(tmp_path / "ck")], extra, "unexpected")
    assert not (tmp_path / "ck").exists()


def test_harmless_extra_tensors_are_ignored(tmp_path):
    # older transformers saved RoPE's inv_freq buffer; some tied checkpoints keep a copy of lm_head
    shapes = {**_tiny_shapes(), "model.layers.0.self_attn.rotary_emb.inv_freq": (4,)}
    hf = _write_tiny_hf(tmp_path / "hf", config=dict(TINY_HF, tie_word_embeddings=True), shapes=shapes)
    m, params = convert.read_hf(str(hf))
    assert m.tie_embeddings and "lm_head" not in params


@pytest.mark.parametrize("change, needle", [
    ({"hidden_size": "big"}, "hidden_size='big'"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"vocab_size": 0}, "vocab_size=0"),
    ({"vocab_size": 64.5}, "vocab_size=64.5"),
    ({"num_attention_heads": True}, "num_attention_heads=True"),
    ({"intermediate_size": [32]}, "intermediate_size=[32]"),
    ({"num_key_value_heads": -1}, "num_key_value_heads=-1"),
    ({"head_dim": "8"}, "head_dim='8'"),
    ({"rope_theta": "fast"}, "rope_theta='fast'"),
    ({"rms_norm_eps": None, "rope_theta": float("nan")}, "rope_theta=nan"),
    ({"rms_norm_eps": -1}, "rms_norm_eps=-1"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes'"),
    ({"rope_scaling": [1, 2]}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "x", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8}}, "rope_scaling.factor='x'"),
    ({"rope_parameters": "big"}, "rope_parameters"),
    ({"model_type": "mistral", "sliding_window": "wide"}, "sliding_window='wide'"),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=true"),
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "norm_topk_prob": False}, "norm_topk_prob=False with num_experts_per_tok=2"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "norm_topk_prob": True, "mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
    ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok=3 is more"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "use_sliding_window=true"),
    ({"num_attention_heads": 32, "head_dim": None}, "hidden_size=16 is not divisible by num_attention_heads=32"),
])
def test_bad_config_json_values_are_one_line_errors(change, needle, tmp_path, capsys):
    config = {k: v for k, v in {**TINY_HF, **change}.items() if v is not None}
    hf = _write_tiny_hf(tmp_path / "hf", config=config)
    _assert_one_error(capsys, ["hf-to-maxtrain", str(hf), str(tmp_path / "ck")], "config.json", needle)


@pytest.mark.parametrize("content, needle", [
    (b"[1, 2]", "not a JSON object"),
    (b"42", "not a JSON object"),
    (b"{\"vocab_size\": 64", "not valid JSON"),
    (b"\xff\xfe{}", "UTF-8"),
    (None, "not a file"),
])
def test_config_json_that_is_not_an_object(content, needle, tmp_path, capsys):
    hf = _write_tiny_hf(tmp_path / "hf")
    (hf / "config.json").unlink()
    if content is None:
        (hf / "config.json").mkdir()
    else:
        (hf / "config.json").write_bytes(content)
    _assert_one_error(capsys, ["hf-to-maxtrain", str(hf), str(tmp_path / "ck")], "config.json", needle)


def _sharded(tmp_path, weight_map):
    hf = _write_tiny_hf(tmp_path / "hf")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return hf


def test_sharded_index_must_name_files_inside_the_model_directory(tmp_path, capsys):
    (tmp_path / "x.safetensors").write_bytes((tmp_path.parent / "x").name.encode())  # bait outside hf/
    ck = str(tmp_path / "ck")
    for name, needle in (("model-2.safetensors", "missing"), ("../x.safetensors", "outside"),
                         (str(tmp_path / "x.safetensors"), "outside")):
        hf = _sharded(tmp_path, {"model.norm.weight": "model.safetensors", "lm_head.weight": name})
        _assert_one_error(capsys, ["hf-to-maxtrain", str(hf), ck], "model.safetensors.index.json", name, needle)
    for index, needle in (("[]", "weight_map"), ('{"weight_map": [1]}', "weight_map"), ("{", "not valid JSON"),
                          ('{"weight_map": {"a": 3}}', "weight_map")):
        (tmp_path / "hf" / "model.safetensors.index.json").write_text(index)
        _assert_one_error(capsys, ["hf-to-maxtrain", str(tmp_path / "hf"), ck], "model.safetensors.index.json",
                          needle)


def test_sharded_index_works(tmp_path):
    hf = _sharded(tmp_path, {k: "model.safetensors" for k in _tiny_shapes()})
    m, params = convert.read_hf(str(hf))
    assert params["layers"]["w_down"].shape == (2, 32, 16)


def _damage(path, header=None, header_len=None, cut=0):
    """Rewrites a safetensors file: its JSON header replaced (a dict), its length field, or its tail cut."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    if header is not None:
        head = header(head)
    body = json.dumps(head).encode()
    raw = (len(body) if header_len is None else header_len).to_bytes(8, "little") + body + data
    path.write_bytes(raw[:len(raw) - cut])


def _retyped(dtype):
    def edit(head):
        head["model.norm.weight"]["dtype"] = dtype
        return head
    return edit


def _moved(offsets):
    def edit(head):
        head["model.norm.weight"]["data_offsets"] = offsets
        return head
    return edit


@pytest.mark.parametrize("damage, needle", [
    (dict(header_len=2**40), "header length"),
    (dict(header_len=200 * 2**20), "header length"),
    (dict(cut=10), "truncated"),
    (dict(header=_retyped("I64")), "dtype I64"),
    (dict(header=_retyped("F8_E4M3")), "dtype F8_E4M3"),
    (dict(header=_moved([0, 2**40])), "model.norm.weight"),
    (dict(header=_moved([0, 4])), "model.norm.weight"),
    (dict(header=lambda h: {**h, "model.norm.weight": {"dtype": "F32", "shape": [2**31, 2**31],
                                                         "data_offsets": [0, 64]}}), "model.norm.weight"),
    (dict(header=lambda h: {**h, "model.norm.weight": [1, 2]}), "model.norm.weight"),
    (dict(header=lambda h: [h]), "header"),
    (dict(header=lambda h: {**h, "__metadata__": {"format": 5}}), "__metadata__"),
])
def test_damaged_safetensors_are_one_line_errors(damage, needle, tmp_path, capsys):
    hf = _write_tiny_hf(tmp_path / "hf")
    _damage(hf / "model.safetensors", **damage)
    _assert_one_error(capsys, ["hf-to-maxtrain", str(hf), str(tmp_path / "ck")], "model.safetensors", needle)


def test_garbage_and_tiny_safetensors_files(tmp_path, capsys):
    hf = _write_tiny_hf(tmp_path / "hf")
    for raw in (b"", b"\x05\0\0", b"\x05\0\0\0\0\0\0\0{\xff}}}", b"\x06\0\0\0\0\0\0\0[1, 2]"):
        (hf / "model.safetensors").write_bytes(raw)
        _assert_one_error(capsys, ["hf-to-maxtrain", str(hf), str(tmp_path / "ck")], "model.safetensors")
    (hf / "model.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}")  # valid, and empty
    _assert_one_error(capsys, ["hf-to-maxtrain", str(hf), str(tmp_path / "ck")], "model.embed_tokens.weight missing")


def test_maxtrain_to_hf_from_something_that_is_not_a_checkpoint(tmp_path, capsys):
    hf = _write_tiny_hf(tmp_path / "hf")
    for src in (hf, hf / "config.json", tmp_path / "nothing"):
        _assert_one_error(capsys, ["maxtrain-to-hf", str(src), str(tmp_path / "out")], str(src))
    assert not (tmp_path / "out").exists()


def test_huge_config_values_fail_fast(tmp_path, capsys):
    # config.json must not make the converter enumerate or allocate what the files do not hold
    for change, needle in (({"num_hidden_layers": 10**12}, "model.layers.2.input_layernorm.weight missing"),
                           ({"vocab_size": 2**70}, "model.embed_tokens.weight")):
        hf = _write_tiny_hf(tmp_path / "hf", config={**TINY_HF, **change})
        _assert_one_error(capsys, ["hf-to-maxtrain", str(hf), str(tmp_path / "ck")], needle)


def test_output_that_cannot_be_created(tiny_ckpt, tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    _assert_one_error(capsys, ["maxtrain-to-hf", str(tiny_ckpt), str(tmp_path / "file" / "out")],
                      str(tmp_path / "file" / "out"), "cannot be created")
    _assert_one_error(capsys, ["maxtrain-to-hf", str(tiny_ckpt), ""], "output path is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "file", "hf"]


@pytest.mark.parametrize("case", ["gqa_untied", "mistral_window", "qwen3_tied", "mixtral_window", "qwen3_moe_sparse_step2_top1"])
def test_greedy_generation_equals_transformers(case, tmp_path, capsys):
    """`maxtrain generate` on a converted model (prefill + KV-cached decode, the parameters FSDP-sharded
    over the 8 test devices) continues a prompt with exactly the tokens `transformers`' greedy
    `generate` picks; the sliding window reaches back past the prompt."""
    hf = _hf_model(case, tmp_path / "hf")
    hf.generation_config.eos_token_id = None  # all 20 tokens, as maxtrain generates
    hf.generation_config.pad_token_id = 0
    base = load_config(None, ["train.dtype=float32"])
    convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "ck"), base)
    prompt = [5, 17, 3, 88, 41, 9, 60]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)[0, len(prompt):].tolist()
    assert cli.main(["generate", str(tmp_path / "ck"), "--prompt-ids", ",".join(map(str, prompt)),
                     "--max-new-tokens", "20", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["prompt_ids"] == prompt and got["samples"][0]["ids"] == want


@pytest.mark.parametrize("name, hf_config", [
    ("qwen3-8b", dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=12288, tie_word_embeddings=False)),
    ("qwen3-0.6b", dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True)),
    ("mixtral-8x7b", dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                          tie_word_embeddings=False)),
])
def test_configs_have_the_published_parameter_counts(name, hf_config):
    """configs/qwen3-*.yaml and mixtral-8x7b.yaml hold as many parameters as transformers' model of
    the published shape (built on the meta device: counted, not allocated)."""
    import os

    from maxtrain.models.registry import param_count

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", f"{name}.yaml"))
    family = "mixtral" if name.startswith("mixtral") else "qwen3"
    cls_cfg, cls = (getattr(transformers, n) for n in HF_CLASSES[family])
    with torch.device("meta"):
        model = cls(cls_cfg(**hf_config))
    unique = {id(p): p.numel() for p in model.parameters()}  # a tied head counted once
    assert param_count(cfg) == sum(unique.values())


# ---------------------------------------------------------------- the export carries what the weights need
# A converted model exported again loads in transformers with its tokenizer, its EOS (generation
# stops there) and its context length; a model trained on other data carries that data's tokenizer.

EOS, BOS = 2, 1


@pytest.fixture(scope="module")
def hf_with_tokenizer(tmp_path_factory):
    """(HF dir, its converted checkpoint): a tiny Llama (transformers' random init) with a tiny
    byte-level BPE tokenizer, max_position_embeddings 512, and an EOS the argmax of every position
    by construction (embedding dim 0 a large constant, lm_head's EOS row reading it), so greedy
    generation emits EOS at once and stops only if the EOS id reached transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tmp = tmp_path_factory.mktemp("hf_tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, the quick brown fox"] * 8, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(tmp / "hf")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS,
        tie_word_embeddings=False))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight[EOS, 0] = 5.0
    model.save_pretrained(tmp / "hf")
    assert cli.main(["convert", "hf-to-maxtrain", str(tmp / "hf"), str(tmp / "ck"), "train.dtype=float32"]) == 0
    return tmp / "hf", tmp / "ck"


def _generates_to_eos(out, prompt):
    """The ids transformers' greedy generation appends to `prompt` with the exported tokenizer and model."""
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        new = model.generate(ids, do_sample=False, max_new_tokens=8)[0, ids.shape[1]:].tolist()
    return tok, model, new


def test_export_of_a_converted_model_generates_with_its_tokenizer_and_stops_at_eos(hf_with_tokenizer, tmp_path,
                                                                                   capsys):
    hf, ck = hf_with_tokenizer
    assert cli.main(["convert", "maxtrain-to-hf", str(ck), str(tmp_path / "out")]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    out = tmp_path / "out"
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the source's files, as they were
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    tok, model, new = _generates_to_eos(out, "hello world")
    assert tok.eos_token_id == EOS and model.generation_config.eos_token_id == EOS
    assert new == [EOS]  # stopped at EOS, not 8 of them
    written, source = (json.loads((d / "config.json").read_text()) for d in (out, hf))
    for key in ("max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rms_norm_eps"):
        assert written[key] == source[key], key
    assert written["max_position_embeddings"] == 512
    # the conversion kept the source's tokenizer files beside its step, for exports of runs trained from it
    assert sorted(p.name for p in ck.iterdir()) == ["0", convert.SOURCE_DIR]


def _safetensors_dtypes(path):
    """The dtypes a safetensors file's header names (read from its bytes: an 8-byte length, then JSON)."""
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_export_keeps_the_source_models_dtype_unless_told(hf_with_tokenizer, tmp_path):
    """A bfloat16 source (config.json's dtype) exports in bfloat16 without --dtype; --dtype wins."""
    import shutil

    hf, _ = hf_with_tokenizer
    shutil.copytree(hf, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop("torch_dtype", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert cli.main(["convert", "hf-to-maxtrain", str(tmp_path / "hf"), str(tmp_path / "ck"), "train.dtype=float32"]) == 0
    for args, want, tensors in (([], "bfloat16", {"BF16"}), (["--dtype", "float32"], "float32", {"F32"})):
        out = tmp_path / f"out-{want}"
        assert cli.main(["convert", "maxtrain-to-hf", str(tmp_path / "ck"), str(out), *args]) == 0
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == want
        assert _safetensors_dtypes(out / "model.safetensors") == tensors


def test_generate_on_a_fresh_conversion_uses_the_source_tokenizer(hf_with_tokenizer, tmp_path, capsys, monkeypatch):
    """`maxtrain generate` on the converted checkpoint, from another directory and without
    --tokenizer: the prompt is encoded by the source's tokenizer.json (read here with the tokenizers
    package itself), and the text stops at its EOS (emitted first by construction)."""
    from tokenizers import Tokenizer

    hf, ck = hf_with_tokenizer
    monkeypatch.chdir(tmp_path)
    assert cli.main(["generate", str(ck), "--prompt", "hello world", "--max-new-tokens", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["prompt_ids"] == Tokenizer.from_file(str(hf / "tokenizer.json")).encode("hello world").ids
    assert got["samples"][0]["ids"][0] == EOS and got["samples"][0]["text"] == ""


def test_export_of_a_model_trained_on_text_carries_the_byte_tokenizer(hf_with_tokenizer, tmp_path, capsys):
    """Trained from the converted model on text (bytes) with sequences longer than the source's
    512: the export's tokenizer.json encodes as maxtrain's byte tokenizer, EOS is 256 (not the
    source's), max_position_embeddings the trained seq_len; transformers stops at that EOS."""
    from maxtrain.data.tokenizers import byte_tokenizer, load_tokenizer

    _, ck = hf_with_tokenizer
    assert cli.main(["train", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ck'}",
                     f"checkpoint.init_from={ck}", "model.vocab_size=320", "model.d_model=32", "model.n_layers=1",
                     "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.d_ff=64",
                     "model.norm_eps=1e-6", "train.steps=1", "train.batch_size=8", "train.seq_len=1024",
                     "optim.lr=0", "optim.weight_decay=0", "data.max_bytes=100000"]) == 0
    capsys.readouterr()
    assert cli.main(["convert", "maxtrain-to-hf", str(tmp_path / "ck"), str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    text = "héllo, wörld <tag> தமிழ் हिन्दी\n\tend"
    assert load_tokenizer(str(out)).encode(text) == byte_tokenizer().encode(text) == list(text.encode())
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == 256 and config["bos_token_id"] is None
    assert config["max_position_embeddings"] == 1024
    tok, model, new = _generates_to_eos(out, text)
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(list(text.encode())) == text
    assert tok.eos_token_id == 256 and model.generation_config.eos_token_id == 256
    assert new == [EOS] * 8  # the source's EOS row still wins (lr 0), but id 2 is byte \x02 now: no stop


def test_export_with_a_sentencepiece_tokenizer(hf_with_tokenizer, tmp_path):
    """--tokenizer names a SentencePiece .model: copied as tokenizer.model, transformers encodes as it."""
    spm = pytest.importorskip("sentencepiece")
    import io

    _, ck = hf_with_tokenizer
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([f"the quick brown fox jumps {i}" for i in range(50)]),
                                   model_writer=model, vocab_size=40, model_type="bpe", minloglevel=2)
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert cli.main(["convert", "maxtrain-to-hf", str(ck), str(tmp_path / "out"), "--tokenizer",
                     str(tmp_path / "sp.model")]) == 0
    out = tmp_path / "out"
    assert (out / "tokenizer.model").read_bytes() == model.getvalue()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("the fox jumps")["input_ids"] == sp.encode("the fox jumps")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tok.eos_token_id == sp.eos_id()


def test_export_without_a_tokenizer_says_so(tiny_ckpt, tmp_path, capsys):
    """No tokenizer anywhere (the source had none, data synthetic): a README in the export and one
    warning line; --tokenizer with more tokens than the model embeds is one error line."""
    assert cli.main(["convert", "maxtrain-to-hf", str(tiny_ckpt), str(tmp_path / "out")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "no tokenizer" in line]
    assert len(warnings) == 1 and "--tokenizer" in warnings[0], warnings
    assert "--tokenizer PATH" in (tmp_path / "out" / "README.md").read_text()
    _assert_one_error(capsys, ["maxtrain-to-hf", str(tiny_ckpt), str(tmp_path / "out2"), "--tokenizer", "byte"],
                      "257 tokens", "model.vocab_size=64")
    assert not (tmp_path / "out2").exists()
