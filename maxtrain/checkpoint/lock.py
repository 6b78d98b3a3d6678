"""The directory lock: one run owns a checkpoint directory for its lifetime (`DIR/maxtrain.lock`),
and a later run takes it over only when the owner is gone (see `DirectoryLock`)."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid

import jax

from maxtrain.checkpoint.agreement import true_on_all_processes
from maxtrain.config import ConfigError
from maxtrain.distributed import job_id

log = logging.getLogger("maxtrain")

LOCK_FILE = "maxtrain.lock"  # in the checkpoint directory while a run owns it
LOCK_HEARTBEAT_S = 30.0  # the owner touches the lock file this often
LOCK_STALE_S = 300.0  # an owner on another host whose heartbeat is older than this is gone


def describe_holder(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    job = f", {holder['job']}" if holder.get("job") else ""
    run = f", run_dir {holder['run_dir']}" if holder.get("run_dir") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {started}{run}"


class DirectoryLock:
    """One run owns a checkpoint directory for its lifetime: `DIR/maxtrain.lock`.

    The owner holds an exclusive `flock` on the file (released by the kernel however the process
    ends, SIGKILL included) and records itself in it (host, pid, job, start, run_dir), touching it
    every `LOCK_HEARTBEAT_S`. A later run takes the lock over when the owner is gone: the flock is
    free and the owner ran on this host, or the owner belongs to the same job (an earlier attempt
    of a restarted or requeued job), or the owner ran on another host and its heartbeat is older
    than `LOCK_STALE_S` (filesystems whose locks do not reach across hosts). Otherwise the run is
    refused with a `ConfigError` naming the owner.
    """

    def __init__(self, directory: str, run_dir: str | None = None):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "started": time.time(),
                       "run_dir": os.path.abspath(run_dir) if run_dir else None, "token": uuid.uuid4().hex}
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> "DirectoryLock":
        for _ in range(5):  # retried only when the file is replaced between our open and our flock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = _try_flock(fd)
                if not _same_file(fd, self.path):
                    os.close(fd)
                    continue
                holder = _read_record(fd)
                if holder and holder.get("token") != self.record["token"]:
                    reason = self._takeover_reason(holder, locked)
                    if reason is None:
                        raise ConfigError(f"checkpoint.dir {self.directory} is in use by another run "
                                          f"({describe_holder(holder)}){self._refusal_hint(holder, locked)}")
                    log.warning("checkpoint.dir %s: taking over the lock of %s (%s)", self.directory,
                                describe_holder(holder), reason)
                _write_record(fd, self.record)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            self._beat = threading.Thread(target=self._heartbeat, name="maxtrain-ckpt-lock", daemon=True)
            self._beat.start()
            return self
        raise ConfigError(f"checkpoint.dir {self.directory}: {LOCK_FILE} keeps being replaced by another process")

    def _refusal_hint(self, holder: dict, locked: bool | None) -> str:
        """How to go on when the recorded owner still owns the directory."""
        if locked is False or holder.get("host") == self.record["host"]:  # alive (flock held, or pid on this host)
            return "; give this run its own checkpoint.dir, or stop that run first"
        age = time.time() - os.stat(self.path).st_mtime
        return (f"; its heartbeat is {age:.0f}s old. Give this run its own checkpoint.dir, or stop that run first; "
                f"if it is no longer running, wait {max(LOCK_STALE_S - age, 0):.0f}s or delete {self.path}")

    def _takeover_reason(self, holder: dict, locked: bool | None) -> str | None:
        """Why the recorded owner is gone (the lock may be taken over), or None while it owns it."""
        here = holder.get("host") == self.record["host"]
        if here and holder.get("pid") == self.record["pid"]:
            return "this process, which never released it"
        if locked is False:  # its flock is held: alive, whatever its record says
            return None
        if holder.get("job") and holder.get("job") == self.record["job"]:
            return "an earlier attempt of this job"
        if here:
            if locked or not _pid_alive(holder.get("pid")):
                return "no longer running"
            return None
        age = time.time() - os.stat(self.path).st_mtime
        return f"its heartbeat is {age:.0f}s old" if age > LOCK_STALE_S else None

    def _heartbeat(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Removes the lock file (if it is still ours) and drops the flock."""
        if self._fd is None:
            return
        self._stop.set()
        try:
            holder = _read_record(self._fd)
            if holder and holder.get("token") == self.record["token"] and _same_file(self._fd, self.path):
                os.unlink(self.path)  # while still holding the flock: a waiter that opened it re-checks
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _try_flock(fd: int) -> bool | None:
    """True: locked; False: another open file holds it; None: the filesystem has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read_record(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    try:
        record = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError):
        return {"host": "?", "pid": None} if data.strip() else None  # unreadable: someone else's
    return record if isinstance(record, dict) else {"host": "?", "pid": None}


def _write_record(fd: int, record: dict) -> None:
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, data)
    os.fsync(fd)


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_directory(directory: str, run_dir: str | None = None) -> DirectoryLock | None:
    """Process 0 takes `directory`'s lock; every process raises the same way if it cannot."""
    lock, problem = None, None
    if jax.process_index() == 0:
        try:
            if os.path.exists(directory) and not os.path.isdir(directory):
                raise ConfigError(f"checkpoint.dir {directory} is a file, not a directory; give a directory")
            os.makedirs(directory, exist_ok=True)
            lock = DirectoryLock(directory, run_dir).acquire()
        except ConfigError as e:
            problem = str(e)
        except OSError as e:
            problem = f"checkpoint.dir {directory} is not usable: {e.strerror or e}"
    if not true_on_all_processes(problem is None):
        if lock is not None:
            lock.release()
        raise ConfigError(problem or f"checkpoint.dir {directory}: process 0 could not take its lock (see its log)")
    return lock
