import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, TINY
from maxtrain import cli
from maxtrain.config import ConfigError, load_config, resolve_mesh_shape, valid_keys


def test_tiny_loads_with_overrides():
    cfg = load_config(TINY, ["train.steps=7", "optim.lr=3e-4", "mesh.fsdp=2", "model.rope_scaling={factor: 4.0}"])
    assert cfg.train.steps == 7
    assert cfg.optim.lr == pytest.approx(3e-4)  # YAML reads 3e-4 as a string; coerced for a float key
    assert cfg.mesh.fsdp == 2
    assert cfg.model.rope_scaling.factor == 4.0 and cfg.model.rope_scaling.original_max_position == 8192
    assert cfg.model.head_dim == cfg.model.d_model // cfg.model.n_heads


def test_base_inheritance_and_rule_merge(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"model": {"d_model": 128, "n_heads": 4}, "train": {"steps": 3}}))
    child = tmp_path / "child.yaml"
    child.write_text(yaml.safe_dump({"base": "base.yaml", "train": {"steps": 5},
                                     "sharding": {"params": {"embed": None}}}))
    cfg = load_config(child)
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.train.steps) == (128, 4, 5)
    assert cfg.sharding.params["embed"] is None
    assert cfg.sharding.params["mlp"] == "tensor"  # untouched rules keep their defaults


@pytest.mark.parametrize("override, message", [
    ("model.n_head=4", "unknown config key model.n_head; did you mean model.n_heads?"),
    ("trian.steps=4", "unknown config key trian; did you mean train?"),
    ("train.steps=many", "train.steps must be an integer, got 'many'"),
    ("model.tie_embeddings=3", "model.tie_embeddings must be true or false"),
    ("model.n_kv_heads=3", "model.n_heads=8 is not divisible by model.n_kv_heads=3"),
    ("model.remat=sometimes", "model.remat='sometimes' is not valid"),
    ("optim.schedule=cosin", "did you mean cosine?"),
    ("mesh.pipeline=3", "model.n_layers=4 is not divisible by mesh.pipeline x train.pipeline_repeats = 3x1"),
    ("sharding.params.embed=fsdpp", "sharding.params.embed='fsdpp' is not a mesh axis"),
])
def test_config_errors(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_mesh_shape_resolution():
    cfg = load_config(TINY, ["mesh.data=-1", "mesh.fsdp=2", "mesh.tensor=2"])
    assert resolve_mesh_shape(cfg.mesh, 8)["data"] == 2
    with pytest.raises(ConfigError, match="multiply to 6 but there are 8 devices"):
        resolve_mesh_shape(load_config(TINY, ["mesh.data=3", "mesh.fsdp=2"]).mesh, 8)
    with pytest.raises(ConfigError, match="does not divide the 8 devices"):
        resolve_mesh_shape(load_config(TINY, ["mesh.fsdp=3"]).mesh, 8)


def _run_cli(capsys, *argv):
    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("maxtrain: error:")]
    return code, errors, err


@pytest.mark.parametrize("overrides, needle", [
    (["model.n_head=4"], "did you mean model.n_heads?"),
    (["train.batch_size=abc"], "train.batch_size must be an integer"),
    (["model.n_kv_heads=3"], "not divisible by model.n_kv_heads=3"),
    (["mesh.data=3"], "multiply to 3, which does not divide the 8 devices"),
    (["mesh.data=3", "mesh.fsdp=1"], "multiply to 3 but there are 8 devices"),
    (["mesh.data=2", "mesh.fsdp=4", "train.batch_size=12"], "not divisible by the 8-way data parallelism"),
    (["model.attention=flashy"], "model.attention='flashy' is unknown"),
    (["model.name=gpt9"], "model.name='gpt9' is not a registered model"),
    (["mesh.tensor=8", "mesh.data=1", "model.n_kv_heads=4"], "does not divide into 8 shards"),
    (["data.path=/nonexistent/*.txt"], "matches no files"),
    (["model.attention=flash", "mesh.data=4", "mesh.sequence=2"], "use model.attention=ring for context parallelism"),
])
def test_cli_errors_exit_2_with_one_line(capsys, tmp_path, overrides, needle):
    code, errors, err = _run_cli(capsys, "train", TINY, f"run_dir={tmp_path}", "train.steps=1", *overrides)
    assert code == 2
    assert len(errors) == 1 and needle in errors[0], err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("override", [
    "object_cache=s3://bucket/cache", "run_dir=hdfs://bucket/run", "checkpoint.local.dir=s3://b/local",
    "checkpoint.init_from=hdfs://b/ck/100", "checkpoint.resume_from=file:///b/ck", "data.path=s3://bucket/tok",
    "data.eval_path=[s3://bucket/val]", "data.path=[{path: /tmp, weight: 1}, {path: 'gs://b/tok', weight: 2}]",
    "reliability.compilation_cache=gs://b/cache", "checkpoint.dir=file:///tmp/ck",
])
def test_a_url_path_in_the_config_is_one_line_before_anything_is_written(capsys, tmp_path, monkeypatch, override):
    """A path with a URL scheme where the key takes none, or a scheme no key takes (object stores:
    tests/test_object_store.py), is refused, never taken as a local directory named `s3:` (or
    `gs:`, `file:`) in the working directory."""
    monkeypatch.chdir(tmp_path)
    code, errors, err = _run_cli(capsys, "train", TINY, "train.steps=1", *([] if "run_dir" in override else
                                                                          ["run_dir=run"]), override)
    key, value = override.split("=", 1)
    assert code == 2 and len(errors) == 1, err
    if key.startswith("data."):  # TINY's data is synthetic: a URL needs data.kind=tokens
        assert f"{key}: s3:// and gs:// data must be prepared tokens" in errors[0], errors
    elif key in ("checkpoint.init_from", "checkpoint.resume_from", "checkpoint.dir", "run_dir"):  # s3://, gs:// only
        assert f"{key}=" in errors[0] and "is not a supported object store" in errors[0], errors
    else:
        assert f"{key}=" in errors[0] and ":// paths are not supported" in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing is written"


@pytest.mark.parametrize("argv", [
    ["generate", "gs://bucket/ck", "--prompt", "a"],
    ["eval", "s3://bucket/ck", "--tasks", "x"],
    ["prepare", "--verify", "gs://bucket/tok"],
    ["prepare", "--input", "raw.txt", "--output", "tok", "--tokenizer", "s3://bucket/tokenizer.json"],
    ["convert", "maxtrain-to-hf", "ck", "out", "--tokenizer", "s3://bucket/tokenizer.json"],
    ["train", "s3://bucket/config.yaml"],
])
def test_a_url_path_argument_is_one_line_before_the_command_runs(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    code, errors, err = _run_cli(capsys, *argv)
    assert code == 2 and len(errors) == 1 and ":// paths are not supported" in errors[0], err
    assert list(tmp_path.iterdir()) == []


def test_a_bucket_without_credentials_is_one_line(capsys, tmp_path, monkeypatch):
    """`checkpoint verify` and `checkpoint.dir` take bucket URLs; with no credentials anywhere the
    command ends in one line saying so (Orbax's own path layer, fsspec/botocore, never reached)."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: never a real bucket
    monkeypatch.chdir(tmp_path)
    for argv in (["checkpoint", "verify", "s3://bucket/ck"],
                 ["train", TINY, "train.steps=1", "run_dir=run", "checkpoint.dir=s3://bucket/ck"]):
        code, errors, err = _run_cli(capsys, *argv)
        assert code == 2 and len(errors) == 1 and "s3://bucket/ck" in errors[0], err
        assert not any("Traceback" in line for line in err), err
    assert list(tmp_path.iterdir()) == []


def test_cli_missing_file_and_bad_override(capsys):
    code, errors, _ = _run_cli(capsys, "train", "no/such.yaml")
    assert code == 2 and "config file no/such.yaml not found" in errors[0]
    code, errors, _ = _run_cli(capsys, "train", TINY, "train.steps")
    assert code == 2 and "is not KEY=VALUE" in errors[0]


def test_cli_subprocess_exit_code_and_no_traceback():
    r = subprocess.run([sys.executable, "-m", "maxtrain.cli", "train", TINY, "model.d_modle=64"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "maxtrain: error: unknown config key model.d_modle; did you mean model.d_model?"
    assert "Traceback" not in r.stderr


def test_every_config_key_documented():
    from maxtrain.models import catalog

    readme = Path(ROOT, "docs", "config.md").read_text()  # the built-in families' keys (not a test's own family)
    missing = [k for k in valid_keys(families=catalog.declared()) if f"`{k}`" not in readme]
    assert not missing, f"keys missing from docs/config.md: {missing}"


def test_readme_quickstart_is_two_commands_and_ci_runs_the_second():
    import re
    import subprocess
    readme = Path(ROOT, "README.md").read_text()
    block = readme.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.strip().splitlines() if line.strip()]
    assert len(commands) == 2
    assert "maxtrain train configs/tiny.yaml" in commands[0]
    install, test_cmd = commands[1].split(" && ")
    assert install == 'pip install -e ".[test]"' and test_cmd.startswith("python -m pytest")
    # .ci/run reads the command out of README.md itself (its CMD= line, run here on the README)
    ci = Path(ROOT, ".ci", "run").read_text()
    extract = re.search(r'^CMD="\$\((.*)\)"$', ci, re.M).group(1)
    got = subprocess.run(["bash", "-c", extract], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert got.strip() == commands[1]
    assert 'bash -c "$INSTALL"' in ci and 'bash -c "$TEST"' in ci and "-m venv" in ci


@pytest.mark.parametrize("content, overrides, needle", [
    ({"base": ["tiny.yaml"]}, [], "`base:` must be one file name"),
    ({"base": "."}, [], "is a directory"),
    (b"\xff\xfe\x00\x81train: {}\n", [], "is not UTF-8 text"),
    ({"base": "./self.yaml"}, [], "`base:` chain loops back to itself"),
    ({"base": TINY, "train": 5}, ["train.steps=3"], "train is 5 in the config, not a section"),
    ({"base": TINY}, ["seed=1e23"], "seed=1e+23 is out of range"),
    ({"base": TINY}, ["train.steps=1e30"], "train.steps=1e+30 is out of range"),
    ({"base": TINY}, ["optim.lr=.nan"], "optim.lr must be a finite number, got nan"),
    ({"base": TINY}, ["optim.lr=.inf"], "optim.lr must be a finite number, got inf"),
    ({"base": TINY}, ["reliability.spike_sigma=-.inf"], "must be a finite number, got -inf"),
    ({"base": TINY}, ["optim.lr=nan"], "optim.lr must be a finite number, got 'nan'"),
])
def test_bad_config_files_are_one_line_errors(capsys, tmp_path, content, overrides, needle):
    path = tmp_path / "self.yaml"
    path.write_bytes(content if isinstance(content, bytes) else yaml.safe_dump(content).encode())
    code, errors, err = _run_cli(capsys, "train", str(path), f"run_dir={tmp_path / 'run'}", *overrides)
    assert code == 2 and len(errors) == 1 and needle in errors[0], err
    assert not any("Traceback" in line for line in err)
    assert not (tmp_path / "run").exists()  # nothing written before the config is known good


def test_a_directory_as_config_is_one_line_error(capsys, tmp_path):
    code, errors, err = _run_cli(capsys, "train", str(tmp_path))
    assert code == 2 and len(errors) == 1 and "is a directory, not a YAML file" in errors[0], err


@pytest.mark.parametrize("overrides, sizes", [
    ([], {"data": 1, "fsdp": 8}),  # out of the box: parameters and Adam state sharded over all devices
    (["mesh.data=-1"], {"data": 8, "fsdp": 1}),  # pure data parallelism, one override away
    (["mesh.fsdp=2"], {"data": 4, "fsdp": 2}),  # fsdp sized: the rest is data parallel, as before
    (["mesh.tensor=2"], {"data": 1, "fsdp": 4, "tensor": 2}),
    (["mesh.data=2", "mesh.tensor=2"], {"data": 2, "fsdp": 2, "tensor": 2}),
    (["mesh.sequence=-1", "mesh.tensor=2"], {"data": 1, "fsdp": 1, "sequence": 4, "tensor": 2}),
])
def test_the_axis_that_fills_the_mesh(overrides, sizes):
    from maxtrain.config import MESH_AXES, resolve_mesh_shape
    cfg = load_config(None, ["model.n_layers=2", *overrides])
    got = resolve_mesh_shape(cfg.mesh, 8)
    assert got == {a: sizes.get(a, 1) for a in MESH_AXES}


def test_every_problem_of_a_config_is_reported_at_once(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: " + TINY + "\nmodel: {hidden_size: 512, d_model: abc}\noptim: {learning_rate: 0.1}\n")
    code, errors, err = _run_cli(capsys, "train", str(bad), "train.max_steps=10")
    assert code == 2 and len(errors) == 1, err
    assert errors[0].startswith("maxtrain: error: 4 problems: "), errors[0]
    for needle in ("unknown config key model.hidden_size; did you mean model.d_model?",
                   "model.d_model must be an integer, got 'abc'",
                   "unknown config key optim.learning_rate; did you mean optim.lr?",
                   "unknown config key train.max_steps; did you mean train.steps?"):
        assert needle in errors[0], errors[0]


def test_other_trainers_names_point_to_ours():
    from maxtrain.config import ALIASES
    assert set(ALIASES.values()) <= set(valid_keys())  # every alias names a real key
    for alias, key in (("num_layers", "model.n_layers"), ("intermediate_size", "model.d_ff"),
                       ("num_key_value_heads", "model.n_kv_heads"), ("gradient_accumulation_steps", "train.grad_accum")):
        section = key.split(".")[0] if "." in key else "train"
        with pytest.raises(ConfigError, match=f"unknown config key {section}.{alias}; did you mean {key}\\?"):
            load_config(TINY, [f"{section}.{alias}=1"])


def test_head_dim_is_never_floored_silently():
    with pytest.raises(ConfigError, match="model.d_model=100 is not divisible by model.n_heads=3; .*model.head_dim"):
        load_config(TINY, ["model.d_model=100", "model.n_heads=3", "model.n_kv_heads=1"])
    cfg = load_config(TINY, ["model.d_model=100", "model.n_heads=3", "model.n_kv_heads=1", "model.head_dim=32"])
    assert cfg.model.head_dim == 32  # an explicit head_dim need not divide d_model


def test_warmup_longer_than_the_run_warns(caplog):
    import logging
    with caplog.at_level(logging.WARNING, logger="maxtrain"):
        load_config(TINY, ["train.steps=10", "optim.warmup_steps=100", "optim.lr=1e-3"])
    assert any("optim.warmup_steps=100 is more than train.steps=10" in r.getMessage() and "never reaches" in
               r.getMessage() for r in caplog.records), caplog.records
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="maxtrain"):
        load_config(TINY, ["train.steps=100", "optim.warmup_steps=10"])
    assert not caplog.records


def test_print_config_is_the_resolved_config_without_jax(tmp_path):
    code = (f"import sys; from maxtrain import cli\n"
            f"assert cli.main(['train', {TINY!r}, '--print-config', 'train.steps=7', 'mesh.data=-1']) == 0\n"
            f"assert 'jax' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    (tmp_path / "c.yaml").write_text(r.stdout)
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg == load_config(TINY, ["train.steps=7", "mesh.data=-1"]) and cfg.mesh.data == -1


def test_dry_run_reports_shapes_and_state_memory_and_writes_nothing(capsys, tmp_path):
    from maxtrain.models import param_count
    run_dir = tmp_path / "never"
    overrides = [f"run_dir={run_dir}", "model.d_model=512", "model.n_heads=8", "mesh.data=1", "mesh.fsdp=8"]
    assert cli.main(["train", TINY, "--dry-run", *overrides]) == 0
    out = capsys.readouterr().out
    n = param_count(load_config(TINY, overrides))
    assert f"{n:,} parameters" in out and "fsdp=8 (8 x cpu)" in out
    # params f32 split 8 ways (the small replicated norm scales aside), AdamW's two moments likewise
    state = re.search(r"state/device ([\d.,]+) MiB = params ([\d.,]+) MiB \+ optimizer ([\d.,]+) MiB", out)
    assert state, out
    params, opt = float(state[2]), float(state[3])
    assert abs(params - 4 * n / 8 / 2**20) < 0.2 and abs(opt - 2 * params) < 0.2, out
    assert not run_dir.exists()
    # optim.groups freezing all but the embedding until step 5: no moments for the rest until then
    frozen = ["optim.groups=[{params: ^embed/, lr_scale: 2}, {params: ., frozen_until: 5}]"]
    assert cli.main(["train", TINY, "--dry-run", *overrides, *frozen]) == 0
    out = capsys.readouterr().out
    phases = re.search(r"by phase +from step 0: params ([\d.,]+) MiB \+ optimizer ([\d.,]+) (KiB|MiB); "
                       r"from step 5: params ([\d.,]+) MiB \+ optimizer ([\d.,]+) MiB", out)
    assert phases, out
    embed = load_config(TINY, overrides).model.vocab_size * 512 * 4 / 8 / 2**10  # KiB per device
    first = float(phases[2]) * (2**10 if phases[3] == "MiB" else 1)
    assert abs(first - 2 * embed) < 2 and float(phases[5]) == opt, out  # the embedding's two moments, then all
    assert f"optimizer {opt:.1f} MiB" in out.split("by phase")[0]  # the largest phase is what must fit
    # a freeze that ends at train.steps is never lifted: one phase, sized without the frozen moments
    steps = load_config(TINY, overrides).train.steps
    never = [f"optim.groups=[{{params: ^embed/, lr_scale: 2}}, {{params: ., frozen_until: {steps}}}]"]
    assert cli.main(["train", TINY, "--dry-run", *overrides, *never]) == 0
    out = capsys.readouterr().out
    assert "by phase" not in out and f"optimizer {float(phases[2]):.1f} {phases[3]}" in out, out


@pytest.mark.parametrize("argv", [
    ["train", TINY, "model.d_modle=64"],
    ["train", TINY, "data.path=/nonexistent/*.txt"],
    ["train", TINY, "train.eval_every=5"],
    ["inspect", TINY, "optim.learning_rate=1"],
    ["inspect", "--devices", "8", TINY, "model.n_heads=3"],
    ["convert", "hf-to-maxtrain", "/nonexistent/hf", "/tmp/never"],
    ["prepare", "--input", "/nonexistent/*.txt", "--output", "/tmp/never"],
])
def test_errors_come_before_jax_is_imported(argv):
    """A typo or a missing path is answered before the slow imports (jax, Orbax, grain): one line, exit 2.
    (`bench/startup.py` times these.)"""
    code = (f"import sys; from maxtrain import cli\n"
            f"rc = cli.main({argv!r})\n"
            f"slow = sorted(m for m in ('jax', 'orbax', 'grain') if m in sys.modules)\n"
            f"assert rc == 2 and not slow, (rc, slow)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x for x in r.stderr.splitlines() if x.startswith("maxtrain: error:")], r.stderr


def test_every_invalid_value_is_reported_at_once(capsys, tmp_path):
    code, errors, err = _run_cli(capsys, "train", TINY, f"run_dir={tmp_path}", "model.remat=fast",
                                 "optim.min_lr_ratio=2", "checkpoint.keep=0", "mesh.tensor=0",
                                 "sharding.params.embed=fsdb")
    assert code == 2 and len(errors) == 1, err
    assert errors[0].startswith("maxtrain: error: 5 problems: "), errors[0]
    for needle in ("model.remat='fast' is not valid", "optim.min_lr_ratio must be in [0, 1]",
                   "checkpoint.keep >= 1", "mesh.tensor=0 must be a positive integer",
                   "sharding.params.embed='fsdb' is not a mesh axis"):
        assert needle in errors[0], errors[0]
    # a size that later checks divide by stops those checks, not the run of the others
    code, errors, _ = _run_cli(capsys, "train", TINY, "train.grad_accum=0", "mesh.pipeline=0", "model.moe={every: 0}")
    assert code == 2 and "train.grad_accum must be a positive integer" in errors[0] and "mesh.pipeline=0" in errors[0]


# documented null sizes resolve as the docs say (tests/test_special_values.py has the other special values)


def test_null_model_sizes_take_their_documented_defaults():
    cfg = load_config(None, ["model.d_model=96", "model.n_heads=6", "model.n_layers=2"])
    assert (cfg.model.n_kv_heads, cfg.model.head_dim) == (6, 16)  # null: n_heads; null: d_model / n_heads
    cfg = load_config(None, ["model.d_model=96", "model.n_heads=6", "model.n_kv_heads=2", "model.head_dim=8",
                             "model.n_layers=2"])
    assert (cfg.model.n_kv_heads, cfg.model.head_dim) == (2, 8)  # explicit values stay


def test_microbatches_null_is_one_per_stage():
    from maxtrain.config import pipeline_microbatches

    common = ["model.n_layers=4", "train.batch_size=8", "mesh.data=1", "mesh.fsdp=1"]
    assert pipeline_microbatches(load_config(None, common + ["mesh.pipeline=2"])) == 2  # null: mesh.pipeline
    assert pipeline_microbatches(load_config(None, common + ["mesh.pipeline=2", "train.microbatches=4"])) == 4
    assert pipeline_microbatches(load_config(None, common)) == 1


@pytest.mark.parametrize("key, meant", [
    ("optim.learnig_rate", "optim.lr"),  # another trainer's name, misspelt: as close as a key would need
    ("model.num_hidden_layer", "model.n_layers"),
    ("model.hidden_sise", "model.d_model"),
    ("train.batchsize", "train.batch_size"),  # our own key's spelling still wins where it is closer
    ("train.step", "train.steps"),
])
def test_a_misspelt_key_or_alias_suggests_the_key_it_means(key, meant):
    with pytest.raises(ConfigError, match=rf"unknown config key {re.escape(key)}; did you mean {re.escape(meant)}\?"):
        load_config(None, [f"{key}=1"])


def test_prepared_data_errors_come_before_anything_is_written(capsys, tmp_path, monkeypatch):
    """data.kind=tokens: a raw text file given as data.path says to run `maxtrain prepare`; a
    directory without a manifest is one line; both before the run directory is claimed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "empty").mkdir()
    run = ["train", TINY, "run_dir=run", "checkpoint.dir=ck", "train.steps=1", "data.kind=tokens"]
    code, errors, err = _run_cli(capsys, *run, "data.path=corpus.jsonl")
    assert code == 2 and len(errors) == 1, err
    assert "data.path=corpus.jsonl is a file (raw text?), not prepared tokens; run `maxtrain prepare" in errors[0]
    code, errors, err = _run_cli(capsys, *run, "data.path=[{path: empty, weight: 1}]")
    assert code == 2 and len(errors) == 1 and "empty/manifest.json not found" in errors[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "empty"]
