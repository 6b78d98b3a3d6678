"""The local checkpoint tier (`checkpoint.local`, maxtrain/checkpoint/local.py): bitwise resume
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
from maxtrain.checkpoint.local import run_key

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
    from maxtrain.checkpoint.local import ring_order

    order = ring_order([10, 10, 10, 10, 20, 20, 20, 20])
    assert order == [0, 4, 1, 5, 2, 6, 3, 7]
    hosts = [10, 10, 10, 10, 20, 20, 20, 20]
    assert all(hosts[p] != hosts[order[(n + 1) % 8]] for n, p in enumerate(order))
    assert ring_order([10, 20, 30]) == [0, 1, 2] and ring_order([1, 1, 1]) == [0, 1, 2]
    assert ring_order([1, 1, 2]) == [0, 1, 2]


def test_a_full_local_disk_turns_the_tier_off_and_the_run_goes_on(tmp_path, caplog, monkeypatch):
    import errno

    from maxtrain.checkpoint import local as local_checkpoint

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local_checkpoint, "write_source", full)
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
    from maxtrain.checkpoint import local as local_checkpoint
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
    from maxtrain.checkpoint import local as local_checkpoint
    from maxtrain.config import ConfigError

    monkeypatch.setattr(local_checkpoint, "filesystem_type", lambda path: "nfs4")
    with pytest.raises(ConfigError, match="is on a nfs4 filesystem, not node-local storage"):
        local_checkpoint.check_dir(str(tmp_path / "local"))


def test_a_local_dir_without_room_is_refused(tmp_path, monkeypatch):
    from collections import namedtuple

    from maxtrain.checkpoint import local as local_checkpoint
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
    # rank 0 is left in a collective with the crashed rank 1: the launcher kills it after a 1 s grace
    first = subprocess.run(_launch_argv(*local, "drills.crash_step=6", "drills.process=1", grace=1),
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

    def held(process, whose):  # per array: the global index and digest of every shard in that copy
        index = json.loads((base / f"p{process}" / "step_4" / f"src_p{whose}" / "index.json").read_text())
        return {name: sorted((json.dumps(e["index"]), e["digest"]) for e in entries)
                for name, entries in index["arrays"].items()}
    # by content: each process's copy of the other's shards is that process's own, shard for shard
    assert held(0, 1) == held(1, 1) and held(1, 0) == held(0, 0) and held(0, 0)
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


# ---------------------------------------------------------------- which neighbour holds which copy
#
# Oracle: the documented rule (the module docstring, docs/reliability.md#local-checkpoints), written
# out by hand per layout below: processes ring host by host for each local rank when they are on
# several hosts with as many each, else in process order; process p keeps its own shards and its
# ring predecessor's, so the copy of p's shards lies with p's successor; device k of each process
# sends to device k of its successor; a step is restorable when every process has its own copy or its
# successor has the copy of it.

A, B, C, D = 11, 22, 33, 44  # host ids, in the order of their first process
RING_LAYOUTS = [
    # (name, host of each process, the ring by hand)
    ("one_process", [A], [0]),
    ("1_host_x_4", [A, A, A, A], [0, 1, 2, 3]),  # one host: process order
    ("2_hosts_x_2", [A, A, B, B], [0, 2, 1, 3]),  # rank 0: A's 0, B's 2; rank 1: A's 1, B's 3
    ("2_hosts_x_2_interleaved", [A, B, A, B], [0, 1, 2, 3]),  # rank 0: A's 0, B's 1; rank 1: A's 2, B's 3
    ("2_hosts_x_4", [A] * 4 + [B] * 4, [0, 4, 1, 5, 2, 6, 3, 7]),  # docs/reliability.md's example
    ("4_hosts_x_2", [A, A, B, B, C, C, D, D], [0, 2, 4, 6, 1, 3, 5, 7]),
    ("3_hosts_x_1", [A, B, C], [0, 1, 2]),
    ("uneven_3_and_1", [A, A, A, B], [0, 1, 2, 3]),  # unequal counts: process order
    ("uneven_1_and_2", [A, B, B], [0, 1, 2]),
]


def _successors(ring):
    return {p: ring[(n + 1) % len(ring)] for n, p in enumerate(ring)}


@pytest.mark.parametrize("name, hosts, ring", RING_LAYOUTS, ids=[r[0] for r in RING_LAYOUTS])
def test_ring_order_follows_the_documented_layouts(name, hosts, ring):
    from maxtrain.checkpoint.local import ring_order

    assert ring_order(hosts) == ring
    counts = {h: hosts.count(h) for h in hosts}
    if len(counts) > 1 and len(set(counts.values())) == 1:  # every copy on another node than its shards
        assert all(hosts[q] != hosts[p] for p, q in _successors(ring).items())


def test_ring_order_puts_successors_on_other_hosts_whatever_the_host_ids():
    """Host ids are hashes of host names, in no particular order: 3 hosts x 3 processes placed
    round-robin, ids descending; every successor is on another host, and a host's processes come
    in their local-rank order."""
    from maxtrain.checkpoint.local import ring_order

    hosts = [90, 50, 10] * 3
    ring = ring_order(hosts)
    assert sorted(ring) == list(range(9))
    assert all(hosts[q] != hosts[p] for p, q in _successors(ring).items())
    for h in set(hosts):
        mine = [p for p in ring if hosts[p] == h]
        assert mine == sorted(mine)


class _FakeDevice:
    def __init__(self, id, process_index, real=None):
        self.id, self.process_index, self.real = id, process_index, real

    def __repr__(self):
        return f"dev{self.id}@p{self.process_index}"


class _FakeMesh:
    """What the ring reads of a mesh: its devices (with their process) and axis names."""

    def __init__(self, processes, shape, axis_names=("data", "fsdp")):
        self.devices = np.array([_FakeDevice(i, p) for i, p in enumerate(processes)], dtype=object).reshape(shape)
        self.axis_names = axis_names


def _ring_as(monkeypatch, mesh, hosts, me):
    """The local tier's ring as process `me` of `len(hosts)` processes builds it (the allgather of
    host ids answered with `hosts`)."""
    from maxtrain.checkpoint import local as local_checkpoint

    with monkeypatch.context() as m:
        m.setattr(local_checkpoint, "allgather", lambda values: np.asarray(hosts, np.int64)[:, None])
        m.setattr(jax, "process_index", lambda: me)
        return local_checkpoint.Ring(mesh)


MESH_LAYOUTS = [
    # (name, process of each mesh position (flat), mesh shape, hosts, the ring by hand)
    ("1_host_x_4_interleaved_in_the_mesh", [0, 1, 2, 3, 0, 1, 2, 3], (2, 4), [A, A, A, A], [0, 1, 2, 3]),
    ("2_hosts_x_2", [0, 0, 1, 1, 2, 2, 3, 3], (2, 4), [A, A, B, B], [0, 2, 1, 3]),
    ("2_hosts_x_2_reversed_in_the_mesh", [3, 3, 2, 2, 1, 1, 0, 0], (4, 2), [A, A, B, B], [0, 2, 1, 3]),
    ("4_hosts_x_2", [0, 1, 2, 3, 4, 5, 6, 7], (2, 4), [A, A, B, B, C, C, D, D], [0, 2, 4, 6, 1, 3, 5, 7]),
]


@pytest.mark.parametrize("name, processes, shape, hosts, ring", MESH_LAYOUTS, ids=[r[0] for r in MESH_LAYOUTS])
def test_peer_permute_pairs_device_k_of_each_process_with_device_k_of_its_successor(
        name, processes, shape, hosts, ring, monkeypatch):
    mesh = _FakeMesh(processes, shape)
    succ = _successors(ring)
    pred = {q: p for p, q in succ.items()}
    # device k of process p: its k-th device in the mesh's flat order
    devices_of = {p: [i for i, q in enumerate(processes) if q == p] for p in set(processes)}
    forward = {(devices_of[p][k], devices_of[succ[p]][k]) for p in succ for k in range(len(devices_of[p]))}
    for me in range(len(hosts)):
        r = _ring_as(monkeypatch, mesh, hosts, me)
        assert (r.successor, r.predecessor) == (succ[me], pred[me]), me
        assert r.successor_of == succ
        assert set(r.forward) == forward and len(r.forward) == len(forward)
        assert set(r.backward) == {(j, i) for i, j in forward} and len(r.backward) == len(forward)
        assert r.source_of == {j: i for i, j in forward}  # where each device's peer copy comes from


def test_the_peer_permute_moves_each_process_shards_to_its_successor_and_back(monkeypatch):
    """Real devices, grouped as 4 processes of 2 devices on 2 hosts (ring 0 2 1 3 by hand): after the
    forward permute each device holds the shard of the same-rank device of its process's
    predecessor, labelled with that shard's global index; the reverse permute gives the shards back."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from maxtrain.checkpoint import local as local_checkpoint

    real = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    processes, hosts = [0, 0, 1, 1, 2, 2, 3, 3], [A, A, B, B]
    flat = list(real.devices.flat)
    fake = _FakeMesh(processes, (2, 4))
    ring = _ring_as(monkeypatch, fake, hosts, 0)
    ring.mesh, ring.flat = real, flat  # the same layout on the real devices
    pred = {q: p for p, q in _successors([0, 2, 1, 3]).items()}
    x = jax.device_put(np.arange(8 * 3, dtype=np.float32).reshape(8, 3) * 10 + 1,
                       NamedSharding(real, PartitionSpec(("data", "fsdp"))))
    moved = ring.permute([x], ring.forward)[0]
    host_x = np.asarray(x)
    for s in moved.addressable_shards:
        i = flat.index(s.device)
        p, k = processes[i], [j for j, q in enumerate(processes) if q == processes[i]].index(i)
        source = [j for j, q in enumerate(processes) if q == pred[p]][k]  # device k of the predecessor
        np.testing.assert_array_equal(np.asarray(s.data), host_x[source:source + 1])  # device i holds row i
    received = local_checkpoint.received_shards(x, moved, ring)
    assert len(received) == 8
    for key, shard in received.items():  # each copy filed under the global index it came from
        (start, stop), _ = json.loads(key)
        np.testing.assert_array_equal(shard, host_x[start:stop])
    back = ring.permute([moved], ring.backward)[0]
    np.testing.assert_array_equal(np.asarray(back), host_x)


class _World:
    """`len(hosts)` processes as threads of this one: while `run` runs them, the local tier's
    allgather goes through a barrier, and each thread has its own process index and host name;
    every host has its own local dir."""

    def __init__(self, hosts, root):
        self.hosts, self.n, self.root = hosts, len(hosts), root
        self.slots = [None] * self.n
        self.barrier = threading.Barrier(self.n, timeout=60)
        self.me = threading.local()
        self.one_at_a_time = threading.Lock()

    def local_dir(self, p):
        return self.root / f"host{self.hosts[p]}"

    def allgather(self, values):
        self.slots[self.me.p] = np.asarray(values)
        self.barrier.wait()
        out = np.stack(self.slots)
        self.barrier.wait()
        return out

    def run(self, fn):
        """fn(p) on every process at once; the results in process order."""
        import socket

        from maxtrain.checkpoint import local as local_checkpoint

        results, errors = [None] * self.n, []
        real_hostname, check_dir = socket.gethostname(), local_checkpoint.check_dir

        def serialized(*args, **kwargs):  # its probe file is named by pid, which these threads share
            with self.one_at_a_time:
                return check_dir(*args, **kwargs)

        def body(p):
            self.me.p = p
            try:
                results[p] = fn(p)
            except BaseException as e:  # noqa: BLE001  (re-raised below; the others must not wait on it)
                errors.append(e)
                self.barrier.abort()
        with pytest.MonkeyPatch.context() as m:
            m.setattr(local_checkpoint, "allgather", self.allgather)
            m.setattr(local_checkpoint, "check_dir", serialized)
            m.setattr(jax, "process_index", lambda: getattr(self.me, "p", 0))
            m.setattr(socket, "gethostname",
                      lambda: f"node-{self.hosts[self.me.p]}" if hasattr(self.me, "p") else real_hostname)
            threads = [threading.Thread(target=body, args=(p,)) for p in range(self.n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return results


@pytest.fixture(scope="module")
def simulated_world(tmp_path_factory):
    """The local tiers of 4 processes on 2 hosts (processes 0, 1 on host A; 2, 3 on B: ring 0 2 1 3 by
    hand), having saved steps 1, 2 and 4, keeping 2 (empty trees: the files name whose shards they hold)."""
    from jax.sharding import Mesh

    from maxtrain.checkpoint import local as local_checkpoint
    from maxtrain.config import LocalCheckpointConfig

    base = tmp_path_factory.mktemp("simulated")
    world = _World([A, A, B, B], base / "nodes")
    fake = _FakeMesh([0, 0, 1, 1, 2, 2, 3, 3], (2, 4))
    real = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))

    def make(p):
        lcfg = LocalCheckpointConfig(dir=str(world.local_dir(p)), every=2, keep=2, replica_of="ring")
        tier = local_checkpoint.LocalTier(lcfg, str(base / "run"), fake)
        tier.ring.mesh = real  # the permutes (of no arrays) run on the real devices
        return tier

    tiers = world.run(make)
    for step in (1, 2, 4):  # step 1: dropped by retention (the newest 2 kept)
        world.run(lambda p: tiers[p].save(step, {}, {"step": step}))
    world.run(lambda p: tiers[p].wait())
    yield world, tiers, base
    for t in tiers:
        t.close()


@pytest.fixture
def simulated_tiers(simulated_world):
    """`simulated_world` as it saved, and `damage(...)` (see `_damage`), undone after the test."""
    world, tiers, base = simulated_world
    undo = []
    yield world, tiers, base / "run", lambda **kw: _damage(world, base / "run", base / "stash", undo, **kw)
    for restore in reversed(undo):
        restore()


def _damage(world, run, stash, undo, lost=(), drop=(), corrupt=(), move_to_predecessor=()):
    """`lost` processes' dirs emptied; copies (step, holder, whose) removed, corrupted, or moved to
    `to` (a process dir); by renames that `undo` reverses."""
    def put_aside(path):
        aside = stash / str(len(undo))
        os.makedirs(stash, exist_ok=True)
        os.rename(path, aside)
        undo.append(lambda: (shutil.rmtree(path, ignore_errors=True), os.rename(aside, path)))

    def copy(step, holder, whose):
        return _process_dir(world, holder, run) / f"step_{step}" / f"src_p{whose}"
    for step, holder, whose in drop:
        put_aside(copy(step, holder, whose))
    for step, holder, whose in corrupt:
        shutil.copytree(copy(step, holder, whose), stash / "corrupt")
        put_aside(copy(step, holder, whose))
        os.rename(stash / "corrupt", copy(step, holder, whose))
        (copy(step, holder, whose) / "index.json").write_text("{not json")
    for step, holder, whose, to in move_to_predecessor:
        shutil.copytree(copy(step, holder, whose), copy(step, to, whose))
        undo.append(lambda path=copy(step, to, whose): shutil.rmtree(path))
        put_aside(copy(step, holder, whose))
    for p in lost:
        put_aside(_process_dir(world, p, run))
        os.makedirs(_process_dir(world, p, run))


def _process_dir(world, p, run_dir):
    return world.local_dir(p) / run_key(str(run_dir)) / f"p{p}"


def test_simulated_processes_keep_their_own_and_their_predecessors_shards(simulated_tiers):
    """On disk, process p's directory (on p's host) holds p's shards and its ring predecessor's: the
    copy of p's shards is with its successor, on the other host."""
    world, _, run, _ = simulated_tiers
    pred = {q: p for p, q in _successors([0, 2, 1, 3]).items()}  # 0->2->1->3->0
    for p in range(4):
        assert sorted(os.listdir(_process_dir(world, p, run))) == ["step_2", "step_4"]
        for step in (2, 4):
            d = _process_dir(world, p, run) / f"step_{step}"
            assert sorted(os.listdir(d)) == sorted({f"src_p{p}", f"src_p{pred[p]}"}), (p, step)
            assert world.hosts[pred[p]] != world.hosts[p]
            for j in (p, pred[p]):
                assert json.loads((d / f"src_p{j}" / "index.json").read_text())["meta"] == {"step": step}


# ring 0 2 1 3 (by hand): successor 0->2, 2->1, 1->3, 3->0; the copy of q's shards is with successor(q)
RESTORE_CASES = [
    # (name, damage, newer_than, steps every process can restore from, the step restored)
    ("whole", {}, 0, [4, 2], 4),
    ("newer_than_the_persistent_tier", {}, 2, [4], 4),
    ("nothing_newer", {}, 4, [], None),
    ("lost_process_1_restores_from_its_successor_3", {"lost": [1]}, 0, [4, 2], 4),
    ("lost_process_0_restores_from_its_successor_2", {"lost": [0]}, 0, [4, 2], 4),
    ("lost_1_and_its_successor_has_no_copy_of_step_4", {"lost": [1], "drop": [(4, 3, 1)]}, 0, [2], 2),
    ("lost_1_a_copy_with_its_predecessor_does_not_count",
     {"lost": [1], "move_to_predecessor": [(4, 3, 1, 2)]}, 0, [2], 2),
    ("lost_1_and_its_successors_copy_corrupt", {"lost": [1], "corrupt": [(4, 3, 1)]}, 0, [4, 2], 2),
    ("lost_1_and_0_not_neighbours", {"lost": [1, 0]}, 0, [4, 2], 4),
    ("lost_1_and_its_successor_3", {"lost": [1, 3]}, 0, [], None),
    ("lost_3_and_its_successor_0", {"lost": [3, 0]}, 0, [], None),
    ("own_copy_kept_its_successors_copy_corrupt", {"corrupt": [(4, 3, 1)]}, 0, [4, 2], 4),
]


@pytest.mark.parametrize("name, damage, newer_than, steps, restored", RESTORE_CASES, ids=[c[0] for c in RESTORE_CASES])
def test_simulated_restore_takes_each_lost_process_from_its_successor(
        name, damage, newer_than, steps, restored, simulated_tiers, caplog):
    world, tiers, run, plant = simulated_tiers
    plant(**damage)
    assert world.run(lambda p: tiers[p].candidates(newer_than)) == [steps] * 4
    caplog.clear()
    results = world.run(lambda p: tiers[p].restore({}, newer_than))
    assert [r and (r[0], r[2]) for r in results] == [restored and (restored, {"step": restored})] * 4
    named = [r.getMessage() for r in caplog.records if "copy of process" in r.getMessage()]
    if damage.get("corrupt"):  # one warning, on the holder, naming whose copy it is
        assert len(named) == 1 and "the copy of process 1's shards" in named[0] and "p3" in named[0], named
    else:
        assert not named, named
