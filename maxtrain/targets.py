"""Compiling for a GPU this machine does not have, and asking which device a program targets.

XLA's CUDA compiler runs without a GPU when it is handed a description of one (a PJRT topology
built from a `GpuTargetConfig`): the whole pipeline runs, including Pallas' Triton and Mosaic GPU
kernels down to ptxas, and the compiled program reports its memory per device, FLOPs and
collectives. `maxtrain inspect --target h200` and `bench/kernel_bench.py --target h200` use this.
It needs jax's CUDA plugin and ptxas, which install on any Linux x86-64 machine
(`INSTALL_HINT`); nothing runs, so step times still need the GPU.

The kernels ask `on_gpu()` / `compute_capability()` instead of `jax.default_backend()`: inside a
mesh context (`jax.set_mesh`) they answer for the mesh's devices, so a program traced for target
devices picks the compiled kernels rather than the interpreter.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from maxtrain.errors import ConfigError, did_you_mean
from maxtrain.devices import device_figures


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """What XLA's GPU compiler needs to know about a device (its cost model and limits)."""
    device_kind: str
    compute_capability: tuple[int, int]
    sm_count: int
    clock_ghz: float
    memory_bytes: int  # what the device reports as total memory
    l2_bytes: int
    smem_per_sm: int
    smem_per_block_optin: int
    fp32_units_per_sm: int = 128

    @property
    def bandwidth_bytes_s(self) -> float:
        """HBM bandwidth, from the one table of device figures (`maxtrain.devices`)."""
        return device_figures(self.device_kind).hbm_bytes_s

    def config_text(self) -> str:
        """The `stream_executor.GpuTargetConfigProto` text XLA's deviceless compiler reads."""
        major, minor = self.compute_capability
        return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.smem_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: {self.fp32_units_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.bandwidth_bytes_s)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.smem_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{self.device_kind}"
"""


# What XLA's compiler needs (SXM parts); memory is what `nvidia-smi` reports as total. Peak
# FLOP/s and bandwidths are in `maxtrain.devices`, the one table of device figures.
TARGETS = {
    "h100": GpuTarget("NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98, 81559 * 2**20, 50 * 2**20, 233472, 232448),
    "h200": GpuTarget("NVIDIA H200", (9, 0), 132, 1.98, 143771 * 2**20, 50 * 2**20, 233472, 232448),
    "a100": GpuTarget("NVIDIA A100-SXM4-80GB", (8, 0), 108, 1.41, 81920 * 2**20, 40 * 2**20, 167936, 166912,
                      fp32_units_per_sm=64),
}

# ptxas 12.9.1 (wheel 12.9.86): 12.8.0-12.9.0 miscompile causal Mosaic GPU kernels, and without a
# GPU the CUDA runtime check in flash_hopper.check_gpu cannot run.
PTXAS_WHEEL = "nvidia-cuda-nvcc-cu12==12.9.86"
INSTALL_HINT = ('pip install "jax-cuda12-plugin=={v}" "jax-cuda12-pjrt=={v}" "' + PTXAS_WHEEL + '" '
                "(about 220 MB; no GPU or driver needed)")


def plugin_version() -> str:
    """The jax CUDA plugin version this jax needs (plugins follow jaxlib)."""
    import jaxlib

    return jaxlib.__version__


def get_target(name: str) -> GpuTarget:
    if name not in TARGETS:
        raise ConfigError(f"--target {name!r} is unknown; {did_you_mean(name, TARGETS)}"
                          f"choose one of {', '.join(TARGETS)}")
    return TARGETS[name]


def target_devices(name: str, count: int, per_host: int = 8) -> list:
    """`count` devices of GPU target `name`, `per_host` to a host, for compiling only.

    Several hosts compile in this one process: a mesh over them shards and emits collectives as a
    multi-host job would. Raises a one-line ConfigError when jax's CUDA plugin is missing."""
    target = get_target(name)
    if count < 1:
        raise ConfigError(f"--target {name}: the device count must be >= 1, got {count}")
    per_host = min(per_host, count)
    if count % per_host:
        raise ConfigError(f"--target {name}: {count} devices do not fill hosts of {per_host} GPUs; "
                          f"use a multiple of {per_host}")
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target.config_text(),
                                                topology=f"1x{count // per_host}x{per_host}")
    except (NotImplementedError, RuntimeError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if cuda_compiler_available():
            raise ConfigError(f"--target {name}: jax's CUDA plugin could not describe a {target.device_kind} "
                              f"({why}); check that jax-cuda12-plugin and jax-cuda12-pjrt are "
                              f"{plugin_version()}, the installed jaxlib") from None
        raise ConfigError(f"--target {name}: compiling for a GPU on this machine needs jax's CUDA plugin ({why}); "
                          + INSTALL_HINT.format(v=plugin_version())) from None
    return list(topology.devices)


def cuda_compiler_available() -> bool:
    """Whether `target_devices` can work here (jax's CUDA plugin is importable)."""
    import importlib.util

    for name in ("jax_plugins.xla_cuda12", "jax_cuda12_plugin"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ImportError:  # the parent package is missing
            pass
    return False


def target_of(device_kind: str) -> GpuTarget | None:
    """The table's entry whose `device_kind` a (described) device reports, if any."""
    return next((t for t in TARGETS.values() if t.device_kind == device_kind), None)


def _context_device():
    """(platform, device_kind) of the mesh in context, or None outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    if device is None:
        return None
    return device.platform, device.device_kind


def traced_platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of the program being traced: the context mesh's devices,
    else the default backend. Traced for `target_devices`, "gpu" on a machine without a GPU."""
    ctx = _context_device()
    return ctx[0] if ctx else jax.default_backend()


def on_gpu() -> bool:
    """Whether the program being traced runs on GPUs (`traced_platform`)."""
    return traced_platform() == "gpu"


def compute_capability() -> str:
    """"9.0"-style compute capability of the devices a program targets, "" when unknown."""
    ctx = _context_device()
    if ctx is None or jax.default_backend() == "gpu":
        return str(getattr(jax.devices()[0], "compute_capability", ""))
    target = target_of(ctx[1])
    return "{}.{}".format(*target.compute_capability) if target else ""


def fp8_support(device) -> str:
    """"native" where the tensor cores multiply FP8 (compute capability 8.9+: Ada, Hopper,
    Blackwell), "emulated" on CPU (same rounding, no speed), "none" on older GPUs."""
    if device.platform == "cpu":
        return "emulated"
    cc = getattr(device, "compute_capability", None)
    if cc:
        major, minor = (int(x) for x in str(cc).split(".")[:2])
    else:
        target = target_of(device.device_kind)
        if target is None:
            return "none"
        major, minor = target.compute_capability
    return "native" if (major, minor) >= (8, 9) else "none"


def device_memory(device) -> int | None:
    """Bytes jax's allocator gets on `device`: its `bytes_limit` on a real GPU; for a described
    one (`target_devices`) the table's total times XLA_PYTHON_CLIENT_MEM_FRACTION (jax's default
    0.75); None when unknown (CPU)."""
    if device.platform == "cpu":
        return None
    try:
        limit = int((device.memory_stats() or {}).get("bytes_limit") or 0)
    except Exception:  # described devices and platforms without memory stats
        limit = 0
    if limit:
        return limit
    target = target_of(device.device_kind)
    if target is None:
        return None
    try:
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or 0.75)
    except ValueError:
        fraction = 0.75
    return int(target.memory_bytes * fraction)
