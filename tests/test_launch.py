"""Multi-host launch: environment detection, `maxtrain launch local`, checkpoints across process
counts, a killed rank, and start-up errors that must end in one line within bounded time."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import yaml

from conftest import FAST_COMPILE, ROOT, SMALL, TINY
from maxtrain import cli, distributed, launcher, load_config, train
from maxtrain.checkpoint import PREEMPTED_EXIT_CODE
from maxtrain.config import ConfigError
from maxtrain.distributed import DistributedError, DistributedSpec, detect, expand_hostlist

pytestmark = pytest.mark.slow  # several processes on localhost (jax.distributed with gloo): `-m "not slow"` leaves them out

MAIN = "import sys; from maxtrain.cli import main; sys.exit(main(sys.argv[1:]))"
# decay_steps fixed: the lr of step s does not depend on train.steps, so runs of different lengths agree
# reliability.preflight off: tests/test_preflight.py runs it; here it would add seconds to every job
MESH_2x4 = SMALL + ["mesh.data=2", "mesh.fsdp=4", "optim.decay_steps=8", "reliability.preflight=off"]
# gloo's cross-process all-reduce adds in another order than one process does: last-bit differences
LOSS_RTOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache_dir=None, **extra) -> dict:
    """A child environment without this test process's 8 fake devices or any scheduler variables."""
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_FLAGS" and not k.startswith(("MAXTRAIN_", "SLURM_", "OMPI_")) and k != "JOB_COMPLETION_INDEX"}
    env.update({"PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
                "XLA_FLAGS": FAST_COMPILE.strip()})  # the launcher adds each process's device count
    if cache_dir:  # the 2-process runs compile the same programs: compile once
        env.update({"JAX_COMPILATION_CACHE_DIR": str(cache_dir), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _launch_argv(*overrides, processes=2, cpu_devices=4, grace=3):
    return [sys.executable, "-c", MAIN, "launch", "local", "--processes", str(processes), "--cpu-devices",
            str(cpu_devices), "--grace", str(grace), TINY, *MESH_2x4, *overrides]


def _losses(run_dir) -> dict[int, float]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["step"]: r["loss"] for r in (json.loads(line) for line in f if line.endswith("\n"))}


# ---------------------------------------------------------------- shared runs


class _Launch:
    """`maxtrain launch local` in the background, its output in files."""

    def __init__(self, tmp, name, *overrides, grace=3):
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        self.run_dir = tmp / f"run_{name}"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(_launch_argv(f"run_dir={self.run_dir}", *overrides, grace=grace),
                                         env=_env(tmp / "cache"),
                                         stdout=out, stderr=err, start_new_session=True)

    def wait(self, timeout=400) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.cleanup()

    def cleanup(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def pids(self) -> dict[int, int]:
        words = [line.split() for line in self.err.read_text().splitlines() if line.startswith("[launch] rank ")]
        return {int(w[2]): int(w[4]) for w in words if len(w) == 5 and w[3] == "pid"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every training run of this module, two at a time (a launched job beside one in this process).

    1. `launch local --processes 2 --cpu-devices 4`, steps 1-3, checkpoint at 3   | beside it, the
       reference: one process with 8 devices, same mesh, steps 1-5, checkpoint at 3.
    2. 2 processes resume from the reference's step 3; rank 1 is SIGKILLed after step 5 | beside it,
       one process resumes from the 2-process checkpoint and runs steps 4-5.
    """
    tmp = tmp_path_factory.mktemp("launch")
    two = _Launch(tmp, "two", "train.steps=3", f"checkpoint.dir={tmp / 'ck2'}")
    try:
        ref = train(load_config(TINY, MESH_2x4 + [f"run_dir={tmp / 'run_ref'}", "train.steps=5",
                                                  f"checkpoint.dir={tmp / 'ck1'}", "checkpoint.every=3"]))
    finally:
        code = two.wait()
    assert code == 0, two.text()[-4000:]
    # rank 0 is left in a collective with the killed rank 1: SIGTERM, then SIGKILL after a 1 s grace
    killed = _Launch(tmp, "killed", "train.steps=1000", f"checkpoint.resume_from={tmp / 'ck1'}/3", grace=1)
    try:
        from_two = train(load_config(TINY, MESH_2x4 + [f"run_dir={tmp / 'run_21'}", "train.steps=5",
                                                       f"checkpoint.resume_from={tmp / 'ck2'}"]))
        deadline = time.monotonic() + 300
        while 5 not in _losses(killed.run_dir):
            assert killed.proc.poll() is None and time.monotonic() < deadline, killed.text()[-4000:]
            time.sleep(0.2)
        pids = killed.pids()
        t_kill = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        killed_code = killed.proc.wait(timeout=60)
        stopped_s = time.monotonic() - t_kill
    finally:
        killed.cleanup()
    return {"ref": {r["step"]: r["loss"] for r in ref.history}, "two": _losses(two.run_dir), "two_text": two.text(),
            "two_dir": two.run_dir,
            "ck2": tmp / "ck2", "from_two": from_two, "from_one": _losses(killed.run_dir),
            "killed": {"code": killed_code, "stopped_s": stopped_s, "pids": pids, "text": killed.text()}}


def test_two_processes_give_the_losses_of_one(runs):
    two, ref = runs["two"], runs["ref"]
    assert sorted(two) == [1, 2, 3]  # only process 0 writes metrics.jsonl: one record per step
    np.testing.assert_allclose([two[s] for s in (1, 2, 3)], [ref[s] for s in (1, 2, 3)], rtol=LOSS_RTOL)
    lines = runs["two_text"].splitlines()
    assert lines and all(line.startswith(("[rank 0] ", "[rank 1] ", "[launch] ")) for line in lines)
    assert any(line.startswith("[rank 0]") and "step 3/3" in line for line in lines)
    assert not any(line.startswith("[rank 1]") and " | loss " in line for line in lines)  # rank 0 logs
    assert any("joined process 0 of 2" in line and "8 devices in all" in line for line in lines)
    from maxtrain.launcher import _GLOO_WHOLE
    leaked = [line for line in lines if _GLOO_WHOLE.search(line)]
    assert not leaked, leaked  # Gloo's connection messages
    run_id = json.loads((runs["two_dir"] / "run.json").read_text())["run_id"]
    assert re.fullmatch(r"[0-9a-f]{12}", run_id), run_id  # agreed by both processes (broadcast as int32 halves)
    assert (runs["ck2"] / "3" / "manifest").is_dir()  # checksums committed with the arrays


def test_gloo_connection_messages_are_cut_whole_or_in_pieces():
    from maxtrain.launcher import _GlooFilter
    msg = "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
    f = _GlooFilter()
    assert f(msg + "\n") is None and f("step 1/2 | loss 5.97\n") == "step 1/2 | loss 5.97\n"
    assert f(msg + "17:35:00 joined process 1 of 2\n") == "17:35:00 joined process 1 of 2\n"  # glued
    # cut by a Python line: "[Gloo] Rank " ends one line, "1 is connected ... : 3" starts the next
    f = _GlooFilter()
    assert f("[Gloo] Rank \n") is None
    assert f("1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n") is None
    f = _GlooFilter()
    assert f("17:35:00 joined process 0 of 2[Gloo] Rank 0 is connected to \n") == "17:35:00 joined process 0 of 2"
    assert f("3 peer ranks. Expected number of connected peer ranks is : 3\n") is None
    assert f("12 steps\n") == "12 steps\n"  # digits at a line's start stay unless a message was cut before
    f = _GlooFilter()  # the first piece, then a whole Python line, then the rest of the message
    assert f("[Gloo] Rank 17:56:55 compiled train step in 0.5s\n") == "17:56:55 compiled train step in 0.5s\n"
    assert f("1 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n") is None
    # two messages written at once (two collective groups): one whole inside the other's pieces
    f = _GlooFilter()
    assert f(msg[:30] + msg.replace("Rank 1", "Rank 0") + msg[30:] + "\n") is None
    assert f(msg[:30] + msg + msg[30:60] + msg + msg[60:] + "step 2/2\n") == "step 2/2\n"


def test_checkpoints_restore_across_process_counts(runs):
    """2 processes -> 1 and 1 -> 2 both continue exactly where the uninterrupted run goes."""
    ref, from_two, from_one = runs["ref"], runs["from_two"], runs["from_one"]
    assert from_two.start_step == 3
    np.testing.assert_allclose([r["loss"] for r in from_two.history], [ref[4], ref[5]], rtol=LOSS_RTOL)
    assert min(from_one) == 4
    np.testing.assert_allclose([from_one[4], from_one[5]], [ref[4], ref[5]], rtol=LOSS_RTOL)


def test_a_killed_rank_stops_the_job(runs):
    killed = runs["killed"]
    assert killed["code"] == 128 + signal.SIGKILL, killed["text"][-3000:]  # rank 1's status: the first failure
    assert killed["stopped_s"] < 30  # grace 1 s, then SIGKILL for a rank stuck in a collective
    assert "rank 1 exited with code 137; stopping the other ranks" in killed["text"]
    for pid in killed["pids"].values():  # nothing left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ---------------------------------------------------------------- start-up errors, real processes


def _train_argv(*overrides):
    return [sys.executable, "-c", MAIN, "train", TINY, *SMALL, "train.steps=1", *overrides]


def test_start_up_errors_end_in_one_line_within_bounded_time(tmp_path):
    """Unreachable coordinator, a peer that never joins, device counts that differ: each process
    prints one line and exits 2, none hangs."""
    run = f"run_dir={tmp_path / 'r'}"
    job = {"MAXTRAIN_NUM_PROCESSES": 2, "MAXTRAIN_INIT_TIMEOUT_S": 3}
    p_dev = _free_port()
    cases = {
        "unreachable": (_train_argv(run), _env(MAXTRAIN_COORDINATOR=f"127.0.0.1:{_free_port()}",
                                               MAXTRAIN_PROCESS_ID=1, **job)),
        "no_peer": (_train_argv(run), _env(MAXTRAIN_COORDINATOR=f"127.0.0.1:{_free_port()}",
                                           MAXTRAIN_PROCESS_ID=0, **job)),
        **{f"devices{i}": (_train_argv(run), _env(MAXTRAIN_COORDINATOR=f"127.0.0.1:{p_dev}", MAXTRAIN_PROCESS_ID=i,
                                                  XLA_FLAGS=f"--xla_force_host_platform_device_count={4 - 2 * i}{FAST_COMPILE}",
                                                  **{**job, "MAXTRAIN_INIT_TIMEOUT_S": 60}))
           for i in (0, 1)},
    }
    t0 = time.monotonic()
    procs = {k: subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, (argv, env) in cases.items()}
    try:
        results = {k: (p.wait(timeout=120), p.communicate()[1]) for k, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert time.monotonic() - t0 < 120
    errors = {}
    for k, (code, err) in results.items():
        lines = [line for line in err.splitlines() if line.startswith("maxtrain: error:")]
        assert code == 2 and len(lines) == 1, f"{k}: exit {code}\n{err[-3000:]}"
        assert "Check failure" not in err and "Traceback" not in err, f"{k}:\n{err[-3000:]}"
        errors[k] = lines[0]
    assert "process 1 of 2 could not reach the coordinator" in errors["unreachable"]
    assert "within 3s" in errors["unreachable"] and "MAXTRAIN_COORDINATOR" in errors["unreachable"]
    assert "process 0 waited 3s" in errors["no_peer"] and "other 1 process(es)" in errors["no_peer"]
    for i in (0, 1):
        assert "different device counts (process 0: 4, process 1: 2)" in errors[f"devices{i}"]


def test_mesh_errors_name_the_global_device_count():
    from maxtrain.mesh import build_mesh

    devices = [types.SimpleNamespace(id=i, process_index=i // 2) for i in range(4)]  # 2 processes, 2 each
    with pytest.raises(ConfigError) as e:
        build_mesh(load_config(TINY, ["mesh.data=3"]).mesh, devices)
    assert "multiply to 3, which does not divide the 4 devices" in str(e.value)
    assert "(the 4 devices of all 2 processes, 2 each; the mesh spans every process)" in str(e.value)


def test_process_id_out_of_range_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("MAXTRAIN_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("MAXTRAIN_NUM_PROCESSES", "2")
    monkeypatch.setenv("MAXTRAIN_PROCESS_ID", "2")
    assert cli.main(["train", TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["maxtrain: error: MAXTRAIN_PROCESS_ID=2 is out of range for MAXTRAIN_NUM_PROCESSES=2 "
                   "(valid ids: 0 to 1)"]


# ---------------------------------------------------------------- environment detection


def test_slurm_host_lists_expand():
    assert expand_hostlist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_hostlist("gpu1,gpu-b[8-10]-ib,login") == ["gpu1", "gpu-b8-ib", "gpu-b9-ib", "gpu-b10-ib", "login"]
    assert expand_hostlist("a[1-2]b[3,4]") == ["a1b3", "a1b4", "a2b3", "a2b4"]
    assert expand_hostlist("n[000-002]")[-1] == "n002"
    for bad in ("node[01-03", "node]1[", "node[3-1]", "node[a-b]", ""):
        with pytest.raises(ValueError):
            expand_hostlist(bad)
    assert distributed.tasks_per_node("4(x2),3") == [4, 4, 3]


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[08-09]", "SLURM_STEP_NUM_TASKS": "4",
         "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


def test_detect_slurm():
    spec = detect(SLURM)
    assert (spec.source, spec.num_processes, spec.process_id) == ("slurm", 4, 3)
    assert spec.coordinator == f"gpu08:{61440 + 4242 % 4096}"  # the step's first host, a port from the job id
    assert spec.local_device_ids == (1,)  # two tasks per node, no GPU binding: one GPU each
    assert detect({**SLURM, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}).local_device_ids == (2, 3)
    assert detect({**SLURM, "CUDA_VISIBLE_DEVICES": "5"}).local_device_ids is None  # Slurm bound one per task
    one_per_node = {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_LOCALID": "0"}
    assert detect(one_per_node).local_device_ids is None
    assert detect({**one_per_node, "MAXTRAIN_COORDINATOR_PORT": "9000"}).coordinator == "gpu08:9000"
    no_step = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP_")}
    assert detect(no_step).coordinator.startswith("gpu07:")  # falls back to the job's list and SLURM_NTASKS
    assert detect({**SLURM, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}) is None


def test_detect_kubernetes_mpi_and_explicit():
    k8s = {"JOB_COMPLETION_INDEX": "1", "MAXTRAIN_NUM_PROCESSES": "2", "JOBSET_NAME": "run7",
           "REPLICATED_JOB_NAME": "workers"}
    spec = detect(k8s)
    assert (spec.source, spec.process_id, spec.num_processes, spec.coordinator) == \
        ("k8s", 1, 2, "run7-workers-0-0.run7:8476")
    assert detect({**k8s, "MAXTRAIN_COORDINATOR": "10.0.0.5:1234"}).coordinator == "10.0.0.5:1234"
    mpi = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MAXTRAIN_COORDINATOR": "host0:8476", **SLURM}
    spec = detect(mpi)  # mpirun inside a Slurm allocation: MPI's ranks, not the batch script's
    assert (spec.source, spec.process_id, spec.num_processes, spec.local_device_ids) == ("mpi", 5, 8, (1,))
    explicit = {"MAXTRAIN_COORDINATOR": "[::1]:7000", "MAXTRAIN_NUM_PROCESSES": "3", "MAXTRAIN_PROCESS_ID": "2",
                "MAXTRAIN_LOCAL_DEVICE_IDS": "0,1"}
    assert detect(explicit) == DistributedSpec("[::1]:7000", 3, 2, (0, 1), "env")
    # explicit variables win over the scheduler's, field by field
    spec = detect({**SLURM, "MAXTRAIN_PROCESS_ID": "0", "MAXTRAIN_COORDINATOR": "me:1"})
    assert (spec.process_id, spec.coordinator, spec.num_processes) == (0, "me:1", 4)
    assert detect({}) is None and detect({"MAXTRAIN_NUM_PROCESSES": "1"}) is None
    assert detect({"JOB_COMPLETION_INDEX": "3"}) is None  # an Indexed Job of independent single-process runs
    assert detect({"PATH": "/bin", "HOME": "/root"}) is None


@pytest.mark.parametrize("env, message", [
    ({"MAXTRAIN_NUM_PROCESSES": "2", "MAXTRAIN_PROCESS_ID": "2", "MAXTRAIN_COORDINATOR": "h:1"},
     "MAXTRAIN_PROCESS_ID=2 is out of range for MAXTRAIN_NUM_PROCESSES=2 (valid ids: 0 to 1)"),
    ({**SLURM, "SLURM_PROCID": "4"}, "SLURM_PROCID=4 is out of range for SLURM_STEP_NUM_TASKS=4"),
    ({"MAXTRAIN_NUM_PROCESSES": "two"}, "MAXTRAIN_NUM_PROCESSES='two' is not an integer"),
    ({"MAXTRAIN_NUM_PROCESSES": "0"}, "the process count must be at least 1"),
    ({"MAXTRAIN_NUM_PROCESSES": "2", "MAXTRAIN_COORDINATOR": "h:1"}, "set MAXTRAIN_PROCESS_ID"),
    ({"MAXTRAIN_NUM_PROCESSES": "2", "MAXTRAIN_PROCESS_ID": "1"}, "no coordinator address: set MAXTRAIN_COORDINATOR"),
    ({"MAXTRAIN_PROCESS_ID": "1", "MAXTRAIN_COORDINATOR": "h:1"}, "set MAXTRAIN_NUM_PROCESSES"),
    ({"MAXTRAIN_COORDINATOR": "nohostport", "MAXTRAIN_NUM_PROCESSES": "2", "MAXTRAIN_PROCESS_ID": "0"},
     "MAXTRAIN_COORDINATOR='nohostport' must be host:port"),
    ({"JOB_COMPLETION_INDEX": "1", "MAXTRAIN_NUM_PROCESSES": "2"}, "set MAXTRAIN_COORDINATOR"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, "set MAXTRAIN_COORDINATOR"),
    ({**SLURM, "SLURM_STEP_NODELIST": "gpu[1-"}, "SLURM_STEP_NODELIST='gpu[1-' is not a Slurm host list"),
    ({"MAXTRAIN_LOCAL_DEVICE_IDS": "0,x", "MAXTRAIN_NUM_PROCESSES": "1"}, "MAXTRAIN_LOCAL_DEVICE_IDS='0,x'"),
])
def test_detect_rejects_bad_environments(env, message):
    with pytest.raises(DistributedError, match=None) as e:
        detect(env)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_device_count_check_and_timeout_messages():
    distributed.check_device_counts({0: 4, 1: 4})
    with pytest.raises(DistributedError, match=r"process 0: 4, process 1: 2"):
        distributed.check_device_counts({0: 4, 1: 2})
    spec = DistributedSpec("n1:5", 4, 2, names={"coordinator": "SLURM_STEP_NODELIST"})
    assert "could not reach the coordinator n1:5 (from SLURM_STEP_NODELIST)" in distributed.timeout_message(
        spec, 9, False)
    assert "reached the coordinator n1:5 but" in distributed.timeout_message(spec, 9, True)
    assert distributed.timeout_from_env({"MAXTRAIN_INIT_TIMEOUT_S": "7"}) == 7
    with pytest.raises(DistributedError):
        distributed.timeout_from_env({"MAXTRAIN_INIT_TIMEOUT_S": "0"})


# ---------------------------------------------------------------- launcher pieces


def test_launcher_placement_and_child_environment():
    assert launcher.placements(2, 4, []) == [launcher.Placement(cpu_devices=4)] * 2
    assert launcher.placements(2, None, []) == [launcher.Placement(cpu_devices=1)] * 2
    gpus = launcher.placements(2, None, ["0", "1", "2", "3"])
    assert [p.gpus for p in gpus] == [("0", "1"), ("2", "3")]
    with pytest.raises(launcher.ConfigError, match="do not split evenly"):
        launcher.placements(3, None, ["0", "1", "2", "3"])
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/x", "SLURM_PROCID": "3",
            "HOME": "/h", "JOB_COMPLETION_INDEX": "2"}
    env = launcher.child_env(base, 1, 2, "127.0.0.1:5", launcher.Placement(cpu_devices=4))
    assert env["XLA_FLAGS"] == "--xla_dump_to=/x --xla_force_host_platform_device_count=4"
    assert (env["MAXTRAIN_PROCESS_ID"], env["MAXTRAIN_NUM_PROCESSES"], env["JAX_PLATFORMS"]) == ("1", "2", "cpu")
    assert "SLURM_PROCID" not in env and "JOB_COMPLETION_INDEX" not in env and env["HOME"] == "/h"
    assert detect(env) == DistributedSpec("127.0.0.1:5", 2, 1, None, "env")
    assert launcher.child_env({}, 0, 2, "h:1", gpus[1])["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert launcher.visible_gpus({"CUDA_VISIBLE_DEVICES": "4, 5"}) == ["4", "5"]
    assert launcher.exit_code(-9) == 137 and launcher.exit_code(75) == 75
    assert launcher.should_restart(1, 0, 2) and not launcher.should_restart(2, 0, 2)
    assert not launcher.should_restart(1, 2, 2) and not launcher.should_restart(0, 0, 2)


def test_launch_rejects_bad_options(capsys):
    assert cli.main(["launch", "local", "--processes", "0", TINY]) == 2
    assert "--processes must be at least 1" in capsys.readouterr().err
    assert cli.main(["launch", "local", "--processes", "2", "--cpu-devices", "0", TINY]) == 2
    assert "--cpu-devices must be at least 1" in capsys.readouterr().err


# ---------------------------------------------------------------- schedulers' files


@pytest.mark.parametrize("tasks, srun_exit, code, requeued", [
    ("", PREEMPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, True),  # no task records: srun's code
    ("0:75 1:75", PREEMPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, True),
    ("1:76 0:134", 134, 76, True),  # the watchdog's exit first, then the coordinator's peer aborted
    ("0:1 1:75", 75, 1, False),  # a crash first; the peer saved on srun's SIGTERM: not a preemption
    ("0:77", 77, 77, False), ("0:2 1:2", 2, 2, False), ("", 1, 1, False), ("0:0 1:0", 0, 0, False)])
def test_slurm_script_requeues_only_when_the_first_failure_is_a_preemption_or_a_hang(
        tmp_path, tasks, srun_exit, code, requeued):
    script = os.path.join(ROOT, "launch", "slurm", "train.sbatch")
    text = open(script).read()
    assert f"PREEMPTED_EXIT_CODE={PREEMPTED_EXIT_CODE}" in text and "#SBATCH --signal=TERM@" in text
    assert "#SBATCH --requeue" in text and "--ntasks-per-node=1" in text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # stand-ins that record their arguments; srun runs its command once per task of TASKS
    # ("rank:code ..." in the order they end) with a `maxtrain` that exits with that code
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "scontrol $*" >> "$LOG"\n')
    (bin_dir / "srun").write_text('#!/bin/sh\necho "srun $*" >> "$LOG"\nshift\n'
                                  'for t in $TASKS; do SLURM_PROCID=${t%%:*} TASK_CODE=${t#*:} "$@"; done\n'
                                  'exit "$SRUN_EXIT"\n')
    (bin_dir / "maxtrain").write_text('#!/bin/sh\nexit "$TASK_CODE"\n')
    for tool in ("srun", "scontrol", "maxtrain"):
        (bin_dir / tool).chmod(0o755)
    log = tmp_path / "log"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log), "SRUN_EXIT": str(srun_exit), "TASKS": tasks,
           "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "t", "HOME": str(tmp_path)}
    if tasks:  # node-local scratch for the local checkpoint tier, passed on when set
        env["LOCAL_CKPT_DIR"] = "/scratch/t"
    run = subprocess.run(["bash", script, "configs/tiny.yaml", "train.steps=5"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == code, run.stdout + run.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("srun --kill-on-bad-exit=1 bash -c ")
    assert " task maxtrain train configs/tiny.yaml checkpoint.dir=" in calls[0] and calls[0].endswith("train.steps=5")
    assert ("checkpoint.local.dir=/scratch/t train.steps=5" in calls[0]) == bool(tasks)
    assert ("scontrol requeue 77" in calls) == requeued
    assert not list((tmp_path / "runs" / "t" / "slurm-exits").iterdir())  # the records are removed


def test_jobset_manifest_has_what_a_multi_host_run_needs():
    with open(os.path.join(ROOT, "launch", "k8s", "jobset.yaml")) as f:
        js = yaml.safe_load(f)
    assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    spec = js["spec"]
    assert spec["network"]["enableDNSHostnames"] is True and spec["failurePolicy"]["maxRestarts"] > 0
    (rjob,) = spec["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert int(env["MAXTRAIN_NUM_PROCESSES"]["value"]) == job["parallelism"] == job["completions"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert any(a.startswith("checkpoint.dir=") for a in container["args"])
    assert container["ports"][0]["containerPort"] == int(env["MAXTRAIN_COORDINATOR_PORT"]["value"])
    assert "jobset-name" in env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    # what the pod of index 1 sees resolves to pod 0 under the headless service
    pod_env = {"JOB_COMPLETION_INDEX": "1", "JOBSET_NAME": js["metadata"]["name"],
               "REPLICATED_JOB_NAME": rjob["name"], **{k: e["value"] for k, e in env.items() if "value" in e}}
    got = detect(pod_env)
    name = js["metadata"]["name"]
    assert (got.process_id, got.coordinator) == (1, f"{name}-{rjob['name']}-0-0.{name}:8476")
    rule = job["podFailurePolicy"]["rules"][0]
    assert rule["onExitCodes"]["values"] == [2] and spec["failurePolicy"]["rules"][0]["action"] == "FailJobSet"
    # exit 78 (a condemned node) restarts the pods, within maxRestarts, off the nodes labelled unhealthy;
    # the report names a pod's node by spec.nodeName
    unhealthy = [r for r in job["podFailurePolicy"]["rules"] if 78 in r["onExitCodes"]["values"]]
    assert [r["action"] for r in unhealthy] == ["Count"]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "maxtrain.io/unhealthy", "operator": "DoesNotExist"}]
    assert env["MAXTRAIN_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


# JobSet v1alpha2's fields (jobset.sigs.k8s.io/docs/reference/jobset.v1alpha2; its CRD is not in the
# Kubernetes schemas): what the manifest may use, and the values its enums allow
JOBSET_FIELDS = {
    "spec": {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
             "coordinator", "managedBy", "ttlSecondsAfterFinished"},
    "network": {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"},
    "failurePolicy": {"maxRestarts", "rules", "restartStrategy"},
    "rule": {"name", "action", "onJobFailureReasons", "targetReplicatedJobs"},
    "replicatedJob": {"name", "template", "replicas", "dependsOn"},
}
JOBSET_ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"}
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy"}


def _jobset_problems(js: dict) -> list[str]:
    """What in a JobSet manifest the Kubernetes schemas (its Job template, validated strictly as a
    batch/v1 Job by kubernetes-validate) or the JobSet API's fields reject; empty when valid."""
    import kubernetes_validate

    problems = []
    if (js.get("apiVersion"), js.get("kind")) != ("jobset.x-k8s.io/v1alpha2", "JobSet"):
        problems.append(f"not a JobSet v1alpha2: {js.get('apiVersion')} {js.get('kind')}")
    spec = js.get("spec", {})
    for part, fields in (("spec", spec), ("network", spec.get("network", {})),
                         ("failurePolicy", spec.get("failurePolicy", {}))):
        problems += [f"{part}.{k} is not a JobSet field" for k in set(fields) - JOBSET_FIELDS[part]]
    for rule in spec.get("failurePolicy", {}).get("rules", []):
        problems += [f"rule field {k}" for k in set(rule) - JOBSET_FIELDS["rule"]]
        if rule.get("action") not in JOBSET_ACTIONS:
            problems.append(f"rule action {rule.get('action')}")
        problems += [f"job failure reason {r}" for r in set(rule.get("onJobFailureReasons", [])) - JOB_FAILURE_REASONS]
    for rjob in spec.get("replicatedJobs", []):
        problems += [f"replicatedJob field {k}" for k in set(rjob) - JOBSET_FIELDS["replicatedJob"]]
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{js['metadata']['name']}-{rjob['name']}-0"},
               **{k: v for k, v in rjob["template"].items() if k != "metadata"}}
        try:
            kubernetes_validate.validate(job, "1.31", strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"replicatedJob {rjob['name']}: {e.message}")
    return problems


def test_jobset_validates_against_the_kubernetes_schemas_and_the_jobset_api():
    """launch/k8s/jobset.yaml: its Job template is a valid batch/v1 Job under Kubernetes 1.31's
    schemas (strict: no unknown field), its JobSet fields and enums are the API's; and the check
    fails on planted mistakes."""
    import copy

    with open(os.path.join(ROOT, "launch", "k8s", "jobset.yaml")) as f:
        js = yaml.safe_load(f)
    assert _jobset_problems(js) == []
    job = lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"]  # noqa: E731
    pod = lambda d: job(d)["template"]["spec"]  # noqa: E731
    planted = []
    for mutate in (lambda d: job(d).update(backoffLimit="zero"),  # a wrong type
                   lambda d: pod(d)["containers"][0].update(envv=[]),  # a misspelt field (strict)
                   lambda d: pod(d).update(restartPolicy=7),
                   lambda d: d["spec"]["failurePolicy"]["rules"][0].update(action="Retry"),  # not a JobSet action
                   lambda d: d["spec"].update(maxRestarts=3)):  # a JobSet field in the wrong place
        bad = copy.deepcopy(js)
        mutate(bad)
        planted.append(_jobset_problems(bad))
    assert all(planted), planted
