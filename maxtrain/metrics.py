"""FLOPs accounting, MFU, metric writers and the per-step progress display."""

from __future__ import annotations

import json
import logging
import math
import os
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
