"""launch/slurm/train.sbatch under a real Slurm: a one-node cluster on this machine
(launch/slurm/local_cluster.sh: munged, slurmctld, slurmd), `sbatch` with 2 tasks, each a JAX
process with 4 fake CPU devices that finds its rank and coordinator in Slurm's environment.

One job goes through what a job on a busy cluster goes through: an injected hang (the watchdog's
exit 76, requeued), `scancel --signal=TERM` (a checkpoint, exit 75, requeued), then a plain
`scancel` (the job is gone); a second submission resumes from what the first left. Every loss
it logs equals an uninterrupted `maxtrain launch local --processes 2` on the same mesh, bitwise.
A config error exits 2, is not requeued and is in the job's output file. A node condemned by the
preflight (exit 78) is requeued with that node in the job's ExcNodeList (on this one-node cluster
the requeued job then pends: the test asserts what the script asked Slurm for), and past
MAX_EXCLUDED_NODES the job fails with one line instead.

The cluster needs root and `apt-get install slurm-wlm munge` (`.ci/run` installs them); without
them these tests skip, with the reason in the summary.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import FAST_COMPILE, ROOT, TINY
from test_launch import MESH_2x4, _env, _launch_argv, _losses
from test_preflight import LOOSE

pytestmark = pytest.mark.slow

CLUSTER = os.path.join(ROOT, "launch", "slurm", "local_cluster.sh")
SBATCH = os.path.join(ROOT, "launch", "slurm", "train.sbatch")
# 2 tasks on the one node, 1 CPU each; the script's own GPU and CPU requests are for real nodes
SHAPE = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]
STEPS = 20
TRAIN = MESH_2x4 + [f"train.steps={STEPS}", "checkpoint.every=3"]
# only in the Slurm job: a hang before step 5 in its first attempt (drills fire in attempt 0), a
# watchdog that notices in 5 s, and steps slowed down so that the signals below land mid-run
FAULTS = ["drills.hang_step=4", "drills.process=1", "reliability.hang_timeout_s=5", "drills.sleep_s=0.15"]


class Cluster:
    def __init__(self, path):
        self.path = path
        self.env = {**os.environ, "SLURM_CONF": str(path / "slurm.conf")}

    def run(self, *argv, timeout=30) -> str:
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"{' '.join(argv)}: {out.stderr.strip()}"
        return out.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as fields (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "-o", "show", "job", job_id)
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n" + (self.path / name).read_text()[-3000:]
                         for name in ("slurmctld.log", "slurmd.log") if (self.path / name).exists())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [t for t in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"no Slurm here ({', '.join(missing)} not found): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("a local Slurm cluster needs root (slurmd starts jobs as their users)")
    path = tmp_path_factory.mktemp("slurm")
    start = subprocess.run(["bash", CLUSTER, "start", str(path)], capture_output=True, text=True, timeout=120)
    if start.returncode != 0:
        pytest.skip(f"Slurm did not start: {start.stderr.strip().splitlines()[-1:]}")
    try:
        yield Cluster(path)
    finally:
        subprocess.run(["bash", CLUSTER, "stop", str(path)], capture_output=True, timeout=60)


def _job_env(tmp, name) -> dict:
    """What `sbatch` passes on to the job (Slurm exports the submitting environment)."""
    return _env(tmp / "cache", XLA_FLAGS=f"--xla_force_host_platform_device_count=4{FAST_COMPILE}",
                MAXTRAIN_INIT_TIMEOUT_S=120, MAXTRAIN=f"{sys.executable} -m maxtrain.cli",
                CKPT_DIR=tmp / f"ck_{name}", RUN_DIR=tmp / f"run_{name}")


def _sbatch(cluster, tmp, name, *overrides, env_extra=None) -> str:
    env = {**_job_env(tmp, name), "SLURM_CONF": cluster.env["SLURM_CONF"], **(env_extra or {})}
    out = subprocess.run(["sbatch", "--parsable", *SHAPE, f"--job-name={name}", f"--output={tmp / name}.out",
                          f"--chdir={tmp}", SBATCH, TINY, *overrides],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _wait(what, predicate, cluster, output, timeout=240):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            text = output.read_text()[-6000:] if output.exists() else "(no job output)"
            pytest.fail(f"timed out waiting for {what}\n{text}\n{cluster.logs()}")
        time.sleep(0.25)


def _steps(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def test_sbatch_trains_like_launch_local_through_a_hang_a_preemption_and_a_cancel(cluster, tmp_path):
    # the reference, uninterrupted, beside the Slurm job: launch local, the same 2 processes, mesh and
    # XLA flags (the suite's quick LLVM settings: the same compiled programs, so bitwise equal losses)
    ref = subprocess.Popen(_launch_argv(f"run_dir={tmp_path / 'run_ref'}", f"checkpoint.dir={tmp_path / 'ck_ref'}",
                                        *TRAIN[len(MESH_2x4):]),
                           env=_env(tmp_path / "cache", XLA_FLAGS=FAST_COMPILE.strip()), stdout=subprocess.DEVNULL,
                           stderr=open(tmp_path / "ref.err", "w"), start_new_session=True)
    try:
        run_dir, out = tmp_path / "run_job", tmp_path / "job.out"
        job = _sbatch(cluster, tmp_path, "job", *TRAIN, *FAULTS)
        # attempt 0 hangs before step 5: the watchdog exits 76, the script requeues
        _wait("the requeue after the hang", lambda: cluster.job(job).get("Restarts") == "1", cluster, out)
        # attempt 1 resumes from step 3; SIGTERM to the tasks: they save, exit 75, the script requeues
        _wait("step 7 in the second attempt", lambda: any(r["step"] >= 7 for r in _steps(run_dir)), cluster, out)
        cluster.run("scancel", "--signal=TERM", job)
        _wait("the requeue after SIGTERM", lambda: cluster.job(job).get("Restarts") == "2", cluster, out)
        term_step = max(r["step"] for r in _steps(run_dir))
        # attempt 2 resumes from the step SIGTERM saved; a plain scancel ends the job for good
        _wait(f"step {term_step + 4} in the third attempt",
              lambda: any(r["step"] >= term_step + 4 for r in _steps(run_dir)), cluster, out)
        cluster.run("scancel", job)
        _wait("the cancelled job to end", lambda: cluster.job(job)["JobState"] == "CANCELLED", cluster, out)
        first = out.read_text()
        cancel_step = max(r["step"] for r in _steps(run_dir))
        assert cancel_step < STEPS, "the job finished before it was cancelled: slow its steps down"
        # a new submission with the same directories takes over from the checkpoint the first left
        again = _sbatch(cluster, tmp_path, "job", *TRAIN, *FAULTS)
        _wait("the second submission to finish", lambda: cluster.job(again)["JobState"] not in ("PENDING", "RUNNING",
                                                                                               "CONFIGURING", "COMPLETING"),
              cluster, out, timeout=300)
        assert ref.wait(timeout=300) == 0, (tmp_path / "ref.err").read_text()[-4000:]
    finally:
        if ref.poll() is None:
            os.killpg(ref.pid, signal.SIGKILL)
        subprocess.run(["scancel", "--full", "--signal=KILL", "-u", "root"], env=cluster.env, capture_output=True)
    text = out.read_text()
    end = cluster.job(again)
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("COMPLETED", "0:0", "0"), text[-6000:]
    # the script's own account of each attempt, in the job's output file
    assert "exit 76 with a checkpoint" in first and "exit 75 with a checkpoint" in first, first[-6000:]
    assert [int(n) for n in re.findall(r"^maxtrain: job \d+ restart (\d+) on localhost", text, re.M)] == [0, 1, 2, 0]
    assert "fault injection: hanging before step 5" in first
    # what each attempt resumed from: 3 (the last periodic checkpoint before the hang), the step
    # SIGTERM stopped at, and for the new submission the newest checkpoint the cancelled job left
    resumed = [int(n) for n in re.findall(r" state resumed .* at step (\d+)$", text, re.M)]
    assert resumed[:2] == [3, term_step], text[-6000:]
    assert len(resumed) == 3 and term_step < resumed[2] <= cancel_step, (resumed, term_step, cancel_step)
    # every step logged by every attempt, redone ones included, equals the uninterrupted run's
    ref_losses = _losses(tmp_path / "run_ref")
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    records = _steps(run_dir)
    assert {r["step"] for r in records} == set(ref_losses)
    assert [(r["step"], r["loss"]) for r in records if r["loss"] != ref_losses[r["step"]]] == []


def test_a_config_error_exits_2_is_not_requeued_and_is_in_the_job_output(cluster, tmp_path):
    job = _sbatch(cluster, tmp_path, "bad", *MESH_2x4, "train.stpes=5")
    out = tmp_path / "bad.out"
    _wait("the job to fail", lambda: cluster.job(job)["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING",
                                                                          "COMPLETING"), cluster, out, timeout=120)
    end, text = cluster.job(job), out.read_text()
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("FAILED", "2:0", "0"), text
    errors = [line for line in text.splitlines() if line.startswith("maxtrain: error:")]
    assert errors and all("train.stpes" in line for line in errors), text
    assert "Traceback" not in text and "requeueing" not in text


def _ended(cluster, job) -> bool:
    return cluster.job(job)["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")


def test_a_condemned_node_is_left_out_of_the_requeued_job(cluster, tmp_path):
    """The preflight drill condemns rank 1; its node (Slurm's name for it, `localhost` here) goes into
    the requeued job's ExcNodeList and the job's exclusion file; with MAX_EXCLUDED_NODES=0 the same
    verdict fails the job with exit 78 and one line, unrequeued."""
    sick = [*MESH_2x4, "reliability.preflight=quick", *LOOSE, "drills.preflight_slow=matmul",
            "drills.preflight_factor=6", "drills.process=1", "train.steps=3"]
    job = _sbatch(cluster, tmp_path, "sick", *sick)
    out = tmp_path / "sick.out"
    try:
        _wait("the requeue that excludes the node",
              lambda: (lambda f: (f.get("ExcNodeList"), f["JobState"]) == ("localhost", "PENDING"))(cluster.job(job)),
              cluster, out, timeout=240)
        fields, text = cluster.job(job), out.read_text()
        assert fields["Restarts"] == "1" and fields["JobState"] == "PENDING", (fields, text[-4000:])
        assert f"maxtrain: requeueing job {job} excluding localhost" in text, text[-4000:]
        assert "preflight condemned 1 of 2 processes: rank 1 (localhost): matmul_tflops" in text, text[-4000:]
        assert (tmp_path / "run_sick" / "slurm-excluded" / job).read_text().split() == ["localhost"]
        assert not (tmp_path / "run_sick" / "metrics.jsonl").exists()  # no step was trained on it
    finally:
        subprocess.run(["scancel", job], env=cluster.env, capture_output=True)

    capped = _sbatch(cluster, tmp_path, "capped", *sick, env_extra={"MAX_EXCLUDED_NODES": "0"})
    out = tmp_path / "capped.out"
    _wait("the capped job to fail", lambda: _ended(cluster, capped), cluster, out, timeout=240)
    end, text = cluster.job(capped), out.read_text()
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("FAILED", "78:0", "0"), text[-4000:]
    assert "more than MAX_EXCLUDED_NODES=0: not requeueing" in text and "requeueing job" not in text, text[-4000:]
    assert end.get("ExcNodeList") in (None, "(null)")
