"""The library contract: a model registered from outside trains with the same loop; forward()."""

import importlib.util
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import FAST_COMPILE, ROOT, SMALL, TINY
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
    w_in = result.state.params["layers"]["w_in"]
    assert w_in.sharding.shard_shape(w_in.shape) == (2, 32, 64)  # embed over fsdp, mlp over tensor
    logits = forward(cfg, result.state.params, np.zeros((2, 8), np.int32))
    assert logits.shape == (2, 8, 128) and logits.dtype == np.float32
    # a layered model gets the fused losses from the trainer: the same numbers
    fused = train(load_config(TINY, SMALL + ["model.name=mini_gpt", "model.n_kv_heads=4", "train.steps=8",
                                             "optim.lr=3e-3", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                             "train.cross_entropy=fused", f"run_dir={tmp_path / 'fused'}"]))
    np.testing.assert_allclose([r["loss"] for r in fused.history], [r["loss"] for r in result.history], rtol=1e-4)


def test_example_script_runs(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2" + FAST_COMPILE}
    # a fresh run_dir: a fixed one holds the last run's config, and any config change refuses it
    r = subprocess.run([sys.executable, "examples/custom_model.py", "train.steps=10", "train.log_every=5",
                        f"run_dir={tmp_path / 'mini_gpt'}"],
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
    well under a second); `maxtrain.train` is the function (there is no module of that name to
    shadow it), `maxtrain.run.train` the same, and the old `maxtrain.loop` imports with a warning."""
    code = ("import sys, maxtrain.config, maxtrain.cli, maxtrain.launcher, maxtrain.analysis.report, maxtrain.exit_codes\n"
            "assert 'jax' not in sys.modules, 'import maxtrain.config (or the launcher, report) imported jax'\n"
            "try:\n    maxtrain.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert maxtrain.cli.main(['train', sys.argv[1], 'model.n_head=4']) == 2\n"
            "assert 'jax' not in sys.modules, 'a config error imported jax'\n"
            "import maxtrain, maxtrain.run\n"
            "assert callable(maxtrain.train) and maxtrain.train is maxtrain.run.train\n"
            "from maxtrain import forward, load_checkpoint, train\n"
            "assert train is maxtrain.train and 'jax' in sys.modules\n"
            "from maxtrain.loop import Callback\n"
            "assert Callback is maxtrain.run.Callback\n")
    r = subprocess.run([sys.executable, "-c", code, TINY], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "did you mean model.n_heads?" in r.stderr


def test_custom_layered_model_trains_pipelined_without_pipeline_code(tmp_path):
    """examples/custom_model.py's model has no pipeline code: the trainer cuts its layer stack into
    stages (circular, two repeats) and the run matches the same model on one device."""
    _load_example()
    common = SMALL + ["model.name=mini_gpt", "model.n_kv_heads=4", "model.n_layers=4", "train.steps=3"]
    one = train(load_config(TINY, common + ["mesh.data=1", f"run_dir={tmp_path / 'one'}"]), devices=jax.devices()[:1])
    piped = train(load_config(TINY, common + ["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2",
                                              "train.pipeline_repeats=2", "train.microbatches=4",
                                              "train.pipeline_schedule=interleaved", f"run_dir={tmp_path / 'piped'}"]))
    np.testing.assert_allclose([r["loss"] for r in piped.history], [r["loss"] for r in one.history], rtol=2e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in piped.history], [r["grad_norm"] for r in one.history],
                               rtol=1e-4)
    w = piped.state.params["layers"]["w_in"]  # [repeats, stages, layers per chunk, D, F]
    assert w.shape[:3] == (2, 2, 1) and w.sharding.shard_shape(w.shape)[1] == 1


def test_model_functions_get_the_model_config_and_a_runtime_not_the_config():
    """A layered model's functions see `cfg.model` and a `Runtime` (dtype, rules, length) only."""
    from maxtrain.config import ModelConfig
    from maxtrain.models import Runtime
    seen = []

    def spy(fn):
        def wrapped(*args):
            seen.append(tuple(type(a) for a in args[-2:]))
            return fn(*args)
        return wrapped

    ex = _load_example()
    models.register("spy_gpt", param_specs=spy(ex.param_specs), embed=spy(ex.embed), layer=spy(ex.layer),
                    final=spy(ex.final), head=spy(ex.head))
    cfg = load_config(TINY, SMALL + ["model.name=spy_gpt", "model.n_kv_heads=4"])
    model = models.get("spy_gpt")
    params = model.init(cfg, jax.random.key(0))
    jax.eval_shape(lambda p: model.apply(p, {"inputs": np.zeros((2, 8), np.int32)}, cfg), params)
    assert len(seen) == 5 and set(seen) == {(ModelConfig, Runtime)}  # specs (init), embed, layer (scanned), final, head


def test_a_feature_a_whole_config_model_lacks_is_a_config_error(capsys, tmp_path):
    """A model registered the deprecated way (whole-Config functions) without supports=('pipeline',)
    has no stages: asking it for mesh.pipeline=2 is one line, not a run that quietly spends the
    pipeline axis on data parallelism."""
    from maxtrain import cli
    llama = models.get("llama")
    with pytest.warns(DeprecationWarning, match="whole-Config model functions are deprecated"):
        models.register("whole_llama", init=llama.init, apply=llama.apply, logical_axes=llama.logical_axes)
    code = cli.main(["train", TINY, "model.name=whole_llama", "mesh.pipeline=2", f"run_dir={tmp_path / 'r'}"])
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("maxtrain: error:")]
    assert code == 2 and len(errors) == 1 and "model 'whole_llama' is not registered with supports=('pipeline',)" \
        in errors[0], errors
    with pytest.raises(ValueError, match="supports=\\['tensor_magic'\\] unknown"):
        models.register("bad", init=llama.init, apply=llama.apply, logical_axes=llama.logical_axes,
                        supports=("tensor_magic",))
    with pytest.raises(ValueError, match="a layered model gives param_specs, embed, layer, final and head; missing embed, final"):
        models.register("bad", param_specs=dict, embed=None, layer=len, head=len)


def test_the_old_loop_module_still_imports_with_a_deprecation_warning(monkeypatch):
    import importlib

    import maxtrain.run

    monkeypatch.delitem(sys.modules, "maxtrain.loop", raising=False)
    with pytest.warns(DeprecationWarning, match="maxtrain.run"):
        old = importlib.import_module("maxtrain.loop")
    assert old.Callback is maxtrain.run.Callback and old.train is maxtrain.run.train


def test_the_training_path_imports_no_analysis_code():
    """`maxtrain.analysis` (HLO, inspect, report) sits above the training path: training imports none of it."""
    code = ("import sys, maxtrain.run, maxtrain.step, maxtrain.checkpoint, maxtrain.cli\n"
            "bad = sorted(m for m in sys.modules if m.startswith('maxtrain.analysis'))\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_importing_maxtrain_leaves_logging_to_the_application(tmp_path):
    """No root handler after importing the training path (Orbax's absl logging used to install one,
    and a script's `logging.basicConfig(level=INFO)` then did nothing): the script's own logging
    configuration shows maxtrain's progress; `maxtrain.configure_logging()` is the CLI's format."""
    overrides = SMALL + [f"run_dir={tmp_path / 'run'}", "train.steps=2", "logging.tensorboard=false"]
    code = (f"import logging, jax, maxtrain, maxtrain.run, maxtrain.step, maxtrain.checkpoint\n"
            f"assert not logging.getLogger().handlers, logging.getLogger().handlers\n"
            f"logging.basicConfig(level=logging.INFO, format='LOG %(name)s: %(message)s')\n"
            f"cfg = maxtrain.load_config({TINY!r}, {overrides!r})\n"
            f"maxtrain.train(cfg, devices=jax.devices()[:1])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert any(x.startswith("LOG maxtrain: run ") for x in lines), r.stderr[-2000:]
    assert any(x.startswith("LOG maxtrain: model llama") for x in lines), r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", "import logging, maxtrain; maxtrain.configure_logging(); "
                        "logging.getLogger('maxtrain').info('hello')"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr.strip().endswith("hello"), r.stderr


def test_the_model_authors_guide_names_only_what_exists():
    """docs/models.md: every `maxtrain.x.y` it names is a module or an attribute of one."""
    import importlib
    import re
    text = open(os.path.join(ROOT, "docs", "models.md")).read()
    names = set(re.findall(r"\bmaxtrain(?:\.[A-Za-z_]\w*)+", text))
    assert len(names) >= 8, names
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"docs/models.md names {name}, which does not exist"
            obj = getattr(obj, attr)


def test_a_familys_functions_still_resolve_from_its_old_module_with_a_warning():
    """`maxtrain.models.llama.embed` (a module before the family became a folder) is the model's
    function, with a DeprecationWarning naming its module now."""
    import maxtrain.models.deepseek as deepseek_pkg
    import maxtrain.models.llama as llama_pkg
    from maxtrain.models.deepseek import model as deepseek_model
    from maxtrain.models.llama import model as llama_model

    with pytest.warns(DeprecationWarning, match="maxtrain.models.llama.embed is now maxtrain.models.llama.model.embed"):
        assert llama_pkg.embed is llama_model.embed
    with pytest.warns(DeprecationWarning, match="deepseek.balance is now"):
        assert deepseek_pkg.balance is deepseek_model.balance
    with pytest.raises(AttributeError):
        llama_pkg.no_such_function


def test_the_old_converter_modules_still_resolve_with_a_warning():
    """`maxtrain.models.hf_llama` / `hf_deepseek` (before the converter's file side became
    `maxtrain.convert` and the mappings moved into the family folders): the old names, warned."""
    from maxtrain import convert
    from maxtrain.models import hf_deepseek, hf_llama
    from maxtrain.models.deepseek import hf as deepseek_hf

    with pytest.warns(DeprecationWarning, match="hf_llama.read_hf is now maxtrain.convert.read_hf"):
        assert hf_llama.read_hf is convert.read_hf
    with pytest.warns(DeprecationWarning, match="hf_deepseek.hf_shapes is now maxtrain.models.deepseek.hf"):
        assert hf_deepseek.hf_shapes is deepseek_hf.hf_shapes
