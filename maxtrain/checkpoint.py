"""Checkpoints on Orbax: async saves, per-array checksums, verified restore with fallback, retention.

A checkpoint is one step directory `DIR/<step>/`:

- `params`, `opt_state`: the arrays, each process writing its own shards (OCDBT/tensorstore);
- `meta`: JSON with the format version, step, seed, data-iterator state, the resolved config and
  the data's tokenizer (a copy kept in `DIR`, see `keep_tokenizer`);
- `manifest`: two uint32 words per array (see `tree_checksums`), computed on device when the save
  starts and saved as one more Orbax item, so it is committed in the same atomic step as the
  arrays: every step directory Orbax lists has its checksums, and a crash at any moment leaves
  either the whole checkpoint or none of it.

Restoring verifies the checksums; a checkpoint that fails is named in one warning line and the
previous one is tried. (Checkpoints from before format 1's in-commit manifest have a
`manifest.json` file written after the commit; they still restore, and a step directory without
either is not a checkpoint.)
Retention never deletes the newest complete checkpoint nor the one this run restored from.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import threading
import time
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxtrain import exit_codes, imports
from maxtrain.config import CheckpointConfig, ConfigError
from maxtrain.distributed import job_id

log = logging.getLogger("maxtrain")
ocp = imports.quietly("orbax.checkpoint")  # leaves the root logger to the application

FORMAT_VERSION = 1
PREEMPTED_EXIT_CODE = exit_codes.PREEMPTED
MANIFEST = "manifest"  # the Orbax item holding the checksums
LEGACY_MANIFEST = "manifest.json"  # written after the commit by earlier versions
TRASH = ".maxtrain-deleted"  # steps retention drops are renamed in here; the commit thread removes them


class CorruptCheckpoint(Exception):
    """A checkpoint that is partial, unreadable or fails its checksums."""


# ---------------------------------------------------------------- checksums


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (one per element; 8-byte elements give two)."""
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing dim of 2
    raise TypeError(f"no checksum for dtype {x.dtype}")


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """`[sum(w), sum(w * (1 + flat_index mod 65521))]` mod 2^32 over the words `w` of `x`.

    Integer sums are exact and associative, so the result does not depend on the sharding, and
    the index weighting also catches values moved to the wrong place. Computed elementwise plus one
    reduction: no gather of the array.
    """
    w = _words(x)
    if w.ndim == 0:
        w = w[None]
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % 2**32)
        stride *= w.shape[d]
    weight = index % jnp.uint32(65521) + jnp.uint32(1)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * weight, dtype=jnp.uint32)])


@jax.jit
def tree_checksums(tree):
    """A uint32[2] checksum for every array leaf of `tree` (same tree structure)."""
    return jax.tree.map(_leaf_checksum, tree)


def checksum_words(tree) -> dict[str, list[int]]:
    """`tree_checksums` on the host, keyed by `_path_key`: the manifest's `checksums`. Leaves on
    different sets of devices (replicated arrays saved from one replica, `_one_replica`) are summed
    by one program per set."""
    leaves = flat_by_path(tree)
    groups: dict = {}
    for k, v in leaves.items():
        groups.setdefault(frozenset(v.sharding.device_set) if isinstance(v, jax.Array) else None, {})[k] = v
    pending = []
    for devices, part in groups.items():
        if devices is not None and len(devices) == 1:  # the caller's context mesh may span every device
            with jax.set_mesh(jax.sharding.Mesh(np.array(list(devices)), ("replica",))):
                pending.append(tree_checksums(part))
        else:
            pending.append(tree_checksums(part))
    sums = {k: v for part in jax.device_get(pending) for k, v in part.items()}
    return {k: [int(w) for w in np.asarray(sums[k])] for k in leaves}


ONE_REPLICA_BYTES = 1 << 20  # replicated arrays up to this size (any size on CPU) are saved from one replica


def _one_replica(x):
    """A fully replicated array as its first replica (the same values on one device, no copy) where
    Orbax's replica-parallel copy gains nothing: one process saves it, and its devices are CPUs
    (where the copy off the devices copies nothing) or it is small. Orbax would otherwise slice
    every replica (one more compiled program per replica and array on the first save, a dispatch
    each on every save) and the checksum would be computed on every replica."""
    if not isinstance(x, jax.Array) or len(x.sharding.device_set) < 2 or not x.sharding.is_fully_replicated:
        return x
    if jax.process_count() != 1:  # each process would write the whole array
        return x
    if next(iter(x.sharding.device_set)).platform != "cpu" and x.nbytes > ONE_REPLICA_BYTES:
        return x  # a large array: its replicas copy their slices off the devices in parallel
    return x.addressable_shards[0].data


def _path_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _path_key(path) -> str:
    """A container-neutral name for a tree path (`opt_state/1/0/mu/layers/wq`)."""
    return "/".join(_path_name(e) for e in path)


def flat_by_path(tree) -> dict[str, Any]:
    """Leaves keyed by `_path_key`: optax NamedTuples and the dicts Orbax's metadata gives back for
    them name the same leaf the same way."""
    return {_path_key(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ---------------------------------------------------------------- layout


def relayout_dims(path: str, saved: tuple[int, ...], want: tuple[int, ...]) -> int | None:
    """For a layer-stack leaf saved in another pipeline layout, the number of trailing dims the two
    shapes share; None when the shapes are not the same stack.

    A pipelined stack `[R, S, N/(R S), ...]` is the flat `[N, ...]` stack reshaped (chunk r*S + s
    at [r, s]; see `maxtrain.parallel.pipeline.stage_specs`), so any two layouts of it convert
    by a reshape: a run may resume with another `mesh.pipeline` or `train.pipeline_repeats`. Only
    the leading layer dims may differ (one of them flat, three pipelined); every other dim must
    be identical, so a different model (say heads x head_dim regrouped) is never accepted.
    """
    saved, want = tuple(saved), tuple(want)
    if saved == want or "layers" not in path.split("/"):
        return None
    for lead_saved, lead_want in ((1, 3), (3, 1), (3, 3)):
        rest = len(saved) - lead_saved
        if rest >= 0 and rest == len(want) - lead_want and saved[lead_saved:] == want[lead_want:] and (
                math.prod(saved[:lead_saved]) == math.prod(want[:lead_want])):
            return rest
    return None


def _restorable(path: str, saved: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """A saved leaf restores into `want` as is, or by a pipeline relayout."""
    return tuple(saved) == tuple(want) or relayout_dims(path, saved, want) is not None


def _relayout_target(x: jax.ShapeDtypeStruct, saved_shape: tuple[int, ...], k: int) -> jax.ShapeDtypeStruct:
    """Where to read a leaf saved as `saved_shape` before reshaping it into `x`: the shared trailing
    dims keep x's sharding; the mesh axes x splits its leading (layer) dims over split the first
    saved leading dim they divide, so no device reads more of the stack than it needs."""
    sh = x.sharding
    if not isinstance(sh, NamedSharding):  # one device (load_checkpoint without a mesh): read it whole
        return jax.ShapeDtypeStruct(saved_shape, x.dtype, sharding=sh)
    spec = tuple(sh.spec) + (None,) * (len(x.shape) - len(sh.spec))
    lead_axes = [a for e in spec[:len(x.shape) - k] if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    n = math.prod(sh.mesh.shape[a] for a in lead_axes)
    lead = [None] * (len(saved_shape) - k)
    if lead_axes:
        for d in range(len(lead)):
            if saved_shape[d] % n == 0:
                lead[d] = tuple(lead_axes) if len(lead_axes) > 1 else lead_axes[0]
                break
    rest = spec[len(x.shape) - k:]
    return jax.ShapeDtypeStruct(saved_shape, x.dtype, sharding=NamedSharding(sh.mesh, PartitionSpec(*lead, *rest)))


def _read_targets(abstract, saved_tree):
    """(what to restore, {path: final target}): leaves saved in another pipeline layout or dtype
    are read as saved (so their checksums verify) and converted afterwards."""
    have = flat_by_path(saved_tree)
    relaid = {}

    def one(path, x):
        name = _path_key(path)
        if name not in have:
            return x
        k = relayout_dims(name, tuple(have[name].shape), x.shape)
        dtype = jnp.dtype(getattr(have[name], "dtype", None) or x.dtype)
        if k is None and dtype == x.dtype:
            return x
        relaid[name] = x
        target = x if k is None else _relayout_target(x, tuple(have[name].shape), k)
        return jax.ShapeDtypeStruct(target.shape, dtype, sharding=target.sharding)

    return jax.tree_util.tree_map_with_path(one, abstract), relaid


def _apply_relayout(tree, relaid: dict):
    """Reshapes and casts the converted leaves into their final shapes, dtypes and shardings, one
    at a time, each saved-layout array freed once converted (peak: the state plus one leaf)."""
    def one(path, x):
        target = relaid.get(_path_key(path))
        if target is None:
            return x
        out = _reshaper(target.shape, jnp.dtype(target.dtype), target.sharding)(x)
        x.delete()
        return out

    return jax.tree_util.tree_map_with_path(one, tree)


@functools.lru_cache(maxsize=None)
def _reshaper(shape: tuple[int, ...], dtype, out_sharding):
    """One compiled reshape and cast per target (layer stacks share a few)."""
    return jax.jit(lambda a: a.reshape(shape).astype(dtype), out_shardings=out_sharding)


def split_step_path(path: str) -> tuple[str, int | None]:
    """`DIR` -> (DIR, None); `DIR/<step>` -> (DIR, step)."""
    path = os.path.abspath(path)
    base = os.path.basename(path)
    if base.isdigit() and os.path.isfile(os.path.join(path, "_CHECKPOINT_METADATA")):
        return os.path.dirname(path), int(base)
    return path, None


def open_path(path: str, what: str) -> tuple["Checkpointer", list[int]]:
    """A checkpoint directory or one step directory -> (read-only checkpointer, its complete steps)."""
    if not os.path.isdir(path):
        raise ConfigError(f"{what}={path} does not exist; give a checkpoint directory or a step directory")
    root, step = split_step_path(path)
    ckpt = Checkpointer(root, read_only=True)
    steps = [step] if step is not None else ckpt.steps()
    if not steps:
        raise ConfigError(f"{what}={path} holds no complete checkpoint")
    return ckpt, steps


# ---------------------------------------------------------------- ownership

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
    if not _true_on_all_processes(problem is None):
        if lock is not None:
            lock.release()
        raise ConfigError(problem or f"checkpoint.dir {directory}: process 0 could not take its lock (see its log)")
    return lock


# ---------------------------------------------------------------- manager


@dataclasses.dataclass
class Restored:
    step: int
    params: Any
    opt_state: Any | None
    meta: dict


class _Phases:
    """Seconds spent in each named phase of one save (`Checkpointer.last_save_phases`)."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        """The time since the previous lap goes to `name`."""
        t = time.perf_counter()
        self.s[name] = self.s.get(name, 0.0) + t - self._t
        self._t = t

    def total(self) -> float:
        return sum(self.s.values())


class Checkpointer:
    """Saves and restores train state under one directory; wraps an Orbax CheckpointManager."""

    def __init__(self, directory: str, cfg: CheckpointConfig | None = None, *, read_only: bool = False,
                 run_dir: str | None = None):
        self.directory = os.path.abspath(directory)
        self.cfg = cfg or CheckpointConfig(dir=directory)
        self.read_only = read_only
        self._protected: set[int] = set()  # restored-from step: never deleted by retention
        self._committer: threading.Thread | None = None
        self.corrupt: set[int] = set()  # steps that failed verification in this run
        self._closed = False
        self._partial: set[int] = set()  # steps whose save failed: their temporary directories go
        self.last_save_phases: dict[str, float] = {}  # seconds per phase of the latest save() (bench/checkpoint.py)
        if read_only and not os.path.isdir(self.directory):
            raise ConfigError(f"checkpoint path {directory} does not exist")
        # before Orbax touches the directory (it deletes partial saves it finds: another run's)
        self._lock = None if read_only else lock_directory(self.directory, run_dir)
        try:
            options = ocp.CheckpointManagerOptions(
                save_interval_steps=0 if read_only else 1,
                max_to_keep=None,  # retention is ours: it must never drop the last good checkpoint
                create=not read_only, read_only=read_only,
                enable_async_checkpointing=self.cfg.async_,
                cleanup_tmp_directories=not read_only,  # partial saves of a killed run
                # a deleted step is renamed out of the way (one metadata operation on process 0); its files
                # are removed by the commit thread, not while the train loop waits (`_empty_trash`)
                todelete_subdir=None if read_only else TRASH,
            )
            handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                        "meta": ocp.JsonCheckpointHandler(), MANIFEST: ocp.JsonCheckpointHandler()}
            with imports.muted("absl", "Given directory is read only"):  # we opened it to read it
                self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        except (OSError, PermissionError) as e:
            self._release_lock()
            raise ConfigError(f"checkpoint.dir {directory} is not usable: {e}") from None
        if not read_only:
            self._empty_trash()  # what a killed run had not removed yet

    def steps(self) -> list[int]:
        """Complete checkpoints (committed by Orbax, with checksums, not found corrupt), oldest first.

        Multi-process: process 0's view (it writes the manifests), so every process decides alike."""
        mine = [s for s in self._all_steps() if s not in self.corrupt and self._has_manifest(s)]
        return mine if self.read_only else _same_on_all_processes(mine)

    def _all_steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    def _has_manifest(self, step: int) -> bool:
        step_dir = os.path.join(self.directory, str(step))
        return os.path.isdir(os.path.join(step_dir, MANIFEST)) or os.path.isfile(
            os.path.join(step_dir, LEGACY_MANIFEST))

    # -------------------------------------------------------- save

    def save(self, step: int, params, opt_state, meta: dict, *, wait: bool = False) -> float:
        """Starts saving `step`; returns the seconds the caller was blocked.

        `opt_state=None` writes a params-only checkpoint (conversions, exports), usable with
        `checkpoint.init_from` and `load_checkpoint` but not for resuming.
        Unless `wait`, blocks only for the checksums (computed on device) and Orbax's copy of the
        arrays off the devices, plus the previous save if it is still writing; the seconds of each
        phase are in `last_save_phases`. Orbax writes and commits in the background, and the
        directories of checkpoints retention drops are removed there too. An error of a
        background save is logged and leaves the previous good checkpoint in place.
        """
        ph = _Phases()
        self.last_save_phases = ph.s
        self._finish_previous(retention=False)  # joins the previous save's thread: waits only while it writes
        ph.lap("previous")
        complete = self._apply_retention()  # which steps go is decided here; their files go in the background
        ph.lap("retention")
        if step in complete:
            return ph.total()  # already complete (e.g. resumed at this step)
        if step in self._all_steps():
            self._delete_agreed([step])  # no manifest (the save never finished) or found corrupt: redo it
        ph.lap("listing")
        arrays = {"params": params} if opt_state is None else {"params": params, "opt_state": opt_state}
        arrays = jax.tree.map(_one_replica, arrays)
        try:
            jax.block_until_ready(arrays)  # the step that produced them (Orbax's copy would wait for it too)
            ph.lap("ready")
            manifest = {"format": FORMAT_VERSION, "step": int(step), "checksums": checksum_words(arrays)}
        except Exception as e:  # noqa: BLE001
            log.error("checkpoint save at step %d failed: checksums: %s; previous checkpoint kept", step, _one_line(e))
            return ph.total()
        meta = {"format": FORMAT_VERSION, "step": int(step), **meta}
        if "tokenizer" not in meta:  # what generate/eval decode with, wherever they run (end of this file)
            meta["tokenizer"] = data_tokenizer(self.directory, meta.get("config"))
        manifest["meta_sha256"] = meta_digest(meta)
        ph.lap("checksum")
        try:  # async: returns once the arrays are copied off the devices; the write goes on in Orbax's thread
            self._mgr.save(int(step), force=True, args=ocp.args.Composite(
                **{k: ocp.args.StandardSave(v) for k, v in arrays.items()}, meta=ocp.args.JsonSave(meta),
                **{MANIFEST: ocp.args.JsonSave(manifest)}))
        except Exception as e:  # noqa: BLE001  (disk full, permissions, ... : report, keep training)
            ph.lap("orbax")
            self._failed(step, e)
            return ph.total()
        ph.lap("orbax")
        self._committer = threading.Thread(target=self._commit, args=(int(step),),
                                           name=f"maxtrain-ckpt-{step}", daemon=True)
        self._committer.start()
        ph.lap("thread")
        if wait:
            self._finish_previous()
            ph.lap("wait")
        return ph.total()

    def _commit(self, step: int) -> None:
        """Background: remove what retention dropped (while Orbax writes), then wait for Orbax's commit
        (arrays, meta and manifest together); log a failure."""
        self._empty_trash()
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._failed(step, e)

    def _empty_trash(self) -> None:
        """Process 0 removes the step directories Orbax renamed into `TRASH` (never concurrently with
        a rename: deletions happen on the caller's thread only after this thread was joined)."""
        if jax.process_index() == 0:
            shutil.rmtree(os.path.join(self.directory, TRASH), ignore_errors=True)

    def _failed(self, step: int, e: BaseException) -> None:
        """A save that failed: one line naming the newest good checkpoint, and its partial files
        removed at once (on a full disk they hold the space the next save needs)."""
        # this process's view, not steps(): a background commit must not enter its collective
        good = [s for s in self._all_steps() if s != step and self._has_manifest(s) and s not in self.corrupt]
        kept = f"newest good checkpoint: step {good[-1]}" if good else "no checkpoint of this run is complete yet"
        log.error("checkpoint save at step %d failed: %s; %s", step, _one_line(e), kept)
        self._partial.add(step)
        self._remove_partials()

    def _remove_partials(self, settle: bool = False) -> None:
        """Process 0 deletes what failed saves left (again later: Orbax's writer threads may still
        be failing one by one when the first error reaches us). `settle` (at close): again until
        those late writers stop re-creating files there, within a bound."""
        if jax.process_index() != 0 or not self._partial:
            return
        if not settle:
            for path in self._partial_dirs():
                shutil.rmtree(path, ignore_errors=True)
        elif left := remove_settled(self._partial_dirs):
            log.warning("a failed save's partial files are still being written (%s); the next start removes "
                        "them", ", ".join(left))

    def _partial_dirs(self) -> list[str]:
        """The temporary directories of the steps whose save failed."""
        try:
            names = os.listdir(self.directory)
        except OSError:  # the directory itself went (or cannot be read): nothing of ours to remove
            return []
        paths = []
        for name in names:
            step, tmp, _ = name.partition(".orbax-checkpoint-tmp")
            if tmp and step.isdigit() and int(step) in self._partial:
                paths.append(os.path.join(self.directory, name))
        return paths

    def _finish_previous(self, retention: bool = True) -> None:
        if self._committer is not None:
            self._committer.join()
            self._committer = None
            try:  # Orbax re-raises a failed finalize on every join; the committer has logged it
                self._mgr.wait_until_finished()
            except Exception:  # noqa: BLE001
                pass
            self._remove_partials()
        if retention:
            self._apply_retention()

    def _apply_retention(self) -> list[int]:
        """Keeps the newest `keep` complete checkpoints, `keep_every` multiples and the restored one;
        returns the complete steps that remain.

        Steps Orbax committed that never got a manifest (a crash in between) or that failed
        verification are not complete and go once a newer complete checkpoint exists; the last
        complete checkpoint is never among the deleted.
        """
        if self.read_only:
            return self.steps()
        complete = self.steps()
        keep = set(complete[-self.cfg.keep:]) | self._protected
        if self.cfg.keep_every:
            keep |= {s for s in complete if s % self.cfg.keep_every == 0}
        newest = complete[-1] if complete else -1
        gone = self._delete([s for s in self._all_steps() if s not in keep and (s in complete or s < newest)])
        return [s for s in complete if s not in gone]

    def _delete(self, steps: list[int]) -> list[int]:
        """Deletes process 0's `steps` on every process (Orbax's delete is a collective)."""
        agreed = _same_on_all_processes(steps)
        self._delete_agreed(agreed)
        return agreed

    def _delete_agreed(self, steps: list[int]) -> None:
        """Orbax renames each step into `TRASH` (and agrees with the other processes); the next
        commit thread, or `close`, removes the files."""
        for s in steps:
            leftover = os.path.join(self.directory, TRASH, str(s))
            if jax.process_index() == 0 and os.path.isdir(leftover):  # Orbax's rename must not land on it
                shutil.rmtree(leftover, ignore_errors=True)
            self._mgr.delete(s)

    def wait(self, retention: bool = True) -> None:
        self._finish_previous(retention)

    def discard_from(self, step: int) -> list[int]:
        """Deletes every checkpoint of `step` or later (a rollback undoes them); returns them."""
        self._finish_previous(retention=False)  # callers have waited already; never delete beside a commit thread
        return self._delete([s for s in self._all_steps() if s >= step])

    def close(self, *, failed: bool = False) -> None:
        """Lets an in-flight save commit, applies retention and closes. `failed`: the run is
        ending on an error, maybe on this process alone, so nothing that talks to the other
        processes runs (retention agrees on steps with a collective; the next start applies it)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_previous(retention=not failed)
            self._mgr.close()
        except Exception as e:  # noqa: BLE001  (a failed save re-raised by Orbax: already reported)
            log.debug("checkpoint close: %s", _one_line(e))
        finally:
            self._remove_partials(settle=True)
            self._empty_trash()
            self._release_lock()

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -------------------------------------------------------- restore

    def read_meta(self, step: int) -> dict:
        """The step's meta (config, seed, data position), checked against its manifest's digest."""
        try:
            meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001
            raise CorruptCheckpoint(f"meta unreadable ({_one_line(e)})") from None
        _check_meta(meta, self._read_manifest(step))
        return meta

    def _item_trees(self, step: int) -> dict:
        try:
            meta = self._mgr.item_metadata(step)
            trees = {k: getattr(meta[k], "tree", meta[k]) if meta.get(k) is not None else None
                     for k in ("params", "opt_state")}
        except Exception as e:  # noqa: BLE001
            raise CorruptCheckpoint(f"metadata unreadable ({_one_line(e)})") from None
        if trees["params"] is None:
            raise CorruptCheckpoint("params missing")
        return trees

    def check_compatible(self, step: int, abstract_params, saved_params=None, fix: str | None = None) -> None:
        """Raises ConfigError when the checkpoint's parameter shapes differ from the model's; `fix`:
        what the error tells the user to change (default: where a resume reads from)."""
        if saved_params is None:
            saved_params = self._item_trees(step)["params"]
        want, have = flat_by_path(abstract_params), flat_by_path(saved_params)
        where = f"checkpoint {self.directory}/{step} is from a different model"
        fix = fix or "point checkpoint.dir/resume_from elsewhere or set checkpoint.resume_from=none"
        if want.keys() != have.keys():
            diff = sorted(want.keys() ^ have.keys())
            raise ConfigError(f"{where}: parameters {', '.join(diff[:3])} differ; {fix}")
        for k, x in want.items():
            if not _restorable(k, have[k].shape, x.shape):
                raise ConfigError(f"{where}: {k} has shape {tuple(have[k].shape)}, the model expects "
                                  f"{tuple(x.shape)}; {fix}")

    def _read_manifest(self, step: int) -> dict:
        step_dir = os.path.join(self.directory, str(step))
        try:
            if os.path.isdir(os.path.join(step_dir, MANIFEST)):
                manifest = self._mgr.restore(step, args=ocp.args.Composite(
                    **{MANIFEST: ocp.args.JsonRestore()}))[MANIFEST]
            else:
                with open(os.path.join(step_dir, LEGACY_MANIFEST)) as f:
                    manifest = json.load(f)
        except FileNotFoundError:
            raise CorruptCheckpoint("no manifest: the save never completed") from None
        except Exception as e:  # noqa: BLE001  (unreadable or not JSON)
            raise CorruptCheckpoint(f"manifest unreadable ({_one_line(e)})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION or not isinstance(
                manifest.get("checksums"), dict):
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise CorruptCheckpoint(f"manifest has unknown format {found!r}")
        return manifest

    def restore(self, step: int, abstract_params, abstract_opt_state=None, fix: str | None = None) -> Restored:
        """Restores `step` into the given shardings and verifies its checksums.

        `abstract_*` are trees of `jax.ShapeDtypeStruct` with the target shardings: each device
        reads only its own slices, whatever mesh the checkpoint was saved from. Without
        `abstract_opt_state` only the params are read (fine-tuning).
        """
        saved, problem = _attempt(lambda: self._item_trees(step))
        _agree(problem)  # see below
        self.check_compatible(step, abstract_params, saved["params"], fix)
        if abstract_opt_state is not None and saved["opt_state"] is None:
            raise ConfigError(f"checkpoint {self.directory}/{step} holds params only (a conversion or export); "
                              f"start from it with checkpoint.init_from={self.directory}/{step}")
        if abstract_opt_state is not None:
            want, have = flat_by_path(abstract_opt_state), flat_by_path(saved["opt_state"])
            if want.keys() != have.keys() or any(not _restorable(k, have[k].shape, x.shape) for k, x in want.items()):
                raise ConfigError(f"checkpoint {self.directory}/{step} has a different optimizer state layout "
                                  f"(optim.* changed, e.g. clip_norm or weight_decay, or train.fp8.recipe to or from "
                                  f"delayed, or train.fp8.amax_history); restore its params with "
                                  f"checkpoint.init_from={self.directory}/{step} and checkpoint.resume_from=none")
        # leaves saved in another pipeline layout are read as saved, verified, then reshaped
        wanted = {"params": abstract_params}
        if abstract_opt_state is not None:
            wanted["opt_state"] = abstract_opt_state
        tree, relaid = _read_targets(wanted, {k: saved[k] for k in wanted})
        items = {k: ocp.args.StandardRestore(v) for k, v in tree.items()}
        # Local reads may fail on one process only (a bad local copy, a flaky mount). The processes
        # agree after each phase, so none goes on to the next phase's collectives (the checksums
        # are computed over the global arrays) while another has given up on this checkpoint.
        manifest, problem = _attempt(lambda: self._read_manifest(step))
        _agree(problem)
        restored, problem = _attempt(lambda: self._mgr.restore(step, args=ocp.args.Composite(
            **items, meta=ocp.args.JsonRestore())), unreadable=True)
        _agree(problem)
        got = {k: restored[k] for k in tree}
        actual, expected = checksum_words(got), manifest["checksums"]
        bad = [k for k in actual if expected.get(k) != actual[k]]
        if bad:
            raise CorruptCheckpoint(f"checksum mismatch in {', '.join(bad[:3])}" + (" ..." if len(bad) > 3 else ""))
        meta = restored["meta"]
        _check_meta(meta, manifest)
        if relaid:
            log.info("checkpoint %s/%d: %d arrays converted from the saved pipeline layout or dtype "
                     "(train.param_dtype) after verification", self.directory, step, len(relaid))
            got = _apply_relayout(got, relaid)
        return Restored(step, got["params"], got.get("opt_state"), meta)

    def restore_latest_good(self, abstract_params, abstract_opt_state=None, *, steps=None,
                            fix: str | None = None) -> Restored | None:
        """Newest checkpoint that verifies; each failing one is named in one warning line (`fix`: as
        for `check_compatible`)."""
        for step in reversed(steps if steps is not None else self.steps()):
            try:
                r, problem = self.restore(step, abstract_params, abstract_opt_state, fix), None
            except CorruptCheckpoint as e:
                r, problem = None, str(e)
            if not _true_on_all_processes(problem is None):  # one bad local read fails it for all
                log.warning("checkpoint %s/%d is corrupt: %s; trying the previous one", self.directory, step,
                            problem or "failed verification on another process")
                self.corrupt.add(step)
                continue
            self._protected.add(step)
            return r
        return None

    def verify(self, step: int) -> None:
        """Offline check of one step onto this host's first device; raises CorruptCheckpoint."""
        trees = self._item_trees(step)
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = {k: jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device), t)
                    for k, t in trees.items() if t is not None}
        self.restore(step, abstract["params"], abstract.get("opt_state"))


def meta_digest(meta: dict) -> str:
    """sha256 of the meta item's canonical JSON: the manifest covers it as it covers the arrays."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_meta(meta, manifest: dict) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CorruptCheckpoint(f"meta has unknown format {found!r}")
    want = manifest.get("meta_sha256")  # None: saved before meta was covered
    if want is not None and meta_digest(meta) != want:
        raise CorruptCheckpoint("meta (config, seed, data position) does not match its checksum: edited or damaged")


def _same_on_all_processes(steps: list[int]) -> list[int]:
    """Process 0's list of step numbers, on every process (the newest 4096 at most)."""
    if jax.process_count() == 1:
        return steps
    from jax.experimental import multihost_utils

    buf = np.full(4096, -1, np.int64)
    kept = steps[-4096:]  # the newest, if ever more (steps are sorted oldest first)
    buf[: len(kept)] = kept
    return [int(x) for x in multihost_utils.broadcast_one_to_all(buf) if x >= 0]


def _true_on_all_processes(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(flag))))


def _attempt(fn, unreadable: bool = False):
    """(fn(), None), or (None, the CorruptCheckpoint it raised or an Orbax read error became)."""
    try:
        return fn(), None
    except CorruptCheckpoint as e:
        return None, e
    except Exception as e:  # noqa: BLE001  (truncated or missing files, bad metadata)
        if not unreadable or _out_of_memory(e):  # not the checkpoint's fault: never mark good ones corrupt
            raise
        return None, CorruptCheckpoint(f"unreadable ({_one_line(e)})")


def _agree(problem: CorruptCheckpoint | None) -> None:
    """Raises on every process when any has a problem: its own, or that of another process."""
    if not _true_on_all_processes(problem is None):
        raise problem or CorruptCheckpoint("failed verification on another process")


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = (text[0] if text else "").split(" See full TensorStore details")[0]  # then a repr of the spec
    line = f"{type(e).__name__}: {first}"
    short = line if len(line) <= 300 else f"{line[:140]} ... {line[-150:]}"  # the cause is often at the end
    code = re.search(r"\[os_error_code='?(\d+)'?\]", first)  # TensorStore's OS error, anywhere in the line
    cause = os.strerror(int(code.group(1))) if code else ""  # its text may sit inside the cut, or
    if cause and cause not in short:  # before a repr of the spec that sits between it and the code
        short += f" (cause: {cause})"
    return short


def remove_settled(list_paths, quiet_s: float = 0.5, timeout_s: float = 10.0) -> list[str]:
    """Removes the trees `list_paths()` names, and removes them again while something still writes
    there (a failed save's remaining writes go on after its first error reaches the caller, and
    re-create their directories), until none has appeared for `quiet_s`; gives up after
    `timeout_s`. The paths still there (none once it settled)."""
    end = time.monotonic() + timeout_s
    while True:
        for path in list_paths():
            shutil.rmtree(path, ignore_errors=True)
        quiet_until = time.monotonic() + quiet_s
        while not (left := list_paths()) and time.monotonic() < quiet_until:
            time.sleep(0.02)
        if not left or time.monotonic() >= end:
            return left


def verify_path(path: str) -> list[tuple[int, str | None]]:
    """(step, error or None) for one step directory or every step under a checkpoint directory."""
    root, step = split_step_path(path)
    if not os.path.isdir(root):
        raise ConfigError(f"checkpoint path {path} does not exist")
    ckpt = Checkpointer(root, read_only=True)
    steps = [step] if step is not None else ckpt._all_steps()
    if not steps:
        raise ConfigError(f"no committed checkpoints under {path}")
    results = []
    for s in steps:
        try:
            ckpt.verify(s)
            results.append((s, None))
        except CorruptCheckpoint as e:
            results.append((s, str(e)))
    return results


def _saved_config(ckpt: Checkpointer, steps: list[int], path: str):
    """The config of the newest step whose meta reads (its params are verified when restored)."""
    from maxtrain.config import from_dict

    for s in reversed(steps):
        try:
            return from_dict(ckpt.read_meta(s)["config"])
        except (CorruptCheckpoint, KeyError, ConfigError) as e:
            log.warning("checkpoint %s/%d: no usable config (%s); trying the previous step", ckpt.directory, s,
                        _one_line(e))
            continue
    raise ConfigError(f"no checkpoint under {path} has a readable config; pass cfg=")


def saved_config(path: str):
    """The config saved with a checkpoint directory (its newest readable step) or one step directory."""
    ckpt, steps = open_path(path, "checkpoint")
    return _saved_config(ckpt, steps, path)


def load_checkpoint(path: str, cfg=None, mesh=None):
    """`(cfg, params)` from a checkpoint directory (its latest good step) or one step directory.

    `cfg` defaults to the config saved with the checkpoint. Params are placed by the config's
    parameter rules on `mesh`, or on this host's first device when no mesh is given. A `cfg` with
    another pipeline layout than the saved one gets its layer stacks converted (`relayout_dims`).
    """
    from maxtrain import models, sharding

    ckpt, steps = open_path(path, "checkpoint")
    if cfg is None:
        cfg = _saved_config(ckpt, steps, path)
    model = models.get(cfg.model.name)
    shapes = jax.eval_shape(lambda k: model.init(cfg, k), jax.random.key(0))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, shapes)
    else:
        shardings = sharding.tree_shardings(mesh, model.logical_axes(cfg), cfg.sharding.params)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    restored = ckpt.restore_latest_good(abstract, None, steps=steps, fix="pass cfg=None to load it with the "
                                        "config saved with it, or a cfg of the same model")
    if restored is None:
        raise ConfigError(f"no checkpoint under {path} passes verification")
    return cfg, restored.params


# ---------------------------------------------------------------- the tokenizer kept with a checkpoint
# A run's saved config names its data by `data.path` as written, often relative to where training
# ran; generate and eval may run anywhere. So each save records the data's tokenizer in the step's
# meta (`tokenizer`: {"kind": "byte"}, or the kind, file name and sha256 of a copy in DIR).


def keep_tokenizer(directory: str, spec: str) -> dict:
    """The meta record of tokenizer `spec` ("byte", or a tokenizer.json / SentencePiece .model file):
    a file is copied into the checkpoint `directory` (by process 0) as tokenizer.json /
    tokenizer.model, or tokenizer-<sha256 prefix>.<ext> when another tokenizer holds that name."""
    from maxtrain.data.manifest import sha256_file

    if spec == "byte":
        return {"kind": "byte"}
    ext = ".model" if spec.endswith(".model") else ".json"
    digest = sha256_file(spec)
    name = "tokenizer" + ext
    held = os.path.join(directory, name)
    if os.path.exists(held) and sha256_file(held) != digest:
        name = f"tokenizer-{digest[:12]}{ext}"
    dest = os.path.join(directory, name)
    if jax.process_index() == 0 and not os.path.exists(dest):
        os.makedirs(directory, exist_ok=True)
        tmp = f"{dest}.tmp-{os.getpid()}"
        shutil.copyfile(spec, tmp)
        os.replace(tmp, dest)
    return {"kind": "sentencepiece" if ext == ".model" else "hf", "file": name, "sha256": digest}


@functools.lru_cache(maxsize=8)
def _data_tokenizer(directory: str, kind: str, path_json: str, cwd: str) -> dict | None:
    from maxtrain.data.manifest import manifest_tokenizer, read_manifest
    from maxtrain.data.tokens import parse_mixture

    path = json.loads(path_json)
    if kind == "text":
        return {"kind": "byte"}
    if kind != "tokens" or not path:
        return None
    first = parse_mixture(path)[0][0]  # a mixture's sources share one tokenizer (make_tokens_source)
    return keep_tokenizer(directory, manifest_tokenizer(first, read_manifest(first)))


def data_tokenizer(directory: str, config: dict | None) -> dict | None:
    """The record of the tokenizer the saved `config` (a mapping) trains on, kept with the checkpoint
    in `directory` (once per process); None for data that names none (synthetic). Never fails a
    save: a tokenizer that cannot be read or copied is one warning, and generate then needs
    --tokenizer."""
    data = (config or {}).get("data") or {}
    try:
        return _data_tokenizer(directory, str(data.get("kind")), json.dumps(data.get("path")), os.getcwd())
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
        log.warning("checkpoint %s: the training data's tokenizer is not kept with it (%s); generate and eval "
                    "from it need --tokenizer", directory, _one_line(e))
        return None


def saved_tokenizer(path: str) -> str | None:
    """The tokenizer kept with a checkpoint directory (its newest step that records one) or one step
    directory, as a `load_tokenizer` spec ("byte", or its copy's path); None when none is recorded
    (synthetic data, or a checkpoint from before they were kept). A copy that is gone or altered is
    a one-line error naming --tokenizer."""
    from maxtrain.data.manifest import sha256_file

    ckpt, steps = open_path(path, "checkpoint")
    for s in reversed(steps):
        try:
            record = ckpt.read_meta(s).get("tokenizer")
        except CorruptCheckpoint:
            continue
        if record is None:
            return None
        if record.get("kind") == "byte":
            return "byte"
        copy = os.path.join(ckpt.directory, record["file"])
        if not os.path.isfile(copy) or sha256_file(copy) != record["sha256"]:
            raise ConfigError(f"checkpoint {path}: the tokenizer kept with it, {copy}, is "
                              f"{'altered' if os.path.isfile(copy) else 'missing'}; pass --tokenizer (byte, a "
                              f"tokenizer.json or a SentencePiece .model)")
        return copy
    return None
