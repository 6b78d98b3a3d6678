"""A run directory belongs to one run.

`run_dir/run.json` names the run (`run_id`, when it was created) and what identifies it: the
model section (less the keys that choose how it is computed: attention kernel, ring layout,
remat, fused norm) and the seed. A start whose config has the same identity is the same run (a
resume, or a rerun of the same config) and appends to the directory; any other start is refused
with one line before anything is written, so two runs never mix their `metrics.jsonl`,
`config.yaml` or `goodput.json`. Data, optimizer, mesh and cadence settings may change between
attempts of one run (a curriculum, a new learning rate after a spike, fewer nodes).

`run_dir` may hold `{run_id}` and `{timestamp}` (UTC, `YYYYmmdd-HHMMSS`): every start then gets a
fresh directory. Directories written before `run.json` existed are recognised by their
`config.yaml`.
"""

from __future__ import annotations

import json
import os
import secrets
import time

from maxtrain.config import ConfigError

RUN_FILE = "run.json"
IDENTITY_SECTIONS = ("model", "seed")  # what makes two starts the same run
# model keys that choose how the same model is computed, not what it is: free to change between attempts
HOW_COMPUTED = ("model.attention", "model.ring_layout", "model.remat", "model.fused_norm")


def new_run_id() -> str:
    """12 hex digits, random."""
    return secrets.token_hex(6)


def timestamp(t: float) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(t))


def expand(pattern: str, run_id: str, t: float) -> str:
    """`run_dir` with its `{run_id}` and `{timestamp}` placeholders filled in."""
    try:
        return pattern.format(run_id=run_id, timestamp=timestamp(t))
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"run_dir {pattern!r}: only {{run_id}} and {{timestamp}} may appear in braces ({e})") from None


def identity(config: dict) -> dict:
    """The flattened `IDENTITY_SECTIONS` of a config dict (`maxtrain.config.to_dict`)."""
    out: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value

    for section in IDENTITY_SECTIONS:
        walk(section, config.get(section))
    return {k: v for k, v in out.items() if k not in HOW_COMPUTED}


def differences(old: dict, new: dict) -> list[str]:
    """`key old -> new` for each identity key that differs, in key order."""
    keys = sorted(set(old) | set(new))
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def previous_run(run_dir: str) -> dict | None:
    """What `run_dir` holds: its run.json, or for a directory of an earlier version the identity
    in its config.yaml (run_id None); None for a directory no run has written to."""
    path = os.path.join(run_dir, RUN_FILE)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                run = json.load(f)
            if not isinstance(run, dict) or not isinstance(run.get("identity"), dict):
                raise ValueError("no identity")
            return run
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path} is unreadable ({e}); remove it if {run_dir} holds only this run, "
                              f"or give a new run_dir") from None
    legacy = os.path.join(run_dir, "config.yaml")
    if os.path.isfile(legacy):
        import yaml

        try:
            with open(legacy) as f:
                config = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            config = None
        if isinstance(config, dict):
            return {"run_id": None, "created": os.path.getmtime(legacy), "identity": identity(config)}
    return None


def claim(run_dir: str, config: dict, run_id: str, now: float, shown: str | None = None) -> dict:
    """The run `run_dir` is for, after checking that this start belongs to it: this start's run_id
    for a new directory, the stored one for the same run. Raises ConfigError (before anything is
    written) when the directory holds another run, naming it as `shown` (a bucket run_dir's URL:
    `run_dir` is then its local mirror)."""
    mine = identity(config)
    prev = previous_run(run_dir)
    if prev is None:
        return {"run_id": run_id, "created": now, "identity": mine}
    diff = differences(prev["identity"], mine)
    if diff:
        who = f"run {prev['run_id']}" if prev.get("run_id") else "another run"
        diffs = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
        where = shown or run_dir
        raise ConfigError(f"run_dir {where} holds {who} of another model or seed ({diffs}); give a new "
                          f"run_dir (run_dir=runs/NAME-{{run_id}} makes one per start), or remove {where}")
    return {"run_id": prev.get("run_id") or run_id, "created": prev.get("created", now), "identity": mine}


def write(run_dir: str, run: dict) -> None:
    """run.json, atomically."""
    path = os.path.join(run_dir, RUN_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(run, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_run_id(run_dir: str) -> str | None:
    """The run id in run_dir/run.json, if any (for reports)."""
    try:
        with open(os.path.join(run_dir, RUN_FILE)) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
