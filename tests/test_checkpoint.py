"""Checkpoints: exact resume, resharding, integrity and fallback, preemption, retention, errors."""

import errno
import fcntl
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import FAST_COMPILE, ROOT, SMALL, TINY
from maxtrain import cli, forward, load_checkpoint, load_config, train
from maxtrain.checkpoint import PREEMPTED_EXIT_CODE, Checkpointer, tree_checksums, verify_path
from maxtrain.config import ConfigError

# decay_steps pinned so a run stopped at step 10 follows the 20-step run's schedule exactly
BASE = SMALL + ["optim.decay_steps=20", "mesh.data=1", "mesh.fsdp=8", "model.n_kv_heads=4"]


def _run(tmp_path, name, *extra, devices=None):
    cfg = load_config(TINY, BASE + [f"run_dir={tmp_path / name}", *extra])
    return train(cfg, devices=devices)


def _losses(result, after=0):
    return [r["loss"] for r in result.history if r["step"] > after]


def _assert_same_params(a, b):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """20 uninterrupted steps on fsdp=8: the reference for every restart below."""
    return _run(tmp_path_factory.mktemp("straight"), "run", "train.steps=20")


@pytest.fixture(scope="module")
def ckpt_at_10(tmp_path_factory):
    """10 steps on fsdp=8 saving at 5 and 10."""
    tmp = tmp_path_factory.mktemp("ck10")
    result = _run(tmp, "run", "train.steps=10", f"checkpoint.dir={tmp / 'ck'}", "checkpoint.every=5")
    return tmp / "ck", result


def test_resume_is_bitwise_identical(straight, ckpt_at_10, tmp_path):
    ck, first_half = ckpt_at_10
    assert sorted(os.listdir(ck)) == ["10", "5"]
    assert {"manifest", "meta", "opt_state", "params"} <= set(os.listdir(ck / "10"))
    assert all("ckpt_block_s" in r for r in first_half.history)
    assert _losses(first_half) == _losses(straight)[:10]
    copy = tmp_path / "ck"
    subprocess.run(["cp", "-r", str(ck), str(copy)], check=True)
    resumed = _run(tmp_path, "resumed", "train.steps=20", f"checkpoint.dir={copy}", "checkpoint.every=5")
    assert resumed.start_step == 10
    assert [r["step"] for r in resumed.history][0] == 11
    assert _losses(resumed) == _losses(straight, after=10)  # bitwise: same floats
    _assert_same_params(resumed.state.params, straight.state.params)
    _assert_same_params(resumed.state.opt_state, straight.state.opt_state)


@pytest.mark.parametrize("mesh", [["mesh.fsdp=2", "mesh.tensor=4"], ["mesh.fsdp=1"]])
def test_restore_onto_another_mesh(straight, ckpt_at_10, tmp_path, mesh):
    ck, first_half = ckpt_at_10
    devices = jax.devices()[:1] if mesh == ["mesh.fsdp=1"] else None
    resumed = _run(tmp_path, "resharded", "train.steps=11", f"checkpoint.resume_from={ck}/10", *mesh,
                   devices=devices)
    assert resumed.start_step == 10
    np.testing.assert_allclose(_losses(resumed), _losses(straight)[10:11], rtol=2e-5)
    wq = resumed.state.params["layers"]["wq"]
    if devices is None:
        assert wq.sharding.shard_shape(wq.shape) == (2, 32, 1, 16)  # embed over fsdp=2, heads over tensor=4
    else:
        assert len(wq.sharding.device_set) == 1


def test_a_run_started_from_resume_from_path_restarts_from_its_own_checkpoints(ckpt_at_10, tmp_path):
    """`resume_from=PATH` seeds a run; rerunning the same command after a crash or preemption
    continues from the run's own newest checkpoint instead of refusing to overwrite it."""
    ck, _ = ckpt_at_10
    same = [f"checkpoint.resume_from={ck}/5", f"checkpoint.dir={tmp_path / 'mine'}", "checkpoint.every=1"]
    first = _run(tmp_path, "a", "train.steps=7", *same)
    assert first.start_step == 5
    again = _run(tmp_path, "a", "train.steps=8", *same)
    assert again.start_step == 7 and [r["step"] for r in again.history] == [8]


def test_params_restore_into_another_param_dtype(ckpt_at_10, tmp_path):
    """float32 params saved, bfloat16 asked for (`train.param_dtype`): read as saved, verified
    against their checksums, then cast, rather than every checkpoint failing verification."""
    ck, first_half = ckpt_at_10
    fine = _run(tmp_path, "bf16", "train.steps=1", f"checkpoint.init_from={ck}/10", "train.param_dtype=bfloat16")
    assert fine.start_step == 0 and fine.state.params["layers"]["wq"].dtype == jax.numpy.bfloat16
    ckpt = Checkpointer(str(ck), read_only=True)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jax.numpy.bfloat16, sharding=a.sharding),
                            first_half.state.params)
    r = ckpt.restore(10, abstract)
    np.testing.assert_array_equal(np.asarray(r.params["layers"]["wq"]),
                                  np.asarray(first_half.state.params["layers"]["wq"].astype(jax.numpy.bfloat16)))


def test_resume_with_other_data_settings_is_refused(ckpt_at_10, tmp_path, caplog):
    """The data position is step x batch of a stream fixed by seed, seq_len and the data: resuming
    with another batch size would skip examples, so it is a one-line error unless allowed."""
    ck, _ = ckpt_at_10
    copy = tmp_path / "ck"
    subprocess.run(["cp", "-r", str(ck), str(copy)], check=True)
    with pytest.raises(ConfigError, match=r"other data settings \(seed: 0 -> 1; train.batch_size: 16 -> 8\)"):
        _run(tmp_path, "r", "train.steps=11", f"checkpoint.dir={copy}", "train.batch_size=8", "seed=1")
    with caplog.at_level(logging.WARNING, logger="maxtrain"):
        allowed = _run(tmp_path, "r", "train.steps=11", f"checkpoint.dir={copy}", "train.batch_size=8",
                       "checkpoint.allow_data_change=true", "checkpoint.every=0")
    assert allowed.start_step == 10 and any("other data settings" in r.getMessage() for r in caplog.records)


def test_params_only_restore_and_load_checkpoint(ckpt_at_10, tmp_path, caplog):
    ck, first_half = ckpt_at_10
    fine = _run(tmp_path, "fine", "train.steps=2", f"checkpoint.init_from={ck}")
    assert fine.start_step == 0
    assert int(jax.device_get(fine.state.opt_state[1][0].count)) == 2  # a fresh optimizer
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cfg, params = load_checkpoint(str(ck))
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no "Given directory is read only"
    _assert_same_params(params, first_half.state.params)
    assert cfg.train.steps == 10 and cfg.mesh.fsdp == 8
    logits = forward(cfg, params, np.zeros((1, 8), np.int32))
    assert logits.shape == (1, 8, 128)
    cfg5, params5 = load_checkpoint(str(ck / "5"))
    assert not np.array_equal(np.asarray(params5["layers"]["wq"]), np.asarray(params["layers"]["wq"]))


def _largest_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "params").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_latest_falls_back_to_previous(ckpt_at_10, tmp_path, caplog, damage):
    ck, _ = ckpt_at_10
    copy = tmp_path / "ck"
    subprocess.run(["cp", "-r", str(ck), str(copy)], check=True)
    target = _largest_file(copy / "10")
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    target.write_bytes(bytes(data))
    bad = dict(verify_path(str(copy)))
    assert bad[5] is None and bad[10] is not None
    with caplog.at_level(logging.WARNING, logger="maxtrain"):
        resumed = _run(tmp_path, "resumed", "train.steps=12", f"checkpoint.dir={copy}", "checkpoint.every=0",
                       "checkpoint.keep=1")
    assert resumed.start_step == 5
    warnings = [r.getMessage() for r in caplog.records if "is corrupt" in r.getMessage()]
    assert len(warnings) == 1 and "/10 is corrupt" in warnings[0] and "\n" not in warnings[0]
    # keep=1: the final save at 12 is the newest; step 5 (restored from, verified) survives
    assert sorted(int(s) for s in os.listdir(copy) if s.isdigit()) == [5, 12]


def test_a_committed_step_is_complete_without_any_later_write(monkeypatch, tmp_path):
    """The checksums are committed with the arrays: once Orbax lists a step it verifies, even if the
    process dies before any of our code runs after the commit (the background thread never runs)."""
    monkeypatch.setattr(Checkpointer, "_commit", lambda self, step: None)
    params = {"w": jax.numpy.arange(12.0).reshape(3, 4), "b": jax.numpy.ones(3, jax.numpy.bfloat16)}
    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save(7, params, None, {"seed": 0})
    ck._mgr.wait_until_finished()  # Orbax's commit, and nothing of ours after it
    fresh = Checkpointer(str(tmp_path / "ck"), read_only=True)
    assert fresh.steps() == [7]
    fresh.verify(7)
    assert verify_path(str(tmp_path / "ck")) == [(7, None)]


def test_closing_after_an_error_commits_the_save_and_talks_to_no_other_process(monkeypatch, tmp_path):
    """A run ending on an error (maybe on one process alone) must not enter a collective while the
    other processes are still stepping: `close(failed=True)` lets the in-flight save commit and
    skips retention, whose step list is agreed across processes; the next start applies it."""
    from maxtrain.checkpoint import manager
    from maxtrain.config import CheckpointConfig

    params = {"w": jax.numpy.arange(6.0)}
    ck = Checkpointer(str(tmp_path / "ck"), CheckpointConfig(dir=str(tmp_path / "ck"), keep=1))
    ck.save(1, params, None, {"seed": 0}, wait=True)
    ck.save(2, params, None, {"seed": 0})  # in flight

    def collective(steps):
        raise AssertionError("a collective during clean-up after an error")
    monkeypatch.setattr(manager, "same_on_all_processes", collective)
    ck.close(failed=True)
    monkeypatch.undo()
    assert Checkpointer(str(tmp_path / "ck"), read_only=True).steps() == [1, 2]  # committed; keep=1 not applied


def test_an_async_save_returns_before_its_background_work(monkeypatch, tmp_path):
    """An async save blocks for the checksums and the copy off the devices only. Orbax's commit (the
    rename of its temporary directory) and the removal of the checkpoint retention drops are held
    back here until save() has returned: a save() that waited for either would never return."""
    import shutil
    import threading

    from maxtrain.checkpoint import TRASH
    from maxtrain.config import CheckpointConfig

    ck_dir = tmp_path / "ck"
    params = {"w": jax.numpy.arange(12.0).reshape(3, 4), "b": jax.numpy.ones(3, jax.numpy.bfloat16)}
    ck = Checkpointer(str(ck_dir), CheckpointConfig(dir=str(ck_dir), keep=1))
    ck.save(1, params, None, {"seed": 0}, wait=True)
    ck.save(2, params, None, {"seed": 0})
    ck.wait(retention=False)  # as the loop leaves it: step 1 goes at the next save's start

    release, held = threading.Event(), []

    def gated(kind, real, applies):
        def fn(path, *a, **k):
            if str(ck_dir) in str(path) and applies(str(path)):
                held.append(kind)
                release.wait(timeout=300)
            return real(path, *a, **k)
        return fn

    monkeypatch.setattr(os, "rename", gated("commit", os.rename, lambda p: ".orbax-checkpoint-tmp" in p))
    monkeypatch.setattr(shutil, "rmtree", gated("delete", shutil.rmtree, lambda p: True))
    saver = threading.Thread(target=ck.save, args=(3, params, None, {"seed": 0}), daemon=True)
    saver.start()
    saver.join(timeout=120)  # seconds where it needs well under one: only a save that waits stays
    try:
        assert not saver.is_alive(), f"save() waited for its background work (held: {held})"
        assert set(ck.last_save_phases) <= {"previous", "retention", "listing", "ready", "checksum", "orbax",
                                            "thread"}
    finally:
        release.set()
    ck.wait(retention=False)
    assert set(held) == {"commit", "delete"}, held  # both really ran, after save() had returned
    assert sorted(n for n in os.listdir(ck_dir) if n != "maxtrain.lock") == ["2", "3"]  # step 1 and its trash gone
    Checkpointer(str(ck_dir), read_only=True).verify(3)
    ck.close()  # retention (keep=1) drops step 2: nothing of it, nor of the trash, is left
    monkeypatch.undo()
    assert sorted(os.listdir(ck_dir)) == ["3"] and Checkpointer(str(ck_dir), read_only=True).steps() == [3]
    assert not (ck_dir / TRASH).exists()


def test_a_step_saved_with_a_manifest_file_still_restores(ckpt_at_10, tmp_path):
    """Checkpoints of earlier versions kept the checksums in `manifest.json`, written after the commit."""
    ck, first_half = ckpt_at_10
    copy = tmp_path / "ck"
    subprocess.run(["cp", "-r", str(ck), str(copy)], check=True)
    step = copy / "10"
    manifest = json.loads((step / "manifest" / "metadata").read_text())
    subprocess.run(["rm", "-r", str(step / "manifest")], check=True)
    assert Checkpointer(str(copy), read_only=True).steps() == [5]  # neither: not a checkpoint
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert Checkpointer(str(copy), read_only=True).steps() == [5, 10]
    _, params = load_checkpoint(str(step))
    _assert_same_params(params, first_half.state.params)
    manifest["checksums"]["params/final_norm/scale"] = [0, 0]
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert "checksum mismatch in params/final_norm/scale" in dict(verify_path(str(copy)))[10]


def test_checksums_see_bit_flips_and_moves():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    base = np.asarray(tree_checksums({"x": x})["x"])
    flipped = x.copy()
    flipped.view(np.uint32)[1, 2] ^= 1
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert not np.array_equal(base, np.asarray(tree_checksums({"x": flipped})["x"]))
    assert not np.array_equal(base, np.asarray(tree_checksums({"x": swapped})["x"]))
    sharded = jax.device_put(x, jax.sharding.NamedSharding(
        jax.make_mesh((4,), ("a",), axis_types=(jax.sharding.AxisType.Auto,)), jax.sharding.PartitionSpec(None, "a")))
    np.testing.assert_array_equal(base, np.asarray(tree_checksums({"x": sharded})["x"]))


def test_retention_keeps_newest_and_keep_every(tmp_path):
    ck = tmp_path / "ck"
    _run(tmp_path, "run", "train.steps=10", f"checkpoint.dir={ck}", "checkpoint.every=2", "checkpoint.keep=2",
         "checkpoint.keep_every=4")
    assert sorted(int(s) for s in os.listdir(ck) if s.isdigit()) == [4, 8, 10]


def test_failed_save_is_reported_and_training_continues(tmp_path, caplog, monkeypatch):
    real_save = ocp.CheckpointManager.save

    def flaky(self, step, *a, **k):
        if step == 4:
            raise OSError(28, "No space left on device")
        return real_save(self, step, *a, **k)

    monkeypatch.setattr(ocp.CheckpointManager, "save", flaky)
    ck = tmp_path / "ck"
    with caplog.at_level(logging.ERROR, logger="maxtrain"):
        result = _run(tmp_path, "run", "train.steps=6", f"checkpoint.dir={ck}", "checkpoint.every=2")
    assert result.history[-1]["step"] == 6
    assert any("save at step 4 failed" in r.getMessage() and "No space" in r.getMessage() for r in caplog.records)
    assert not any("step 6 failed" in r.getMessage() for r in caplog.records)  # no stale re-raise
    assert sorted(int(s) for s in os.listdir(ck) if s.isdigit()) == [2, 6]


def test_bad_checkpoint_input_is_a_one_line_error(ckpt_at_10, tmp_path, capsys):
    ck, _ = ckpt_at_10
    copy = tmp_path / "ck"
    subprocess.run(["cp", "-r", str(ck), str(copy)], check=True)
    common = ["train", TINY, *BASE, f"run_dir={tmp_path / 'r'}", "train.steps=11"]
    assert cli.main(common + [f"checkpoint.dir={copy}", "model.d_model=96"]) == 2
    err = capsys.readouterr().err
    assert "maxtrain: error: checkpoint" in err and "is from a different model" in err and "(128, 64)" in err
    assert cli.main(common + [f"checkpoint.dir={copy}", "optim.clip_norm=null"]) == 2
    assert "different optimizer state layout" in capsys.readouterr().err
    assert cli.main(common + [f"checkpoint.resume_from={tmp_path}/nope"]) == 2
    assert "checkpoint.resume_from=" in capsys.readouterr().err
    # starting over, or rolling back to step 5, would write over checkpoints that exist
    assert cli.main(common + [f"checkpoint.dir={copy}", "checkpoint.resume_from=none"]) == 2
    assert "already holds checkpoints at steps 5, 10" in capsys.readouterr().err
    assert cli.main(common + [f"checkpoint.dir={copy}", f"checkpoint.resume_from={copy}/5"]) == 2
    assert "at steps 10 after the starting step 5" in capsys.readouterr().err
    assert cli.main(["checkpoint", "verify", str(copy)]) == 0
    assert "step 10: ok" in capsys.readouterr().out
    assert cli.main(["checkpoint", "verify", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------- real processes and signals

ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2" + FAST_COMPILE, "PYTHONUNBUFFERED": "1"}
PROC = ["model.d_model=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=256",
        "model.vocab_size=256", "train.batch_size=4", "train.seq_len=32", "train.dtype=float32",
        "data.kind=synthetic", "mesh.data=1", "mesh.fsdp=2", "train.log_every=1", "optim.decay_steps=400"]


def _start(tmp_path, *extra):
    cmd = [sys.executable, "-m", "maxtrain.cli", "train", TINY, *PROC, f"run_dir={tmp_path / 'run'}",
           f"checkpoint.dir={tmp_path / 'ck'}", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, timeout=120.0):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _logged_steps(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


def test_sigterm_saves_then_exits_with_preempted_code_and_resumes(tmp_path):
    proc = _start(tmp_path, "train.steps=400", "checkpoint.every=1000")
    assert _wait_for(lambda: len(_logged_steps(tmp_path)) >= 3), proc.kill() or proc.communicate()[0]
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # a second signal during the save must not corrupt it
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, out[-3000:]
    saved = [int(s) for s in os.listdir(tmp_path / "ck") if s.isdigit()]
    assert len(saved) == 1 and saved[0] == _logged_steps(tmp_path)[-1], out[-3000:]
    assert all(err is None for _, err in verify_path(str(tmp_path / "ck")))
    n = saved[0]
    r = subprocess.run([sys.executable, "-m", "maxtrain.cli", "train", TINY, *PROC, f"run_dir={tmp_path / 'run'}",
                        f"checkpoint.dir={tmp_path / 'ck'}", f"train.steps={n + 2}"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _logged_steps(tmp_path)[-2:] == [n + 1, n + 2]


def test_sigkill_during_async_save_restarts_from_last_complete(tmp_path):
    proc = _start(tmp_path, "train.steps=400", "checkpoint.every=1", "checkpoint.keep=2")
    ck = tmp_path / "ck"

    def saving():
        return ck.is_dir() and any("tmp" in n for n in os.listdir(ck)) and any(n.isdigit() for n in os.listdir(ck))

    assert _wait_for(saving), proc.kill() or proc.communicate()[0]
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    complete = sorted(int(s) for s in os.listdir(ck) if s.isdigit() and (ck / s / "manifest").is_dir())
    assert complete
    r = subprocess.run([sys.executable, "-m", "maxtrain.cli", "train", TINY, *PROC, f"run_dir={tmp_path / 'run'}",
                        f"checkpoint.dir={ck}", f"train.steps={complete[-1] + 3}", "checkpoint.every=1"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {ck}/{complete[-1]}" in r.stderr
    assert not any("tmp" in n for n in os.listdir(ck))  # the partial save was cleaned up
    assert _logged_steps(tmp_path)[-1] == complete[-1] + 3


# ---------------------------------------------------------------- one owner per checkpoint directory

HOLD_LOCK = ("import sys, time; from maxtrain.checkpoint import DirectoryLock; "
             "DirectoryLock(sys.argv[1], sys.argv[2]).acquire(); print('locked', flush=True); time.sleep(600)")


def test_a_second_run_on_a_checkpoint_dir_is_refused_and_a_killed_owner_is_taken_over(tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck"
    ck.mkdir()
    partial = ck / "7.orbax-checkpoint-tmp-1234"  # the owner's save in flight: a second run must not clean it
    partial.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MAXTRAIN_JOB_ID", "SLURM_JOB_ID", "JOBSET_NAME")}
    owner = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(ck), str(tmp_path / "owner_run")], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "locked"
        code = cli.main(["train", TINY, *BASE, "train.steps=2", f"run_dir={tmp_path / 'r'}", f"checkpoint.dir={ck}"])
        err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("maxtrain: error")]
        assert code == 2 and len(err) == 1, err
        assert f"checkpoint.dir {ck} is in use by another run (pid {owner.pid} on" in err[0], err
        assert "owner_run" in err[0] and "its own checkpoint.dir" in err[0], err
        assert partial.is_dir() and not (tmp_path / "r").exists()
    finally:
        owner.kill()  # SIGKILL: the kernel drops its flock, its record stays behind
        owner.wait()
    from maxtrain.checkpoint import LOCK_FILE, DirectoryLock
    same_job = {**env, "MAXTRAIN_JOB_ID": "job-1"}  # an earlier attempt of this job, still alive: refused too
    owner = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(ck), str(tmp_path / "owner_run")], env=same_job,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "locked"
        monkeypatch.setenv("MAXTRAIN_JOB_ID", "job-1")
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {owner.pid} on .*MAXTRAIN_JOB_ID=job-1"):
            DirectoryLock(str(ck)).acquire()
    finally:
        monkeypatch.delenv("MAXTRAIN_JOB_ID", raising=False)
        owner.kill()
        owner.wait()
    assert (ck / LOCK_FILE).exists()
    lock = DirectoryLock(str(ck)).acquire()  # logs through the handler cli.main installed (captured stderr)
    taken = [x for x in capsys.readouterr().err.splitlines() if "taking over the lock" in x]
    assert len(taken) == 1 and f"of pid {owner.pid} on" in taken[0] and "no longer running" in taken[0], taken
    assert json.loads((ck / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (ck / LOCK_FILE).exists()


@pytest.mark.parametrize("case", ["fresh", "stale", "same_job"])
def test_an_owner_on_another_host_is_judged_by_its_heartbeat_or_job(tmp_path, monkeypatch, case):
    """Filesystems whose locks do not reach across hosts: the record and its heartbeat decide."""
    from maxtrain.checkpoint import LOCK_FILE, LOCK_STALE_S, DirectoryLock
    monkeypatch.setenv("MAXTRAIN_JOB_ID", "job-b")
    path = tmp_path / LOCK_FILE
    record = {"host": "node-elsewhere", "pid": 4242, "job": "MAXTRAIN_JOB_ID=" + ("job-b" if case == "same_job"
                                                                                  else "job-a"), "started": 0}
    path.write_text(json.dumps(record))
    if case == "stale":
        old = time.time() - LOCK_STALE_S - 60
        os.utime(path, (old, old))
    if case == "fresh":
        with pytest.raises(ConfigError, match=r"pid 4242 on node-elsewhere, MAXTRAIN_JOB_ID=job-a.*heartbeat is \d+s old"):
            DirectoryLock(str(tmp_path)).acquire()
        assert json.loads(path.read_text()) == record  # untouched
        return
    lock = DirectoryLock(str(tmp_path)).acquire()
    assert json.loads(path.read_text())["job"] == "MAXTRAIN_JOB_ID=job-b"
    lock.release()


def test_an_edited_meta_fails_verification_and_is_not_trusted(ckpt_at_10, tmp_path, capsys):
    """The manifest covers the meta item (config, seed, data position) as it covers the arrays."""
    ck, _ = ckpt_at_10
    copy = tmp_path / "ck"
    subprocess.run(["cp", "-r", str(ck), str(copy)], check=True)
    meta_file = copy / "10" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["config"]["model"]["rope_theta"] = 12345.0
    meta_file.write_text(json.dumps(meta))
    assert cli.main(["checkpoint", "verify", str(copy)]) == 2
    out = capsys.readouterr().out
    assert "step 5: ok" in out and "step 10: CORRUPT: meta (config, seed, data position) does not match" in out, out
    cfg, _ = load_checkpoint(str(copy))  # the config of step 5, never the edited one
    assert cfg.model.rope_theta == 10000.0


def _hang_a_read(step_dir: Path) -> None:
    """The step's largest array file becomes a FIFO: opening it blocks (a hung network filesystem)."""
    victim = _largest_file(step_dir)
    victim.unlink()
    os.mkfifo(victim)


def test_a_hung_checkpoint_read_is_bounded_and_signals_still_stop_it(tmp_path):
    ck = tmp_path / "ck"
    train(load_config(TINY, PROC + ["train.steps=2", f"run_dir={tmp_path / 'first'}", f"checkpoint.dir={ck}"]),
          devices=jax.devices()[:2])
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(ck), str(damaged)], check=True)
    victim = _largest_file(damaged / "2")
    victim.write_bytes(victim.read_bytes()[:50])
    verify = subprocess.run([sys.executable, "-m", "maxtrain.cli", "checkpoint", "verify", str(damaged)],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert verify.returncode == 2 and verify.stdout.startswith("step 2: CORRUPT: unreadable"), verify
    assert verify.stderr.strip().splitlines() == [f"maxtrain: error: 1 of 1 checkpoints under {damaged} are corrupt "
                                                  f"(steps 2)"], verify.stderr[-3000:]  # no asyncio aftermath

    _hang_a_read(ck / "2")
    verify = subprocess.run([sys.executable, "-m", "maxtrain.cli", "checkpoint", "verify", "--timeout", "3", str(ck)],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert verify.returncode == 76, verify.stderr[-3000:]
    assert f"checkpoint verify {ck} did not finish in" in verify.stderr and "Thread MainThread" in verify.stderr

    resume = _start(tmp_path, "train.steps=4", "reliability.restore_timeout_s=3")
    out, _ = resume.communicate(timeout=120)
    assert resume.returncode == 76 and "checkpoint restore (or initialisation) did not finish in" in out, out[-3000:]

    resume = _start(tmp_path, "train.steps=4")  # restore_timeout_s 1800: SIGTERM must still end it now
    lines = []
    for line in resume.stdout:
        lines.append(line)
        if "model llama" in line:
            break
    time.sleep(3)  # into the restore, blocked on the FIFO
    resume.send_signal(signal.SIGTERM)
    out = "".join(lines) + resume.communicate(timeout=60)[0]  # not the 1800 s restore limit
    assert resume.returncode == PREEMPTED_EXIT_CODE, out[-3000:]
    assert "received SIGTERM during checkpoint restore (or initialisation): nothing to save" in out, out[-3000:]


@pytest.mark.parametrize("message", [
    # the OS text beside its code, inside what the cut keeps
    'Error writing "1.0.count/0" in OCDBT database at local file "/ck/d/5279": Failed to write 2447538 bytes '
    "to file 9: No space left on device [os_error_code='28']",
    # the OS text far from its code: a spec's repr between them, longer than the cut keeps (seen in CI)
    'Error opening "zarr" driver: Error writing "1.0.mu.layers.w_down/.zarray" in OCDBT database at local file '
    '"' + "/tmp/x" * 40 + '": No space left on device [tensorstore_spec=\'{"driver":"zarr","metadata":{"chunks":'
    '[4,256,128]},"open":true,"recheck_cached_data":false,"store_data_equal_to_fill_value":true}\'] '
    "[os_error_code='28']",
    # a long line whose code comes last and whose OS text is missing altogether
    "Error writing " + "x" * 400 + " [os_error_code=28]",
])
def test_a_failed_saves_one_line_always_names_the_os_error(message):
    from maxtrain.checkpoint import one_line

    line = one_line(ValueError("RESOURCE_EXHAUSTED: " + message + "\nsecond line"))
    assert line.startswith("ValueError: RESOURCE_EXHAUSTED: Error") and "\n" not in line and len(line) < 400, line
    assert "No space left on device" in line, line


def test_close_removes_a_failed_saves_files_that_late_writers_still_create(tmp_path):
    """A failed save's other writes run on after its first error reaches us and re-create their
    directories (seen in CI as a `10.orbax-checkpoint-tmp` left after a full disk's run)."""
    import threading

    sentinel = tmp_path / "ck" / "9.orbax-checkpoint-tmp"  # a killed run's, which Orbax's start-up clean-up
    sentinel.mkdir(parents=True)  # removes in the background: once it is gone, that clean-up is done
    ck = Checkpointer(str(tmp_path / "ck"))
    assert _wait_for(lambda: not sentinel.exists(), timeout=30)
    ck._failed(10, ValueError("No space left on device [os_error_code=28]"))
    partial = tmp_path / "ck" / "10.orbax-checkpoint-tmp" / "ocdbt.process_0" / "d"
    other = tmp_path / "ck" / "11.orbax-checkpoint-tmp"  # a step whose save did not fail: not ours to remove
    other.mkdir()
    stop = time.monotonic() + 0.3

    def late_writer():
        i = 0
        while time.monotonic() < stop:
            partial.mkdir(parents=True, exist_ok=True)
            (partial / f"{i}").write_bytes(b"x")
            i += 1
            time.sleep(0.005)

    writer = threading.Thread(target=late_writer)
    writer.start()
    while not partial.exists():
        time.sleep(0.001)
    ck.close()
    writer.join()
    assert sorted(os.listdir(tmp_path / "ck")) == ["11.orbax-checkpoint-tmp"], os.listdir(tmp_path / "ck")


def test_close_after_a_failed_save_survives_its_directory_gone(tmp_path):
    """The run's last words must not be a traceback because someone removed checkpoint.dir."""
    import shutil

    ck = Checkpointer(str(tmp_path / "ck"))
    ck._failed(10, ValueError("Permission denied [os_error_code=13]"))
    shutil.rmtree(tmp_path / "ck")
    ck.close()
    assert not (tmp_path / "ck").exists()


def test_a_full_disk_fails_saves_cleanly_and_the_run_ends_naming_the_last_good_checkpoint(tmp_path):
    """A real full filesystem (an 8 MiB tmpfs holds two of this model's checkpoints, not three)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(ck)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        proc = _start(tmp_path, "train.steps=10", "checkpoint.every=2", "checkpoint.keep=5",
                      "reliability.compilation_cache=null")
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        failed = [x for x in out.splitlines() if "checkpoint save at step" in x and "failed" in x]
        assert failed and all("No space left on device" in x for x in failed), out[-3000:]
        good = sorted(int(n) for n in os.listdir(ck) if n.isdigit())
        assert good and sorted(os.listdir(ck)) == sorted(map(str, good)), os.listdir(ck)  # no partial saves left
        assert f"the checkpoint of step 10 could not be saved (see above); the newest good checkpoint is step " \
               f"{good[-1]}: {ck}/{good[-1]}" in out, out[-3000:]
        assert "checkpoint of step 10 saved" not in out and "Traceback" not in out, out[-3000:]
        assert all(err is None for _, err in verify_path(str(ck)))
    finally:
        subprocess.run(["umount", "-l", str(ck)], capture_output=True)


def test_a_save_error_keeps_its_os_cause_when_shortened():
    """TensorStore puts the OS error mid-line, before a long repr of the spec: the one-line report
    names it even when the middle is cut (a full disk's first failure was reported without it)."""
    from maxtrain.checkpoint import one_line

    spec = '{"driver": "zarr", ' * 30 + '"open": true}'
    err = ValueError('RESOURCE_EXHAUSTED: Error opening "zarr" driver: Error writing "1.0.nu/.zarray": Failed to '
                     f"write 263256 bytes to file 9: No space left on device [os_error_code='28'] {spec}")
    line = one_line(err)
    assert len(line) < 400 and " ... " in line and line.endswith("(cause: No space left on device)")
    assert one_line(ValueError("disk: Permission denied [os_error_code=13]")).count("Permission denied") == 1


# The takeover rules as a table. Oracle: the rules of docs/reliability.md#one-run-per-checkpoint-directory
# and DirectoryLock's docstring, written row by row as the expected outcome (not read from the code):
#   the holder is this very process (this host AND this pid)        -> take over (it never released it)
#   its flock is held by another open file                          -> refuse (alive, whatever it records)
#   the same job (a non-empty job id equal to ours)                 -> take over (an earlier attempt)
#   this host: the flock is free (recorded pid reused or not)       -> take over (the kernel dropped it)
#   this host, no flock on the filesystem: its pid alive / gone     -> refuse / take over
#   another host (its pid says nothing here, ours included):
#     heartbeat (the file's mtime) older than 300 s / fresher        -> take over / refuse
# A record no one can read counts as someone else's, on an unknown host.
STALE_S = 300  # docs/reliability.md: "its heartbeat (the file's mtime) is older than 300 s"
LOCK_ROWS = [
    # (name, holder host, holder pid, holder job, our job, heartbeat age s, flock, expected)
    ("this_process_flock_free", "here", "me", None, None, 5, "free", "take"),
    ("this_process_its_own_fd_holds_the_flock", "here", "me", None, None, 5, "held", "take"),
    ("here_dead_pid_flock_free", "here", "dead", None, None, 5, "free", "take"),
    ("here_recycled_pid_flock_free", "here", "alive", None, None, 5, "free", "take"),
    ("here_alive_pid_flock_held", "here", "alive", None, None, 5, "held", "refuse"),
    ("here_dead_pid_flock_held", "here", "dead", None, None, 5, "held", "refuse"),
    ("here_stale_heartbeat_flock_held", "here", "dead", None, None, 3600, "held", "refuse"),
    ("here_alive_pid_no_flock", "here", "alive", None, None, 3600, "none", "refuse"),
    ("here_init_pid_no_flock", "here", 1, None, None, 3600, "none", "refuse"),
    ("here_dead_pid_no_flock", "here", "dead", None, None, 5, "none", "take"),
    ("other_host_our_pid_fresh", "other", "me", None, None, 5, "free", "refuse"),
    ("other_host_our_pid_fresh_no_flock", "other", "me", None, None, 5, "none", "refuse"),
    ("other_host_our_pid_stale", "other", "me", None, None, STALE_S + 30, "free", "take"),
    ("other_host_pid_dead_here_fresh", "other", "dead", None, None, 5, "free", "refuse"),
    ("other_host_just_under_stale", "other", 4242, None, None, STALE_S - 30, "free", "refuse"),
    ("other_host_just_over_stale", "other", 4242, None, None, STALE_S + 30, "free", "take"),
    ("other_host_stale_no_flock", "other", 4242, None, None, STALE_S + 30, "none", "take"),
    ("other_host_stale_flock_held", "other", 4242, None, None, STALE_S + 30, "held", "refuse"),
    ("same_job_other_host_fresh", "other", 4242, "job-b", "job-b", 5, "free", "take"),
    ("same_job_here_alive_pid_flock_free", "here", "alive", "job-b", "job-b", 5, "free", "take"),
    ("same_job_flock_held", "other", 4242, "job-b", "job-b", 5, "held", "refuse"),
    ("other_job_other_host_fresh", "other", 4242, "job-a", "job-b", 5, "free", "refuse"),
    ("other_job_here_alive_pid_no_flock", "here", "alive", "job-a", "job-b", 5, "none", "refuse"),
    ("no_job_on_either_side_other_host_fresh", "other", 4242, None, None, 5, "free", "refuse"),
    ("unreadable_fresh", "garbage", None, None, None, 5, "free", "refuse"),
    ("unreadable_stale", "garbage", None, None, None, STALE_S + 30, "free", "take"),
    ("unreadable_stale_flock_held", "garbage", None, None, None, STALE_S + 30, "held", "refuse"),
]


@pytest.fixture(scope="module")
def lock_pids():
    """A pid alive on this host that is not this process (a sleeper: a recycled pid, as far as a
    stale record can tell) and one that is gone (a child that exited and was reaped)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    yield {"me": os.getpid(), "alive": sleeper.pid, "dead": gone.pid}
    sleeper.kill()
    sleeper.wait()


@pytest.mark.parametrize("row", LOCK_ROWS, ids=[r[0] for r in LOCK_ROWS])
def test_lock_takeover_follows_the_documented_rules(row, lock_pids, tmp_path, monkeypatch, caplog):
    from maxtrain.checkpoint import LOCK_FILE, lock_directory

    name, host, pid, job, ours, age, flock, expected = row
    for var in ("MAXTRAIN_JOB_ID", "SLURM_JOB_ID", "JOBSET_NAME"):
        monkeypatch.delenv(var, raising=False)
    if ours:
        monkeypatch.setenv("MAXTRAIN_JOB_ID", ours)
    path = tmp_path / LOCK_FILE
    here = socket.gethostname()
    pid = lock_pids.get(pid, pid)
    if host == "garbage":
        path.write_bytes(b"\x00\x9f not json")
        holder = None
    else:
        holder = {"host": here if host == "here" else f"{here}-elsewhere", "pid": pid,
                  "job": f"MAXTRAIN_JOB_ID={job}" if job else None, "started": time.time() - 7200,
                  "run_dir": str(tmp_path / "owner_run"), "token": "the-holder"}
        path.write_text(json.dumps(holder))
    before = path.read_bytes()
    when = time.time() - age
    os.utime(path, (when, when))
    held = None
    if flock == "held":  # another open file description holds it (as the live owner's would)
        held = os.open(path, os.O_RDWR)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    elif flock == "none":  # a filesystem without locks
        def no_locks(fd, op):
            raise OSError(errno.ENOLCK, "No locks available")
        monkeypatch.setattr(fcntl, "flock", no_locks)
    try:
        if expected == "refuse":
            with pytest.raises(ConfigError) as refused:
                lock_directory(str(tmp_path), str(tmp_path / "me_run"))
            message = str(refused.value)
            assert f"checkpoint.dir {tmp_path} is in use by another run" in message, message
            if holder is not None:  # the refusal names the holder: pid, host, job, start, run_dir
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
                assert f"(pid {pid} on {holder['host']}" in message and started in message, message
                assert "owner_run" in message and (not job or f"MAXTRAIN_JOB_ID={job}" in message), message
            if host != "here" and flock != "held":  # judged by its heartbeat: says how long it must age
                seen = re.search(r"heartbeat is (\d+)s old.* wait (\d+)s or delete", message)
                assert seen and abs(int(seen[1]) - age) <= 2 and abs(int(seen[2]) - (STALE_S - age)) <= 2, message
            assert path.read_bytes() == before  # the holder's record is untouched
        else:
            caplog.clear()
            lock = lock_directory(str(tmp_path), str(tmp_path / "me_run"))
            try:
                record = json.loads(path.read_text())
                assert (record["host"], record["pid"]) == (here, os.getpid()) and "me_run" in record["run_dir"]
                taken = [r.getMessage() for r in caplog.records if "taking over the lock" in r.getMessage()]
                assert len(taken) == 1, taken
                if holder is not None:
                    assert f"of pid {pid} on {holder['host']}" in taken[0], taken
            finally:
                lock.release()
    finally:
        if held is not None:
            os.close(held)


def test_a_lock_releases_only_while_it_is_still_the_owner(tmp_path, monkeypatch):
    """A second lock of this very process takes the directory over (the first never released it);
    the first's release then leaves the second's lock file alone; the second's removes it."""
    from maxtrain.checkpoint import LOCK_FILE, DirectoryLock

    for var in ("MAXTRAIN_JOB_ID", "SLURM_JOB_ID", "JOBSET_NAME"):
        monkeypatch.delenv(var, raising=False)
    first = DirectoryLock(str(tmp_path), str(tmp_path / "first")).acquire()
    second = DirectoryLock(str(tmp_path), str(tmp_path / "second")).acquire()
    first.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["run_dir"] == str(tmp_path / "second")
    second.release()
    assert not (tmp_path / LOCK_FILE).exists()


# ---------------------------------------------------------------- continued pretraining: init_from's model is the base


@pytest.fixture(scope="module")
def odd_model_ckpt(tmp_path_factory):
    """A checkpoint of a model whose norm_eps and rope_theta are not the defaults (as a converted
    Llama's 1e-6 and 500000 are not)."""
    tmp = tmp_path_factory.mktemp("odd")
    _run(tmp, "run", "train.steps=1", "model.norm_eps=1e-6", "model.rope_theta=500000", "model.d_ff=96",
         f"checkpoint.dir={tmp / 'ck'}")
    return tmp / "ck"


# what the fixture's model is (BASE's model keys and the two above), written out: the oracle
ODD_MODEL = {"vocab_size": 128, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "d_ff": 96,
             "norm_eps": 1e-6, "rope_theta": 500000.0}
NO_MODEL = ["data.kind=synthetic", "train.batch_size=16", "train.seq_len=32", "train.dtype=float32", "mesh.data=1"]


def test_init_from_trains_the_checkpoints_model_and_warns_for_each_key_set_otherwise(odd_model_ckpt, tmp_path,
                                                                                        caplog):
    """No model section: the checkpoint's model, not the dataclass defaults (norm_eps 1e-5, a 6.7B
    model). A key the config sets to another value wins, with one warning line naming both values."""
    with caplog.at_level(logging.WARNING, logger="maxtrain"):
        plain = load_config(None, NO_MODEL + [f"checkpoint.init_from={odd_model_ckpt}"])
    assert {k: getattr(plain.model, k) for k in ODD_MODEL} == ODD_MODEL and not caplog.records
    with caplog.at_level(logging.WARNING, logger="maxtrain"):
        longer = load_config(None, NO_MODEL + [f"checkpoint.init_from={odd_model_ckpt}/1", "model.rope_theta=1e6",
                                               "model.norm_eps=1e-6"])  # the same value: no warning
    assert longer.model.rope_theta == 1e6 and longer.model.norm_eps == 1e-6 and longer.model.d_ff == 96
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("model.rope_theta: 500000.0 in checkpoint.init_from=") \
        and "1000000.0 here" in lines[0], lines
    run = train(load_config(None, NO_MODEL + [f"run_dir={tmp_path / 'run'}", "train.steps=1",
                                              f"checkpoint.init_from={odd_model_ckpt}"]))
    import yaml
    trained = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    assert run.start_step == 0 and {k: trained[k] for k in ODD_MODEL} == ODD_MODEL  # its params restored into it


def test_init_from_is_shown_resolved_and_a_shape_change_names_the_model_keys(odd_model_ckpt, tmp_path, capsys):
    assert cli.main(["train", "--print-config", TINY, *NO_MODEL, f"checkpoint.init_from={odd_model_ckpt}",
                     "model.remat=none"]) == 0
    printed = capsys.readouterr().out
    assert "norm_eps: 1.0e-06" in printed and "d_model: 256" in printed  # tiny.yaml sets d_model: it wins
    code = cli.main(["train", TINY, *NO_MODEL, f"run_dir={tmp_path / 'run'}", f"checkpoint.init_from={odd_model_ckpt}",
                     f"checkpoint.dir={tmp_path / 'ck'}", "train.steps=1"])
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("maxtrain: error:")]
    assert code == 2 and len(errors) == 1 and "is from a different model" in errors[0], err
    assert "leave out the model.* keys that change shapes" in errors[0] and "resume_from" not in errors[0], errors
    assert "model.d_model: 64 in checkpoint.init_from=" in err  # the warning names the key that did it
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # refused before checkpoint.dir or run_dir was written
    # the sibling: resume_from=PATH of another model, also refused before checkpoint.dir is claimed
    code = cli.main(["train", TINY, *NO_MODEL, f"run_dir={tmp_path / 'run'}", f"checkpoint.resume_from={odd_model_ckpt}",
                     f"checkpoint.dir={tmp_path / 'ck'}", "train.steps=1"])
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("maxtrain: error:")]
    assert code == 2 and len(errors) == 1 and "is from a different model" in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_start_check_decides_on_the_runs_own_directory_without_opening_it(odd_model_ckpt, monkeypatch):
    """Whether checkpoint.dir already holds this run's steps is a directory listing: opening a
    Checkpointer is a collective of every process, and a process that saw the directory a faster
    peer had just created opened one alone (2-process resumes deadlocked, then failed on Orbax's
    sync name mismatch)."""
    from maxtrain.run import resume
    from maxtrain.step import make_setup

    cfg = load_config(None, NO_MODEL + [f"checkpoint.dir={odd_model_ckpt}", f"checkpoint.init_from={odd_model_ckpt}",
                                        "model.d_model=128"])  # another model: only a check that ran would refuse it
    setup = make_setup(cfg, jax.devices()[:1])

    def opened(*a, **k):
        raise AssertionError("check_start_source opened a Checkpointer on the run's own directory")

    monkeypatch.setattr(resume, "Checkpointer", opened)
    resume.check_start_source(setup)  # own steps: resumed from them, nothing else checked, nothing opened


def test_a_missing_init_from_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["train", TINY, "run_dir=run", "checkpoint.dir=ck", "checkpoint.init_from=no/such/ck"])
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("maxtrain: error:")]
    assert code == 2 and len(errors) == 1 and "checkpoint.init_from=no/such/ck does not exist" in errors[0]
    assert list(tmp_path.iterdir()) == []


def test_init_froms_model_is_the_newest_steps_with_an_unreadable_one_passed_over(tmp_path):
    """A checkpoint directory whose steps saved different model sections (a run resumed with another
    rope_theta writes on into it): the base is the newest step's, numerically newest (10 after 9),
    and a step whose meta is unreadable is passed over. The metas are written here by hand, in the
    layout Orbax's JSON handler keeps (`<step>/meta/metadata`)."""
    from maxtrain.config import saved_model_section

    for step, meta in ((2, {"config": {"model": {"rope_theta": 1.0}}}), (9, {"config": {"model": {"rope_theta": 9.0}}}),
                       (10, {"config": {"model": {"rope_theta": 10.0}}}), (11, None)):
        (tmp_path / str(step) / "meta").mkdir(parents=True)
        (tmp_path / str(step) / "meta" / "metadata").write_text("{not json" if meta is None else json.dumps(meta))
    assert saved_model_section(str(tmp_path)) == {"rope_theta": 10.0}
    assert saved_model_section(str(tmp_path / "9")) == {"rope_theta": 9.0}  # one step directory: its own
