"""The local checkpoint tier (`checkpoint.local`): every few steps each process writes its own
shards to node-local storage, and a copy of its ring predecessor's, so a failure costs a few steps
of work and a replaced host still finds its shards on its peer.

Layout: `DIR/<run key>/p<i>/step_<N>/src_p<j>/` holds process j's shards as process i keeps them
(j = i: its own; j = i's predecessor in the ring: its peer copy. The ring runs over hosts when the
processes are on several, `ring_order`, so a peer copy is on another node): `data.bin` (the unique shards of every array,
one after another) and `index.json` (per array its dtype and shape; per shard its global index,
offset, size and BLAKE2b digest; the checkpoint meta). A source directory is written under a
`.partial` name and renamed into place when complete, so one that exists is whole. The run key is
a hash of `run_dir`: restarts of the same run find their checkpoints, other runs do not.

- **Save** (`LocalTier.save`): the peer copy is one `ppermute` program over the whole mesh
  (device k of each process to device k of its successor); then the device-to-host copy of the own and
  received shards, which is all the step waits for. Digests, files and retention (`keep` newest)
  happen on a background thread.
- **Restore** (`LocalTier.restore`): the processes exchange which steps they hold (own and peer
  copies) and take the newest step that every process can be restored from (its own copy, or its
  successor's copy of it), newer than the persistent tier's newest. Each verifies the digests of
  what it holds; a copy that fails is named in one warning line and the peer copy (or the next
  step, or the persistent tier) is used. A process without its own copy (an emptied local dir)
  gets its shards back from its successor by the reverse `ppermute`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from maxtrain.checkpoint.agreement import allgather
from maxtrain.config import ConfigError, LocalCheckpointConfig

log = logging.getLogger("maxtrain")

NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                       "fuse.sshfs", "9p", "afs", "panfs", "wekafs")
MIN_FREE_BYTES = 64 * 2**20


def run_key(run_dir: str) -> str:
    return hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem `path` lies on (the longest mount point above it in /proc/mounts)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = max((m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return None if best is None else best[1]


def check_dir(path: str, needed_bytes: int = 0) -> None:
    """A usable local tier directory: creatable, writable, on a local filesystem, with room; else a
    one-line ConfigError naming the problem."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".maxtrain-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"checkpoint.local.dir={path} is not writable ({e.strerror}); give a node-local "
                          f"directory this user can write (e.g. /dev/shm/maxtrain or a local disk)") from None
    kind = filesystem_type(path)
    if kind in NETWORK_FILESYSTEMS:
        raise ConfigError(f"checkpoint.local.dir={path} is on a {kind} filesystem, not node-local storage; the "
                          f"local tier must survive without the network (use /dev/shm or a local disk; the "
                          f"persistent tier, checkpoint.dir, is for shared storage)")
    free = shutil.disk_usage(path).free
    if free < max(needed_bytes, MIN_FREE_BYTES):
        raise ConfigError(f"checkpoint.local.dir={path} has {free / 2**20:.0f} MiB free, less than the "
                          f"{max(needed_bytes, MIN_FREE_BYTES) / 2**20:.0f} MiB its checkpoints need; free space "
                          f"or choose another directory")


def check_not_shared(root: str, configured: str) -> None:
    """Refuses a local directory that other hosts also see (a shared filesystem this check's type
    list missed): every process of this attempt leaves `<nonce>-<hostname>` in `ROOT/.hosts/` (the
    nonce from process 0: names left by earlier attempts, or by a restarted container under a new
    hostname, do not count), and after all have (an allgather as barrier) a host that finds another
    host's name with this attempt's nonce is on shared storage. The names are removed after."""
    hosts = os.path.join(root, ".hosts")
    os.makedirs(hosts, exist_ok=True)
    # 30 bits: the allgather goes through int32 unless jax runs with 64-bit types
    nonce = int(allgather(np.asarray([int.from_bytes(os.urandom(4), "little") >> 2], np.int64))[0, 0])
    prefix = f"{nonce:08x}-"
    me = socket.gethostname()
    mine = os.path.join(hosts, prefix + me)
    open(mine, "a").close()
    allgather(np.zeros(1, np.int64))  # every process has written its name
    others = sorted({n[len(prefix):] for n in os.listdir(hosts) if n.startswith(prefix)} - {me})
    allgather(np.zeros(1, np.int64))  # every process has looked
    try:
        os.remove(mine)
    except OSError:
        pass
    if others:
        raise ConfigError(f"checkpoint.local.dir={configured} is shared between hosts (host {me} sees "
                          f"{', '.join(others[:3])} there); give every host its own node-local directory "
                          f"(the persistent tier, checkpoint.dir, is the shared one)")


def _index_of(index: tuple, shape: tuple[int, ...]) -> list[list[int]]:
    """A shard's global index (a tuple of slices) as [[start, stop], ...]."""
    return [[s.start or 0, n if s.stop is None else s.stop] for s, n in zip(index, shape)]


def _key(index: list[list[int]]) -> str:
    return json.dumps(index)


def _digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _flat(tree) -> tuple[list[str], list[Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(p) for p, _ in leaves], [x for _, x in leaves], treedef


def ring_order(hosts: list[int]) -> list[int]:
    """Processes (by index; `hosts[p]`: process p's host) in ring order: with processes on several
    hosts, each equally many, host by host for each local rank, so every process's successor is on
    another host (its copy survives losing the node); else in process order."""
    by_host: dict[int, list[int]] = {}
    for p, h in enumerate(hosts):
        by_host.setdefault(h, []).append(p)
    groups = list(by_host.values())
    if len(groups) < 2 or len({len(g) for g in groups}) != 1:
        return list(range(len(hosts)))
    return [g[r] for r in range(len(groups[0])) for g in groups]


class Ring:
    """Device k of each process and device k of its successor in `ring_order`, as flat mesh indices."""

    def __init__(self, mesh):
        self.mesh = mesh
        flat = list(mesh.devices.flat)
        by_process = {p: [k for k, d in enumerate(flat) if d.process_index == p]
                      for p in sorted({d.process_index for d in flat})}
        if len({len(v) for v in by_process.values()}) != 1:
            raise ConfigError("checkpoint.local with peer copies needs the same number of devices in every process")
        host = int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:4], "little") >> 2  # int32-safe
        hosts = [int(h) for h in allgather(np.asarray([host], np.int64))[:, 0]]
        order = ring_order(hosts)
        self.processes = order
        P = len(order)
        self.successor_of = {p: order[(n + 1) % P] for n, p in enumerate(order)}
        self.forward = [(i, by_process[self.successor_of[p]][k]) for p in order for k, i in enumerate(by_process[p])]
        self.backward = [(j, i) for i, j in self.forward]
        self.source_of = {j: i for i, j in self.forward}  # device index -> the device its peer copy comes from
        self.flat = flat
        me = jax.process_index()
        self.successor = self.successor_of[me]
        self.predecessor = next(p for p, q in self.successor_of.items() if q == me)
        self._fns: dict = {}

    def permute(self, xs: list[jax.Array], pairs: list[tuple[int, int]]) -> list[jax.Array]:
        """`xs` with every device's shard moved along `pairs` (flat device indices), as jax.Arrays of
        the same shardings whose shards hold the moved data: one program, one collective round."""
        specs = tuple(x.sharding.spec if hasattr(x.sharding, "spec") else PartitionSpec() for x in xs)
        key = (id(pairs), tuple((x.shape, str(x.dtype)) for x in xs), specs)
        fn = self._fns.get(key)
        if fn is None:
            axes = tuple(self.mesh.axis_names)
            move = lambda *shards: tuple(jax.lax.ppermute(s, axes, pairs) for s in shards)  # noqa: E731
            fn = jax.jit(jax.shard_map(move, mesh=self.mesh, in_specs=specs, out_specs=specs, check_vma=False))
            self._fns[key] = fn
        return list(fn(*xs))


def _device_index(ring: Ring, device) -> int:
    return ring.flat.index(device)


def _own_shards(x: jax.Array) -> dict[str, np.ndarray]:
    """This process's unique shards of `x`, by global index (numpy: the device-to-host copy)."""
    out = {}
    for s in x.addressable_shards:
        k = _key(_index_of(s.index, x.shape))
        if k not in out:
            out[k] = np.asarray(s.data)
    return out


def received_shards(x: jax.Array, moved: jax.Array, ring: Ring) -> dict[str, np.ndarray]:
    """The predecessor's shards that `moved` (`x` after the forward permute) holds here, by their
    global index (the index of the device each came from)."""
    indices = x.sharding.devices_indices_map(x.shape)
    out = {}
    for s in moved.addressable_shards:
        source = ring.flat[ring.source_of[_device_index(ring, s.device)]]
        k = _key(_index_of(indices[source], x.shape))
        if k not in out:
            out[k] = np.asarray(s.data)
    return out


def write_source(directory: str, names: list[str], shards: list[dict[str, np.ndarray]], meta: dict, step: int) -> None:
    """One source directory: data.bin and index.json, under `.partial` until complete."""
    partial = directory + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    index, offset = {}, 0
    with open(os.path.join(partial, "data.bin"), "wb") as f:
        for name, by_index in zip(names, shards):
            entries = []
            for k, a in by_index.items():
                raw = np.ascontiguousarray(a).tobytes()
                f.write(raw)
                entries.append({"index": json.loads(k), "offset": offset, "nbytes": len(raw), "digest": _digest(raw),
                                "dtype": str(a.dtype), "shape": list(a.shape)})
                offset += len(raw)
            index[name] = entries
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(partial, "index.json"), "w") as f:
        json.dump({"step": step, "meta": meta, "arrays": index}, f)
    shutil.rmtree(directory, ignore_errors=True)
    os.rename(partial, directory)


class CorruptLocal(Exception):
    pass


def _read_source(directory: str, names: list[str], leaves=None, needed=None) -> tuple[dict, list[dict]]:
    """(meta, per array its shards by global index), every digest checked and (with `leaves`, the
    abstract arrays, and `needed(x) -> the index keys this process needs of x`) every needed shard
    present with its shape and dtype; CorruptLocal if anything fails (a changed mesh or dtype too)."""
    try:
        return _read_checked(directory, names, leaves, needed)
    except CorruptLocal:
        raise
    except Exception as e:  # noqa: BLE001  (a damaged index.json: any error means this copy is unusable)
        raise CorruptLocal(f"{directory} is unusable ({type(e).__name__}: {e})") from None


def _read_checked(directory, names, leaves, needed):
    try:
        with open(os.path.join(directory, "index.json")) as f:
            index = json.load(f)
        with open(os.path.join(directory, "data.bin"), "rb") as f:
            data = f.read()
    except (OSError, ValueError) as e:
        raise CorruptLocal(f"{directory} is unreadable ({e})") from None
    out = []
    for name in names:
        entries = index.get("arrays", {}).get(name)
        if entries is None:
            raise CorruptLocal(f"{directory} has no array {name}")
        by_index = {}
        for e in entries:
            raw = data[e["offset"]:e["offset"] + e["nbytes"]]
            if len(raw) != e["nbytes"] or _digest(raw) != e["digest"]:
                raise CorruptLocal(f"{directory}: array {name} fails its checksum")
            by_index[_key(e["index"])] = np.frombuffer(raw, dtype=e["dtype"]).reshape(e["shape"])
        out.append(by_index)
    for x, by_index in zip(leaves or [], out):
        for k in needed(x):
            a = by_index.get(k)
            if a is None or a.shape != x.sharding.shard_shape(x.shape) or a.dtype != x.dtype:
                raise CorruptLocal(f"{directory} does not hold this run's layout of every array (another mesh, "
                                   f"shape or dtype)")
    return index.get("meta", {}), out


def _shared_meta(meta: dict | None) -> dict:
    """The checkpoint meta (the same on every process) on every process, also one whose local dir
    was emptied: taken from the first process that read one."""
    raw = np.frombuffer(json.dumps(meta).encode() if meta is not None else b"", np.uint8)
    n = int(allgather(np.asarray([raw.size], np.int64)).max())
    padded = np.zeros(n + 1, np.uint8)
    padded[:raw.size], padded[n] = raw, raw.size > 0
    every = allgather(padded)
    first = next(row for row in every if row[n])
    return json.loads(bytes(first[:n]).rstrip(b"\0").decode())


class LocalTier:
    """The local tier of one process (see the module docstring)."""

    def __init__(self, lcfg: LocalCheckpointConfig, key_source: str, mesh):
        self.cfg = lcfg
        self.ring = Ring(mesh)
        self.peers = lcfg.replica_of == "ring" and len(self.ring.processes) > 1
        self.root = os.path.join(lcfg.dir, run_key(key_source))
        self.dir = os.path.join(self.root, f"p{jax.process_index()}")
        problem = None
        try:
            check_dir(lcfg.dir)
            os.makedirs(self.dir, exist_ok=True)
        except (ConfigError, OSError) as e:
            problem = e
        if allgather(np.asarray([problem is not None], np.int64)).any():  # every process stops, not one
            raise problem if isinstance(problem, ConfigError) else ConfigError(
                f"checkpoint.local.dir={lcfg.dir} is not usable on "
                + ("this process" if problem is not None else "another process") + " (its error is logged there)")
        check_not_shared(self.root, lcfg.dir)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maxtrain-local-ckpt")
        self._pending: Future | None = None
        self.disabled = False

    # ------------------------------------------------------------ save

    def save(self, step: int, trees: dict[str, Any], meta: dict) -> float:
        """Starts a local checkpoint of `trees` (name -> pytree of jax.Arrays) at `step`; returns the
        seconds the caller was blocked (the peer permute and the device-to-host copies)."""
        t0 = time.perf_counter()
        self.wait()
        # every process takes part in the permute or none does: a disk that failed on one turns the
        # tier off on all
        if allgather(np.asarray([self.disabled], np.int64)).any():
            self.disabled = True
            return time.perf_counter() - t0
        names, leaves, _ = _flat(trees)
        own = [_own_shards(x) for x in leaves]
        peer = None
        if self.peers:
            moved = self.ring.permute(leaves, self.ring.forward)
            peer = [received_shards(x, y, self.ring) for x, y in zip(leaves, moved)]
        blocked = time.perf_counter() - t0
        me, pred = jax.process_index(), self.ring.predecessor
        self._pending = self._pool.submit(self._write, step, names, own, peer, meta, me, pred)
        return blocked

    def _write(self, step, names, own, peer, meta, me, pred) -> None:
        step_dir = os.path.join(self.dir, f"step_{step}")
        try:
            os.makedirs(step_dir, exist_ok=True)
            write_source(os.path.join(step_dir, f"src_p{me}"), names, own, meta, step)
            if peer is not None:
                write_source(os.path.join(step_dir, f"src_p{pred}"), names, peer, meta, step)
            self._retain()
        except OSError as e:  # a full or failing local disk: the run goes on with the persistent tier only
            self.disabled = True
            shutil.rmtree(step_dir, ignore_errors=True)
            log.warning("local checkpoint of step %d failed (%s); the local tier is off for this run "
                        "(checkpoint.dir still saves)", step, e.strerror or e)

    def _retain(self) -> None:
        steps = sorted(self._steps_on_disk())
        for s in steps[:-self.cfg.keep] if self.cfg.keep > 0 else []:
            shutil.rmtree(os.path.join(self.dir, f"step_{s}"), ignore_errors=True)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001  (the run's own outcome matters more; the write is logged)
            log.warning("the last local checkpoint write failed: %s", e)
        self._pool.shutdown(wait=True)

    def discard_after(self, step: int) -> None:
        """Removes this process's local steps after `step` (the step a run resumed or rolled back to):
        they belong to a history the run left, and retention keeps the newest steps."""
        self.wait()
        for s in self._steps_on_disk():
            if s > step:
                shutil.rmtree(os.path.join(self.dir, f"step_{s}"), ignore_errors=True)

    # ------------------------------------------------------------ restore

    def _steps_on_disk(self) -> list[int]:
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        return [int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit()]

    def _holds(self, step: int, process: int) -> bool:
        return os.path.isfile(os.path.join(self.dir, f"step_{step}", f"src_p{process}", "index.json"))

    def candidates(self, newer_than: int) -> list[int]:
        """Steps every process can be restored from (own copy, or the successor's copy of it), newest
        first, newer than `newer_than`: agreed across processes."""
        me, pred = jax.process_index(), self.ring.predecessor
        K = 16
        mine = sorted(self._steps_on_disk(), reverse=True)[:K]
        own = np.full(K, -1, np.int64)
        peer = np.full(K, -1, np.int64)
        own[:len(mine)] = [s if self._holds(s, me) else -1 for s in mine]
        peer[:len(mine)] = [s if self._holds(s, pred) and self.peers else -1 for s in mine]
        owns, peers = allgather(own), allgather(peer)  # row p: process p's
        succ = self.ring.successor_of
        steps = sorted({int(s) for s in owns.flat if s > newer_than}, reverse=True)
        return [s for s in steps if all(s in owns[p] or (self.peers and s in peers[succ[p]]) for p in succ)]

    def restore(self, abstract, newer_than: int):
        """`(step, trees, meta)` of the newest local step newer than `newer_than` that every process
        can restore and whose digests verify, or None. `abstract`: name -> pytree of
        ShapeDtypeStructs with shardings (the trees `save` was given), or a function of the step
        that gives them (a train state's layout may change with the step: `maxtrain.step.at_step`)."""
        me, pred = jax.process_index(), self.ring.predecessor
        newer_than = int(allgather(np.asarray([newer_than], np.int64)).max())  # the same on every process
        for step in self.candidates(newer_than):
            names, leaves, treedef = _flat(abstract(step) if callable(abstract) else abstract)
            step_dir = os.path.join(self.dir, f"step_{step}")
            own, peer, meta, peer_meta = None, None, None, None
            if self._holds(step, me):
                try:
                    meta, own = _read_source(os.path.join(step_dir, f"src_p{me}"), names, leaves, self._mine)
                except CorruptLocal as e:
                    log.warning("local checkpoint: %s; using the peer copy or an older checkpoint", e)
            if self.peers and self._holds(step, pred):
                try:
                    peer_meta, peer = _read_source(os.path.join(step_dir, f"src_p{pred}"), names, leaves,
                                                   self._held_indices)
                except CorruptLocal as e:
                    log.warning("local checkpoint: %s (the copy of process %d's shards)", e, pred)
            flags = allgather(np.asarray([own is not None, peer is not None], np.int64))  # row p: process p's
            succ = self.ring.successor_of
            whole = all(flags[p, 0] or (self.peers and flags[succ[p], 1]) for p in succ)
            if not whole:
                log.warning("local checkpoint step %d cannot be restored on every process; trying an older one", step)
                continue
            need_peer = not all(flags[:, 0])
            arrays = self._arrays(leaves, own, peer, need_peer)
            meta = _shared_meta(meta if meta is not None else peer_meta)
            trees = jax.tree_util.tree_unflatten(treedef, arrays)
            return step, trees, meta
        return None

    def _arrays(self, leaves, own, peer, need_peer: bool) -> list[jax.Array]:
        """The restored global arrays (`leaves`: ShapeDtypeStructs with shardings): this process's
        shards from its own copy, or (when some process lacks its own) moved back from the
        successor's copy by one reverse permute of them all."""
        n = len(leaves)
        own, peer = own or [None] * n, peer or [None] * n
        mine = [self._build(x, self._lookup(x, o)) for x, o in zip(leaves, own)]
        if not need_peer:
            return mine
        held = [self._build(x, self._held(x, p)) for x, p in zip(leaves, peer)]
        returned = self.ring.permute(held, self.ring.backward)
        return [r if o is None else m for r, m, o in zip(returned, mine, own)]

    @staticmethod
    def _mine(x) -> set[str]:
        """The index keys of `x` this process's devices hold."""
        return {_key(_index_of(idx, x.shape)) for idx in x.sharding.addressable_devices_indices_map(x.shape).values()}

    def _held_indices(self, x) -> set[str]:
        """The index keys of `x` this process holds copies of (its predecessor's devices')."""
        every = x.sharding.devices_indices_map(x.shape)
        return {_key(_index_of(every[self.ring.flat[self.ring.source_of[_device_index(self.ring, d)]]], x.shape))
                for d in x.sharding.addressable_devices_indices_map(x.shape)}

    @staticmethod
    def _build(x, lookup) -> jax.Array:
        indices = x.sharding.addressable_devices_indices_map(x.shape)
        bufs = [jax.device_put(lookup(d, idx), d) for d, idx in indices.items()]
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, bufs)

    @staticmethod
    def _lookup(x, by_index):
        """This device's shard from this process's own copy (zeros without one)."""
        if by_index is None:
            zeros = np.zeros(x.sharding.shard_shape(x.shape), x.dtype)
            return lambda d, idx: zeros
        return lambda d, idx: by_index[_key(_index_of(idx, x.shape))]

    def _held(self, x, by_index):
        """On device d: the shard of the predecessor's device whose copy d holds (zeros without)."""
        if by_index is None:
            zeros = np.zeros(x.sharding.shard_shape(x.shape), x.dtype)
            return lambda d, idx: zeros
        all_indices = x.sharding.devices_indices_map(x.shape)

        def held(d, idx):
            source = self.ring.flat[self.ring.source_of[_device_index(self.ring, d)]]
            return by_index[_key(_index_of(all_indices[source], x.shape))]
        return held
