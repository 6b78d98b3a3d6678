"""A model family that lives in one folder (tests/toy_family/) goes the whole way through maxtrain's
shared code: its config class reads its own keys (and refuses them for another family), it trains on
8 devices and resumes from its checkpoint, generates through `maxtrain.generate` (equal to a greedy
loop over the plain training forward, no cache), and converts to Hugging Face files and back through
`maxtrain.convert` (every parameter equal). Nothing outside tests/toy_family/ names it."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toy_family  # noqa: F401  (registers "toy")
from conftest import ROOT, SMALL, TINY
from maxtrain import ConfigError, convert, load_config, train
from maxtrain.checkpoint import load_checkpoint
from maxtrain.generate import generate_tokens
from maxtrain.step import forward
from toy_family.config import ToyConfig

TOY = SMALL + ["model.name=toy", "model.activation=relu", "model.max_positions=48", "model.n_kv_heads=4"]


def test_the_toy_config_reads_its_own_keys_and_only_for_itself():
    cfg = load_config(TINY, TOY)
    assert type(cfg.model) is ToyConfig and cfg.model.activation == "relu" and cfg.model.max_positions == 48
    with pytest.raises(ConfigError, match="model.activation is a key of model.name=toy, not of model.name=llama"):
        load_config(TINY, ["model.activation=relu"])
    with pytest.raises(ConfigError, match="model.activation='tanh' is not one of gelu, relu"):
        load_config(TINY, TOY + ["model.activation=tanh"])
    with pytest.raises(ConfigError, match="longer than model.max_positions=48"):
        from maxtrain.config import validate_for_mesh
        validate_for_mesh(load_config(TINY, TOY + ["train.seq_len=64"]),
                          {"data": 1, "pipeline": 1, "fsdp": 8, "expert": 1, "sequence": 1, "tensor": 1})


@pytest.mark.slow
def test_the_toy_family_trains_resumes_generates_and_converts(tmp_path):
    ck = tmp_path / "ck"
    common = TOY + [f"checkpoint.dir={ck}", "checkpoint.every=2"]
    first = train(load_config(TINY, common + ["train.steps=2", f"run_dir={tmp_path / 'a'}"]))
    resumed = train(load_config(TINY, common + ["train.steps=4", f"run_dir={tmp_path / 'b'}"]))
    whole = train(load_config(TINY, TOY + ["train.steps=4", f"run_dir={tmp_path / 'c'}"]))
    assert [r["step"] for r in resumed.history] == [3, 4]
    np.testing.assert_allclose([r["loss"] for r in first.history + resumed.history],
                               [r["loss"] for r in whole.history], rtol=1e-6)
    assert whole.history[-1]["loss"] < whole.history[0]["loss"]

    cfg, params = load_checkpoint(str(ck))
    assert type(cfg.model) is ToyConfig and cfg.model.activation == "relu"
    params = jax.device_get(params)
    prompt = jnp.asarray([[5, 17, 3, 99], [1, 2, 3, 4]], jnp.int32)
    got = np.asarray(generate_tokens(params, prompt, jax.random.key(0), m=cfg.model, new_tokens=6))
    want = np.asarray(prompt)  # the reference: the whole sequence through the training forward, each step
    for _ in range(6):
        logits = forward(cfg, params, want)
        want = np.concatenate([want, np.argmax(np.asarray(logits)[:, -1], -1)[:, None]], axis=1)
    np.testing.assert_array_equal(got, want)

    files = convert.maxtrain_to_hf(str(ck), str(tmp_path / "hf"))
    assert "model.safetensors" in files
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == "maxtrain_toy" and hf_config["hidden_act"] == "relu"
    back = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "ck2"), load_config(TINY, TOY))
    cfg2, params2 = load_checkpoint(back)
    assert cfg2.model == cfg.model
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params2), params)


def test_nothing_outside_the_folder_names_the_toy_family():
    hits = [str(p.relative_to(ROOT)) for d in ("maxtrain", "kernels", "configs")
            for p in pathlib.Path(ROOT, d).rglob("*") if p.is_file() and p.suffix in (".py", ".yaml", ".md")
            and ("toy_family" in p.read_text() or "maxtrain_toy" in p.read_text())]
    assert hits == []
