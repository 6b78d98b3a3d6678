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
        self.previous = _read_json(self.path)

    def start(self, first_step: int, startup_s: float) -> None:
        """The step the run starts from, and the seconds it took to get there (setup, restore)."""
        self.first_step = first_step
        self.parts["startup"] = startup_s

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] += seconds

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
        }]
        total = {k: sum(a[k] for a in attempts) for k in attempts[-1] if k.endswith("_s")}
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


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
