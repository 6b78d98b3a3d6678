"""Long-run reliability: numerical guards in the step, the hang watchdog, restarts after injected
faults, goodput accounting and the exit codes the launchers share."""

import io
import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FAST_COMPILE, ROOT, SMALL, TINY
from maxtrain import load_config, train
from maxtrain.config import ConfigError, ReliabilityConfig
from maxtrain import launcher, reliability
from maxtrain.reliability import drills

pytestmark = pytest.mark.slow  # fault drills: crashes, hangs and restarts of real runs: `-m "not slow"` leaves them out

MAIN = "import sys; from maxtrain.cli import main; sys.exit(main(sys.argv[1:]))"
BASE = SMALL + ["mesh.data=2", "optim.decay_steps=8"]


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("MAXTRAIN_")}
    env.update({"PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
                "XLA_FLAGS": "--xla_force_host_platform_device_count=2" + FAST_COMPILE})
    return env


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_nan_step_is_skipped_inside_the_step(tmp_path):
    one = train(load_config(TINY, BASE + ["train.steps=1", f"run_dir={tmp_path / 'a'}"]), devices=jax.devices()[:2])
    nan = train(load_config(TINY, BASE + ["train.steps=2", "drills.nan_step=1",
                                          f"run_dir={tmp_path / 'b'}"]), devices=jax.devices()[:2])
    assert not np.isfinite(nan.history[1]["loss"]) and nan.history[1]["skipped_updates"] == 1.0
    _same(nan.state.params, one.state.params)  # the NaN step changed nothing
    _same(nan.state.opt_state, one.state.opt_state)
    assert int(nan.state.step) == 2  # its batch is consumed; the next step reads the next batch


def test_spike_detection_on_device():
    cfg = ReliabilityConfig(spike_sigma=4.0, spike_warmup=5)
    guard = reliability.init_guard()
    step = jnp.zeros((), jnp.int32)
    rng = np.random.default_rng(0)
    for loss in 3.0 + 0.01 * rng.normal(size=20):  # a calm run: nothing fires
        ok, guard = reliability.check_step(guard, jnp.float32(loss), jnp.float32(1.0), step, cfg)
        assert bool(ok)
        step = step + 1
    ok, spiked = reliability.check_step(guard, jnp.float32(5.0), jnp.float32(1.0), step, cfg)
    assert not bool(ok) and int(spiked["last_kind"]) == 2 and float(spiked["last_value"]) == 5.0
    assert float(spiked["loss_mean"]) == pytest.approx(float(guard["loss_mean"]))  # the spike is not learned
    ok, _ = reliability.check_step(guard, jnp.float32(3.0), jnp.float32(50.0), step, cfg)
    assert not bool(ok)  # a grad-norm spike
    ok, _ = reliability.check_step(guard, jnp.float32(5.0), jnp.float32(1.0), step,
                                   ReliabilityConfig(spike_action="none"))
    assert bool(ok)
    with pytest.raises(reliability.Halted, match="loss_spike at step 21"):
        reliability.report_events(jax.device_get(spiked), 0, ReliabilityConfig(spike_action="halt"))


def test_halt_exits_77_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-c", MAIN, "train", TINY, *BASE, "train.steps=4",
                        "drills.nan_step=1", "reliability.nan_action=halt", f"run_dir={tmp_path / 'r'}"],
                       env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == reliability.HALT_EXIT_CODE, r.stderr[-2000:]
    assert "maxtrain: halted: nan at step 2" in r.stderr and "Traceback" not in r.stderr


def test_watchdog_dumps_stacks_and_exits():
    exited, out = [], io.StringIO()
    cfg = ReliabilityConfig(hang_timeout_s=0.3, first_step_timeout_s=0.3)
    dog = reliability.Watchdog(cfg, exit_fn=exited.append, stream=out).start()
    deadline = time.monotonic() + 10
    while not exited and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert exited == [reliability.HANG_EXIT_CODE]
    assert "maxtrain-watchdog" in out.getvalue() or "Thread" in out.getvalue()
    calm = []
    dog = reliability.Watchdog(ReliabilityConfig(hang_timeout_s=0.3, first_step_timeout_s=0.3), exit_fn=calm.append,
                               stream=io.StringIO()).start()
    for _ in range(12):  # beating keeps it quiet
        dog.beat()
        time.sleep(0.05)
    dog.stop()
    assert calm == []
    # work between steps that may outlast one (compiling the replay or eval step, the final save)
    # is judged against first_step_timeout_s; the step clock restarts after it
    slow = []
    dog = reliability.Watchdog(ReliabilityConfig(hang_timeout_s=0.3, first_step_timeout_s=5), exit_fn=slow.append,
                               stream=io.StringIO()).start()
    dog.beat(), dog.beat()
    with dog.long_work():
        time.sleep(1.0)
    assert slow == []
    time.sleep(1.0)
    dog.stop()
    assert slow == [reliability.HANG_EXIT_CODE]


def test_a_data_read_that_never_returns_is_a_hang_not_a_stall(tmp_path):
    """A hung read before the first step (a prepared manifest that blocks, standing in for a stuck
    network filesystem) is bounded like a hung step: stacks, exit 76."""
    from maxtrain.data.prepare import prepare
    (tmp_path / "text.txt").write_text("\n\n".join(f"document {i} " * 40 for i in range(200)))
    data = tmp_path / "data"
    prepare(str(tmp_path / "text.txt"), str(data), shards=2, workers=1)
    (data / "manifest.json").unlink()  # regular files only are taken as shards; the manifest is opened as is
    os.mkfifo(data / "manifest.json")
    r = subprocess.run([sys.executable, "-c", MAIN, "train", TINY, *BASE, "mesh.data=-1", "model.vocab_size=264",
                        "data.kind=tokens", f"data.path={data}", "train.steps=3", "reliability.first_step_timeout_s=3",
                        "reliability.hang_timeout_s=3", f"run_dir={tmp_path / 'r'}"],
                       env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == reliability.HANG_EXIT_CODE, r.stderr[-3000:]
    assert "watchdog:" in r.stderr and "Thread MainThread" in r.stderr, r.stderr[-3000:]


# the crash comes right after the checkpoint of step 2: its checksums are committed with it, so the
# restart resumes from step 2 however soon the process dies after the save
@pytest.mark.parametrize("fault,code", [("hang_step=2", reliability.HANG_EXIT_CODE), ("crash_step=3", 1)])
def test_launcher_restarts_after_a_fault_and_finishes(fault, code, tmp_path):
    """A hang (watchdog exit 76) or a crash: the launcher restarts from the last checkpoint, the
    fault does not repeat on the restart, the run finishes, and goodput records both attempts."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    # the hang case sets --max-restarts, the crash case relies on the config's reliability.max_restarts
    restarts = ["--max-restarts", "1"] if code == reliability.HANG_EXIT_CODE else []
    argv = [sys.executable, "-c", MAIN, "launch", "local", "--processes", "1", "--cpu-devices", "2",
            *restarts, "--grace", "2", "--backoff", "0.2", TINY, *BASE, "train.steps=5", f"drills.{fault}",
            *([] if restarts else ["reliability.max_restarts=1"]),
            "reliability.hang_timeout_s=4", "reliability.first_step_timeout_s=120", f"run_dir={run}",
            f"checkpoint.dir={ckpt}", "checkpoint.every=2", "checkpoint.async=false"]
    t0 = time.monotonic()
    r = subprocess.run(argv, env=_env(tmp_path), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"job failed with code {code} ({launcher.exit_cause(code)})" in r.stderr
    if code == reliability.HANG_EXIT_CODE:
        assert "watchdog: no step completed" in r.stderr and "File " in r.stderr  # the stacks
    with open(run / "goodput.json") as f:
        gp = json.load(f)
    assert len(gp["attempts"]) == 2 and gp["last_step"] == 5
    assert gp["attempts"][1]["first_step"] >= 2 and gp["attempts"][1]["steps_redone"] <= 2  # <= checkpoint.every
    assert time.monotonic() - t0 < 400


def test_goodput_adds_up_to_wall_time(tmp_path):
    result = train(load_config(TINY, BASE + ["train.steps=3", f"run_dir={tmp_path / 'r'}", "train.eval_every=2",
                                             f"checkpoint.dir={tmp_path / 'c'}", "checkpoint.every=2"]),
                   devices=jax.devices()[:2])
    with open(tmp_path / "r" / "goodput.json") as f:
        total = json.load(f)["total"]
    parts = sum(total[k] for k in ("startup_s", "compile_s", "data_wait_s", "ckpt_block_s", "eval_s",
                                   "productive_s", "lost_s"))
    assert parts == pytest.approx(total["wall_s"], rel=0.02)
    assert total["compile_s"] > 0 and total["productive_s"] > 0 and total["eval_s"] > 0
    assert total["wall_s"] <= result.wall_s + 1.0
    # a second run in the same run_dir that redoes steps 3..: counted as lost work
    train(load_config(TINY, BASE + ["train.steps=4", f"run_dir={tmp_path / 'r'}", f"checkpoint.dir={tmp_path / 'c'}",
                                    "checkpoint.every=2"]), devices=jax.devices()[:2])
    with open(tmp_path / "r" / "goodput.json") as f:
        gp = json.load(f)
    assert [a["first_step"] for a in gp["attempts"]] == [0, 3] and gp["attempts"][1]["steps_redone"] == 0


def test_exit_codes_and_backoff():
    assert launcher.exit_cause(76) == "hang (watchdog)" and launcher.exit_cause(75).startswith("preempted")
    assert launcher.exit_cause(137) == "killed by signal 9"
    assert not launcher.should_restart(reliability.HALT_EXIT_CODE, 0, 3)
    assert [launcher.restart_backoff(a) for a in (1, 2, 3, 10)] == [1, 2, 4, 60]


def test_reliability_config_errors():
    with pytest.raises(ConfigError, match="reliability.nan_action='restart' is not valid"):
        load_config(TINY, ["reliability.nan_action=restart"])
    with pytest.raises(ConfigError, match="spike_warmup >= 1"):
        load_config(TINY, ["reliability.spike_warmup=0"])
    with pytest.raises(ConfigError, match="^reliability.inject_nan_step is now drills.nan_step$"):
        load_config(TINY, ["reliability.inject_nan_step=3"])
    with pytest.raises(ConfigError, match="drills.sleep_s and drills.process must be >= 0"):
        load_config(TINY, ["drills.sleep_s=-1"])


def test_the_step_knows_no_drills_and_carries_no_guard_when_none_is_on(tmp_path):
    """The NaN/spike drills wrap the step's gradients only when configured, and the guard wraps the
    update only while a guard is on: otherwise neither leaves a trace in the traced step or state."""
    from maxtrain.step import make_setup, trace_train_step

    def traced(*extra):
        return str(trace_train_step(make_setup(load_config(TINY, SMALL + list(extra)), jax.devices()[:1])).jaxpr)

    plain, drilled = traced(), traced("drills.nan_step=2")
    assert drilled.count("nan") > plain.count("nan") and len(drilled) > len(plain)  # the drill's select
    assert traced("drills.sleep_s=1", "drills.crash_step=5") == plain  # host drills: nothing in the step
    off = ["reliability.nan_action=none", "reliability.spike_action=none"]
    assert "cond" in plain and "cond" not in traced(*off)  # the guard's skip branch
    common = BASE + ["train.steps=2", f"checkpoint.dir={tmp_path / 'c'}", "checkpoint.every=2"]
    guarded = train(load_config(TINY, common + [f"run_dir={tmp_path / 'a'}"]), devices=jax.devices()[:2])
    assert set(guarded.state.guard) >= {"events", "skipped"}
    # a checkpoint written with a guard on resumes with none on (the guard is never checkpointed)
    resumed = train(load_config(TINY, common + off + ["train.steps=3", f"run_dir={tmp_path / 'b'}"]),
                    devices=jax.devices()[:2])
    assert resumed.start_step == 2 and resumed.state.guard is None and len(resumed.history) == 1
    assert "skipped_updates" not in resumed.history[0] and np.isfinite(resumed.history[0]["loss"])


@pytest.mark.parametrize("every", [3, 100])  # 100: no periodic check in the run, only the ones before saves
def test_flipped_bit_in_one_replica_halts_before_the_checkpoint(tmp_path, every):
    ckpt = tmp_path / "ckpt"
    cfg = load_config(TINY, SMALL + ["mesh.data=2", "mesh.fsdp=2", "train.steps=6", f"run_dir={tmp_path / 'r'}",
                                     f"reliability.fingerprint_every={every}", "drills.bitflip_step=3",
                                     f"checkpoint.dir={ckpt}", "checkpoint.every=3", "checkpoint.async=false"])
    with pytest.raises(reliability.Corrupted, match=r"silent corruption at step 6: parameters on cpu:\d.*cpu:3"):
        train(cfg, devices=jax.devices()[:4])
    assert sorted(os.listdir(ckpt)) == ["3"]  # step 3 (clean) saved; nothing after the flip


def test_fingerprints_agree_on_healthy_replicas():
    from maxtrain.step import init_state, make_setup
    from maxtrain.mesh import use_mesh
    setup = make_setup(load_config(TINY, SMALL + ["mesh.data=4", "mesh.tensor=2"]))
    with use_mesh(setup.mesh):
        state = init_state(setup, 0)
        fp = reliability.make_fingerprint(setup.mesh, setup.state_shardings.params)(state.params)
        axes = reliability.replica_axes(setup.state_shardings.params, setup.mesh)
        assert axes == ("data",)
        assert reliability.mismatched_devices(jax.device_get(fp), setup.mesh, axes) == []
        bad = drills.flip_a_bit(state.params, device_index=5)
        fp = jax.device_get(reliability.make_fingerprint(setup.mesh, setup.state_shardings.params)(bad))
        assert reliability.mismatched_devices(fp, setup.mesh, axes) == [jax.devices()[5]]


def test_slow_processes_against_the_median():
    assert reliability.slow_processes([0.010, 0.011, 0.5, 0.012], 2.0) == [2]
    assert reliability.slow_processes([0.001, 0.003], 2.0) == []  # under the 10 ms floor: noise
    assert reliability.slow_processes([0.2], 2.0) == []
    assert reliability.slow_processes([0.003, 0.30], 2.0) == [1]  # two processes: against the other one


def test_slowed_process_is_named(tmp_path):
    run = tmp_path / "run"
    argv = [sys.executable, "-c", MAIN, "launch", "local", "--processes", "2", "--cpu-devices", "2", "--grace", "2",
            TINY, *SMALL, "mesh.data=4", "train.steps=4", "drills.sleep_s=0.3", "reliability.preflight=off",
            "drills.process=1", "reliability.straggler_every=2",
            "reliability.fingerprint_every=2", f"run_dir={run}"]  # also: fingerprints across processes
    r = subprocess.run(argv, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "straggler: process 1 (" in r.stderr
    with open(run / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert records[-1]["stragglers"] == [1]


def test_deterministic_replay_check(tmp_path):
    ok = {"loss": np.float32(2.5), "grad_norm": np.float32(0.75)}
    reliability.check_replay(ok, dict(ok), 7)
    off = {"loss": np.nextafter(np.float32(2.5), np.float32(3)), "grad_norm": np.float32(0.75)}
    with pytest.raises(reliability.Nondeterministic, match="step 7 recomputed on the same batch gave loss"):
        reliability.check_replay(ok, off, 7)
    # in a run: the check replays steps 2 and 4 and finds the CPU deterministic
    result = train(load_config(TINY, BASE + ["train.steps=4", "reliability.replay_every=2", f"run_dir={tmp_path}"]),
                   devices=jax.devices()[:2])
    assert len(result.history) == 4


def test_a_halt_keeps_no_checkpoint_of_the_event_or_later(tmp_path, caplog):
    """The event is read before every save (not only at logged steps): with log_every=10 and a save
    every step, an event at step 4 stops the run before step 4 is saved, and the message is true."""
    ck = tmp_path / "c"
    cfg = load_config(TINY, BASE + ["train.steps=9", "train.log_every=10", "drills.nan_step=3",
                                    "reliability.nan_action=halt", f"checkpoint.dir={ck}", "checkpoint.every=1",
                                    "checkpoint.keep=20", f"run_dir={tmp_path / 'r'}"])
    with caplog.at_level("INFO", logger="maxtrain"):
        with pytest.raises(reliability.Halted, match="nan at step 4 .* no checkpoint of step 4 or later is kept"):
            train(cfg, devices=jax.devices()[:2])
    assert sorted(int(n) for n in os.listdir(ck) if n.isdigit()) == [1, 2, 3]
    assert "training stopped at step 4 by Halted" in caplog.text  # before step 4's save, not at the next log
    assert "deleted the checkpoints" not in caplog.text  # nothing to undo: step 4 was never saved


def test_a_run_whose_updates_are_all_skipped_halts(tmp_path):
    """A poisoned state (here: lr 1e30 turns the parameters to inf after one update) makes every
    later update a skipped NaN step; after max_consecutive_skips of them the run halts, it is not 'done'."""
    cfg = load_config(TINY, BASE + ["train.steps=12", "optim.lr=1e30", "optim.warmup_steps=0",
                                    "reliability.max_consecutive_skips=3", f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(reliability.Halted, match=r"3 updates in a row were skipped \(last: nan at step 4"):
        train(cfg, devices=jax.devices()[:2])


def test_only_consecutive_skips_count_towards_the_halt():
    cfg = ReliabilityConfig(max_consecutive_skips=2)
    guard, step = reliability.init_guard(), jnp.zeros((), jnp.int32)
    for loss in [3.0, np.nan, 3.0, np.nan, 3.0, np.nan, 3.0]:  # three skips, never two in a row
        _, guard = reliability.check_step(guard, jnp.float32(loss), jnp.float32(1.0), step, cfg)
        step = step + 1
    host = jax.device_get(guard)
    assert host["skipped"] == 3 and host["streak"] == 0 and host["worst_streak"] == 1
    assert reliability.report_events(host, 0, cfg) == (3, None)  # no halt
    _, guard = reliability.check_step(guard, jnp.float32(np.nan), jnp.float32(1.0), step, cfg)
    _, guard = reliability.check_step(guard, jnp.float32(np.nan), jnp.float32(1.0), step + 1, cfg)
    with pytest.raises(reliability.Halted, match="2 updates in a row were skipped") as e:
        reliability.report_events(jax.device_get(guard), 3, cfg)
    assert e.value.step == 8  # the first of the two


def test_the_spike_drill_fires_the_spike_guard(tmp_path):
    result = train(load_config(TINY, BASE + ["train.steps=8", "reliability.spike_warmup=3",
                                             "drills.spike_step=5", f"run_dir={tmp_path / 'r'}"]),
                   devices=jax.devices()[:2])
    rec = {r["step"]: r for r in result.history}
    assert rec[6]["loss"] > 100 * rec[5]["loss"] and rec[6]["skipped_updates"] == 1.0
    assert int(result.state.guard["last_kind"]) == 2 and int(result.state.guard["last_step"]) == 6  # loss_spike


def test_rollback_restores_the_last_checkpoint_and_finishes(tmp_path, caplog):
    common = BASE + ["train.steps=8", "drills.nan_step=4", f"checkpoint.dir={tmp_path / 'c'}",
                     "checkpoint.every=2", "checkpoint.async=false"]
    with caplog.at_level("WARNING", logger="maxtrain"):
        rolled = train(load_config(TINY, common + ["reliability.nan_action=rollback", f"run_dir={tmp_path / 'r'}"]),
                       devices=jax.devices()[:2])
    assert "rollback: restored the checkpoint of step 4 after the event at step 5; continuing at step 6" in caplog.text
    assert [r["step"] for r in rolled.history] == list(range(1, 9)) and int(rolled.state.step) == 8
    assert np.isfinite(rolled.history[-1]["loss"])
    # the event counter carries over the rollback, so the host's count of events seen (1) stays in
    # step with the device's and a later event is reported (a fresh counter would hide the next one)
    assert int(rolled.state.guard["events"]) == 1
    # optim.groups freezing everything until step 5: the checkpoint of step 4 holds no moments (phase
    # one's layout) and the rollback continues at step 6 in phase two's (its moments start at zero)
    caplog.clear()
    with caplog.at_level("WARNING", logger="maxtrain"):
        phased = train(load_config(TINY, common + ["reliability.nan_action=rollback", f"run_dir={tmp_path / 'p'}",
                                                   f"checkpoint.dir={tmp_path / 'pc'}",
                                                   "optim.groups=[{params: ., frozen_until: 5}]"]),
                       devices=jax.devices()[:2])
    assert "restored the checkpoint of step 4 after the event at step 5; continuing at step 6" in caplog.text
    assert [r["step"] for r in phased.history] == list(range(1, 9)) and np.isfinite(phased.history[-1]["loss"])
    assert phased.history[-1]["loss"] != phased.history[4]["loss"]  # it learns after the rollback
    # keep=1 and a save every step: the guard is read before each save, so the event's step is never
    # saved; the rollback must not let retention drop step 4 for a later one
    caplog.clear()
    with caplog.at_level("WARNING", logger="maxtrain"):
        train(load_config(TINY, BASE + ["train.steps=7", "drills.nan_step=4", "checkpoint.every=1",
                                        "checkpoint.keep=1", f"checkpoint.dir={tmp_path / 'k'}",
                                        "reliability.nan_action=rollback", f"run_dir={tmp_path / 'k1'}"]),
              devices=jax.devices()[:2])
    assert "restored the checkpoint of step 4 after the event at step 5" in caplog.text
    assert "deleted the checkpoints" not in caplog.text  # nothing at or after the event was ever saved
    assert sorted(int(n) for n in os.listdir(tmp_path / "k") if n.isdigit()) == [4, 7]  # restored-from: kept
    with pytest.raises(reliability.Halted, match="asks for a rollback but checkpoint.dir is not set"):
        train(load_config(TINY, BASE + ["train.steps=4", "drills.nan_step=1",
                                        "reliability.nan_action=rollback", f"run_dir={tmp_path / 'n'}"]),
              devices=jax.devices()[:2])


def test_goodput_counts_steps_redone_against_every_earlier_attempt(tmp_path):
    """Attempt 1 reached step 1490, attempt 2 crashed at 1200, both after the checkpoint of 1000:
    attempt 3 redoes 490 steps, not the 200 the last attempt alone would say."""
    for first, last in ((0, 1490), (1000, 1200)):
        gp = reliability.Goodput(str(tmp_path))
        gp.start(first, startup_s=0.0)
        gp.write(last, final=False)
    gp = reliability.Goodput(str(tmp_path))
    gp.start(1000, startup_s=0.0)
    attempts = gp.summary(1600)["attempts"]
    assert [a["steps_redone"] for a in attempts] == [0, 200, 490]
