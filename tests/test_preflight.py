"""Preflight (maxtrain/reliability/preflight.py): the judging rules on made-up tables, then real
multi-process jobs on localhost (gloo) where one process is made slow by a drill sized just past
the default threshold: the preflight names exactly that rank and that check, and `train` exits 78.
On a CPU only the comparison with the job's median can be exercised (a CPU has no device-table
entry); the healthy repetitions are bench/preflight.py's, not the suite's."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import TINY
from maxtrain import exit_codes
from maxtrain.reliability import preflight
from test_launch import MAIN, _env

TH = preflight.Thresholds()


# ---------------------------------------------------------------- the rules


def test_ring_rounds_pair_each_process_once_and_cover_every_link():
    for n in range(2, 10):
        links = preflight.ring_links(n)
        rounds = preflight.ring_rounds(links)
        assert sorted(link for r in rounds for link in r) == sorted(links)
        for r in rounds:
            ends = [p for pair in r for p in pair]
            assert len(ends) == len(set(ends))
        assert len(rounds) == (1 if n == 2 else 2 if n % 2 == 0 else 3)
    assert preflight.ring_links(1) == []


def _judge(table, kinds=None, links=None, names=("matmul_tflops", "checkpoint_write_mb_s", "data_all_reduce_gb_s"),
           peaks=None):
    table = np.asarray(table, np.float64)
    return preflight.judge(list(names), table, kinds or ["gpu"] * len(table), links or {}, peaks or {}, TH)


def test_a_device_past_the_slack_is_condemned_for_that_figure_only():
    healthy = [100.0, 500.0, 50.0]
    got = _judge([healthy, healthy, [100 * 0.85, 500, 50], healthy])  # 15% slow GEMMs
    assert list(got) == [2] and list(got[2]) == ["matmul_tflops"]
    assert _judge([healthy, healthy, [100 * 0.93, 500, 50], healthy]) == {}  # within the 10% slack
    # storage has its own (wider) slack; collectives never condemn (everyone waits for the slowest)
    got = _judge([healthy, [100, 200, 50], [100, 500, 5], healthy])
    assert list(got) == [1] and list(got[1]) == ["checkpoint_write_mb_s"]


def test_memory_bandwidth_is_judged_on_devices_with_their_own_memory_only():
    rows = [[100.0, 50.0]] * 3 + [[100.0, 20.0]]  # the last one's memory pass at 40%
    names = ("matmul_tflops", "hbm_gb_s")
    got = _judge(rows, names=names)
    assert list(got) == [3] and list(got[3]) == ["hbm_gb_s"]
    assert _judge(rows, kinds=["cpu"] * 4, names=names) == {}  # fake CPU devices share the host's memory


def test_a_heterogeneous_cluster_is_judged_within_each_device_kind():
    rows = [[100.0, 500, 50]] * 3 + [[60.0, 500, 50]] * 3
    assert _judge(rows, kinds=["H100"] * 3 + ["A100"] * 3) == {}
    assert list(_judge(rows)) == [3, 4, 5]  # the same table as one kind: the slow half is condemned


def test_the_device_table_condemns_a_device_far_below_its_peak():
    rows = [[200.0, 500, 50]] * 4
    got = _judge(rows, kinds=["NVIDIA H100"] * 4, peaks={"NVIDIA H100": 989.0})
    assert sorted(got) == [0, 1, 2, 3] and all("matmul_peak" in why for why in got.values())
    assert _judge(rows, kinds=["cpu"] * 4, peaks={"cpu": None}) == {}


def test_a_slow_link_names_its_ends_and_two_slow_links_name_the_host_between():
    rows = [[100.0, 500, 50]] * 4
    one = {(0, 1): 10.0, (1, 2): 5.0, (2, 3): 10.0, (3, 0): 10.0}
    got = _judge(rows, links=one)
    assert sorted(got) == [1, 2] and all(list(why) == ["link 1<->2"] for why in got.values())
    two = {(0, 1): 10.0, (1, 2): 5.0, (2, 3): 5.0, (3, 0): 10.0}
    got = _judge(rows, links=two)
    assert list(got) == [2] and sorted(got[2]) == ["link 1<->2", "link 2<->3"]
    # a ring of three: every link shares an end with the others, so the bar is the fastest other
    # link (the median of the other two would hold the slow host's second link)
    three = {(0, 1): 10.0, (1, 2): 5.0, (2, 0): 5.0}
    got = _judge(rows[:3], links=three)
    assert list(got) == [2] and sorted(got[2]) == ["link 1<->2", "link 2<->0"]


def test_preflight_off_in_yaml_or_on_the_command_line_is_off():
    from maxtrain.config import ConfigError, load_config

    for value in ("off", "false", "'off'"):  # YAML reads a bare off as false
        cfg = load_config(TINY, [f"reliability.preflight={value}"])
        assert preflight.resolve_mode(cfg.reliability.preflight, 8) == "off"
    assert preflight.resolve_mode(load_config(TINY, []).reliability.preflight, 2) == "quick"
    assert preflight.resolve_mode(load_config(TINY, []).reliability.preflight, 1) == "off"
    assert preflight.resolve_mode(load_config(TINY, ["reliability.preflight=full"]).reliability.preflight, 1) == "full"
    with pytest.raises(ConfigError, match="reliability.preflight='sometimes' is not valid"):
        load_config(TINY, ["reliability.preflight=sometimes"])


def test_a_drill_stretches_the_timed_work():
    # 50 ms of work: a loaded machine's oversleep (several ms on CI's 2 busy cores) is small beside it
    work = lambda: time.sleep(0.05)  # noqa: E731
    base = preflight.best_time(work, 3)
    assert 1.4 < preflight.best_time(work, 3, stretch=1.5) / base < 1.7


# ---------------------------------------------------------------- real jobs on localhost


def _preflight_job(tmp_path, processes, *overrides):
    """`maxtrain preflight` as `processes` ranks of one CPU device each; (exit code, output, report)."""
    out = tmp_path / "preflight.json"
    code = ("import sys; from maxtrain.launcher import launch_local; "
            f"sys.exit(launch_local(['preflight', {TINY!r}, 'mesh.data={processes}', 'mesh.fsdp=1', "
            f"'--mode', 'quick', '--out', {str(out)!r}, *sys.argv[1:]], {processes}, cpu_devices=1, grace_s=2))")
    r = subprocess.run([sys.executable, "-c", code, *overrides], env=_env(), capture_output=True, text=True,
                       timeout=240)
    report = json.loads(out.read_text()) if out.exists() else None
    return r.returncode, r.stdout + r.stderr, report


# The suite's drills run beside another test worker on CI's 2 cores, where timings swing by tens of
# percent and a neighbour's load can mask a drill just past a threshold: here they are sized far past
# looser thresholds, to check that the right rank and check are named end to end. How close to the
# default thresholds a drill is caught (and how often a healthy job is not condemned) is measured on
# an idle machine by bench/preflight.py; the rules themselves are the table tests above.
LOOSE = ["reliability.preflight_compute_slack=0.35", "reliability.preflight_storage_slack=0.7",
         "reliability.preflight_link_slack=0.6"]
DRILLS = [  # processes, check, factor (past its threshold), process, expected {rank: [checks]}
    (2, "matmul", 6.0, 1, {1: ["matmul_tflops"]}),
    (3, "link", 8.0, 0, {0: ["link 0<->1"], 1: ["link 0<->1"]}),
    (3, "collective", 8.0, 2, {2: ["link 1<->2", "link 2<->0"]}),
    (2, "storage", 15.0, 1, {1: ["checkpoint_write_mb_s"]}),
]


@pytest.mark.parametrize("processes,check,factor,process,expected", DRILLS, ids=[d[1] for d in DRILLS])
def test_preflight_names_the_drilled_rank_and_check(tmp_path, processes, check, factor, process, expected):
    ck = tmp_path / "ck"
    code, out, report = _preflight_job(tmp_path, processes, f"checkpoint.dir={ck}", *LOOSE,
                                       f"drills.preflight_slow={check}", f"drills.preflight_factor={factor}",
                                       f"drills.process={process}")
    assert code == exit_codes.UNHEALTHY, out[-3000:]
    got = {c["rank"]: sorted(c["checks"]) for c in report["condemned"]}
    assert got == expected, out[-3000:]
    for rank in expected:
        assert f"preflight condemned rank {rank} " in out  # the launcher says which rank, and why
    assert not os.path.exists(ck / ".maxtrain-preflight")  # the probes' private directory is gone


def test_train_runs_the_preflight_and_exits_78_on_a_condemned_node(tmp_path):
    """`reliability.preflight: auto` is on for a multi-process job: a drilled rank stops the job before
    the first step with exit 78, run_dir/preflight.json naming it; a healthy job trains."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-c", MAIN, "launch", "local", "--processes", "2", "--cpu-devices", "1", "--grace", "2",
            TINY, "mesh.data=2", "mesh.fsdp=1", "train.steps=2", "train.batch_size=4", "train.seq_len=32",
            "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64",
            f"run_dir={run_dir}", *LOOSE, "drills.preflight_slow=matmul", "drills.preflight_factor=6",
            "drills.process=1"]
    r = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == exit_codes.UNHEALTHY, (r.stdout + r.stderr)[-3000:]
    report = json.loads((run_dir / "preflight.json").read_text())
    assert [c["rank"] for c in report["condemned"]] == [1] and not report["healthy"]
    assert "preflight condemned rank 1 " in r.stdout + r.stderr
    assert "(a node condemned by preflight" not in r.stdout  # not restarted: launch local has no other node
    assert not (run_dir / "metrics.jsonl").exists()


# ---------------------------------------------------------------- in the run: the straggler watch

SMALL_RUN = [TINY, "mesh.data=2", "mesh.fsdp=1", "train.batch_size=4", "train.seq_len=32", "model.d_model=32",
             "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64", "reliability.preflight=off",
             "reliability.straggler_every=2", "reliability.straggler_evict_after=2", *LOOSE]


def _launch_2(tmp_path, *overrides):
    argv = [sys.executable, "-c", MAIN, "launch", "local", "--processes", "2", "--cpu-devices", "1", "--grace", "2",
            *SMALL_RUN, *overrides]
    r = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def test_a_process_that_stays_slow_in_compute_mid_run_is_evicted_after_saving(tmp_path):
    """drills.straggler_factor slows rank 1's devices from the first step: slow at the comparisons of
    steps 2 and 4, it is condemned at the second (straggler_evict_after=2); step 4 is saved, the job
    exits 78, run_dir/stragglers.json names rank 1 and its check, and the launcher names the rank."""
    run_dir, ck = tmp_path / "run", tmp_path / "ck"
    code, out = _launch_2(tmp_path, "train.steps=30", "checkpoint.every=100", f"checkpoint.dir={ck}",
                          f"run_dir={run_dir}", "drills.straggler_factor=4", "drills.process=1")
    assert code == exit_codes.UNHEALTHY, out[-3000:]
    report = json.loads((run_dir / "stragglers.json").read_text())
    assert [(c["rank"], c["checks"]) for c in report["condemned"]] == [(1, ["matmul_tflops"])], report
    assert "the straggler watch condemned rank 1 (" in out
    with open(run_dir / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert max(steps) == 4, steps  # stopped after the second comparison, not at train.steps
    assert sorted(p.name for p in ck.iterdir() if p.name.isdigit()) == ["4"]  # the step it left at is saved
    saves = json.loads((run_dir / "goodput.json").read_text())["attempts"][-1]["saves"]
    assert [(s["step"], s["kind"]) for s in saves] == [(4, "eviction")]


def test_a_slow_data_loader_is_reported_not_evicted(tmp_path):
    """drills.sleep_s slows rank 1's host work before every step (what a slow data loader looks like):
    named at every comparison, never evicted (its devices are as fast as the others')."""
    run_dir = tmp_path / "run"
    code, out = _launch_2(tmp_path, "train.steps=6", f"run_dir={run_dir}", "drills.sleep_s=0.3", "drills.process=1")
    assert code == 0, out[-3000:]
    assert out.count("straggler: process 1 (") >= 3 and "condemned" not in out
    with open(run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert records[-1]["step"] == 6 and records[-1]["stragglers"] == [1]
    assert not (run_dir / "stragglers.json").exists()


def test_a_re_measurement_confirms_a_check_not_the_exact_link():
    found = {2: {"link 1<->2": "a", "link 2<->0": "b"}, 1: {"matmul_tflops": "c"}}
    again = {2: {"link 2<->0": "b2"}, 1: {"hbm_gb_s": "d"}}  # rank 1's matmul not repeated: noise
    assert preflight.confirmed(found, again) == {2: {"link 2<->0": "b2"}}
    assert preflight.confirmed(found, {}) == {}
    # noise picked the other of the slow host's links this time: still its link check, confirmed
    assert preflight.confirmed({2: {"link 1<->2": "a"}}, {2: {"link 2<->0": "b"}}) == {2: {"link 2<->0": "b"}}
    # noise slowed rank 0's healthy link once, so it looked like a slow host; the re-judged links
    # (each at its best over both measurements) leave 0<->1 alone slow: both of its ends are named
    found = {0: {"link 0<->1": "a", "link 2<->0": "b"}}
    again = {0: {"link 0<->1": "c"}, 1: {"link 0<->1": "c"}}
    assert preflight.confirmed(found, again) == again


def test_re_measurements_judge_each_figure_and_link_at_its_best():
    """A process slow once (noise) is cleared by a re-measurement where it is not; one slow every
    time stays condemned; a healthy link slowed once, which made rank 0 look like a slow host
    (two slow links), is judged at its best: the slow link 0<->1 alone remains, both ends named."""
    names = ["matmul_tflops", "checkpoint_write_mb_s", "data_all_reduce_gb_s"]
    kinds = ["gpu"] * 3

    def fold(measurements):
        table, links = measurements[0]
        found = preflight.judge(names, table, kinds, links, {}, TH)
        for more in measurements[1:]:
            found, (table, links) = preflight.rejudge(found, (table, links), more, names, kinds, {}, TH)
        return found

    ok = {(0, 1): 5.0, (1, 2): 5.0, (2, 0): 5.0}
    once = np.array([[100.0, 500, 50], [80, 500, 50], [100, 500, 50]])
    fine = np.array([[100.0, 500, 50], [99, 500, 50], [100, 500, 50]])
    assert fold([(once, ok), (once, ok), (fine, ok), (once, ok)]) == {}
    got = fold([(once, ok)] * 4)
    assert list(got) == [1] and list(got[1]) == ["matmul_tflops"]
    slow = {(0, 1): 2.0, (1, 2): 5.0, (2, 0): 5.0}
    noisy = {(0, 1): 2.0, (1, 2): 5.0, (2, 0): 2.5}  # rank 0's other link slowed too, this once
    got = fold([(fine, noisy), (fine, slow), (fine, noisy)])
    assert got == {0: {"link 0<->1": got[0]["link 0<->1"]}, 1: {"link 0<->1": got[1]["link 0<->1"]}}
