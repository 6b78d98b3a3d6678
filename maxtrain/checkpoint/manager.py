"""Checkpoints on Orbax: async saves, per-array checksums, verified restore with fallback, retention.

A checkpoint is one step directory `DIR/<step>/`:

- `params`, `opt_state`: the arrays, each process writing its own shards (OCDBT/tensorstore);
- `meta`: JSON with the format version, step, seed, data-iterator state, the resolved config and
  the data's tokenizer (a copy kept in `DIR`, see tokenizer.py; meta.py reads it without jax);
- `manifest`: two uint32 words per array (checksums.py), computed on device when the save
  starts and saved as one more Orbax item, so it is committed in the same atomic step as the
  arrays: every step directory Orbax lists has its checksums, and a crash at any moment leaves
  either the whole checkpoint or none of it.

Restoring verifies the checksums; a checkpoint that fails is named in one warning line and the
previous one is tried. (Checkpoints from before format 1's in-commit manifest have a
`manifest.json` file written after the commit; they still restore, and a step directory without
either is not a checkpoint.)
Retention never deletes the newest complete checkpoint nor the one this run restored from.
Leaves saved in another pipeline layout or dtype are converted after verification (relayout.py).

`DIR` may be an `s3://` or `gs://` prefix (objects.py, imported as `buckets`: Orbax writes through
TensorStore's drivers, and a step's commit is a marker object written last instead of a rename);
the directory is then owned through a lease object instead of an flock (lock.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from typing import Any

import jax

from maxtrain import exit_codes, imports, storage
from maxtrain.checkpoint import objects as buckets
from maxtrain.checkpoint.agreement import same_on_all_processes, true_on_all_processes
from maxtrain.checkpoint.checksums import checksum_words, flat_by_path, one_replica
from maxtrain.checkpoint.errors import CorruptCheckpoint, one_line
from maxtrain.checkpoint.lock import LOCK_FILE, lock_directory
from maxtrain.checkpoint.relayout import apply_relayout, read_targets, restorable
from maxtrain.checkpoint.tokenizer import data_tokenizer
from maxtrain.config import CheckpointConfig, ConfigError

log = logging.getLogger("maxtrain")
ocp = imports.quietly("orbax.checkpoint")  # leaves the root logger to the application

FORMAT_VERSION = 1
PREEMPTED_EXIT_CODE = exit_codes.PREEMPTED
MANIFEST = "manifest"  # the Orbax item holding the checksums
LEGACY_MANIFEST = "manifest.json"  # written after the commit by earlier versions
TRASH = ".maxtrain-deleted"  # steps retention drops are renamed in here; the commit thread removes them


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
        self.remote = storage.is_url(directory)  # an object store: no rename, no flock, no os.path
        self.directory = directory.rstrip("/") if self.remote else os.path.abspath(directory)
        self.cfg = cfg or CheckpointConfig(dir=directory)
        self.read_only = read_only
        self._protected: set[int] = set()  # restored-from step: never deleted by retention
        self._committer: threading.Thread | None = None
        self.corrupt: set[int] = set()  # steps that failed verification in this run
        self._closed = False
        self._partial: set[int] = set()  # steps whose save failed: their temporary directories go
        self._manifested: set[int] = set()  # steps known to hold their manifest (a remote check is a request)
        self.last_save_phases: dict[str, float] = {}  # seconds per phase of the latest save() (bench/checkpoint.py)
        if self.remote:  # reachable, with credentials: one line from our path layer if not
            buckets.require(self.directory)
            if read_only:  # a writer's lease (process 0's requests, agreed by all) checks the same
                storage.list_prefixes(self.directory)
        elif read_only and not os.path.isdir(self.directory):
            raise ConfigError(f"checkpoint path {directory} does not exist")
        # before Orbax touches the directory (it deletes partial saves it finds: another run's)
        self._lock = None if read_only else lock_directory(self.directory, run_dir)
        try:
            options = ocp.CheckpointManagerOptions(
                save_interval_steps=0 if read_only else 1,
                max_to_keep=None,  # retention is ours: it must never drop the last good checkpoint
                create=not read_only, read_only=read_only,
                enable_async_checkpointing=self.cfg.async_,
                # partial saves of a killed run; in an object store Orbax would take every sub-prefix
                # without a marker for one (a run_dir or data under checkpoint.dir): ours removes steps only
                cleanup_tmp_directories=not read_only and not self.remote,
                # a deleted step is renamed out of the way (one metadata operation on process 0); its files
                # are removed by the commit thread, not while the train loop waits (`_empty_trash`)
                todelete_subdir=None if read_only or self.remote else TRASH,
                atomicity_options=buckets.atomicity(self.directory),  # in an object store: a commit marker
            )
            handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                        "meta": ocp.JsonCheckpointHandler(), MANIFEST: ocp.JsonCheckpointHandler()}
            with imports.muted("absl", "Given directory is read only"):  # we opened it to read it
                self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        except (OSError, PermissionError, storage.StorageError) as e:
            self._release_lock()
            raise ConfigError(f"checkpoint.dir {directory} is not usable: {e}") from None
        except Exception as e:  # noqa: BLE001  (fsspec/botocore errors of a bucket: one line, never a secret)
            if not self.remote:
                raise
            self._release_lock()
            raise ConfigError(storage.redacted(f"checkpoint.dir {directory} is not usable: {one_line(e)}")) from None
        if not read_only:
            self._empty_trash()  # what a killed run had not removed yet
            self._remove_uncommitted_steps()

    def steps(self) -> list[int]:
        """Complete checkpoints (committed by Orbax, with checksums, not found corrupt), oldest first.

        Multi-process: process 0's view (it writes the manifests), so every process decides alike;
        in an object store only process 0 asks the store, and a failed request is a StorageError
        on every process (none is left waiting in the next collective)."""
        if self.read_only or not self.remote:
            mine = [s for s in self.all_steps() if s not in self.corrupt and self._has_manifest(s)]
            return mine if self.read_only else same_on_all_processes(mine)
        mine, problem = [], None
        if jax.process_index() == 0:
            try:
                mine = [s for s in self.all_steps() if s not in self.corrupt and self._has_manifest(s)]
            except storage.StorageError as e:
                problem = e
        if not true_on_all_processes(problem is None):
            raise problem or storage.StorageError(f"{self.directory}: process 0 could not list the checkpoints")
        return same_on_all_processes(mine)

    def all_steps(self) -> list[int]:
        """Every step Orbax committed, complete or not (`steps` filters), oldest first; this process's view."""
        return sorted(self._mgr.all_steps())

    def _has_manifest(self, step: int) -> bool:
        if step in self._manifested:
            return True
        step_dir = storage.join(self.directory, str(step))
        if self.remote:  # Orbax's JSON handler writes the item's `metadata` object
            found = storage.exists(storage.join(step_dir, MANIFEST, "metadata"))
        else:
            found = os.path.isdir(os.path.join(step_dir, MANIFEST)) or os.path.isfile(
                os.path.join(step_dir, LEGACY_MANIFEST))
        if found:
            self._manifested.add(step)
        return found

    # -------------------------------------------------------- save

    def save(self, step: int, params, opt_state, meta: dict, *, wait: bool = False) -> float:
        """Starts saving `step`; returns the seconds the caller was blocked.

        `opt_state=None` writes a params-only checkpoint (conversions, exports), usable with
        `checkpoint.init_from` and `load_checkpoint` but not for resuming.
        Unless `wait`, blocks only for the checksums (computed on device) and Orbax's copy of the
        arrays off the devices, plus the previous save if it is still writing; the seconds of each
        phase are in `last_save_phases`. Orbax writes and commits in the background, and the
        directories of checkpoints retention drops are removed there too (in an object store they
        are deleted here, object by object: no rename to defer it with). An error of a
        background save is logged and leaves the previous good checkpoint in place.
        """
        ph = _Phases()
        self.last_save_phases = ph.s
        if getattr(self._lock, "lost", None):  # another run took the directory over: never write beside it
            log.error("checkpoint save at step %d skipped: another run owns %s now (%s)", step, self.directory,
                      self._lock.lost)
            return ph.total()
        self._finish_previous(retention=False)  # joins the previous save's thread: waits only while it writes
        ph.lap("previous")
        try:
            complete = self._apply_retention()  # which steps go is decided here (files: see the docstring)
            ph.lap("retention")
            if step in complete:
                return ph.total()  # already complete (e.g. resumed at this step)
            if step in self.all_steps():
                self._delete_agreed([step])  # no manifest (the save never finished) or found corrupt: redo it
        except storage.StorageError as e:  # the store is unreachable: this save is lost, training goes on
            self._failed(step, e)
            return ph.total()
        ph.lap("listing")
        arrays = {"params": params} if opt_state is None else {"params": params, "opt_state": opt_state}
        arrays = jax.tree.map(one_replica, arrays)
        try:
            jax.block_until_ready(arrays)  # the step that produced them (Orbax's copy would wait for it too)
            ph.lap("ready")
            manifest = {"format": FORMAT_VERSION, "step": int(step), "checksums": checksum_words(arrays)}
        except Exception as e:  # noqa: BLE001
            log.error("checkpoint save at step %d failed: checksums: %s; previous checkpoint kept", step, one_line(e))
            return ph.total()
        meta = {"format": FORMAT_VERSION, "step": int(step), **meta}
        if "tokenizer" not in meta:  # what generate/eval decode with, wherever they run (tokenizer.py)
            meta["tokenizer"] = data_tokenizer(self.directory, meta.get("config"))
        manifest["meta_sha256"] = meta_digest(meta)
        ph.lap("checksum")
        if self.remote and (problem := self._unreachable()):  # before Orbax starts threads that would wait for it
            self._failed(step, problem)
            return ph.total()
        try:  # async: returns once the arrays are copied off the devices; the write goes on in Orbax's thread
            self._mgr.save(int(step), force=True, args=ocp.args.Composite(
                **{k: ocp.args.StandardSave(v) for k, v in arrays.items()}, meta=ocp.args.JsonSave(meta),
                **{MANIFEST: ocp.args.JsonSave(manifest)}))
        except Exception as e:  # noqa: BLE001  (disk full, permissions, ... : report, keep training)
            ph.lap("orbax")
            _release_stranded_writers()
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

    def _unreachable(self) -> storage.StorageError | None:
        """Why the store cannot be written now (one request per process, agreed by all), or None.
        A save Orbax starts while the store is down fails in its synchronous part, which leaves
        Orbax's writer threads waiting for a signal until its timeout (minutes: the process could
        not exit); this check makes that a window of one request."""
        try:
            storage.exists(storage.join(self.directory, LOCK_FILE))
            problem = None
        except storage.StorageError as e:
            problem = e
        if true_on_all_processes(problem is None):
            return None
        return problem or storage.StorageError(f"{self.directory} is unreachable from another process")

    def _commit(self, step: int) -> None:
        """Background: remove what retention dropped (while Orbax writes), then wait for Orbax's commit
        (arrays, meta and manifest together); log a failure."""
        self._empty_trash()
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            _release_stranded_writers()  # the failed part may be the one that signals the writers
            self._failed(step, e)
            return
        self._manifested.add(step)  # committed with its manifest: no request needed to know it

    def _empty_trash(self) -> None:
        """Process 0 removes the step directories Orbax renamed into `TRASH` (never concurrently with
        a rename: deletions happen on the caller's thread only after this thread was joined). An
        object store has no trash: Orbax deletes a step's objects at once."""
        if jax.process_index() == 0 and not self.remote:
            shutil.rmtree(os.path.join(self.directory, TRASH), ignore_errors=True)

    def _failed(self, step: int, e: BaseException) -> None:
        """A save that failed: one line naming the newest good checkpoint, and its partial files
        removed at once (on a full disk they hold the space the next save needs)."""
        # this process's view, not steps(): a background commit must not enter its collective
        try:
            good = [s for s in self.all_steps() if s != step and self._has_manifest(s) and s not in self.corrupt]
            kept = f"newest good checkpoint: step {good[-1]}" if good else "no checkpoint of this run is complete yet"
        except storage.StorageError:  # the store is down: the steps known to hold their checksums
            good = sorted(s for s in self._manifested if s != step and s not in self.corrupt)
            kept = f"newest good checkpoint: step {good[-1]}" if good else "no checkpoint of this run is known complete"
        log.error("checkpoint save at step %d failed: %s; %s", step, one_line(e), kept)
        self._partial.add(step)
        self._remove_partials()

    def _remove_partials(self, settle: bool = False) -> None:
        """Process 0 deletes what failed saves left (again later: Orbax's writer threads may still
        be failing one by one when the first error reaches us). `settle` (at close): again until
        those late writers stop re-creating files there, within a bound."""
        if jax.process_index() != 0 or not self._partial:
            return
        if self.remote:  # a failed step's objects (never its marker: the step was not committed)
            for step in sorted(self._partial):
                self._remove_uncommitted(step, last=settle)
            return
        if not settle:
            for path in self._partial_dirs():
                shutil.rmtree(path, ignore_errors=True)
        elif left := remove_settled(self._partial_dirs):
            log.warning("a failed save's partial files are still being written (%s); the next start removes "
                        "them", ", ".join(left))

    def _remove_uncommitted_steps(self) -> None:
        """In an object store, process 0 deletes the step prefixes (`DIR/<digits>/`) that have no
        commit marker: saves a killed run left (this run owns the directory now). Nothing else
        under the prefix is touched. A store that cannot be listed leaves them for the next start."""
        if not self.remote or jax.process_index() != 0:
            return
        try:
            committed = set(self.all_steps())
            stale = [int(p) for p in storage.list_prefixes(self.directory) if p.isdigit() and int(p) not in committed]
        except storage.StorageError as e:
            log.warning("checkpoint.dir %s: unfinished saves not looked for (%s)", self.directory, e)
            return
        for step in stale:
            self._remove_uncommitted(step, last=True)

    def _remove_uncommitted(self, step: int, last: bool = False) -> None:
        """Deletes the objects of a step whose save failed, unless its commit marker is there; if
        the store cannot be reached, tried again later (`last`: at close, said in one line)."""
        prefix = storage.join(self.directory, str(step))
        try:
            if not storage.exists(storage.join(prefix, buckets.COMMIT_MARKER)):
                storage.delete_prefix(prefix)
            self._partial.discard(step)
        except storage.StorageError as e:
            if last:
                log.warning("the objects of the failed save at step %d are still in %s (%s); a later save of "
                            "that step removes them", step, prefix, e)

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
            try:
                self._apply_retention()
            except storage.StorageError as e:  # the store is unreachable: the next save applies it
                log.warning("checkpoint retention in %s skipped: %s", self.directory, e)

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
        gone = self._delete([s for s in self.all_steps() if s not in keep and (s in complete or s < newest)])
        return [s for s in complete if s not in gone]

    def _delete(self, steps: list[int]) -> list[int]:
        """Deletes process 0's `steps` on every process (Orbax's delete is a collective)."""
        agreed = same_on_all_processes(steps)
        self._delete_agreed(agreed)
        return agreed

    def _delete_agreed(self, steps: list[int]) -> None:
        """Orbax renames each step into `TRASH` (and agrees with the other processes); the next
        commit thread, or `close`, removes the files."""
        for s in steps:
            self._manifested.discard(s)
            if self.remote:  # the marker goes first: a step half deleted is no longer listed
                if jax.process_index() == 0:
                    storage.delete(storage.join(self.directory, str(s), buckets.COMMIT_MARKER))
            else:
                leftover = os.path.join(self.directory, TRASH, str(s))
                if jax.process_index() == 0 and os.path.isdir(leftover):  # Orbax's rename must not land on it
                    shutil.rmtree(leftover, ignore_errors=True)
            self._mgr.delete(s)

    def wait(self, retention: bool = True) -> None:
        self._finish_previous(retention)

    def discard_from(self, step: int) -> list[int]:
        """Deletes every checkpoint of `step` or later (a rollback undoes them); returns them."""
        self._finish_previous(retention=False)  # callers have waited already; never delete beside a commit thread
        return self._delete([s for s in self.all_steps() if s >= step])

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
            log.debug("checkpoint close: %s", one_line(e))
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
            raise CorruptCheckpoint(f"meta unreadable ({one_line(e)})") from None
        _check_meta(meta, self.read_manifest(step))
        return meta

    def _item_trees(self, step: int) -> dict:
        try:
            meta = self._mgr.item_metadata(step)
            trees = {k: getattr(meta[k], "tree", meta[k]) if meta.get(k) is not None else None
                     for k in ("params", "opt_state")}
        except Exception as e:  # noqa: BLE001
            raise CorruptCheckpoint(f"metadata unreadable ({one_line(e)})") from None
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
            if not restorable(k, have[k].shape, x.shape):
                raise ConfigError(f"{where}: {k} has shape {tuple(have[k].shape)}, the model expects "
                                  f"{tuple(x.shape)}; {fix}")

    def read_manifest(self, step: int) -> dict:
        """The step's manifest (format, step, per-array `checksums`, `meta_sha256`); CorruptCheckpoint
        when it is missing, unreadable or of an unknown format."""
        step_dir = os.path.join(self.directory, str(step))
        try:
            if self.remote or os.path.isdir(os.path.join(step_dir, MANIFEST)):  # no legacy files in buckets
                manifest = self._mgr.restore(step, args=ocp.args.Composite(
                    **{MANIFEST: ocp.args.JsonRestore()}))[MANIFEST]
            else:
                with open(os.path.join(step_dir, LEGACY_MANIFEST)) as f:
                    manifest = json.load(f)
        except FileNotFoundError:
            raise CorruptCheckpoint("no manifest: the save never completed") from None
        except Exception as e:  # noqa: BLE001  (unreadable or not JSON)
            raise CorruptCheckpoint(f"manifest unreadable ({one_line(e)})") from None
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
            if want.keys() != have.keys() or any(not restorable(k, have[k].shape, x.shape) for k, x in want.items()):
                raise ConfigError(f"checkpoint {self.directory}/{step} has a different optimizer state layout "
                                  f"(optim.* changed, e.g. clip_norm or weight_decay, or train.fp8.recipe to or from "
                                  f"delayed, or train.fp8.amax_history); restore its params with "
                                  f"checkpoint.init_from={self.directory}/{step} and checkpoint.resume_from=none")
        # leaves saved in another pipeline layout are read as saved, verified, then reshaped
        wanted = {"params": abstract_params}
        if abstract_opt_state is not None:
            wanted["opt_state"] = abstract_opt_state
        tree, relaid = read_targets(wanted, {k: saved[k] for k in wanted})
        items = {k: ocp.args.StandardRestore(v) for k, v in tree.items()}
        # Local reads may fail on one process only (a bad local copy, a flaky mount). The processes
        # agree after each phase, so none goes on to the next phase's collectives (the checksums
        # are computed over the global arrays) while another has given up on this checkpoint.
        manifest, problem = _attempt(lambda: self.read_manifest(step))
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
            got = apply_relayout(got, relaid)
        return Restored(step, got["params"], got.get("opt_state"), meta)

    def restore_latest_good(self, abstract_params, abstract_opt_state=None, *, steps=None,
                            fix: str | None = None) -> Restored | None:
        """Newest checkpoint that verifies; each failing one is named in one warning line (`fix`: as
        for `check_compatible`). `abstract_opt_state` may be a function of the step that gives it
        (the optimizer's layout may change with the step: `maxtrain.step.at_step`)."""
        for step in reversed(steps if steps is not None else self.steps()):
            opt = abstract_opt_state(step) if callable(abstract_opt_state) else abstract_opt_state
            try:
                r, problem = self.restore(step, abstract_params, opt, fix), None
            except CorruptCheckpoint as e:
                r, problem = None, str(e)
            if not true_on_all_processes(problem is None):  # one bad local read fails it for all
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


def _release_stranded_writers() -> int:
    """Lets go of the Orbax writer threads a failed save left behind.

    Those threads wait for a signal the failed part would have sent (the step directory exists) for
    Orbax's coordination timeout, minutes, and are not daemons: the process could not exit until
    then. Each is cancelled and its signals set, so it wakes, sees the cancellation and ends. Called
    only right after a save failed (in its synchronous part, or its commit), when no other save is
    in flight (the previous one was joined). Returns how many there were."""
    import threading
    import warnings

    from orbax.checkpoint._src.futures import future

    kind = getattr(future, "_SignalingThread", None)  # Orbax 0.12's; an Orbax without it strands none
    stranded = [t for t in threading.enumerate() if kind is not None and isinstance(t, kind) and t.is_alive()]
    if stranded:  # their coroutines are dropped unawaited: Python would say so for each at exit
        warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)
    for t in stranded:
        t.cancel()
        future.set_signals(t._receive_signals, operation_id=t._operation_id)
    return len(stranded)


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


def _attempt(fn, unreadable: bool = False):
    """(fn(), None), or (None, the CorruptCheckpoint it raised or an Orbax read error became)."""
    try:
        return fn(), None
    except CorruptCheckpoint as e:
        return None, e
    except Exception as e:  # noqa: BLE001  (truncated or missing files, bad metadata)
        if not unreadable or _out_of_memory(e):  # not the checkpoint's fault: never mark good ones corrupt
            raise
        return None, CorruptCheckpoint(f"unreadable ({one_line(e)})")


def _agree(problem: CorruptCheckpoint | None) -> None:
    """Raises on every process when any has a problem: its own, or that of another process."""
    if not true_on_all_processes(problem is None):
        raise problem or CorruptCheckpoint("failed verification on another process")


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


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


def split_step_path(path: str) -> tuple[str, int | None]:
    """`DIR` -> (DIR, None); `DIR/<step>` -> (DIR, step)."""
    path = os.path.abspath(path)
    base = os.path.basename(path)
    if base.isdigit() and os.path.isfile(os.path.join(path, "_CHECKPOINT_METADATA")):
        return os.path.dirname(path), int(base)
    return path, None


def open_path(path: str, what: str, cache: str | None = None) -> tuple["Checkpointer", list[int]]:
    """A checkpoint directory or one step directory -> (read-only checkpointer, its complete steps).
    An s3:// or gs:// prefix is read from its node-local copy under `cache` (`staged_checkpoint`)."""
    from maxtrain import storage

    if storage.is_url(path):  # the bucket's listing decides the step, not what the cache holds
        root, step = staged_checkpoint(path, what, cache or storage.DEFAULT_CACHE)
        return Checkpointer(root, read_only=True), [step]
    if not os.path.isdir(path):
        raise ConfigError(f"{what}={path} does not exist; give a checkpoint directory or a step directory")
    root, step = split_step_path(path)
    ckpt = Checkpointer(root, read_only=True)
    steps = [step] if step is not None else ckpt.steps()
    if not steps:
        raise ConfigError(f"{what}={path} holds no complete checkpoint")
    return ckpt, steps


def staged_checkpoint(url: str, what: str, cache: str) -> tuple[str, int]:
    """(the node-local directory, the step) of a checkpoint in an object store, copied with
    `storage.stage`: a step prefix's step, or a checkpoint directory's newest complete step (Orbax's
    step metadata and our manifest both there), each with the directory's own files (the data's
    tokenizer, a conversion's source files); other steps stay in the bucket. Every process lists
    the same bucket, so all restore the same step, whatever older copies their caches hold."""
    from maxtrain import storage

    root, step = split_step_url(url)
    objects = storage.list_objects(root)
    keys = {o["key"] for o in objects}

    # Orbax 0.12 writes a step's commit marker last, in a bucket (objects.py) and on disk alike (so a
    # published copy has it); only a directory none of whose steps has one predates markers
    markers = any(k.count("/") == 1 and k.endswith("/" + buckets.COMMIT_MARKER) for k in keys)

    def complete(s: str) -> bool:
        return f"{s}/_CHECKPOINT_METADATA" in keys and any(
            k.startswith(f"{s}/{MANIFEST}/") or k == f"{s}/{LEGACY_MANIFEST}" for k in keys) and (
            not markers or f"{s}/{buckets.COMMIT_MARKER}" in keys)

    if step is None:
        steps = sorted(int(k.split("/", 1)[0]) for k in keys if k.count("/") == 1
                       and k.endswith("/_CHECKPOINT_METADATA") and k.split("/", 1)[0].isdigit())
        step = next((s for s in reversed(steps) if complete(str(s))), None)
        if step is None:
            raise ConfigError(f"{what}={url} holds no complete checkpoint")
    elif not complete(str(step)):
        raise ConfigError(f"{what}={url} is not a complete checkpoint step (no Orbax step metadata and manifest)")
    return stage_checkpoint_files(root, cache, step, objects), step


def split_step_url(url: str) -> tuple[str, int | None]:
    """`split_step_path` of a URL: `s3://b/ck` -> (s3://b/ck, None); `s3://b/ck/200` -> (s3://b/ck, 200)."""
    root, _, last = url.rstrip("/").rpartition("/")
    if last.isdigit() and "://" in root and root.split("://", 1)[1]:
        return root, int(last)
    return url.rstrip("/"), None


def stage_checkpoint_files(root: str, cache: str, step: int | None, objects: list[dict] | None = None) -> str:
    """The node-local copy of a bucket's checkpoint directory `root`: its own files (not under a step:
    the data's tokenizer, a conversion's source) and, given one, `step`'s; other steps are left."""
    from maxtrain import storage

    mine = f"{step}/"
    return storage.stage(root, cache, objects=objects, keep=lambda k: not k.split("/", 1)[0].isdigit()
                         or (step is not None and k.startswith(mine)))
