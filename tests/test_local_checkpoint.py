"""The local checkpoint tier (`checkpoint.local`, maxtrain/local_checkpoint.py): bitwise resume
from it, corrupted copies falling back, bad directories refused in one line, and, with two real
processes, a crashed job restored from the peer copy of a wiped process's shards."""

import json
import os
import shutil
import subprocess
import threading

import jax
import numpy as np
import pytest

from conftest import SMALL, TINY
from maxtrain import load_config, train
from maxtrain.local_checkpoint import run_key

BASE = SMALL + ["mesh.data=2", "mesh.fsdp=4", "optim.decay_steps=8"]


def _local(tmp_path, every=2):
    return [f"checkpoint.local.dir={tmp_path / 'local'}", f"checkpoint.local.every={every}"]


def _losses(result):
    return {r["step"]: r["loss"] for r in result.history}


def _step_dirs(tmp_path, run_dir, process=0):
    d = tmp_path / "local" / run_key(str(run_dir)) / f"p{process}"
    return sorted(os.listdir(d)) if d.exists() else []


def test_resume_from_the_local_tier_is_bitwise(tmp_path):
    """Steps 1-5 with a local checkpoint every 2 steps (the newest 2 kept), then the same run again:
    it resumes from step 4 of the local tier, not from scratch, and steps 5-6 equal the
    uninterrupted run's bitwise."""
    whole = train(load_config(TINY, BASE + [f"run_dir={tmp_path / 'whole'}", "train.steps=6"]))
    run = tmp_path / "run"
    train(load_config(TINY, BASE + _local(tmp_path) + [f"run_dir={run}", "train.steps=5"]))
    assert _step_dirs(tmp_path, run) == ["step_2", "step_4"]
    resumed = train(load_config(TINY, BASE + _local(tmp_path) + [f"run_dir={run}", "train.steps=6"]))
    assert [r["step"] for r in resumed.history] == [5, 6]
    assert _losses(resumed) == {s: _losses(whole)[s] for s in (5, 6)}


def test_a_corrupted_local_copy_falls_back_with_one_warning(tmp_path, caplog):
    """A flipped byte in step 4's shards: one warning naming it, and the run resumes from step 2."""
    run = tmp_path / "run"
    train(load_config(TINY, BASE + _local(tmp_path) + [f"run_dir={run}", "train.steps=4"]))
    data = tmp_path / "local" / run_key(str(run)) / "p0" / "step_4" / "src_p0" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    caplog.clear()
    resumed = train(load_config(TINY, BASE + _local(tmp_path) + [f"run_dir={run}", "train.steps=4"]))
    assert [r["step"] for r in resumed.history] == [3, 4]
    warnings = [r.getMessage() for r in caplog.records if "fails its checksum" in r.getMessage()]
    assert len(warnings) == 1 and "step_4" in warnings[0], warnings


def test_the_ring_puts_every_peer_copy_on_another_host():
    """Failure domains: 2 hosts x 4 processes (ranks 0-3 on host A, 4-7 on B) ring as
    0 4 1 5 2 6 3 7, so each process's successor, which holds its copy, is on the other host; one
    host, or hosts with unequal process counts, ring in process order."""
    from maxtrain.local_checkpoint import ring_order

    order = ring_order([10, 10, 10, 10, 20, 20, 20, 20])
    assert order == [0, 4, 1, 5, 2, 6, 3, 7]
    hosts = [10, 10, 10, 10, 20, 20, 20, 20]
    assert all(hosts[p] != hosts[order[(n + 1) % 8]] for n, p in enumerate(order))
    assert ring_order([10, 20, 30]) == [0, 1, 2] and ring_order([1, 1, 1]) == [0, 1, 2]
    assert ring_order([1, 1, 2]) == [0, 1, 2]


def test_a_full_local_disk_turns_the_tier_off_and_the_run_goes_on(tmp_path, caplog, monkeypatch):
    import errno

    from maxtrain import local_checkpoint

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local_checkpoint, "_write_source", full)
    result = train(load_config(TINY, BASE + _local(tmp_path) + [f"run_dir={tmp_path / 'run'}", "train.steps=5"]))
    assert [r["step"] for r in result.history] == [1, 2, 3, 4, 5]
    warnings = [r.getMessage() for r in caplog.records if "the local tier is off" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
    assert _step_dirs(tmp_path, tmp_path / "run") == []


def test_a_newer_persistent_checkpoint_wins(tmp_path):
    """Local steps 2 and 4, persistent 5 (the final save): the resume takes the persistent one."""
    run = tmp_path / "run"
    train(load_config(TINY, BASE + _local(tmp_path) + [f"run_dir={run}", "train.steps=5",
                                                     f"checkpoint.dir={tmp_path / 'ck'}"]))
    resumed = train(load_config(TINY, BASE + _local(tmp_path) + [f"run_dir={run}", "train.steps=6",
                                                                 f"checkpoint.dir={tmp_path / 'ck'}"]))
    assert [r["step"] for r in resumed.history] == [6]


@pytest.mark.parametrize("make, message", [
    (lambda t: (t / "file").write_text("x") and t / "file" / "sub", "is not writable"),
    (lambda t: t / "ck", "is checkpoint.dir"),
])
def test_bad_local_dirs_are_one_line_errors(make, message, tmp_path, capsys):
    from maxtrain import cli

    local = make(tmp_path)
    code = cli.main(["train", TINY, *BASE, f"run_dir={tmp_path / 'run'}", "train.steps=2",
                     f"checkpoint.dir={tmp_path / 'ck'}", f"checkpoint.local.dir={local}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("maxtrain: error:") and "\n" not in err and message in err, err
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed


def test_a_directory_another_host_writes_to_is_refused(tmp_path, monkeypatch):
    """A local dir where another host's name appears with this attempt's nonce (storage two hosts
    share) is refused; names from earlier attempts (a restarted container's old hostname) are not."""
    from maxtrain import local_checkpoint
    from maxtrain.config import ConfigError

    root = tmp_path / "local" / "key"
    (root / ".hosts").mkdir(parents=True)
    (root / ".hosts" / "0123abcd-old-container").touch()  # an earlier attempt's
    local_checkpoint.check_not_shared(str(root), str(tmp_path / "local"))  # not refused
    listdir = os.listdir

    def shared(path):
        names = listdir(path)
        ours = [n for n in names if not n.startswith("0123abcd-")]
        return names + [ours[0][:9] + "node-17"] if str(path).endswith(".hosts") and ours else names

    monkeypatch.setattr(local_checkpoint.os, "listdir", shared)
    with pytest.raises(ConfigError, match="is shared between hosts .* sees node-17"):
        local_checkpoint.check_not_shared(str(root), str(tmp_path / "local"))


def test_a_network_filesystem_is_refused(tmp_path, monkeypatch):
    from maxtrain import local_checkpoint
    from maxtrain.config import ConfigError

    monkeypatch.setattr(local_checkpoint, "filesystem_type", lambda path: "nfs4")
    with pytest.raises(ConfigError, match="is on a nfs4 filesystem, not node-local storage"):
        local_checkpoint.check_dir(str(tmp_path / "local"))


def test_a_local_dir_without_room_is_refused(tmp_path, monkeypatch):
    from collections import namedtuple

    from maxtrain import local_checkpoint
    from maxtrain.config import ConfigError

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(local_checkpoint.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    with pytest.raises(ConfigError, match="has 1 MiB free, less than the 64 MiB"):
        local_checkpoint.check_dir(str(tmp_path / "local"))


@pytest.mark.slow
def test_two_processes_restore_a_wiped_process_from_its_peer(tmp_path):
    """`launch local --processes 2`: a local checkpoint every 2 steps, each process also keeping its
    predecessor's shards. Process 1 crashes before step 7. Then its local dir is wiped (a replaced
    host) and process 0's copy of its step-6 shards corrupted: the next launch warns once, restores
    step 4 (process 1's shards from process 0's copy), and its step 5 repeats the first launch's
    bitwise and steps 5-8 match one process with 8 devices."""
    from test_launch import LOSS_RTOL, _env, _launch_argv

    run = tmp_path / "run"
    local = _local(tmp_path) + [f"run_dir={run}", "train.steps=8"]
    first = subprocess.run(_launch_argv(*local, "drills.crash_step=6", "drills.process=1"),
                           env=_env(tmp_path / "cache"), capture_output=True, text=True, timeout=400)
    ref = {}
    thread = threading.Thread(target=lambda: ref.update(_losses(train(load_config(
        TINY, BASE + [f"run_dir={tmp_path / 'ref'}", "train.steps=8"])))))
    thread.start()
    assert first.returncode != 0, first.stdout[-3000:] + first.stderr[-3000:]
    before = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    base = tmp_path / "local" / run_key(str(run))
    assert {"step_4", "step_6"} <= set(os.listdir(base / "p0"))
    assert (base / "p0" / "step_4" / "src_p1" / "index.json").exists()  # the peer copy
    shutil.rmtree(base / "p1")
    peer6 = base / "p0" / "step_6" / "src_p1" / "data.bin"
    if peer6.exists():
        raw = bytearray(peer6.read_bytes())
        raw[-1] ^= 0x01
        peer6.write_bytes(bytes(raw))
    second = subprocess.run(_launch_argv(*local), env=_env(tmp_path / "cache"), capture_output=True, text=True,
                            timeout=400)
    thread.join()
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert "resumed from the local tier" in out and "at step 4" in out, out[-4000:]
    after = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    # the crash came before step 6's record was written (records trail the step by one)
    assert sorted(before) == list(range(1, 6)) and sorted(after) == list(range(1, 9))
    assert after[5] == before[5]  # a redone step: bitwise
    attempt = json.loads((run / "goodput.json").read_text())["attempts"][-1]
    assert attempt["restore_tier"] == "local" and attempt["first_step"] == 4
    assert attempt["compile_cache"] == "hit" and attempt["restore_s"] > 0  # the first launch filled the cache
    if peer6.exists():
        assert out.count("fails its checksum") == 1, out[-4000:]
    np.testing.assert_allclose([after[s] for s in range(1, 9)], [ref[s] for s in range(1, 9)], rtol=LOSS_RTOL)
