"""`maxtrain plan`: the layouts it considers, its memory estimate, and a plan on fake CPU devices
whose YAML trains."""

import json
import os
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE, ROOT, TINY
from maxtrain.analysis.plan import Candidate, activation_bytes, candidates, plan_yaml
from maxtrain.config import load_config


def test_candidates_divide_the_devices_heads_layers_and_batch():
    cfg = load_config(TINY, ["train.batch_size=8"])
    every = candidates(cfg, 8, per_host=8, supports_pipeline=True)
    assert every and len(set(every)) == len(every)
    for c in every:
        s = c.sizes
        assert s["data"] * s["fsdp"] * s["tensor"] * s["pipeline"] * s["expert"] * s["sequence"] == 8
        assert cfg.model.n_kv_heads % s["tensor"] == 0 and cfg.model.n_layers % s["pipeline"] == 0
        assert s["expert"] == 1  # a dense model
        per_step = cfg.train.batch_size // c.grad_accum
        assert per_step % (s["data"] * s["fsdp"] * (c.microbatches or 1)) == 0
        assert (c.microbatches is None) == (s["pipeline"] == 1)
    labels = {c.label() for c in every}
    assert "fsdp=8 remat=full" in labels and "data=8 remat=save_dots" in labels
    assert not candidates(cfg, 8, per_host=8, supports_pipeline=False)[0].sizes["pipeline"] > 1


def test_activation_estimate_orders_the_remat_policies_and_splits_over_devices():
    cfg = load_config(TINY, ["train.batch_size=8"])
    mesh = (("data", 1), ("pipeline", 1), ("fsdp", 8), ("expert", 1), ("sequence", 1), ("tensor", 1))
    full, dots, none = (activation_bytes(cfg, Candidate(mesh, r)) for r in ("full", "save_dots", "none"))
    assert 0 < full < dots < none
    # one sequence per device, the input of every layer in bf16
    assert full == 2 * cfg.model.d_model * cfg.train.seq_len * cfg.model.n_layers
    assert activation_bytes(cfg, Candidate(mesh, "full", grad_accum=2)) == full / 2


def test_plan_on_fake_devices_writes_a_config_that_trains(tmp_path):
    out = tmp_path / "plan.yaml"
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE.strip()}
    r = subprocess.run([sys.executable, "-m", "maxtrain.cli", "plan", TINY, "train.batch_size=8", "--devices", "8",
                        "--top", "2", "--out", str(out), "--json"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["compiled"] == 2 and result["ranked_by"] == "estimate" and result["best"]["fits"]
    assert "plan: [2/2]" in r.stderr  # progress, one line per compiled layout
    text = out.read_text()
    assert text.startswith("# maxtrain plan: ") and "mesh:" in text and "model:" in text
    cfg = load_config(str(out), [])
    for o in result["best"]["overrides"]:
        key, value = o.split("=", 1)
        section, name = key.split(".", 1)
        assert str(getattr(getattr(cfg, section), name)) == value, o
    run = subprocess.run([sys.executable, "-m", "maxtrain.cli", "train", str(out), "train.steps=2",
                          f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT,
                         env={**env, "XLA_FLAGS": FAST_COMPILE.strip() + " --xla_force_host_platform_device_count=8"},
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_plan_yaml_points_at_its_base_from_anywhere(tmp_path):
    best = {"layout": "fsdp=8 remat=full", "overrides": ["mesh.fsdp=8", "model.remat=full", "train.grad_accum=1"]}
    out = tmp_path / "deep" / "p.yaml"
    out.parent.mkdir()
    out.write_text(plan_yaml(TINY, best, str(out)))
    cfg = load_config(str(out), [])
    assert cfg.mesh.fsdp == 8 and cfg.model.remat == "full" and cfg.model.d_model == load_config(TINY).model.d_model


@pytest.mark.parametrize("argv, message", [(["--devices", "0"], "--devices must be >= 1"),
                                           (["--devices", "8", "--hosts", "3"], "does not divide")])
def test_plan_errors_are_one_line(argv, message, capsys):
    from maxtrain import cli

    assert cli.main(["plan", TINY, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
