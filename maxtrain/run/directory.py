"""The run directory of one run: its path's placeholders filled in (the same on every process),
refused when it holds another run, and written (run.json, config.yaml) once start-up passed.
The on-disk format lives in `maxtrain.rundir`."""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from maxtrain import rundir
from maxtrain.config import Config, ConfigError, save_config, to_dict


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
    if path != cfg.run_dir:
        cfg = dataclasses.replace(cfg, run_dir=path)
    return cfg, rundir.claim(path, to_dict(cfg), run_id, now)


def write_run_dir(cfg: Config, run: dict) -> None:
    """Process 0 creates run_dir and writes run.json and config.yaml."""
    if jax.process_index() == 0:
        make_run_dir(cfg.run_dir)
        rundir.write(cfg.run_dir, run)
        save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))


def make_run_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run_dir {path} cannot be created ({e.strerror or e}); give a writable directory") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"run_dir {path} is not writable; give a writable directory")
