"""Recovery from killed processes: steps lost and seconds per recovery, persistent tier only vs
the local tier beside it (`checkpoint.local`).

    python bench/recovery.py [--kills 10] [--processes 4] [--cpu-devices 2] [--every 100]
                             [--local-every 5] [--seed 0] [--modes persistent,multi-tier]

Each mode runs one `maxtrain launch local --processes P --cpu-devices D --max-restarts K --backoff 0.5`
of a small model (configs/tiny.yaml shrunk: d_model 64, 2 layers, synthetic data, seq 64) that
would run far longer than the bench lets it. After the job's first step, and after every restart's
first new step, the bench waits a random 4-15 new steps and SIGKILLs one random rank; in multi-tier
mode the fifth kill also empties that rank's local directory (a replaced host). Per kill:

- steps lost: the newest step logged before the kill minus the step the next attempt resumed from;
- recovery: seconds from the kill to the next attempt's first new step record;
- from goodput.json's attempts: detection, backoff, process start, restore (and its tier), compile
  (cache hit or miss).

Persistent mode saves `checkpoint.every` steps (default 100, as the issue's multi-tier case);
multi-tier adds the local tier every `--local-every` steps. The per-kill table and a summary per
mode are printed; the last line is one JSON object. The local tier's step-time overhead is the
loop's checkpoint blocking over the step time summed over the records (`ckpt_block_s`, `step_time_s`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["model.vocab_size=128", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.d_ff=128", "train.batch_size=16", "train.seq_len=64", "train.dtype=float32", "train.log_every=1",
         "optim.warmup_steps=2", "data.kind=synthetic", "train.steps=100000", "mesh.data=-1", "mesh.fsdp=1",
         "reliability.hang_timeout_s=120"]


def _records(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except OSError:
        return []


def _pids(err_path: str) -> dict[int, int]:
    """rank -> pid of the newest attempt (the launcher's `[launch] rank R pid P` lines)."""
    out = {}
    with open(err_path) as f:
        for line in f:
            w = line.split()
            if len(w) == 5 and w[0] == "[launch]" and w[1] == "rank" and w[3] == "pid":
                out[int(w[2])] = int(w[4])
    return out


def _attempts(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "goodput.json")) as f:
            return json.load(f).get("attempts", [])
    except (OSError, ValueError):
        return []


def run_mode(mode: str, args, work: str, rng: random.Random) -> dict:
    run_dir = os.path.join(work, f"run_{mode}")
    local_dir = os.path.join(work, f"local_{mode}")
    overrides = MODEL + [f"run_dir={run_dir}", f"checkpoint.dir={os.path.join(work, f'ck_{mode}')}",
                         f"checkpoint.every={args.every}", f"seed={args.seed}"]
    if mode == "multi-tier":
        overrides += [f"checkpoint.local.dir={local_dir}", f"checkpoint.local.every={args.local_every}"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith(("MAXTRAIN_", "SLURM_"))}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAX_COMPILATION_CACHE_DIR=os.path.join(work, "jax_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    out_path, err_path = os.path.join(work, f"{mode}.out"), os.path.join(work, f"{mode}.err")
    argv = [sys.executable, "-m", "maxtrain.cli", "launch", "local", "--processes", str(args.processes),
            "--cpu-devices", str(args.cpu_devices), "--max-restarts", str(args.kills + 1), "--backoff", "0.5",
            "--grace", "2", os.path.join(ROOT, "configs", "tiny.yaml"), *overrides]
    with open(out_path, "w") as out, open(err_path, "w") as err:
        job = subprocess.Popen(argv, env=env, stdout=out, stderr=err, start_new_session=True)
    kills = []
    try:
        resumed_from = 0
        for k in range(args.kills):
            # wait for this attempt's first new step, then a random number more
            target = None
            deadline = time.monotonic() + 600
            while True:
                recs = _records(run_dir)
                new = [r for r in recs if r["step"] > resumed_from]
                if new and target is None:
                    target = new[0]["step"] + rng.randint(4, 15)
                if target is not None and recs and recs[-1]["step"] >= target:
                    break
                if job.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{mode}: the job stopped or stalled; see {err_path}")
                time.sleep(0.05)
            last = recs[-1]["step"]
            rank = rng.randrange(args.processes)
            pid = _pids(err_path)[rank]
            t_kill = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            wiped = mode == "multi-tier" and k == 4
            if wiped:  # a replaced host: this rank's local directory is gone
                for key in os.listdir(local_dir):
                    shutil.rmtree(os.path.join(local_dir, key, f"p{rank}"), ignore_errors=True)
            n_attempts = len(_attempts(run_dir))
            while True:  # the next attempt's first new record
                attempts = _attempts(run_dir)
                if len(attempts) > n_attempts and _records(run_dir) and \
                        _records(run_dir)[-1]["step"] > attempts[-1]["first_step"]:
                    break
                if job.poll() is not None or time.monotonic() > deadline + 600:
                    raise RuntimeError(f"{mode}: no restart after kill {k + 1}; see {err_path}")
                time.sleep(0.05)
            recovery = time.monotonic() - t_kill
            a = attempts[-1]
            resumed_from = a["first_step"]
            kills.append({"kill": k + 1, "rank": rank, "last_logged": last, "resumed_from": resumed_from,
                          "steps_lost": last - resumed_from, "recovery_s": recovery, "wiped_local": wiped,
                          **{key: a.get(key) for key in ("detection_s", "backoff_s", "process_start_s", "restore_s",
                                                          "restore_tier", "compile_s", "compile_cache")}})
            print(f"{mode:>10} kill {k + 1:2d}: rank {rank} after step {last:4d}, resumed from {resumed_from:4d} "
                  f"({last - resumed_from:3d} steps lost), recovered in {recovery:5.1f}s: restore "
                  f"{(a.get('restore_s') or 0):.2f}s ({a.get('restore_tier')}), compile {a.get('compile_s', 0):.1f}s "
                  f"(cache {a.get('compile_cache')}), process start {(a.get('process_start_s') or 0):.1f}s"
                  + (" [local dir wiped]" if wiped else ""), flush=True)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
    recs = _records(run_dir)
    times = [r["step_time_s"] for r in recs if isinstance(r.get("step_time_s"), (int, float))]
    blocked = sum(r.get("ckpt_block_s") or 0.0 for r in recs)
    lost = [x["steps_lost"] for x in kills]
    return {"mode": mode, "kills": kills, "steps_lost_max": max(lost), "steps_lost_mean": statistics.mean(lost),
            "recovery_s_median": statistics.median(x["recovery_s"] for x in kills),
            "step_time_s_median": statistics.median(times) if times else None,
            "ckpt_block_frac": blocked / max(sum(times), 1e-9)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--cpu-devices", type=int, default=2)
    p.add_argument("--every", type=int, default=100, help="checkpoint.every (both modes)")
    p.add_argument("--local-every", type=int, default=5, help="checkpoint.local.every (multi-tier)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="persistent,multi-tier")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    args = p.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="maxtrain-recovery-")
    os.makedirs(work, exist_ok=True)
    rng = random.Random(args.seed)
    results = []
    try:
        for mode in args.modes.split(","):
            results.append(run_mode(mode, args, work, rng))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'mode':>10} | kills | steps lost max | mean | recovery s (median) | step time ms (median) | "
          f"checkpoint blocking / step time")
    for r in results:
        st = r["step_time_s_median"]
        print(f"{r['mode']:>10} | {len(r['kills']):5d} | {r['steps_lost_max']:14d} | {r['steps_lost_mean']:4.1f} | "
              f"{r['recovery_s_median']:19.1f} | {'—' if st is None else f'{1e3 * st:.1f}':>20} | "
              f"{100 * r['ckpt_block_frac']:.2f}%")
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
