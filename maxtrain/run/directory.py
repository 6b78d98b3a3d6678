"""The run directory of one run: its path's placeholders filled in (the same on every process),
refused when it holds another run, and written (run.json, config.yaml) once start-up passed.
The on-disk format lives in `maxtrain.rundir`.

A `run_dir` in an object store (`s3://`, `gs://`) is written through a node-local mirror under
`object_cache/run_dirs/p<process>/`: at the start the bucket's copy is fetched into it (so a
resumed run appends to its metrics, and the claim reads the bucket's run.json), the run writes
its files there as on a filesystem, and process 0's `RunDirUpload` puts every changed file under
the prefix every `UPLOAD_EVERY_S` and at the end. Profiles (`profile/`) are uploaded, never
fetched back. What an attempt killed between two rounds left in this node's mirror goes up when
the next attempt starts here (`upload_leftovers`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time

import jax
import numpy as np

from maxtrain import rundir, storage
from maxtrain.config import Config, ConfigError, save_config, to_dict

log = logging.getLogger("maxtrain")

UPLOAD_EVERY_S = 30.0  # a bucket run_dir is brought up to date this often (and at the end)
NOT_FETCHED = ("profile/",)  # large, written once: uploaded, never fetched back at a start


def claim_run_dir(cfg: Config) -> tuple[Config, dict]:
    """`cfg` with `run_dir`'s placeholders filled in (the same on every process), and the run the
    directory is for (`maxtrain.rundir`). Every process checks that the directory holds this run,
    or none (a ConfigError); nothing is written here: `write_run_dir` does, once start-up passed
    every other check."""
    run_id, now = rundir.new_run_id(), time.time()
    if jax.process_count() > 1:  # process 0's id and clock: one directory for the job
        from jax.experimental import multihost_utils

        # jax arrays are 32-bit here: the 48-bit id goes as two 24-bit halves
        agreed = multihost_utils.broadcast_one_to_all(
            np.array([int(run_id[:6], 16), int(run_id[6:], 16), int(now)], np.int32))
        run_id, now = f"{int(agreed[0]):06x}{int(agreed[1]):06x}", float(agreed[2])
    path = rundir.expand(cfg.run_dir, run_id, now)
    url = None
    if storage.is_url(path):  # the run writes into a node-local mirror of the prefix
        url, path = path, fetch_run_dir(path, cfg.object_cache)
    if path != cfg.run_dir:
        cfg = dataclasses.replace(cfg, run_dir=path)
    run = rundir.claim(path, to_dict(cfg), run_id, now, shown=url)
    return cfg, ({**run, "url": url} if url else run)


def fetch_run_dir(url: str, cache: str) -> str:
    """The node-local mirror this process writes a bucket `run_dir` through (one per process: two on
    one node never share it), emptied and filled with what the prefix holds now (none of
    `NOT_FETCHED`; on processes other than 0, which write nothing there, only what the claim
    reads); returns its path."""
    root = os.path.join(cache, "run_dirs", f"p{jax.process_index()}")
    local = storage.cache_path(url, root)
    if jax.process_index() == 0:
        upload_leftovers(local, url)
    shutil.rmtree(local, ignore_errors=True)
    objects = [o for o in storage.list_objects(url) if not o["key"].startswith(NOT_FETCHED)
               and (jax.process_index() == 0 or o["key"] in (rundir.RUN_FILE, "config.yaml"))]
    if objects:
        storage.stage(url, root, objects=objects)
    return local


def upload_leftovers(local: str, url: str) -> int:
    """What an earlier attempt of the same run wrote into this node's mirror but did not upload (it
    was killed between two rounds): files the prefix lacks, and files that grew beyond the
    prefix's copy of them (metrics.jsonl, TensorBoard events: appended to) when that copy is
    their beginning. Only when the mirror's run.json names the run the prefix holds; a failed
    request is one warning. Returns how many files went up."""
    try:
        with open(os.path.join(local, rundir.RUN_FILE)) as f:
            mine = json.load(f).get("run_id")
        theirs = json.loads(storage.read_bytes(storage.join(url, rundir.RUN_FILE))).get("run_id")
    except (OSError, ValueError, AttributeError, storage.StorageError):
        return 0
    if not mine or mine != theirs:
        return 0
    sent = 0
    try:
        held = {o["key"]: o["size"] for o in storage.list_objects(url)}
        for rel, (size, _) in _files(local).items():
            path, dest = os.path.join(local, rel), storage.join(url, rel)
            if rel in held and (size <= held[rel] or not _begins_with(path, storage.read_bytes(dest))):
                continue
            storage.upload(path, dest)
            sent += 1
    except (storage.StorageError, OSError) as e:
        log.warning("run_dir %s: the previous attempt's last files were not all uploaded (%s)", url, e)
    if sent:
        log.info("run_dir %s: %d files the previous attempt on this node had not uploaded are now there", url, sent)
    return sent


def _begins_with(path: str, head: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(head)) == head


def write_run_dir(cfg: Config, run: dict) -> None:
    """Process 0 creates run_dir and writes run.json and config.yaml (naming a bucket run_dir by
    its URL, not its mirror)."""
    if jax.process_index() == 0:
        make_run_dir(cfg.run_dir)
        rundir.write(cfg.run_dir, run)
        shown = dataclasses.replace(cfg, run_dir=run["url"]) if run.get("url") else cfg
        save_config(shown, os.path.join(cfg.run_dir, "config.yaml"))


class RunDirUpload:
    """Keeps a bucket `run_dir` up to date with its node-local mirror (process 0): every changed
    file put under the prefix every `every_s` on a background thread, and once more at `close`. A
    failed upload is one warning (once per outage) and is retried at the next round."""

    def __init__(self, local: str, url: str, every_s: float = UPLOAD_EVERY_S):
        self.local, self.url, self.every_s = local, url, every_s
        self._sent = _files(local)  # relative path -> (size, mtime_ns) last uploaded: what was fetched is there
        self._failing = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="maxtrain-run-dir", daemon=True)

    def start(self) -> "RunDirUpload":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sync()

    def sync(self) -> bool:
        """Uploads what changed since the last round; False if something could not be uploaded."""
        with self._lock:
            try:
                for rel, stamp in _files(self.local).items():
                    if self._sent.get(rel) != stamp:
                        storage.upload(os.path.join(self.local, rel), storage.join(self.url, rel))
                        self._sent[rel] = stamp
            except (storage.StorageError, OSError) as e:
                if not self._failing:
                    log.warning("run_dir %s: upload failed (%s); retried every %.0fs and at the end", self.url,
                                e, self.every_s)
                self._failing = True
                return False
            self._failing = False
            return True

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if not self.sync():
            log.error("run_dir %s is not complete: the last upload failed; its files are in %s", self.url, self.local)


def _files(root: str) -> dict[str, tuple[int, int]]:
    """Every file under `root` (relative, `/`-separated) with its (size, mtime_ns)."""
    out = {}
    for d, _, names in os.walk(root):
        for name in names:
            if name.endswith(".tmp"):  # written, then renamed into place (run.json)
                continue
            path = os.path.join(d, name)
            try:
                st = os.stat(path)
            except OSError:  # removed while we walked
                continue
            out[os.path.relpath(path, root).replace(os.sep, "/")] = (st.st_size, st.st_mtime_ns)
    return out


def make_run_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run_dir {path} cannot be created ({e.strerror or e}); give a writable directory") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"run_dir {path} is not writable; give a writable directory")
