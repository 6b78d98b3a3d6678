"""How long the `maxtrain` command takes to answer before any training: help, config errors,
missing inputs, `--print-config`, `--dry-run`, and the first log line of a real run.

    python bench/startup.py [--repeats N]

Each command runs in a fresh process (`sys.executable -m maxtrain.cli ...`, from the repository
root) `--repeats` times; the median wall seconds are printed per command, and the last line is
one JSON object. Errors must come before jax is imported (tests/test_config.py checks that the
slow modules are not loaded); this measures what a user waits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
CASES = {
    "--help": ["--help"],
    "config typo": ["train", TINY, "model.d_modle=64"],
    "missing data path": ["train", TINY, "data.path=/nonexistent/*.txt"],
    "inspect config typo": ["inspect", TINY, "optim.learning_rate=1"],
    "convert missing input": ["convert", "hf-to-maxtrain", "/nonexistent/hf", "/tmp/never"],
    "prepare missing input": ["prepare", "--input", "/nonexistent/*.txt", "--output", "/tmp/never"],
    "--print-config": ["train", TINY, "--print-config"],
    "--dry-run": ["train", TINY, "--dry-run"],
}


def time_command(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "maxtrain.cli", *argv], capture_output=True, cwd=ROOT, timeout=300)
    return time.perf_counter() - t0


def first_log_line(run_dir: str) -> float:
    """Seconds from the start of `maxtrain train` to its first log line (the run id)."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "maxtrain.cli", "train", TINY, f"run_dir={run_dir}", "train.steps=1"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        for line in p.stderr:
            if " run " in line:
                return time.perf_counter() - t0
        return float("nan")
    finally:
        p.kill()
        p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import tempfile

    out = {}
    for name, cmd in CASES.items():
        out[name] = statistics.median(time_command(cmd) for _ in range(args.repeats))
        print(f"{name:<24} {out[name]:6.2f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out["train: first log line"] = statistics.median(
            first_log_line(os.path.join(tmp, f"r{i}")) for i in range(args.repeats))
    print(f"{'train: first log line':<24} {out['train: first log line']:6.2f} s")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
