"""The directory lock: one run owns a checkpoint directory for its lifetime (`DIR/maxtrain.lock`),
and a later run takes it over only when the owner is gone: `DirectoryLock` on a filesystem (an
`flock`), `ObjectLease` in an object store (conditional puts, the server's clocks)."""

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
        self.record = _new_record(run_dir)
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
    return _parse_record(data) if data.strip() else None  # an empty file: nobody's yet


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


class ObjectLease:
    """One run owns a checkpoint directory in an object store for its lifetime: the object
    `URL/maxtrain.lock`, holding the same record as `DirectoryLock`'s file.

    An object store has no `flock`; what it has are conditional puts. The lease is created with a
    create-only put (If-None-Match: a second creator fails), renewed every `LOCK_HEARTBEAT_S` by a
    put that names the version the owner wrote last (If-Match: it fails once another run has taken
    the lease over, and the owner then says so), and deleted by the owner at the end. A later run
    takes it over with an If-Match put on the version it judged (so of two contenders one wins)
    when the owner is this job's earlier attempt, a process of this host that is no longer running,
    or its heartbeat is older than `LOCK_STALE_S` by the store's clock: the lease's Last-Modified
    against that of an object this run writes now (`_store_now`), never a host's clock.
    """

    def __init__(self, url: str, run_dir: str | None = None):
        from maxtrain import storage

        self.directory = url
        self.path = storage.join(url, LOCK_FILE)
        self.record = {**_new_record(run_dir), "pidns": _pid_namespace()}
        self._version: dict | None = None  # the lease's version this run wrote last (ETag; GCS generation)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.lost: str | None = None  # set when another run took the lease over while this one held it

    def _data(self) -> bytes:
        return json.dumps(self.record).encode()

    def acquire(self) -> "ObjectLease":
        from maxtrain import storage

        for _ in range(5):  # again only when another contender changed the lease between our read and our put
            head = storage.head(self.path)
            try:
                if head is None:
                    self._version = storage.put_object(self.path, self._data(), create=True)
                else:
                    holder = _parse_record(storage.read_bytes(self.path))
                    age = self._store_now() - head["last_modified"].timestamp()
                    reason = self._takeover_reason(holder, age)
                    if reason is None:
                        raise ConfigError(f"checkpoint.dir {self.directory} is in use by another run "
                                          f"({describe_holder(holder)}); its heartbeat is {age:.0f}s old by the "
                                          f"store's clock. Give this run its own checkpoint.dir, or stop that run "
                                          f"first; if it is no longer running, wait {max(LOCK_STALE_S - age, 0):.0f}s "
                                          f"or delete {self.path}")
                    log.warning("checkpoint.dir %s: taking over the lease of %s (%s)", self.directory,
                                describe_holder(holder), reason)
                    self._version = storage.put_object(self.path, self._data(), match=head)
            except (storage.PreconditionFailed, storage.NotFound):  # changed or released since our read
                continue
            self._beat = threading.Thread(target=self._heartbeat, name="maxtrain-ckpt-lease", daemon=True)
            self._beat.start()
            return self
        raise ConfigError(f"checkpoint.dir {self.directory}: {LOCK_FILE} keeps being replaced by another run")

    def _takeover_reason(self, holder: dict, age: float) -> str | None:
        """Why the recorded owner is gone, or None while it owns the directory (`age`: seconds since
        its last heartbeat, by the store's clock)."""
        # the same host *and* pid namespace: containers sharing a host name (host networking) do not
        # see each other's pids
        here = holder.get("host") == self.record["host"] and holder.get("pidns") == self.record["pidns"]
        if here and holder.get("pid") == self.record["pid"]:
            return "this process, which never released it"
        if holder.get("job") and holder.get("job") == self.record["job"]:
            return "an earlier attempt of this job"
        if here and not _pid_alive(holder.get("pid")):
            return "no longer running"
        return f"its heartbeat is {age:.0f}s old by the store's clock" if age > LOCK_STALE_S else None

    def _store_now(self) -> float:
        """The store's clock now: the Last-Modified of an object written for the purpose (then deleted)."""
        from maxtrain import storage

        probe = storage.join(self.directory, f".maxtrain-clock-{self.record['token']}")
        storage.write_bytes(probe, b"")
        try:
            return storage.head(probe)["last_modified"].timestamp()
        finally:
            storage.delete(probe)

    def _heartbeat(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            self.renew()

    def renew(self) -> bool:
        """Rewrites the lease (its Last-Modified is the heartbeat) if it is still this run's version;
        False once another run took it over (said once) or the store is unreachable (retried)."""
        from maxtrain import storage

        if self.lost:
            return False
        try:
            self._version = storage.put_object(self.path, self._data(), match=self._version)
            return True
        except storage.PreconditionFailed:
            try:
                holder = describe_holder(_parse_record(storage.read_bytes(self.path)))
            except storage.StorageError:
                holder = "unknown: the lease is gone"
            self.lost = holder
            log.error("checkpoint.dir %s: another run took this run's lease over (%s); two runs now write "
                      "there: stop one of them", self.directory, holder)
        except storage.StorageError as e:
            log.warning("checkpoint.dir %s: lease heartbeat failed (%s); retried in %.0fs", self.directory, e,
                        LOCK_HEARTBEAT_S)
        return False

    def release(self) -> None:
        """Stops the heartbeat and deletes the lease if it is still this run's."""
        from maxtrain import storage

        if self._beat is None:
            return
        self._stop.set()
        if self._beat is not threading.current_thread():
            self._beat.join()  # a renewal in flight must not race the delete
        self._beat = None
        try:
            if self.lost or not storage.exists(self.path):  # taken over, or removed by hand
                return
            if _parse_record(storage.read_bytes(self.path)).get("token") == self.record["token"]:
                storage.delete(self.path)
        except storage.StorageError as e:
            log.warning("checkpoint.dir %s: the lease was not released (%s); the next run of this job takes it "
                        "over, another after %.0fs", self.directory, e, LOCK_STALE_S)


def _new_record(run_dir: str | None) -> dict:
    """What a lock or lease says of its owner: host, pid, job, start, run_dir (a path made absolute,
    a URL as given) and a token of its own."""
    from maxtrain import storage

    shown = None if not run_dir else run_dir if storage.is_url(run_dir) else os.path.abspath(run_dir)
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "started": time.time(),
            "run_dir": shown, "token": uuid.uuid4().hex}


def _pid_namespace() -> int | None:
    """The inode of this process's pid namespace (None where /proc has none)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _parse_record(data: bytes) -> dict:
    """A lock record; one that does not parse stands for someone else's."""
    try:
        record = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError):
        return {"host": "?", "pid": None}
    return record if isinstance(record, dict) else {"host": "?", "pid": None}


def lock_directory(directory: str, run_dir: str | None = None) -> DirectoryLock | ObjectLease | None:
    """Process 0 takes `directory`'s lock (a lease in an object store); every process raises the
    same way if it cannot."""
    from maxtrain import storage

    lock, problem = None, None
    if jax.process_index() == 0:
        try:
            if storage.is_url(directory):
                lock = ObjectLease(directory, run_dir).acquire()
            else:
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
