"""Preflight on an otherwise idle machine: N healthy repetitions (the spread of every figure, and
whether any healthy run was condemned), then each drill at the default thresholds (is the drilled
rank, and only it, named?).

    python bench/preflight.py --runs 20 --processes 3

Each run is `maxtrain preflight configs/tiny.yaml --mode quick` as `--processes` ranks of one CPU
device each (`maxtrain.launcher.launch_local`), on this machine's cores: on a CPU only the
comparison with the job's median exists (no device-table entry). Prints a table, then one JSON line.
"""

import argparse
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

# drills sized just past each default threshold (compute 10%, link 40%, storage 50%)
DRILLS = [("matmul", 1.25, 1), ("link", 2.0, 0), ("collective", 2.0, 2), ("storage", 2.5, 1)]


def one_run(processes: int, out: str, *overrides: str) -> dict:
    from maxtrain.launcher import launch_local

    argv = ["preflight", os.path.join(ROOT, "configs", "tiny.yaml"), f"mesh.data={processes}", "mesh.fsdp=1",
            "--mode", "quick", "--out", out, f"checkpoint.dir={os.path.dirname(out)}/ck", *overrides]
    code = launch_local(argv, processes, cpu_devices=1, grace_s=2)
    with open(out) as f:
        return {"code": code, **json.load(f)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--processes", type=int, default=3)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="maxtrain-preflight-bench-")
    healthy = [one_run(args.processes, os.path.join(work, f"h{i}", "p.json")) for i in range(args.runs)]
    false = sum(bool(r["condemned"]) for r in healthy)
    names = [k for k in healthy[0]["processes"][0] if k not in ("rank", "host", "device_kind")
             and not k.endswith("_device")]
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
    links = [v for r in healthy for v in r["links_gb_s"].values()]
    if links:
        print(f"{'links GB/s':<28}{np.median(links):>10.4g}{min(links):>10.4g}{max(links):>10.4g}")
    drills = []
    for check, factor, process in DRILLS:
        if check in ("link", "collective") and args.processes < 3:
            continue
        r = one_run(args.processes, os.path.join(work, f"d-{check}", "p.json"), f"drills.preflight_slow={check}",
                    f"drills.preflight_factor={factor}", f"drills.process={process}")
        named = {c["rank"]: c["checks"] for c in r["condemned"]}
        drills.append({"check": check, "factor": factor, "process": process, "exit": r["code"], "named": named})
        print(f"drill {check} x{factor} on rank {process}: exit {r['code']}, named {named or 'nobody'}")
    print(json.dumps({"runs": args.runs, "processes": args.processes, "false_condemnations": false,
                      "spread": spread, "drills": drills}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
