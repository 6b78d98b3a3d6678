"""The library contract: a model registered from outside trains with the same loop; forward()."""

import importlib.util
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import ROOT, SMALL, TINY
from maxtrain import forward, load_config, models, train


def _load_example():
    spec = importlib.util.spec_from_file_location("custom_model", os.path.join(ROOT, "examples", "custom_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_model_registers_and_trains_sharded(tmp_path):
    _load_example()
    assert "mini_gpt" in models.names()
    cfg = load_config(TINY, SMALL + ["model.name=mini_gpt", "model.n_kv_heads=4", "train.steps=8",
                                     "optim.lr=3e-3", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                     f"run_dir={tmp_path}"])
    result = train(cfg)
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    w_in = result.state.params["blocks"][0]["w_in"]
    assert w_in.sharding.shard_shape(w_in.shape) == (32, 64)  # embed over fsdp, mlp over tensor
    logits = forward(cfg, result.state.params, np.zeros((2, 8), np.int32))
    assert logits.shape == (2, 8, 128) and logits.dtype == np.float32
    # it registers features/head too: the fused loss trains it to the same numbers
    fused = train(load_config(TINY, SMALL + ["model.name=mini_gpt", "model.n_kv_heads=4", "train.steps=8",
                                             "optim.lr=3e-3", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                             "train.cross_entropy=fused", f"run_dir={tmp_path / 'fused'}"]))
    np.testing.assert_allclose([r["loss"] for r in fused.history], [r["loss"] for r in result.history], rtol=1e-4)


def test_example_script_runs():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    r = subprocess.run([sys.executable, "examples/custom_model.py", "train.steps=10", "train.log_every=5",
                        "run_dir=" + os.path.join(os.environ.get("TMPDIR", "/tmp"), "mini_gpt_test")],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mini_gpt: loss" in r.stdout


def test_forward_contract_matches_apply():
    cfg = load_config(TINY, SMALL)
    params = models.get("llama").init(cfg, jax.random.key(1))
    tokens = np.arange(24).reshape(2, 12) % 128
    seg = np.ones_like(tokens)
    pos = np.tile(np.arange(12), (2, 1))
    a = forward(cfg, params, tokens)
    b = forward(cfg, params, tokens, segment_ids=seg, positions=pos)
    np.testing.assert_allclose(a, b, atol=1e-6)
    assert a.shape == (2, 12, 128) and a.dtype == np.float32


def test_config_and_help_import_no_jax_and_the_library_names_still_work():
    """`import maxtrain.config`, `maxtrain --help` and a config error import no jax (they answer in
    well under a second); `maxtrain.train` is still the function after `import maxtrain.train`."""
    code = ("import sys, maxtrain.config, maxtrain.cli, maxtrain.launcher, maxtrain.report, maxtrain.exit_codes\n"
            "assert 'jax' not in sys.modules, 'import maxtrain.config (or the launcher, report) imported jax'\n"
            "try:\n    maxtrain.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert maxtrain.cli.main(['train', sys.argv[1], 'model.n_head=4']) == 2\n"
            "assert 'jax' not in sys.modules, 'a config error imported jax'\n"
            "import maxtrain, maxtrain.train\n"
            "assert callable(maxtrain.train) and maxtrain.train is maxtrain.train.__globals__['train']\n"
            "from maxtrain import forward, load_checkpoint, train\n"
            "assert train is maxtrain.train and 'jax' in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code, TINY], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "did you mean model.n_heads?" in r.stderr


def test_a_feature_a_registered_model_lacks_is_a_config_error(capsys, tmp_path):
    """examples/custom_model.py's model splits no layers into stages: asking it for mesh.pipeline=2
    is one line, not a run that quietly spends the pipeline axis on data parallelism."""
    from maxtrain import cli
    _load_example()
    code = cli.main(["train", TINY, "model.name=mini_gpt", "mesh.pipeline=2", f"run_dir={tmp_path / 'r'}"])
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("maxtrain: error:")]
    assert code == 2 and len(errors) == 1 and "model 'mini_gpt' is not registered with supports=('pipeline',)" \
        in errors[0], errors
    with pytest.raises(ValueError, match="supports=\\['tensor_magic'\\] unknown"):
        models.register("bad", init=None, apply=None, logical_axes=None, supports=("tensor_magic",))
