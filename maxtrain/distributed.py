"""Multi-host start-up: find this process's place in the job, then join JAX's distributed runtime.

`detect(env)` is pure (tests fake environments); `initialize(spec, timeout_s)` calls
`jax.distributed.initialize` under a watchdog, because a peer that never shows up makes the
runtime abort the process with a stack trace instead of raising. Sources, later ones winning
field by field:

- Open MPI (`OMPI_COMM_WORLD_SIZE/RANK/LOCAL_RANK`; the coordinator from `MAXTRAIN_COORDINATOR`),
  else Slurm (`SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`/`SLURM_NTASKS`, the first host of
  `SLURM_STEP_NODELIST`/`SLURM_JOB_NODELIST`), else Kubernetes (`JOB_COMPLETION_INDEX`; the
  coordinator from `MAXTRAIN_COORDINATOR` or the JobSet's headless-service name; only together
  with `MAXTRAIN_NUM_PROCESSES`, since an Indexed Job may as well run independent pods);
- explicit `MAXTRAIN_COORDINATOR`, `MAXTRAIN_NUM_PROCESSES`, `MAXTRAIN_PROCESS_ID`,
  `MAXTRAIN_LOCAL_DEVICE_IDS`.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import os
import re
import socket
import sys
import threading
import time
from typing import Mapping

from maxtrain.config import ConfigError

JOB_ID_ENV = "MAXTRAIN_JOB_ID"  # the same on every attempt of one job (set by the launchers)


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The job this process belongs to, the same across its restarts and requeues (None: unknown)."""
    env = os.environ if env is None else env
    for name in (JOB_ID_ENV, "SLURM_JOB_ID", "JOBSET_NAME"):
        if env.get(name):
            return f"{name}={env[name]}"
    return None

log = logging.getLogger("maxtrain")

COORDINATOR = "MAXTRAIN_COORDINATOR"
NUM_PROCESSES = "MAXTRAIN_NUM_PROCESSES"
PROCESS_ID = "MAXTRAIN_PROCESS_ID"
LOCAL_DEVICE_IDS = "MAXTRAIN_LOCAL_DEVICE_IDS"
COORDINATOR_PORT = "MAXTRAIN_COORDINATOR_PORT"
INIT_TIMEOUT = "MAXTRAIN_INIT_TIMEOUT_S"

DEFAULT_PORT = 8476
DEFAULT_TIMEOUT_S = 300
TIMEOUT_EXIT_CODE = 2  # the same code as every other `maxtrain: error:` line
_RUNTIME_MARGIN_S = 60  # JAX's own deadline sits past ours, so the watchdog always speaks first
_LINGER_S = 3.0  # process 0's wait before leaving after an error (see leave_now)


class DistributedError(ConfigError):
    """A launch environment that cannot work: one `maxtrain: error:` line, exit 2."""


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """This process's place in a multi-process job; `names` says which variable gave each field."""
    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None  # None: every device this process sees
    source: str = "env"  # slurm, mpi, k8s or env
    names: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def describe(self) -> str:
        return f"process {self.process_id} of {self.num_processes} ({self.source}), coordinator {self.coordinator}"


# ---------------------------------------------------------------- parsing helpers


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list (`node[01-03,07],gpu-a[1-2]-ib`) -> every host name, in order.

    Zero padding of a range is kept (`01-03` -> 01, 02, 03). Nested brackets do not occur in Slurm.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        parts = re.split(r"\[([^\]]*)\]", item)  # literal, ranges, literal, ranges, ..., literal
        if "[" in item and (len(parts) % 2 == 0 or any("[" in p or "]" in p for p in parts)):
            raise ValueError(f"unbalanced brackets in {item!r}")
        names = [""]
        for k, part in enumerate(parts):
            choices = [part] if k % 2 == 0 else _expand_ranges(part)
            names = [n + c for n in names for c in choices]
        hosts.extend(n for n in names if n)
    if not hosts:
        raise ValueError("no hosts")
    return hosts


def _split_top_level(s: str) -> list[str]:
    """Splits on commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in {s!r}")
        if ch == "," and depth == 0:
            items.append(s[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in {s!r}")
    items.append(s[start:])
    return [x for x in items if x]


def _expand_ranges(spec: str) -> list[str]:
    out = []
    for r in spec.split(","):
        lo, sep, hi = r.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {r!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {r!r}")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's `SLURM_STEP_TASKS_PER_NODE` (`4(x2),3`) -> tasks on each node ([4, 4, 3])."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise ValueError(f"bad tasks-per-node entry {item!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer") from None


def _address(value: str, name: str) -> str:
    """Validates host:port (IPv6 in brackets)."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{name}={value!r} must be host:port (e.g. node01:{DEFAULT_PORT})")
    return value.strip()


def _device_ids(value: str, name: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise DistributedError(f"{name}={value!r} must be comma-separated device numbers, e.g. 0,1") from None
    if not ids:
        raise DistributedError(f"{name} is empty; give device numbers such as 0,1 or unset it")
    return ids


def _port(env: Mapping[str, str], default: int) -> int:
    if COORDINATOR_PORT not in env:
        return default
    port = _int(env, COORDINATOR_PORT)
    if not 0 < port < 65536:
        raise DistributedError(f"{COORDINATOR_PORT}={port} is not a TCP port (1-65535)")
    return port


# ---------------------------------------------------------------- schedulers


def _local_ids(local_rank: int, local_size: int, env: Mapping[str, str]) -> tuple[int, ...] | None:
    """This process's share of the host's GPUs when several processes share a host.

    None (all it sees) when it is alone on the host or the scheduler already bound GPUs per task
    (CUDA_VISIBLE_DEVICES lists fewer GPUs than there are processes on the host).
    """
    if local_size <= 1:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return (local_rank,)
    n = len([g for g in visible.split(",") if g.strip()])
    if n < local_size:
        return None
    per = n // local_size
    return tuple(range(local_rank * per, (local_rank + 1) * per))


def _from_mpi(env: Mapping[str, str]) -> dict:
    fields = {"num_processes": _int(env, "OMPI_COMM_WORLD_SIZE"), "process_id": _int(env, "OMPI_COMM_WORLD_RANK"),
              "names": {"num_processes": "OMPI_COMM_WORLD_SIZE", "process_id": "OMPI_COMM_WORLD_RANK",
                        "coordinator": COORDINATOR}}
    if "OMPI_COMM_WORLD_LOCAL_RANK" in env and "OMPI_COMM_WORLD_LOCAL_SIZE" in env:
        fields["local_device_ids"] = _local_ids(_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                                                _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"), env)
    return fields


def _from_slurm(env: Mapping[str, str]) -> dict:
    count_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    list_var = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    fields = {"num_processes": _int(env, count_var), "process_id": _int(env, "SLURM_PROCID"),
              "names": {"num_processes": count_var, "process_id": "SLURM_PROCID", "coordinator": list_var}}
    if fields["num_processes"] > 1:
        if list_var not in env:
            raise DistributedError(f"Slurm sets SLURM_PROCID and {count_var} but no SLURM_STEP_NODELIST or "
                                   f"SLURM_JOB_NODELIST; set {COORDINATOR}=host:port of task 0")
        try:
            first = expand_hostlist(env[list_var])[0]
        except ValueError as e:
            raise DistributedError(f"{list_var}={env[list_var]!r} is not a Slurm host list ({e})") from None
        # a port derived from the job id keeps two jobs sharing a node apart, like JAX's own detection
        job = env.get("SLURM_JOB_ID", "")
        default = 61440 + int(job) % 4096 if job.isdigit() else DEFAULT_PORT
        fields["coordinator"] = f"{first}:{_port(env, default)}"
    per_node_var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if v in env), None)
    if per_node_var and "SLURM_LOCALID" in env:
        try:
            local_size = max(tasks_per_node(env[per_node_var]))
        except ValueError as e:
            raise DistributedError(f"{per_node_var}={env[per_node_var]!r} cannot be read ({e})") from None
        fields["local_device_ids"] = _local_ids(_int(env, "SLURM_LOCALID"), local_size, env)
    return fields


def _from_k8s(env: Mapping[str, str]) -> dict:
    """Indexed Job / JobSet: the index is the process id; the host count comes from our manifest."""
    fields = {"process_id": _int(env, "JOB_COMPLETION_INDEX"),
              "names": {"process_id": "JOB_COMPLETION_INDEX", "num_processes": NUM_PROCESSES,
                        "coordinator": COORDINATOR}}
    jobset, rjob = env.get("JOBSET_NAME"), env.get("REPLICATED_JOB_NAME")
    if jobset and rjob:  # pod 0 of job 0, under the JobSet's headless service (named after the JobSet)
        fields["coordinator"] = f"{jobset}-{rjob}-0-0.{jobset}:{_port(env, DEFAULT_PORT)}"
        fields["names"]["coordinator"] = "JOBSET_NAME"
    return fields


def _scheduler_fields(env: Mapping[str, str]) -> dict:
    if "OMPI_COMM_WORLD_SIZE" in env and "OMPI_COMM_WORLD_RANK" in env:
        return {"source": "mpi", **_from_mpi(env)}
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        return {"source": "slurm", **_from_slurm(env)}
    if "JOB_COMPLETION_INDEX" in env and env.get(NUM_PROCESSES):  # an index alone: independent pods
        return {"source": "k8s", **_from_k8s(env)}
    return {"source": "env", "names": {}}


def _explicit_fields(env: Mapping[str, str]) -> dict:
    fields: dict = {}
    if env.get(COORDINATOR):
        fields["coordinator"] = _address(env[COORDINATOR], COORDINATOR)
    if env.get(NUM_PROCESSES):
        fields["num_processes"] = _int(env, NUM_PROCESSES)
    if env.get(PROCESS_ID):
        fields["process_id"] = _int(env, PROCESS_ID)
    if env.get(LOCAL_DEVICE_IDS):
        fields["local_device_ids"] = _device_ids(env[LOCAL_DEVICE_IDS], LOCAL_DEVICE_IDS)
    return fields


def detect(env: Mapping[str, str]) -> DistributedSpec | None:
    """This process's `DistributedSpec` from `env`, or None for a single-process run.

    Raises DistributedError naming the variable when the environment is inconsistent.
    """
    fields = _scheduler_fields(env)
    explicit = _explicit_fields(env)
    names = {**fields.pop("names"), **{k: _explicit_name(k) for k in explicit}}
    fields.update(explicit)
    if fields.get("num_processes") is None and "process_id" not in fields and "coordinator" not in fields:
        return None  # nothing says this is a multi-process job
    if fields.get("num_processes") is None:
        raise DistributedError(f"{names.get('process_id') or names.get('coordinator')} is set but the process "
                               f"count is not: set {NUM_PROCESSES}")
    n = fields["num_processes"]
    if n < 1:
        raise DistributedError(f"{names['num_processes']}={n}: the process count must be at least 1")
    if n == 1 and fields.get("process_id", 0) == 0:
        return None
    if "process_id" not in fields:
        raise DistributedError(f"{names['num_processes']}={n} is set but this process's id is not: set {PROCESS_ID}")
    pid = fields["process_id"]
    if not 0 <= pid < n:
        raise DistributedError(f"{names['process_id']}={pid} is out of range for {names['num_processes']}={n} "
                               f"(valid ids: 0 to {n - 1})")
    if "coordinator" not in fields:
        raise DistributedError(f"{n} processes but no coordinator address: set {COORDINATOR}=host:port "
                               f"(the host of process 0, e.g. node01:{DEFAULT_PORT})")
    return DistributedSpec(fields["coordinator"], n, pid, fields.get("local_device_ids"), fields["source"], names)


def _explicit_name(field: str) -> str:
    return {"coordinator": COORDINATOR, "num_processes": NUM_PROCESSES, "process_id": PROCESS_ID,
            "local_device_ids": LOCAL_DEVICE_IDS}[field]


def timeout_from_env(env: Mapping[str, str]) -> int:
    if not env.get(INIT_TIMEOUT):
        return DEFAULT_TIMEOUT_S
    t = _int(env, INIT_TIMEOUT)
    if t < 1:
        raise DistributedError(f"{INIT_TIMEOUT}={t} must be at least 1 (seconds)")
    return t


# ---------------------------------------------------------------- joining the runtime


def check_device_counts(per_process: Mapping[int, int]) -> None:
    """Every process must bring the same number of devices: the mesh tiles them host by host."""
    counts = collections.Counter(per_process.values())
    if len(counts) > 1:
        listing = ", ".join(f"process {p}: {c}" for p, c in sorted(per_process.items()))
        raise DistributedError(f"processes have different device counts ({listing}); give every process the "
                               f"same number of devices (GPUs per task, or --xla_force_host_platform_device_count)")


def timeout_message(spec: DistributedSpec, timeout_s: int, coordinator_reachable: bool | None) -> str:
    """The one line for a job that did not assemble in time; says which side is missing."""
    src = f" (from {spec.names['coordinator']})" if spec.names.get("coordinator") else ""
    if spec.process_id == 0:
        how = " (under Slurm, start them with srun: one task per node)" if spec.source == "slurm" else ""
        return (f"process 0 waited {timeout_s}s at {spec.coordinator} for the other {spec.num_processes - 1} "
                f"process(es) to join; check that all {spec.num_processes} started{how} and can reach this host "
                f"({INIT_TIMEOUT} sets the wait)")
    if coordinator_reachable is False:
        return (f"process {spec.process_id} of {spec.num_processes} could not reach the coordinator "
                f"{spec.coordinator}{src} within {timeout_s}s; check that process 0 is running and that the "
                f"address and port are right ({INIT_TIMEOUT} sets the wait)")
    return (f"process {spec.process_id} of {spec.num_processes} reached the coordinator {spec.coordinator} but the "
            f"job did not assemble within {timeout_s}s; check that all {spec.num_processes} processes started "
            f"({INIT_TIMEOUT} sets the wait)")


def _reachable(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


class _Watchdog:
    """Ends the process with one line if joining takes longer than `timeout_s`.

    JAX's runtime would abort the process itself (a C++ check failure and stack trace), and the
    main thread is blocked inside it, so the line is written from this thread and `os._exit` ends
    the process.
    """

    def __init__(self, spec: DistributedSpec, timeout_s: int):
        self._spec, self._timeout = spec, timeout_s
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True

    def _expire(self) -> None:
        reachable = None if self._spec.process_id == 0 else _reachable(self._spec.coordinator)
        sys.stderr.write(f"maxtrain: error: {timeout_message(self._spec, self._timeout, reachable)}\n")
        sys.stderr.flush()
        os._exit(TIMEOUT_EXIT_CODE)

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()


def _use_gloo_on_cpu() -> None:
    """CPU collectives across processes need gloo (the default in recent jax; set it for older ones)."""
    import jax

    try:
        if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # option gone in a future jax: its default then applies
        pass


def _initialize_kwargs(spec: DistributedSpec, timeout_s: int) -> dict:
    """Arguments for `jax.distributed.initialize`, only those this jax version accepts."""
    import jax

    kwargs = {"coordinator_address": spec.coordinator, "num_processes": spec.num_processes,
              "process_id": spec.process_id, "initialization_timeout": timeout_s + _RUNTIME_MARGIN_S,
              "cluster_detection_method": "deactivate"}  # we detected already; JAX must not second-guess it
    if spec.local_device_ids is not None:
        kwargs["local_device_ids"] = list(spec.local_device_ids)
    accepted = inspect.signature(jax.distributed.initialize).parameters
    return {k: v for k, v in kwargs.items() if k in accepted}


def initialize(spec: DistributedSpec, timeout_s: int = DEFAULT_TIMEOUT_S) -> None:
    """Joins the job described by `spec`; must run before anything asks jax for devices.

    Within `timeout_s` every process must have joined and the devices must be known, or the
    process ends with one `maxtrain: error:` line (exit 2). Raises DistributedError when processes
    bring different device counts (all processes see the same list, so all stop alike).
    """
    import jax

    _use_gloo_on_cpu()
    with _Watchdog(spec, timeout_s):
        jax.distributed.initialize(**_initialize_kwargs(spec, timeout_s))
        devices = jax.devices()  # the device exchange between processes happens here
    try:
        check_device_counts(collections.Counter(d.process_index for d in devices))
    except DistributedError:
        jax.distributed.shutdown()  # every process sees the same list and stops here: leave together
        raise
    log.info("joined %s: %d devices in all", spec.describe(), len(devices))


def initialize_from_env(env: Mapping[str, str] | None = None) -> DistributedSpec | None:
    """`detect` + `initialize` for the command line; None (and nothing done) for one process."""
    env = os.environ if env is None else env
    spec = detect(env)
    if spec is not None:
        initialize(spec, timeout_from_env(env))
    return spec


def joined() -> bool:
    """Whether this process has joined a multi-process job (jax.distributed is initialised)."""
    jax = sys.modules.get("jax")
    if jax is None:  # never imported: nothing was joined
        return False
    return bool(getattr(jax.distributed, "is_initialized", lambda: False)())


def leave_now(code: int) -> None:
    """Ends a process of a multi-process job after an error, without JAX's shutdown barrier.

    The barrier would wait minutes for peers that are still training (the launcher, srun or the
    JobSet stops those). Process 0 hosts the coordination service, so it lingers a moment: peers
    that hit the same error (a config error is seen by all) report their own line rather than
    the runtime's "another task died" abort.
    """
    import jax

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    if jax.process_index() == 0:
        time.sleep(_LINGER_S)
    os._exit(code)


def quiet_other_processes(spec: DistributedSpec | None) -> None:
    """Only process 0 logs progress; the others keep warnings and errors."""
    if spec is not None and spec.process_id != 0:
        logging.getLogger("maxtrain").setLevel(logging.WARNING)
