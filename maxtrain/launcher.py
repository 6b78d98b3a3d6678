"""`maxtrain launch local`: N training processes on this machine, started and stopped as one job.

Each child gets `MAXTRAIN_COORDINATOR/NUM_PROCESSES/PROCESS_ID` (see `maxtrain.distributed`) and
either K fake CPU devices or its share of the GPUs. Its output lines are prefixed `[rank i]`.
When one child fails the others get SIGTERM, then SIGKILL after a grace period (a survivor is
usually blocked in a collective with the dead peer and cannot stop by itself), and the launcher
exits with the first failure's code. Children run in their own process groups (so a terminal's
Ctrl-C reaches them once, through us) and die with the launcher (PR_SET_PDEATHSIG): no orphans.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import tempfile
import time
import uuid
from typing import Callable, Mapping, Sequence

from maxtrain import distributed
from maxtrain.distributed import JOB_ID_ENV, job_id
from maxtrain.exit_codes import HALT as HALT_EXIT_CODE, HANG as HANG_EXIT_CODE, PREEMPTED as PREEMPTED_EXIT_CODE
from maxtrain.exit_codes import UNHEALTHY as UNHEALTHY_EXIT_CODE
from maxtrain.config import ConfigError

USER_ERROR = 2  # a config error repeats on every restart
LAUNCHED_ENV = "MAXTRAIN_LAUNCHED_AT"  # when the launcher started this attempt's processes (epoch seconds)
DETECTED_ENV = "MAXTRAIN_FAILURE_SEEN_AT"  # when it saw the previous attempt fail (epoch seconds)
CONDEMNED_ENV = "MAXTRAIN_CONDEMNED_FILE"  # where process 0 writes the ranks preflight condemned (exit 78)
RESTART_ENV = "MAXTRAIN_RESTART"  # which attempt a child belongs to (0: the first); fault drills fire only in 0
POLL_S = 0.1
_CHILD_MAIN = "import sys; from maxtrain.cli import main; sys.exit(main(sys.argv[1:]))"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True)
class Placement:
    """What devices a child gets: K fake CPU devices, or these GPU numbers."""
    cpu_devices: int | None = None
    gpus: tuple[str, ...] | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the coordinator binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """This machine's GPUs: CUDA_VISIBLE_DEVICES if set, else what `nvidia-smi -L` lists."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, _ in enumerate(x for x in out.splitlines() if x.startswith("GPU "))]


def placements(processes: int, cpu_devices: int | None, gpus: Sequence[str]) -> list[Placement]:
    """Per-rank devices: `cpu_devices` fake CPU devices each, else the GPUs split evenly, else 1 CPU device."""
    if processes < 1:
        raise ConfigError(f"--processes must be at least 1, not {processes}")
    if cpu_devices is not None:
        if cpu_devices < 1:
            raise ConfigError(f"--cpu-devices must be at least 1, not {cpu_devices}")
        return [Placement(cpu_devices=cpu_devices)] * processes
    if not gpus:
        return [Placement(cpu_devices=1)] * processes
    if len(gpus) % processes:
        raise ConfigError(f"{len(gpus)} GPUs do not split evenly over --processes {processes}; choose a "
                          f"divisor of {len(gpus)} (or set CUDA_VISIBLE_DEVICES to fewer GPUs)")
    per = len(gpus) // processes
    return [Placement(gpus=tuple(gpus[r * per:(r + 1) * per])) for r in range(processes)]


def child_env(base: Mapping[str, str], rank: int, processes: int, coordinator: str, place: Placement) -> dict:
    """The environment of child `rank`: inherited, minus scheduler variables, plus its place in the job."""
    env = {k: v for k, v in base.items() if not _scheduler_var(k)}
    env.update({distributed.COORDINATOR: coordinator, distributed.NUM_PROCESSES: str(processes),
                distributed.PROCESS_ID: str(rank), "PYTHONUNBUFFERED": "1"})
    if place.cpu_devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
        env["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_COUNT_FLAG}={place.cpu_devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(place.gpus)
    return env


def _scheduler_var(name: str) -> bool:
    """Variables that would make a child think it is a rank of some outer job (we are the job here)."""
    return (name.startswith(("SLURM_", "OMPI_COMM_WORLD_", "MAXTRAIN_LOCAL_DEVICE_IDS"))
            or name in ("JOB_COMPLETION_INDEX", "JOBSET_NAME", "REPLICATED_JOB_NAME"))


def exit_code(returncode: int) -> int:
    """A child's status as a shell would report it: killed by signal S -> 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def exit_cause(code: int) -> str:
    """What an exit code means (the table in docs/reliability.md)."""
    causes = {1: "crash", PREEMPTED_EXIT_CODE: "preempted, checkpoint saved", HANG_EXIT_CODE: "hang (watchdog)",
              HALT_EXIT_CODE: "halted by a numerical guard",
              UNHEALTHY_EXIT_CODE: "a node condemned by preflight or the straggler watch (run_dir/preflight.json, stragglers.json)"}
    if code in causes:
        return causes[code]
    return f"killed by signal {code - 128}" if code > 128 else f"exit {code}"


def restart_backoff(attempt: int, base_s: float = 1.0, cap_s: float = 60.0) -> float:
    """Seconds before restart `attempt` (1, 2, ...): doubling from `base_s`, capped."""
    return min(base_s * 2 ** (attempt - 1), cap_s)


def should_restart(code: int, attempt: int, max_restarts: int) -> bool:
    """Restart the whole group after a failure, up to `max_restarts` times; not after a user error or a
    numerical-guard halt (both would repeat: they need a person), nor after preflight condemned a
    node (here every rank is on this machine: there is no other node to restart on)."""
    return code not in (0, USER_ERROR, HALT_EXIT_CODE, UNHEALTHY_EXIT_CODE) and attempt < max_restarts


def condemned_lines(path: str) -> list[str]:
    """What process 0 wrote to `MAXTRAIN_CONDEMNED_FILE`, one line per condemned rank."""
    import json

    try:
        with open(path) as f:
            found = json.load(f)
        by = found.get("by", "preflight")
        return [f"{by} condemned rank {c['rank']} ({c['host']}): {'; '.join(c['reasons'])}" for c in found["condemned"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


# ---------------------------------------------------------------- one attempt


def _death_signal_setter() -> Callable[[], None] | None:
    """A pre-exec hook making a child get SIGKILL when the launcher dies (Linux PR_SET_PDEATHSIG).

    libc is looked up here, in the parent: between fork and exec the child should only make the call.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: children still run in their own groups and are stopped on failure
    return lambda: prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1


# Gloo's "[Gloo] Rank i is connected to n peer ranks. Expected number of connected peer ranks is : n",
# one per process and collective group (24 lines for 4 processes), says nothing a user needs. It is
# written from C++ piece by piece while Python logs to the same stream, so a message can be cut by
# another line: its pieces, whole or cut at a line's end and resumed at the next one's start
# (best effort: an interleaving can still leave a piece behind).
_GLOO = [re.escape("[Gloo] Rank "), r"\d+", re.escape(" is connected to "), r"\d+",
         re.escape(" peer ranks. Expected number of connected peer ranks is : "), r"\d+"]
_GLOO_WHOLE = re.compile("".join(_GLOO[:3]) + r"(\d+)" + _GLOO[4] + r"\1")  # all expected peers connected
_GLOO_HEAD = re.compile("(?:" + "|".join("".join(_GLOO[:k]) for k in range(1, len(_GLOO))) + r")[ \t]*$")
_GLOO_OPEN = re.compile(_GLOO[0] + r"(?!\d+ is connected)")
_GLOO_TAIL = re.compile("^(?:" + "|".join("".join(_GLOO[k:]) for k in range(1, len(_GLOO))) + ")")


def _without_whole_messages(line: str) -> str:
    """The line with every whole message removed, also one that another message was written into
    (removing the inner one makes the outer one whole)."""
    kept, n = _GLOO_WHOLE.subn("", line)
    while n:
        kept, n = _GLOO_WHOLE.subn("", kept)
    return kept


class _GlooFilter:
    """Cuts Gloo's connection messages out of one stream's lines (state: a message cut at a line's end)."""

    def __init__(self):
        self.cut = False

    def __call__(self, line: str) -> str | None:
        """The line without them; None when nothing else was on it."""
        kept = _without_whole_messages(line)
        if self.cut:
            kept = _GLOO_TAIL.sub("", kept, count=1)
        opened = _GLOO_OPEN.match(kept)  # the message's first piece, then another line's text
        if opened:
            kept = kept[opened.end():]
        head = _GLOO_HEAD.search(kept.rstrip("\n"))  # a message cut at this line's end
        if head:
            kept = kept.rstrip("\n")[:head.start()]
        self.cut = opened is not None or head is not None
        return None if kept != line and not kept.strip() else kept


def _pump(stream, rank: int, out, lock: threading.Lock) -> None:
    """Copies a child's output line by line with its rank in front (Gloo's connection messages left out)."""
    prefix = f"[rank {rank}] "
    quiet = _GlooFilter()
    for raw in iter(stream.readline, b""):
        line = quiet(raw.decode("utf-8", "replace"))
        if line is None:
            continue
        text = prefix + line.rstrip("\n") + "\n"
        with lock:
            out.write(text)
            out.flush()
    stream.close()


def _signal_groups(procs: Sequence[subprocess.Popen], sig: int) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)  # the child and anything it started (data workers)
        except (ProcessLookupError, PermissionError):
            pass


class _Group:
    """The children of one attempt and the signals the launcher itself receives meanwhile."""

    def __init__(self, argv: Sequence[str], envs: Sequence[dict], say: Callable[[str], None]):
        self.say = say
        self.signal: int | None = None
        hook = _death_signal_setter()
        self.procs = [subprocess.Popen([sys.executable, "-c", _CHILD_MAIN, *argv], env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0,
                                       preexec_fn=hook)
                      for env in envs]  # all before our threads start: a pre-exec hook and threads mix badly
        lock = threading.Lock()
        self.pumps = [threading.Thread(target=_pump, args=(s, r, o, lock), daemon=True)
                      for r, p in enumerate(self.procs)
                      for s, o in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]
        for t in self.pumps:
            t.start()
        for r, p in enumerate(self.procs):
            say(f"rank {r} pid {p.pid}")

    def on_signal(self, signum, frame) -> None:
        """First SIGTERM/SIGINT: pass it on (children checkpoint and exit 75); a second: SIGKILL."""
        if self.signal is None:
            self.signal = signum
            _signal_groups(self.procs, signum)
        else:
            _signal_groups(self.procs, signal.SIGKILL)

    def wait(self, grace_s: float) -> int:
        """Waits for all children; on the first failure stops the rest. Returns the job's exit code."""
        exits: queue.Queue = queue.Queue()  # (rank, code) in the order the children ended
        waiters = [threading.Thread(target=lambda r=r, p=p: exits.put((r, exit_code(p.wait()))), daemon=True)
                   for r, p in enumerate(self.procs)]
        for t in waiters:
            t.start()
        failed: tuple[int, int] | None = None
        for ended in range(1, len(self.procs) + 1):
            rank, code = self._next(exits)
            if code != 0 and failed is None:
                failed = (rank, code)
                # after a preemption every rank saves and exits by itself: a SIGKILL could cut a save short
                if ended < len(self.procs) and code != PREEMPTED_EXIT_CODE and self.signal is None:
                    self.say(f"rank {rank} exited with code {code}; stopping the other ranks")
                    threading.Thread(target=self._stop, args=(grace_s,), daemon=True).start()
        for t in self.pumps:
            t.join(timeout=5)
        return failed[1] if failed else 0

    @staticmethod
    def _next(exits: queue.Queue) -> tuple[int, int]:
        while True:  # short waits so our own SIGTERM/SIGINT handler runs promptly
            try:
                return exits.get(timeout=POLL_S * 5)
            except queue.Empty:
                continue

    def _stop(self, grace_s: float) -> None:
        alive = [p for p in self.procs if p.poll() is None]
        _signal_groups(alive, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(POLL_S)
        stuck = [p for p in alive if p.poll() is None]
        if stuck:
            self.say(f"{len(stuck)} rank(s) still running after {grace_s:g}s; killing them")
            _signal_groups(stuck, signal.SIGKILL)


def _say(message: str) -> None:
    sys.stderr.write(f"[launch] {message}\n")
    sys.stderr.flush()


def launch_local(argv: Sequence[str], processes: int, cpu_devices: int | None = None, max_restarts: int = 0,
                 grace_s: float = 10.0, env: Mapping[str, str] | None = None, backoff_s: float = 1.0) -> int:
    """Runs `maxtrain ARGV...` (e.g. `train CONFIG ...`) as `processes` ranks; returns the job's exit code."""
    env = os.environ if env is None else env
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, not {max_restarts}")
    if backoff_s < 0:
        raise ConfigError(f"--backoff must be >= 0 seconds, not {backoff_s}")
    places = placements(processes, cpu_devices, [] if cpu_devices is not None else visible_gpus(env))
    what = (f"{places[0].cpu_devices} CPU device(s) each" if places[0].cpu_devices is not None
            else f"{len(places[0].gpus)} GPU(s) each ({' | '.join(','.join(p.gpus) for p in places)})")
    attempt, seen = 0, None
    job = job_id(env) or f"launch-{uuid.uuid4().hex[:12]}"  # restarts take over the checkpoint.dir lock
    condemned = os.path.join(tempfile.gettempdir(), f"maxtrain-{job}-{os.getpid()}-condemned.json")
    while True:
        coordinator = f"127.0.0.1:{free_port()}"  # fresh each attempt: the old port may linger in TIME_WAIT
        _say(f"starting {processes} processes, {what}, coordinator {coordinator}"
             + (f" (restart {attempt} of {max_restarts})" if attempt else ""))
        stamps = {LAUNCHED_ENV: f"{time.time():.3f}", **({DETECTED_ENV: f"{seen:.3f}"} if seen is not None else {})}
        envs = [{**child_env(env, r, processes, coordinator, p), RESTART_ENV: str(attempt), JOB_ID_ENV: job,
                 CONDEMNED_ENV: condemned, **stamps} for r, p in enumerate(places)]
        group = _Group(argv, envs, _say)
        old = {s: signal.signal(s, group.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = group.wait(grace_s)
            seen = time.time()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if code == UNHEALTHY_EXIT_CODE:
            for line in condemned_lines(condemned):
                _say(line)
        if os.path.exists(condemned):
            os.unlink(condemned)
        if group.signal is not None or not should_restart(code, attempt, max_restarts):
            _say(f"exit code {code}")
            return code
        attempt += 1
        wait = restart_backoff(attempt, backoff_s)
        _say(f"job failed with code {code} ({exit_cause(code)}); restarting all ranks in {wait:.1f}s "
             f"(they resume from checkpoint.dir)")
        time.sleep(wait)
