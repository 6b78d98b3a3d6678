"""What logging costs the training loop: per-record host time of metrics.jsonl + TensorBoard +
the log line, and the loop's step time at log_every=1 with TensorBoard against (almost) no logging.

    python bench/observe.py [configs/tiny.yaml] [KEY=VALUE ...] [--steps N] [--reps R]

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import jax

from maxtrain import load_config, train
from maxtrain.metrics import MetricsSink, TimeBreakdown, format_line, record_time_totals


def per_record_us(record: dict, metrics, tensorboard: bool, n: int = 300) -> float:
    """Host microseconds per logged record: fetch already-copied metrics, write JSONL (+ TensorBoard), log."""
    log = logging.getLogger("maxtrain.bench")
    log.addHandler(logging.FileHandler(os.devnull))
    log.propagate = False
    with tempfile.TemporaryDirectory() as d:
        sink = MetricsSink(d, tensorboard=tensorboard)
        breakdown = TimeBreakdown(0, None)
        t0 = time.perf_counter()
        for i in range(n):
            values = jax.device_get(metrics)
            r = {**record, "step": i + 1, "loss": float(values["loss"])}
            sink.write(r)
            log.info(format_line(r, n) + " | " + breakdown.add(r))
        elapsed = time.perf_counter() - t0
        sink.close()
    return 1e6 * elapsed / n


def loop_step_s(cfg_path: str, overrides: list[str], steps: int, log_every: int, tensorboard: bool) -> float:
    """Mean wall time per step of the training loop (first step excluded: warm-up)."""
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(cfg_path, overrides + [f"run_dir={d}", f"train.steps={steps}", f"train.log_every={log_every}",
                                                 f"logging.tensorboard={str(tensorboard).lower()}"])
        h = train(cfg).history
    wall = record_time_totals(h[1:], h[0]["step"])[0]
    return wall / (h[-1]["step"] - h[0]["step"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default="configs/tiny.yaml")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=2, help="alternating repetitions of each loop variant")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as d:  # one real step's record and device metrics
        cfg = load_config(args.config, args.overrides + [f"run_dir={d}", "train.steps=1"])
        result = train(cfg)
    record = result.history[0]
    metrics = {k: jax.numpy.asarray(v) for k, v in record.items() if isinstance(v, float)}
    rec_tb, rec_plain = per_record_us(record, metrics, True), per_record_us(record, metrics, False)
    on, off = [], []
    for _ in range(args.reps):
        on.append(loop_step_s(args.config, args.overrides, args.steps, 1, True))
        off.append(loop_step_s(args.config, args.overrides, args.steps, args.steps, False))
    step_on, step_off = statistics.median(on), statistics.median(off)
    print(f"per record: {rec_tb:.0f} us with TensorBoard, {rec_plain:.0f} us JSONL + log line only")
    print(f"loop step time: {1e3 * step_on:.2f} ms at log_every=1 with TensorBoard, "
          f"{1e3 * step_off:.2f} ms logging only the first and last step, without TensorBoard")
    print(f"per-record cost / step time: {100 * rec_tb * 1e-6 / step_off:.3f}%; "
          f"loop difference: {100 * (step_on / step_off - 1):+.2f}% (noise included)")
    print(json.dumps({"record_us_tensorboard": rec_tb, "record_us_plain": rec_plain, "step_s_log_every_1_tb": step_on,
                      "step_s_quiet": step_off, "steps_on": on, "steps_off": off}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
