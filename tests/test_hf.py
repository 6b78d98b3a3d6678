"""Hugging Face interchange: logits match transformers' implementation, round trips are exact."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from maxtrain import cli, forward, load_checkpoint  # noqa: E402
from maxtrain.config import ConfigError, load_config  # noqa: E402
from maxtrain.models import hf_llama  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, rms_norm_eps=1e-5, max_position_embeddings=64)
CASES = {
    "gqa_untied": dict(model="llama", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0),
    "tied_llama3_scaling": dict(model="llama", num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
    "mistral_window": dict(model="mistral", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                           sliding_window=5, head_dim=16),
}


def _hf_model(case, path):
    kw = dict(CASES[case])
    kind = kw.pop("model")
    cls_cfg, cls = ((transformers.MistralConfig, transformers.MistralForCausalLM) if kind == "mistral"
                    else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    torch.manual_seed(0)
    model = cls(cls_cfg(**COMMON, **kw, attn_implementation="eager")).eval()
    with torch.no_grad():  # non-trivial norm scales, so a swapped norm cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
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
    step_dir = hf_llama.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "ck"), base)
    cfg, params = load_checkpoint(step_dir)
    assert cfg.model.tie_embeddings == CASES[case]["tie_word_embeddings"]
    ours = np.asarray(forward(cfg, params, TOKENS))
    np.testing.assert_allclose(ours, _torch_logits(hf, TOKENS), atol=2e-5, rtol=1e-4)

    for fmt in ("legacy", "parameters"):
        out = tmp_path / f"export_{fmt}"
        hf_llama.maxtrain_to_hf(str(tmp_path / "ck"), str(out), rope_format=fmt)
        written = json.loads((out / "config.json").read_text())
        assert ("rope_parameters" in written) == (fmt == "parameters")
        back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        for (name, a), (_, b) in zip(sorted(hf.state_dict().items()), sorted(back.state_dict().items())):
            assert torch.equal(a, b), name
        np.testing.assert_allclose(_torch_logits(back, TOKENS), _torch_logits(hf, TOKENS), atol=0, rtol=0)
        again = hf_llama.hf_to_maxtrain(str(out), str(tmp_path / f"ck_{fmt}"), base)
        _, params2 = load_checkpoint(again)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(params2), jax.device_get(params))


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
        hf_llama.read_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type='gpt2' is not supported"):
        hf_llama.read_hf(str(tmp_path))


def test_newer_rope_parameters_form_reads():
    hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    m = hf_llama.model_config_from_hf(hf)
    assert m.rope_theta == 500000.0 and m.rope_scaling.factor == 32.0
    legacy = dict(hf, rope_theta=500000.0, rope_scaling=hf["rope_parameters"])
    del legacy["rope_parameters"]
    assert hf_llama.model_config_from_hf(legacy) == m
