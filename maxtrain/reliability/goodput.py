"""Goodput: each attempt's wall time split into its parts, in run_dir/goodput.json."""

from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger("maxtrain")


class Goodput:
    """Wall time of one run split into its parts; `summary()` makes them add up to the wall time.

    Productive step time is what is left after start-up, compilation, data waits, checkpoint
    blocking and evaluation; `lost` is the part of it that redid steps an earlier attempt had
    already done (it crashed after them, before their checkpoint), and `restart_downtime` the gap
    between the previous attempt's end and this one's start (from run_dir/goodput.json)."""

    PARTS = ("startup", "compile", "data_wait", "ckpt_block", "eval")

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, "goodput.json")
        self.t0 = time.time()
        self.first_step = 0
        self.parts = {p: 0.0 for p in self.PARTS}
        self.facts: dict = {}
        self.saves: list[dict] = []  # each checkpoint this attempt wrote (`saved`)
        self.previous = _read_json(self.path)

    def start(self, first_step: int, startup_s: float) -> None:
        """The step the run starts from, and the seconds it took to get there (setup, restore)."""
        self.first_step = first_step
        self.parts["startup"] = startup_s

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] += seconds

    def saved(self, step: int, kind: str, block_s: float) -> None:
        """A checkpoint of `step` was written (or, for an async save, started): `kind` is periodic |
        final | preemption | local; `block_s` the seconds the loop waited for it (already in `add`)."""
        self.saves.append({"step": step, "kind": kind, "block_s": round(block_s, 4)})

    def note(self, **facts) -> None:
        """Facts about this attempt kept beside its parts (not added to them): `restore_s` and
        `restore_tier` (local | persistent | none), `compile_cache` (hit | miss | off)."""
        self.facts.update(facts)

    def summary(self, last_step: int) -> dict:
        wall = time.time() - self.t0
        steps = max(last_step - self.first_step, 0)
        productive = max(wall - sum(self.parts.values()), 0.0)
        prev = self.previous or {}
        # steps done before by any earlier attempt (not only the last: it may have crashed sooner)
        reached = max([prev.get("last_step", 0)] + [a.get("last_step", 0) for a in prev.get("attempts", [])])
        redone = max(min(reached, last_step) - self.first_step, 0) if prev else 0
        lost = productive * redone / steps if steps else 0.0
        attempts = prev.get("attempts", []) + [{
            "start": self.t0, "end": self.t0 + wall, "first_step": self.first_step, "last_step": last_step,
            "wall_s": wall, **{f"{k}_s": v for k, v in self.parts.items()},
            "productive_s": productive - lost, "lost_s": lost, "steps_redone": redone,
            "restart_downtime_s": max(self.t0 - prev["end"], 0.0) if prev.get("end") else 0.0,
            **self.facts, **_downtime_parts(prev.get("end"), self.t0), "saves": list(self.saves),
        }]
        total = {k: sum(a.get(k, 0.0) for a in attempts) for k in attempts[-1] if k.endswith("_s")}
        total["goodput"] = total["productive_s"] / max(total["wall_s"] + total["restart_downtime_s"], 1e-9)
        return {"last_step": last_step, "end": self.t0 + wall, "attempts": attempts, "total": total}

    def write(self, last_step: int, final: bool = True) -> dict:
        """Writes goodput.json (atomically). The loop also calls it at every logged step
        (`final=False`), so an attempt that crashes or hangs still leaves its account."""
        s = self.summary(last_step)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(s, f, indent=1)
        os.replace(tmp, self.path)
        if not final:
            return s
        t = s["total"]
        log.info("goodput %.1f%%: productive %.1fs, compile %.1fs, start-up %.1fs, data wait %.1fs, checkpoint %.1fs, "
                 "eval %.1fs, lost %.1fs, restart downtime %.1fs (%d attempt%s)", 100 * t["goodput"],
                 t["productive_s"], t["compile_s"], t["startup_s"], t["data_wait_s"], t["ckpt_block_s"], t["eval_s"],
                 t["lost_s"], t["restart_downtime_s"], len(s["attempts"]), "" if len(s["attempts"]) == 1 else "s")
        return s


def _downtime_parts(previous_end: float | None, t0: float) -> dict:
    """A restarted attempt's downtime split by the launcher's timestamps (`maxtrain launch local`):
    detection (the previous attempt's last record until the launcher saw it fail and stopped its
    processes), backoff (until it started this attempt) and process start (interpreter, imports and
    distributed initialisation, until the loop began). Empty without a launcher or a previous attempt."""
    from maxtrain.launcher import DETECTED_ENV, LAUNCHED_ENV

    try:
        seen, launched = float(os.environ[DETECTED_ENV]), float(os.environ[LAUNCHED_ENV])
    except (KeyError, ValueError):
        return {}
    if previous_end is None:
        return {}
    return {"detection_s": max(seen - previous_end, 0.0), "backoff_s": max(launched - seen, 0.0),
            "process_start_s": max(t0 - launched, 0.0)}


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
