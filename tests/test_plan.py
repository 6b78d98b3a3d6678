"""`maxtrain plan`: the layouts it considers, its memory estimate, and a plan on fake CPU devices
whose YAML trains."""

import json
import os
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE, ROOT, TINY
from maxtrain.analysis.plan import (Candidate, Hardware, _better, _refits, activation_bytes, candidates, estimate_s, memory_bytes,
                                    plan_yaml, working_bytes)
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


def _mesh(**sizes):
    return tuple((a, sizes.get(a, 1)) for a in ("data", "pipeline", "fsdp", "expert", "sequence", "tensor"))


def test_memory_estimate_is_state_gradients_activations_and_the_working_set():
    cfg = load_config(TINY, ["train.batch_size=8"])
    c = Candidate(_mesh(fsdp=8), "full")
    params, opt, n = 1000, 2000, 10_000
    layer = (n - 2 * cfg.model.vocab_size * cfg.model.d_model) / cfg.model.n_layers
    # float32 gradients the size of the parameters: the state is counted twice over params
    assert memory_bytes(cfg, c, params, opt, n) == (2 * params + opt + activation_bytes(cfg, c)
                                                    + working_bytes(cfg, c, max(layer, 0)))
    # twice the tokens per microbatch: more working set; half as many with accumulation
    big = load_config(TINY, ["train.batch_size=16"])
    assert working_bytes(big, c, 1e6) > working_bytes(cfg, c, 1e6)
    assert working_bytes(big, Candidate(_mesh(fsdp=8), "full", grad_accum=2), 1e6) == working_bytes(cfg, c, 1e6)
    # FSDP gathers layers (bf16, prefetched) and reduce-scatters their float32 gradients; a pipeline
    # stage gathers all its layers
    assert working_bytes(cfg, c, 1e6) - working_bytes(cfg, Candidate(_mesh(data=8), "full"), 1e6) == 6e6
    staged = Candidate(_mesh(pipeline=2, fsdp=4), "full", microbatches=2)
    assert working_bytes(cfg, staged, 1e6) - working_bytes(cfg, staged, 0) == cfg.model.n_layers / 2 * 1e6 * 2


def test_sequence_parallelism_splits_the_saved_residual_outside_pipelines_only():
    plain = load_config(TINY, ["train.batch_size=8"])
    seq = load_config(TINY, ["train.batch_size=8", "sharding.activations.length=[sequence,tensor]"])
    tp = Candidate(_mesh(fsdp=4, tensor=2), "full")
    assert activation_bytes(seq, tp) == activation_bytes(plain, tp) / 2
    staged = Candidate(_mesh(pipeline=2, fsdp=2, tensor=2), "full", microbatches=2)
    assert activation_bytes(seq, staged) == activation_bytes(plain, staged)


def test_step_estimate_charges_traffic_by_where_it_runs():
    cfg = load_config(TINY, ["train.batch_size=64", "train.seq_len=128"])
    hw = Hardware(peak_flops=1e15, link_bytes_s=450e9, network_bytes_s=50e9, latency_s=10e-6, per_host=8)
    flops, n = 1e12, 10**9

    def est(c, hw=hw):
        return estimate_s(cfg, c, flops, n, hw)

    compute = flops * 4 / 3 / 1e15
    assert est(Candidate(_mesh(data=1), "full")) == pytest.approx(compute)  # one device: compute only
    fsdp16 = Candidate(_mesh(fsdp=16), "full")
    # fsdp over 16 devices crosses 8-device hosts: the network, not NVLink
    assert est(fsdp16) > est(fsdp16, Hardware(1e15, 450e9, 50e9, 10e-6, per_host=16))
    # accumulation gathers the weights once per microbatch
    assert est(Candidate(_mesh(fsdp=16), "full", grad_accum=4)) > est(fsdp16)
    # tensor parallelism pays a latency per collective (4 per layer and pass); across hosts, the network
    tp = Candidate(_mesh(fsdp=4, tensor=4), "full")
    no_latency = Hardware(1e15, 450e9, 50e9, 0.0, per_host=8)
    assert est(tp) - est(tp, no_latency) == pytest.approx(4 * 4 * cfg.model.n_layers * 10e-6)
    assert est(fsdp16) == est(fsdp16, no_latency)  # no tensor collectives, no latency charged
    assert est(tp, Hardware(1e15, 450e9, 50e9, 10e-6, per_host=2)) > est(tp)
    # a pipeline's bubble: fewer microbatches, a longer step
    few, many = (Candidate(_mesh(pipeline=4, data=4), "full", microbatches=m) for m in (4, 16))
    assert est(few) > est(many)


def test_a_layout_just_over_memory_gets_its_fitting_sibling_compiled():
    fsdp8, fsdp4 = Candidate(_mesh(fsdp=8), "full", grad_accum=4), Candidate(_mesh(data=2, fsdp=4), "full", grad_accum=4)
    more_accum = Candidate(_mesh(fsdp=8), "full", grad_accum=8)
    tensor = Candidate(_mesh(fsdp=4, tensor=2), "full", grad_accum=2)
    rows = [{"fits": False, "memory_bytes": 66, "memory_estimate_bytes": 55, "predicted_step_s": 40.0,
             "kind": (1, "full")},
            {"fits": True, "memory_bytes": 50, "memory_estimate_bytes": 50, "predicted_step_s": 43.0,
             "kind": (2, "full")}]
    # (estimate, candidate, config, memory estimate); the compiled layout ran 1.2x over its estimate
    kept = [(1.0, fsdp4, None, 55), (2.0, fsdp8, None, 51), (3.0, more_accum, None, 45), (0.5, tensor, None, 30)]
    picked = _refits(rows, kept, {fsdp4}, limit=60, most=3)
    # fsdp8: 51 x 1.2 > 60; more_accum, 45 x 1.2, fits; tensor is another kind; fsdp4 is compiled
    assert [item[1] for item in picked] == [more_accum]
    # nothing to refit when the layouts that fit already predict better
    rows[1]["predicted_step_s"] = 39.0
    assert _refits(rows, kept, {fsdp4}, limit=60, most=3) == []


def test_the_layout_as_configured_wins_only_on_a_shorter_predicted_step():
    configured, pick = {"predicted_step_s": 9.0}, {"predicted_step_s": 10.0}
    assert _better(configured, pick, by_model=True) and not _better(pick, configured, by_model=True)
    assert not _better({"predicted_step_s": None}, pick, by_model=True)
    assert not _better(configured, pick, by_model=False)  # fake CPU devices: the candidates' estimate decides


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
    assert cfg.train.batch_size == 8  # the batch it planned for, not tiny.yaml's
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
    given = ["train.batch_size=24", "sharding.activations.length=[sequence, tensor]", "run_dir=elsewhere",
             "model.remat=save_dots"]
    out.write_text(plan_yaml(TINY, best, str(out), given))
    cfg = load_config(str(out), [])
    assert cfg.mesh.fsdp == 8 and cfg.model.d_model == load_config(TINY).model.d_model
    assert cfg.model.remat == "full"  # the plan's layout over what it was given
    # what the plan was given (the batch it planned for) stays in the config it writes
    assert cfg.train.batch_size == 24 and cfg.run_dir == "elsewhere"
    assert list(cfg.sharding.activations["length"]) == ["sequence", "tensor"]


@pytest.mark.parametrize("argv, message", [(["--devices", "0"], "--devices must be >= 1"),
                                           (["--devices", "8", "--hosts", "3"], "does not divide")])
def test_plan_errors_are_one_line(argv, message, capsys):
    from maxtrain import cli

    assert cli.main(["plan", TINY, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
