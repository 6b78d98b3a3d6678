"""FLOPs accounting, MFU, metric writers and the per-step progress display."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time

log = logging.getLogger("maxtrain")

# Dense bf16 tensor-core peak per device, TFLOP/s (no sparsity), by substring of `device_kind`.
# Ordered most specific first.
PEAK_BF16_TFLOPS = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 125.0),
    ("TPU v5p", 459.0),
    ("TPU v5 lite", 197.0),
    ("TPU v4", 275.0),
)


def peak_tflops(device_kind: str, override: float | None = None) -> float | None:
    """Per-device peak for MFU: the config's `train.peak_tflops`, else the table, else None."""
    if override:
        return override
    for name, tflops in PEAK_BF16_TFLOPS:
        if name.lower() in device_kind.lower():
            return tflops
    return None


def throughput(step_time_s: float, tokens_per_step: int, flops_per_step: float, n_devices: int,
               peak: float | None) -> dict:
    """tokens/s, achieved model TFLOP/s per device and MFU for one step time."""
    tflops = flops_per_step / step_time_s / n_devices / 1e12
    return {
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_step / step_time_s,
        "tflops_per_device": tflops,
        "mfu": (tflops / peak) if peak else None,
    }


class JsonlWriter:
    """Appends one JSON object per line, flushed so a crash loses at most the current line."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._f = open(path, "a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible rather than null
    return v


def format_line(r: dict, total_steps: int) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
    line = (f"step {r['step']}/{total_steps} | loss {r['loss']:.4f} | grad_norm {r['grad_norm']:.3f} "
            f"| lr {r['lr']:.2e} | {r['tokens_per_s']:,.0f} tok/s | {r['step_time_s'] * 1e3:.1f} ms/step "
            f"| {r['tflops_per_device']:.3g} TFLOP/s/dev | mfu {mfu}")
    if r.get("data_wait_s"):
        line += f" | data wait {100 * r['data_wait_s'] / r['step_time_s']:.0f}%"
    if "eval_loss" in r:
        line += f" | eval_loss {r['eval_loss']:.4f} (ppl {r['eval_ppl']:.2f})"
    return line


class Progress:
    """A one-line progress bar on a terminal; silent when stderr is not a TTY."""

    def __init__(self, total: int, stream=None):
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self._start = time.perf_counter()

    def update(self, step: int, loss: float | None = None) -> None:
        if not self.enabled:
            return
        frac = step / max(self.total, 1)
        bar = "#" * int(30 * frac)
        elapsed = time.perf_counter() - self._start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        extra = f" loss {loss:.3f}" if loss is not None else ""
        self.stream.write(f"\r[{bar:<30}] {step}/{self.total}{extra} eta {eta:5.0f}s")
        self.stream.flush()

    def clear(self) -> None:
        """Erases the bar so a log line can take its place."""
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")


# ---------------------------------------------------------------- compiled-program accounting

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*(.*?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\dm\d(?:fn)?)?)\[([\d,]*)\]")
_WHILE = re.compile(r"while\(.*body=%?([\w.\-]+).*?known_trip_count\W+n\W+(\d+)")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def collective_stats(hlo_text: str) -> dict[str, dict[str, int]]:
    """Collectives of an optimized HLO module: per kind, ops executed per step and their result bytes.

    An op inside a while loop (the scanned layers) counts once per iteration, from XLA's
    `known_trip_count`. Bytes are the op's result size per device (for all-gather the gathered
    array, for reduce-scatter the scattered shard).
    """
    body_of: dict[str, tuple[str, int]] = {}  # while body -> (enclosing computation, trip count)
    ops: list[tuple[str, str, int]] = []  # (computation, kind, bytes)
    current = ""
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line.strip())
        if m and not line.startswith(" "):
            current = m.group(1)
            continue
        w = _WHILE.search(line)
        if w:
            body_of[w.group(1)] = (current, int(w.group(2)))
        o = _OP.search(line)
        if o and "-done" not in line.split("=")[0]:
            ops.append((current, o.group(2), _shape_bytes(o.group(1))))

    def multiplier(comp: str, depth: int = 0) -> int:
        if comp not in body_of or depth > 8:
            return 1
        parent, n = body_of[comp]
        return n * multiplier(parent, depth + 1)

    stats = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES}
    for comp, kind, nbytes in ops:
        k = multiplier(comp)
        stats[kind]["count"] += k
        stats[kind]["bytes"] += k * nbytes
    return stats


def memory_breakdown(compiled) -> dict[str, int] | None:
    """Per-device bytes of the compiled program: arguments, outputs, temporaries, aliased, total."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
           "temporaries": int(m.temp_size_in_bytes), "aliased": int(m.alias_size_in_bytes)}
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    return out


def xla_flops(compiled) -> float | None:
    """FLOPs of one device's program as XLA's cost analysis counts them (a loop body once)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])
