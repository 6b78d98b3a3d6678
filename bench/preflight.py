"""Preflight on an otherwise idle machine: N healthy repetitions (the spread of every figure, and
whether any healthy run was condemned), then each drill at the default thresholds (is the drilled
rank, and only it, named?). `--cost N`: what the quick preflight adds to the time from launch to
the first step of configs/tiny.yaml on 2 processes (compile included), interleaved N times.

    python bench/preflight.py --runs 20 --processes 3
    python bench/preflight.py --cost 5
    python bench/preflight.py --vs-table run_dir/preflight.json   # bench/gpu_check.sh's last lines

Each run is `maxtrain preflight configs/tiny.yaml --mode quick` as `--processes` ranks of one CPU
device each (`maxtrain.launcher.launch_local`), on this machine's cores: on a CPU only the
comparison with the job's median exists (no device-table entry). Prints a table, then one JSON line.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

# drills sized just past each default threshold (compute 10%, link 40%, storage 50%)
DRILLS = [("matmul", 1.25, 1), ("link", 2.0, 0), ("collective", 2.0, 2), ("storage", 2.5, 1)]
EXPECTED = {  # drill -> {rank: the checks it must be named for}, and nobody else
    "matmul": {1: ["matmul_tflops"]}, "link": {0: ["link 0<->1"], 1: ["link 0<->1"]},
    "collective": {2: ["link 1<->2", "link 2<->0"]}, "storage": {1: ["checkpoint_write_mb_s"]}}


def one_run(processes: int, out: str, *overrides: str) -> dict:
    from maxtrain.launcher import launch_local

    argv = ["preflight", os.path.join(ROOT, "configs", "tiny.yaml"), f"mesh.data={processes}", "mesh.fsdp=1",
            "--mode", "quick", "--out", out, f"checkpoint.dir={os.path.dirname(out)}/ck", *overrides]
    code = launch_local(argv, processes, cpu_devices=1, grace_s=2)
    with open(out) as f:
        return {"code": code, **json.load(f)}


def first_step_s(work: str, preflight: str, processes: int = 2) -> tuple[float, float]:
    """`maxtrain launch local --processes N configs/tiny.yaml` with `reliability.preflight`: seconds from
    the launch to the first step's record in metrics.jsonl, and the preflight's own seconds."""
    run_dir = os.path.join(work, f"first-{preflight}-{time.time_ns()}")
    argv = [sys.executable, "-m", "maxtrain.cli", "launch", "local", "--processes", str(processes), "--cpu-devices",
            "1", os.path.join(ROOT, "configs", "tiny.yaml"), f"mesh.data={processes}", "mesh.fsdp=1", "train.steps=2",
            f"run_dir={run_dir}", f"reliability.preflight={preflight}", "reliability.compilation_cache=null"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    first = float("nan")
    while proc.poll() is None:
        if os.path.exists(metrics) and os.path.getsize(metrics):
            first = time.perf_counter() - t0
            break
        time.sleep(0.05)
    proc.wait()
    report = os.path.join(run_dir, "preflight.json")
    seconds = json.load(open(report))["seconds"] if os.path.exists(report) else 0.0
    return first, seconds


def cost(reps: int) -> dict:
    """Quick preflight's share of launch-to-first-step, off and quick interleaved `reps` times."""
    work = tempfile.mkdtemp(prefix="maxtrain-preflight-cost-")
    off, quick, own = [], [], []
    for _ in range(reps):
        off.append(first_step_s(work, "off")[0])
        t, s = first_step_s(work, "quick")
        quick.append(t)
        own.append(s)
    out = {"first_step_off_s": float(np.median(off)), "first_step_quick_s": float(np.median(quick)),
           "preflight_s": float(np.median(own))}
    out["added_fraction"] = out["first_step_quick_s"] / out["first_step_off_s"] - 1
    print(f"configs/tiny.yaml, 2 processes, launch to first step (median of {reps}, interleaved): "
          f"preflight off {out['first_step_off_s']:.1f}s, quick {out['first_step_quick_s']:.1f}s "
          f"(+{100 * out['added_fraction']:.1f}%; the preflight itself {out['preflight_s']:.1f}s)")
    return out


def vs_table(path: str) -> int:
    """One line per process of a preflight report: each device figure against the device table."""
    from maxtrain.devices import device_figures

    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        print(f"preflight: no report at {path}: {e}")
        return 1

    def vs(value, peak, unit):
        if value is None:
            return "-"
        return f"{value:.4g} {unit}" + (f" ({100 * value / peak:.0f}% of the table's {peak:g})" if peak else "")

    for p in report["processes"]:
        e = device_figures(p["device_kind"])
        print(f"preflight ({report['mode']}, {report['seconds']:.1f}s) rank {p['rank']} {p['device_kind']}: "
              f"bf16 matmul {vs(p['matmul_tflops'], e and e.peak_bf16_tflops, 'TFLOP/s')}, "
              f"FP8 matmul {vs(p.get('fp8_matmul_tflops'), e and e.peak_fp8_tflops, 'TFLOP/s')}, "
              f"memory {vs(p['hbm_gb_s'], e and e.hbm_bytes_s and e.hbm_bytes_s / 1e9, 'GB/s')}, "
              f"host-to-device {vs(p['h2d_gb_s'], None, 'GB/s')}; "
              f"{'healthy' if report['healthy'] else 'condemned: ' + json.dumps(report['condemned'])}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--drill-reps", type=int, default=1, metavar="N", help="run each drill N times")
    p.add_argument("--cost", type=int, default=0, metavar="REPS",
                   help="only time launch-to-first-step with the quick preflight and without, REPS times each")
    p.add_argument("--vs-table", metavar="PREFLIGHT_JSON",
                   help="only print a preflight report's device figures against the device table")
    args = p.parse_args(argv)
    if args.vs_table:
        return vs_table(args.vs_table)
    if args.cost:
        print(json.dumps(cost(args.cost)))
        return 0
    work = tempfile.mkdtemp(prefix="maxtrain-preflight-bench-")
    healthy = [one_run(args.processes, os.path.join(work, f"h{i}", "p.json")) for i in range(args.runs)]
    false = sum(bool(r["condemned"]) for r in healthy)
    for i, r in enumerate(healthy):
        if r["condemned"]:
            print(f"healthy run {i} condemned: " + "; ".join(f"rank {c['rank']}: {', '.join(c['reasons'])}"
                                                           for c in r["condemned"]))
    names = [k for k in healthy[0]["processes"][0] if k not in ("rank", "host", "device_kind")
             and not k.endswith("_device")] if healthy else []
    print(f"{args.runs} healthy runs of {args.processes} processes: {false} condemned someone")
    print(f"{'figure':<28}{'median':>10}{'min':>10}{'max':>10}{'max/min within a run':>24}")
    spread = {}
    for n in names:
        vals = np.array([[q[n] for q in r["processes"] if q[n] is not None] for r in healthy], dtype=object)
        flat = np.array([v for row in vals for v in row], np.float64)
        if not flat.size:
            continue
        within = max(max(row) / min(row) for row in vals if len(row))
        spread[n] = {"median": float(np.median(flat)), "min": float(flat.min()), "max": float(flat.max()),
                     "max_ratio_within_run": float(within)}
        print(f"{n:<28}{np.median(flat):>10.4g}{flat.min():>10.4g}{flat.max():>10.4g}{within:>24.2f}")
    links = [v for r in healthy for v in r["links_gb_s"].values()]  # --runs 0: the drills only
    if links:
        print(f"{'links GB/s':<28}{np.median(links):>10.4g}{min(links):>10.4g}{max(links):>10.4g}")
    drills = []
    for rep in range(args.drill_reps):  # one pass over the drills at a time: a slow spell touches each
        for check, factor, process in DRILLS:
            if check in ("link", "collective") and args.processes < 3:
                continue
            r = one_run(args.processes, os.path.join(work, f"d-{check}-{rep}", "p.json"),
                        f"drills.preflight_slow={check}", f"drills.preflight_factor={factor}",
                        f"drills.process={process}")
            named = {c["rank"]: c["checks"] for c in r["condemned"]}
            drills.append({"check": check, "factor": factor, "process": process, "exit": r["code"], "named": named})
            right = {k: sorted(v) for k, v in named.items()} == EXPECTED[check] and r["code"] == 78
            drills[-1]["right"] = right
            print(f"drill {check} x{factor} on rank {process}: exit {r['code']}, named {named or 'nobody'}"
                  f"{'' if right else '  <- not exactly the drilled rank and check'}")
    for check, _, _ in DRILLS:
        mine = [d for d in drills if d["check"] == check]
        if mine:
            print(f"drill {check}: named exactly right {sum(d['right'] for d in mine)}/{len(mine)}")
    print(json.dumps({"runs": args.runs, "processes": args.processes, "false_condemnations": false,
                      "spread": spread, "drills": drills}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
