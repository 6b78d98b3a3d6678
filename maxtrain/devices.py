"""The one table of device figures: dense bf16 peak (MFU), dense FP8 peak, and HBM, NVLink and
network bandwidth and collective latency (the step's roofline, `maxtrain.analysis.hlo`, and
schedule model, `maxtrain.analysis.schedule`). Data-sheet figures, no sparsity;
jax-free. MFU is always against the bf16 peak, whatever precision the GEMMs run in."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Device:
    match: str  # a substring of the `device_kind` jax reports; the table lists the most specific first
    peak_bf16_tflops: float
    hbm_bytes_s: float | None = None  # None: no roofline for this device
    link_bytes_s: float = 450e9  # NVLink, one direction, per GPU (the roofline's collectives)
    network_bytes_s: float = 50e9  # between hosts per GPU (a 400 Gb/s NIC each, as in a DGX)
    peak_fp8_tflops: float | None = None  # dense FP8 tensor cores; None: no FP8 (the roofline's FP8 GEMMs)
    # the fixed cost of one collective (NCCL's small-message time, the schedule model's), within a
    # host over NVLink and across hosts over the network
    link_latency_s: float = 10e-6
    network_latency_s: float = 30e-6


DEVICES = (
    Device("GB200", 2500.0, peak_fp8_tflops=5000.0),
    Device("B200", 2250.0, peak_fp8_tflops=4500.0),
    Device("H200", 989.0, 4.8e12, peak_fp8_tflops=1979.0),
    Device("H100 PCIe", 756.0, peak_fp8_tflops=1513.0),
    Device("H100 80GB HBM3", 989.0, 3.35e12, peak_fp8_tflops=1979.0),  # the SXM part
    Device("H100", 989.0, peak_fp8_tflops=1979.0),
    Device("H800", 989.0, peak_fp8_tflops=1979.0),
    Device("H20", 148.0, peak_fp8_tflops=296.0),
    Device("A100-SXM4-80GB", 312.0, 2.039e12, link_bytes_s=300e9, network_bytes_s=25e9),
    Device("A100", 312.0),
    Device("A800", 312.0),
    Device("L40S", 362.0, peak_fp8_tflops=733.0),
    Device("L4", 121.0, peak_fp8_tflops=242.5),
    Device("A10G", 125.0),
    Device("TPU v5p", 459.0),
    Device("TPU v5 lite", 197.0),
    Device("TPU v4", 275.0),
)


def device_figures(device_kind: str) -> Device | None:
    """The table's entry for a device kind (e.g. "NVIDIA H200"), None when it is not listed."""
    return next((d for d in DEVICES if d.match.lower() in device_kind.lower()), None)
