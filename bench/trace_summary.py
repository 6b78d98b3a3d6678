"""Where a profiled step's device time goes, from a jax.profiler Perfetto trace.

    python bench/trace_summary.py DIR [--top N] [--steps N]

DIR is a `profile.*` window's directory or `bench/step.py --profile DIR`; the newest
`perfetto_trace.json.gz` under it is read. Per device (a `/device:...` process) it prints the
window's wall time, the time some GPU stream was busy (the union of the kernels' intervals; the
rest is idle: launch gaps, host waits, exposed transfers), the busy time by category (matmul,
attention, collective, copy, other fusions) and the kernels taking the most time, per step when
`--steps` says how many steps the window holds. Off GPUs (XLA:CPU) there are no device streams; the
trace's host threads then carry one event per executed HLO op (a thunk, with `hlo_op` and
`device_ordinal`), which are summed the same way per device ordinal and printed as the mean over
the devices: on fake CPU devices that share the machine's cores an op's time includes waiting for
a core, so compare categories between two runs on the same mesh rather than reading them alone.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys

# kernel-name fragments per category, checked in this order (lower case)
CATEGORIES = (
    ("collective", ("nccl", "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective")),
    ("attention", ("flash", "fmha", "cudnn", "attention", "mgpu", "mosaic")),
    ("matmul", ("gemm", "nvjet", "xmma", "cublas", "cutlass", "sm90_", "sm80_", "dot")),
    ("copy", ("memcpy", "memset", "copy")),
)
# XLA:CPU ops whose event spans the ops of the computations they run (counted there instead)
CONTROL_FLOW = ("while", "conditional", "call")
# XLA:CPU thunk names: dots become `dot*` thunks or YNNPACK (`ynn_fusion*`) / oneDNN calls
HOST_CATEGORIES = (
    ("collective", ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
                    "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute")),
    ("matmul", ("ynn_fusion", "dot", "onednn", "xnn_fusion")),
    ("convert", ("convert",)),
    ("copy", ("copy", "transpose", "dynamic-update-slice", "dynamic_update_slice")),
    ("reduce", ("reduce",)),
)


def find_trace(path: str) -> str:
    if os.path.isfile(path):
        return path
    found = glob.glob(os.path.join(path, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {path}; trace with create_perfetto_trace=True")
    return max(found, key=os.path.getmtime)


def read_events(trace: str) -> list[dict]:
    """The events of a `perfetto_trace.json.gz` (an object with `traceEvents`, or the bare list)."""
    with gzip.open(trace) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def category(name: str, table=CATEGORIES) -> str:
    low = name.lower()
    for cat, keys in table:
        if any(k in low for k in keys):
            return cat
    return "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(events: list[dict]) -> dict:
    """Per device process: wall span, busy union, time by category and by kernel name (microseconds)."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    out = {}
    for pid, pname in procs.items():
        if not pname.startswith("/device:"):
            continue
        # kernels live on the stream threads; "XLA Ops"/"XLA Modules"/"Steps" lines aggregate them
        names = {tid: name.lower() for (p, tid), name in threads.items() if p == pid}
        streams = {tid for tid, name in names.items() if "stream" in name}
        if not streams:  # another naming: every line but the aggregates
            streams = {tid for tid, name in names.items() if not any(k in name for k in ("xla", "step", "module"))}
        kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") == pid and e.get("tid") in streams]
        if not kernels:
            continue
        spans = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in kernels]
        by_name, by_cat = collections.Counter(), collections.Counter()
        runs = collections.Counter()
        for e in kernels:
            by_name[e["name"]] += e.get("dur", 0.0)
            by_cat[category(e["name"])] += e.get("dur", 0.0)
            runs[e["name"]] += 1
        out[pname] = {"wall_us": max(b for _, b in spans) - min(a for a, _ in spans),
                      "busy_us": union_length(spans), "kernel_us": sum(by_name.values()),
                      "by_category": dict(by_cat), "by_name": dict(by_name), "runs": dict(runs),
                      "n_kernels": len(kernels)}
    return out or summarize_host_ops(events)


def summarize_host_ops(events: list[dict]) -> dict:
    """XLA:CPU: the per-op thunk events (`args.hlo_op`), summed per device ordinal, then the mean
    over the devices under one key (microseconds, as `summarize`)."""
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})
           and not e["args"]["hlo_op"].startswith(CONTROL_FLOW)]  # their span holds their bodies' ops
    if not ops:
        return {}
    devices = {e["args"].get("device_ordinal", "0") for e in ops}
    n = len(devices)
    by_name, by_cat, runs = collections.Counter(), collections.Counter(), collections.Counter()
    for e in ops:
        name = e["args"]["hlo_op"]
        by_name[name] += e.get("dur", 0.0) / n
        by_cat[category(name, HOST_CATEGORIES)] += e.get("dur", 0.0) / n
        runs[name] += 1
    spans = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in ops]
    modules = sorted({e["args"].get("hlo_module", "?") for e in ops})
    return {f"host ops of {', '.join(modules)[:80]}, mean of {n} CPU devices": {
        "wall_us": max(b for _, b in spans) - min(a for a, _ in spans),
        # per device, the union of its ops' intervals; then the mean, like everything else here
        "busy_us": sum(union_length([(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in ops
                                     if e["args"].get("device_ordinal", "0") == d]) for d in devices) / n,
        "kernel_us": sum(by_name.values()), "by_category": dict(by_cat), "by_name": dict(by_name),
        "runs": {k: v // n for k, v in runs.items()}, "n_kernels": len(ops) // n}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--steps", type=int, default=1, help="steps in the traced window (figures are per step)")
    args = p.parse_args(argv)
    try:
        trace = find_trace(args.path)
    except FileNotFoundError as e:
        print(f"trace_summary: {e}", file=sys.stderr)
        return 2
    summary = summarize(read_events(trace))
    print(f"trace {trace}")
    if not summary:
        print("no device streams and no per-op host events in this trace")
        return 0
    n = max(args.steps, 1)
    for dev, s in summary.items():
        ms = lambda us: us / 1e3 / n  # noqa: E731 - per step, milliseconds
        print(f"{dev}: window {ms(s['wall_us']):.1f} ms/step, streams busy {ms(s['busy_us']):.1f} ms "
              f"({100 * s['busy_us'] / max(s['wall_us'], 1e-9):.1f}%), {s['n_kernels'] // n} kernels/step")
        cats = sorted(s["by_category"].items(), key=lambda kv: -kv[1])
        print("  by category (ms/step): " + ", ".join(f"{c} {ms(us):.1f}" for c, us in cats))
        print(f"  {'ms/step':>8} {'share':>6} {'runs':>5}  kernel")
        for name, us in sorted(s["by_name"].items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {ms(us):8.2f} {100 * us / s['kernel_us']:5.1f}% {s['runs'][name] // n:5d}  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
