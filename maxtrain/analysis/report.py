"""`maxtrain report`: one self-contained HTML page (plots embedded as PNG) or a terminal summary
of one or more run directories, from what the runs wrote: metrics.jsonl, config.yaml and,
when present, goodput.json."""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import math
import os
import statistics

import yaml

from maxtrain.config import ConfigError
from maxtrain.rundir import read_run_id
from maxtrain.metrics import record_time_totals, time_fractions

# goodput.json parts in the order they are drawn; unknown `*_s` parts are appended after these
GOODPUT_PARTS = ("productive_s", "compile_s", "startup_s", "data_wait_s", "ckpt_block_s", "eval_s", "lost_s",
                 "restart_downtime_s")


# an attempt's recovery figures: parts of restart_downtime_s (detection, backoff, process start) and
# of startup_s (restore): shown per restart, not stacked with the parts above
RECOVERY_PARTS = ("detection_s", "backoff_s", "process_start_s", "restore_s")


@dataclasses.dataclass
class Run:
    name: str  # label in plots and tables
    path: str
    records: list[dict]  # metrics.jsonl in file order (a resumed run appends; steps may repeat)
    config: dict | None  # config.yaml
    goodput: dict | None  # goodput.json
    run_id: str | None = None  # run.json (maxtrain.rundir); None for directories of earlier versions

    @property
    def curve(self) -> list[dict]:
        """One record per step, the newest attempt's where a restart redid steps, in step order."""
        return sorted({r["step"]: r for r in self.records}.values(), key=lambda r: r["step"])


# ---------------------------------------------------------------- reading runs


def load_runs(paths: list[str]) -> list[Run]:
    """Reads each run directory; a directory without metrics is a one-line user error."""
    runs = [load_run(p) for p in paths]
    names = [r.name for r in runs]
    for r in runs:
        if names.count(r.name) > 1:  # same basename in different places: label by path
            r.name = os.path.normpath(r.path)
    return runs


def load_run(path: str) -> Run:
    if os.path.basename(path) == "metrics.jsonl" and os.path.isfile(path):
        path = os.path.dirname(path) or "."  # the run directory of a metrics file given instead of it
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(path):
        raise ConfigError(f"{path} is a file; give a run directory (the run_dir holding metrics.jsonl)")
    if not os.path.isdir(path):
        raise ConfigError(f"run directory {path} does not exist")
    if not os.path.isfile(metrics):
        raise ConfigError(f"{path} has no metrics.jsonl (not a maxtrain run directory, or no step logged yet)")
    records = read_metrics(metrics)
    if not records:
        raise ConfigError(f"{metrics} holds no metrics records")
    return Run(os.path.basename(os.path.normpath(path)) or path, path, records,
               _read(os.path.join(path, "config.yaml"), yaml.safe_load),
               _read(os.path.join(path, "goodput.json"), json.load), read_run_id(path))


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a crash mid-write) is skipped, and the
    strings "nan"/"inf" that JsonlWriter writes for non-finite floats become floats again."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and isinstance(r.get("step"), int):
                out.append({k: _number(v) for k, v in r.items()})
    return out


def _number(v):
    if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf"):
        return float(v)
    return v


def _read(path: str, parse):
    try:
        with open(path) as f:
            return parse(f)
    except (OSError, ValueError, yaml.YAMLError):
        return None


# ---------------------------------------------------------------- what the records say


def tokens_per_step(r: dict) -> float:
    """Tokens of one optimizer step: tokens/s × s/step (exact, both come from the same step time)."""
    return r["tokens_per_s"] * r["step_time_s"]


def series(run: Run, key: str) -> tuple[list[float], list[float], list[float]]:
    """(steps, tokens seen, values) of one field over the run, finite values only."""
    xs, ts, ys = [], [], []
    for r in run.curve:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v) and "tokens_per_s" in r:
            xs.append(r["step"])
            ts.append(r["step"] * tokens_per_step(r))
            ys.append(float(v))
    return xs, ts, ys


def events(run: Run) -> list[tuple[int, str, str]]:
    """(step, kind, detail) of checkpoints (each save goodput.json lists; for runs of earlier
    versions, a record with checkpoint blocking), restarts (a record at or before an earlier one's
    step, or an attempt in goodput.json) and skipped updates."""
    out, prev, skipped = [], None, 0.0
    attempts = (run.goodput or {}).get("attempts", [])
    listed = any("saves" in a for a in attempts)  # goodput.json lists every save (periodic, final, SIGTERM, local)
    for a in attempts:
        for s in a.get("saves", []):
            out.append((s["step"], "checkpoint", f"{_SAVE_KINDS.get(s['kind'], s['kind'])}, loop blocked "
                        f"{s['block_s']:.2f}s"))
    for r in run.records:
        if prev is not None and r["step"] <= prev:
            out.append((r["step"], "restart", f"resumed after step {prev} was logged; steps {r['step']}-{prev} redone"))
        prev = r["step"]
        if r.get("ckpt_block_s") and not listed:
            out.append((r["step"], "checkpoint", f"loop blocked {r['ckpt_block_s']:.2f}s"))
        if r.get("skipped_updates", 0) > skipped:
            out.append((r["step"], "skipped update", f"{r['skipped_updates'] - skipped:.0f} update(s) dropped"))
            skipped = r["skipped_updates"]
    logged = {s for s, k, _ in out if k == "restart"}
    for a in attempts[1:]:
        if a.get("restore_tier"):
            out.append((a.get("first_step") or 0, "recovery", recovery_line(a)))
        step = a.get("first_step")
        if isinstance(step, int) and step + 1 not in logged:
            out.append((step, "restart", f"attempt resumed from step {step}"
                        + (f" after {a['restart_downtime_s']:.0f}s down" if a.get("restart_downtime_s") else "")))
    return sorted(out)


_SAVE_KINDS = {"periodic": "periodic", "final": "final", "preemption": "on SIGTERM/SIGINT (preemption)",
               "local": "local tier"}


def recovery_line(a: dict) -> str:
    """One restarted attempt's recovery: downtime split (detection, backoff, process start: known
    only under `maxtrain launch`, else the downtime as one figure), restore by tier, compilation
    (cache hit or miss) and steps redone."""
    f = lambda k: f"{a[k]:.1f}s" if isinstance(a.get(k), (int, float)) else "?"  # noqa: E731
    if any(isinstance(a.get(k), (int, float)) for k in ("detection_s", "backoff_s", "process_start_s")):
        down = f"detection {f('detection_s')}, backoff {f('backoff_s')}, process start {f('process_start_s')}"
    else:  # restarted by hand or by a scheduler: the launcher's timestamps are not there to split it
        down = f"down {f('restart_downtime_s')} (not split: restarted outside `maxtrain launch`)"
    return (f"{down}, restore {f('restore_s')} ({a.get('restore_tier', '?')} tier), compile {f('compile_s')} "
            f"(cache {a.get('compile_cache', '?')}), {a.get('steps_redone', 0)} step(s) redone")


def goodput_parts(goodput: dict | None) -> dict[str, float]:
    """Seconds per part of a goodput.json (its `total`, or the top level), known parts first."""
    if not goodput:
        return {}
    total = goodput.get("total") if isinstance(goodput.get("total"), dict) else goodput
    parts = {k: float(v) for k, v in total.items()
             if k.endswith("_s") and k not in ("wall_s",) + RECOVERY_PARTS and isinstance(v, (int, float))}
    order = [k for k in GOODPUT_PARTS if k in parts] + sorted(k for k in parts if k not in GOODPUT_PARTS)
    return {k: parts[k] for k in order}


def summary(run: Run) -> dict:
    """The figures a person asks of a run first."""
    curve = run.curve
    last = curve[-1]
    evals = [r["eval_loss"] for r in curve if isinstance(r.get("eval_loss"), (int, float))]
    timed = curve[1:] or curve  # the first record holds the first step's warm-up
    tps = [r["tokens_per_s"] for r in timed if "tokens_per_s" in r]
    mfu = [r["mfu"] for r in timed if isinstance(r.get("mfu"), (int, float))]
    tflops = [r["tflops_per_device"] for r in timed if "tflops_per_device" in r]
    totals = record_time_totals(curve, curve[0]["step"] - 1)  # a run's first record is its first step
    gp = run.goodput.get("total", {}).get("goodput") if isinstance((run.goodput or {}).get("total"), dict) else None
    return {
        "run": run.name, "run_id": run.run_id, "steps": last["step"], "loss": last.get("loss"),
        "best_eval_loss": min(evals) if evals else None,
        "tokens_per_s": statistics.median(tps) if tps else None,
        "step_time_s": statistics.median([r["step_time_s"] for r in timed if "step_time_s" in r] or [math.nan]),
        "mfu": statistics.median(mfu) if mfu else None,
        "tflops_per_device": statistics.median(tflops) if tflops else None,
        "time": time_fractions(*totals) if totals[0] > 0 else None,
        "goodput": gp,
    }


def data_sources(run: Run) -> dict | None:
    """A mixture run's training tokens per data source at its last logged step (`tokens_per_source`),
    with each source's share; None for other runs."""
    last = next((r for r in reversed(run.curve) if isinstance(r.get("tokens_per_source"), dict)), None)
    if last is None:
        return None
    total = sum(last["tokens_per_source"].values()) or 1
    return {"step": last["step"], "sources": {k: (v, v / total) for k, v in last["tokens_per_source"].items()}}


def moe_layers(run: Run) -> dict | None:
    """A MoE run's expert load at its last logged step, per MoE layer: max/mean tokens per expert
    (`moe_imbalance_per_layer`), the fraction of assignments dropped, and with aux-loss-free
    balancing the range of the layer's expert biases (`moe_bias_min/max_per_layer`; else None);
    None for other runs."""
    last = next((r for r in reversed(run.curve) if isinstance(r.get("moe_imbalance_per_layer"), list)), None)
    if last is None:
        return None
    n = len(last["moe_imbalance_per_layer"])
    lo, hi = last.get("moe_bias_min_per_layer"), last.get("moe_bias_max_per_layer")
    return {"step": last["step"], "imbalance": last["moe_imbalance_per_layer"],
            "dropped": last.get("moe_dropped_frac_per_layer") or [None] * n,
            "bias": list(zip(lo, hi)) if lo and hi else None}


def config_diff(runs: list[Run]) -> list[tuple[str, list]]:
    """Dotted config keys whose resolved values differ between the runs (`run_dir` left out: it
    names the runs already); a run without config.yaml shows None."""
    flat = [_flatten(r.config or {}) for r in runs]
    keys = sorted(set().union(*flat) - {"run_dir"})
    differs = lambda k: len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1  # noqa: E731
    return [(k, [f.get(k) for f in flat]) for k in keys if differs(k)]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---------------------------------------------------------------- plots


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("maxtrain report draws with matplotlib, which is not installed: pip install matplotlib "
                          "(or use --text)") from None

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_loss(runs: list[Run], path: str) -> str:
    """Training loss (solid) and eval loss (dashed, dots) by step and by tokens; restarts dotted,
    checkpoints as ticks along the bottom of the by-step panel."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    for i, run in enumerate(runs):
        color = f"C{i}"
        steps, tokens, loss = series(run, "loss")
        esteps, etokens, eloss = series(run, "eval_loss")
        for ax, x, ex in ((axes[0], steps, esteps), (axes[1], tokens, etokens)):
            ax.plot(x, loss, color=color, lw=1.4, label=f"{run.name} loss")
            if eloss:
                ax.plot(ex, eloss, color=color, ls="--", marker="o", ms=3, label=f"{run.name} eval")
        per_step = dict(zip(steps, tokens))
        saves = [step for step, kind, _ in events(run) if kind == "checkpoint"]
        if saves:
            axes[0].plot(saves, [0.0] * len(saves), "|", color=color, ms=10, transform=axes[0].get_xaxis_transform())
        for step, kind, _ in events(run):
            if kind == "restart":
                axes[0].axvline(step, color=color, ls=":", lw=1)
                if step in per_step:
                    axes[1].axvline(per_step[step], color=color, ls=":", lw=1)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("tokens")
    for ax in axes:
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title("loss by step (dotted: restarts, ticks: checkpoints)")
    axes[1].set_title("loss by tokens")
    return _save(fig, path)


def plot_throughput(runs: list[Run], path: str) -> str:
    """tokens/s and MFU (TFLOP/s per device where the peak is unknown) over steps, and each run's
    wall-time breakdown (jitted step, dispatch, data wait, host overhead, checkpoint blocking)."""
    return _save(throughput_figure(runs), path)


def throughput_figure(runs: list[Run]):
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    use_mfu = any(series(r, "mfu")[2] for r in runs)
    for i, run in enumerate(runs):
        steps, _, tps = series(run, "tokens_per_s")
        axes[0].plot(steps, tps, color=f"C{i}", label=run.name)
        steps, _, y = series(run, "mfu" if use_mfu else "tflops_per_device")
        axes[1].plot(steps, [100 * v for v in y] if use_mfu else y, color=f"C{i}", label=run.name)
    axes[0].set_title("tokens/s")
    axes[1].set_title("MFU (%)" if use_mfu else "model TFLOP/s per device (device peak unknown)")
    for ax in axes[:2]:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    parts = ("step", "dispatch", "data", "host", "ckpt")
    left = [0.0] * len(runs)
    fracs = [summary(r)["time"] or {} for r in runs]
    for j, part in enumerate(parts):
        widths = [100 * f.get(part, 0.0) for f in fracs]
        axes[2].barh([r.name for r in runs], widths, left=left, color=f"C{j}", label=part)
        left = [a + b for a, b in zip(left, widths)]
    axes[2].set_xlim(0, 100)
    axes[2].invert_yaxis()  # first run on top, as in the tables
    axes[2].set_xlabel("% of wall time (steps)")
    axes[2].set_title("where step time goes")
    axes[2].legend(fontsize=8, ncols=5, loc="upper center", bbox_to_anchor=(0.5, -0.18))  # below, clear of the title
    return fig


def plot_goodput(runs: list[Run], path: str) -> str | None:
    """Each run's wall time by goodput part (from goodput.json), None when no run has one."""
    fig = goodput_figure(runs)
    return None if fig is None else _save(fig, path)


def goodput_figure(runs: list[Run]):
    """The goodput bars (a matplotlib figure; its legend below the axes, clear of the title)."""
    parts = [goodput_parts(r.goodput) for r in runs]
    if not any(parts):
        return None
    plt = _pyplot()
    names = [k for k in GOODPUT_PARTS if any(k in p for p in parts)]
    names += sorted({k for p in parts for k in p} - set(names))
    fig, ax = plt.subplots(figsize=(10, 2.0 + 0.5 * len(runs)), layout="constrained")
    left = [0.0] * len(runs)
    for j, name in enumerate(names):
        widths = [p.get(name, 0.0) for p in parts]
        ax.barh([r.name for r in runs], widths, left=left, color=f"C{j}", label=name.removesuffix("_s"))
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("goodput: wall time by part")
    fig.legend(fontsize=8, ncols=min(len(names), 5), loc="outside lower center")
    return fig


def _save(fig, path: str) -> str:
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ---------------------------------------------------------------- output


def _fmt(v, spec: str = ".4g") -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _summary_rows(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    head = ["run", "run id", "steps", "loss", "best eval", "tokens/s", "ms/step", "MFU", "TFLOP/s/dev",
            "time: step/dispatch/data/host/ckpt",
            "goodput"]
    rows = []
    for r in runs:
        s = summary(r)
        t = s["time"]
        rows.append([s["run"], s["run_id"] or "—", str(s["steps"]), _fmt(s["loss"]), _fmt(s["best_eval_loss"]),
                     _fmt(s["tokens_per_s"], ",.0f"), _fmt(s["step_time_s"] * 1e3, ".1f"),
                     "—" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%", _fmt(s["tflops_per_device"], ".3g"),
                     "—" if t is None else " / ".join(f"{100 * v:.0f}%" for v in t.values()),
                     "—" if s["goodput"] is None else f"{100 * s['goodput']:.1f}%"])
    return head, rows


def text_report(runs: list[Run]) -> str:
    """The terminal summary: one table row per run, then events and the config diff."""
    head, rows = _summary_rows(runs)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in [head, *rows]]
    for r in runs:
        ev = events(r)
        if ev:
            kinds = {}
            for _, k, _ in ev:
                kinds[k] = kinds.get(k, 0) + 1
            lines.append(f"{r.name}: " + ", ".join(f"{n} {k}{'s' if n > 1 else ''}" for k, n in kinds.items()))
    for r in runs:
        src = data_sources(r)
        if src:
            lines.append(f"{r.name}: tokens per data source through step {src['step']}: " + ", ".join(
                f"{k} {v:,} ({100 * f:.1f}%)" for k, (v, f) in src["sources"].items()))
    for r in runs:
        moe = moe_layers(r)
        if moe:
            lines.append(f"{r.name}: MoE load per layer at step {moe['step']}: max/mean tokens per expert "
                         + " ".join(_fmt(x, ".2f") for x in moe["imbalance"]) + "; dropped "
                         + " ".join(_fmt(x, ".3f") for x in moe["dropped"])
                         + ("; balancing bias range " + " ".join(f"[{_fmt(a, '+.3f')}, {_fmt(b, '+.3f')}]"
                                                                  for a, b in moe["bias"]) if moe["bias"] else ""))
    diff = config_diff(runs)
    if len(runs) > 1:
        lines.append("config differences:" if diff else "config: identical (apart from run_dir)")
        for k, vals in diff:
            lines.append(f"  {k}: " + " | ".join(json.dumps(v) for v in vals))
    return "\n".join(lines)


def html_report(runs: list[Run], out: str) -> list[str]:
    """Writes the PNGs beside `out` and `out` itself (PNGs embedded); returns the paths written."""
    out_dir = os.path.dirname(os.path.abspath(out))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(out))[0]
    png = lambda name: os.path.join(out_dir, f"{stem}_{name}.png")  # noqa: E731
    images = [("Loss", plot_loss(runs, png("loss"))), ("Throughput", plot_throughput(runs, png("throughput")))]
    gp = plot_goodput(runs, png("goodput"))
    if gp:
        images.append(("Goodput", gp))
    e = html.escape
    head, rows = _summary_rows(runs)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>maxtrain report: "
             f"{e(', '.join(r.name for r in runs))}</title><style>{_CSS}</style></head><body>",
             f"<h1>maxtrain report</h1><p>{len(runs)} run(s): "
             + ", ".join(f"<b>{e(r.name)}</b> ({e(os.path.abspath(r.path))})" for r in runs) + "</p>",
             _table(head, rows)]
    for title, path in images:
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode()
        parts.append(f"<h2>{title}</h2><img alt='{title}' src='data:image/png;base64,{data}'>")
    ev = [[r.name, str(s), k, d] for r in runs for s, k, d in events(r)]
    parts.append("<h2>Checkpoint and restart events</h2>"
                 + (_table(["run", "step", "event", "detail"], ev) if ev else "<p>none recorded</p>"))
    src_rows = [[r.name, str(d["step"]), k, f"{v:,}", f"{100 * f:.1f}%"] for r in runs if (d := data_sources(r))
                for k, (v, f) in d["sources"].items()]
    if src_rows:
        parts.append("<h2>Tokens per data source (last logged step)</h2>" + _table(
            ["run", "step", "source", "tokens", "share"], src_rows))
    moe_rows = [[r.name, str(m["step"]), str(i), _fmt(x, ".3f"), _fmt(d, ".4f"),
                 "" if m["bias"] is None else f"{_fmt(m['bias'][i][0], '+.4f')} .. {_fmt(m['bias'][i][1], '+.4f')}"]
                for r in runs if (m := moe_layers(r)) for i, (x, d) in enumerate(zip(m["imbalance"], m["dropped"]))]
    if moe_rows:
        parts.append("<h2>MoE load per layer (last logged step)</h2>" + _table(
            ["run", "step", "MoE layer", "max/mean tokens per expert", "dropped fraction", "balancing bias range"],
            moe_rows))
    gp_rows = [[r.name] + [_fmt(goodput_parts(r.goodput).get(k), ".1f") for k in GOODPUT_PARTS]
               for r in runs if r.goodput]
    if gp_rows:
        parts.append("<h2>Goodput (seconds)</h2>" + _table(["run"] + [k.removesuffix("_s") for k in GOODPUT_PARTS],
                                                           gp_rows))
    if len(runs) > 1:
        diff = config_diff(runs)
        parts.append("<h2>Config differences</h2>" + (
            _table(["key"] + [r.name for r in runs], [[k] + [json.dumps(v) for v in vals] for k, vals in diff])
            if diff else "<p>identical resolved configs (apart from run_dir)</p>"))
    parts.append("</body></html>")
    with open(out, "w") as f:
        f.write("\n".join(parts))
    return [out] + [p for _, p in images]


def _table(head: list[str], rows: list[list[str]]) -> str:
    e = html.escape
    return ("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows) + "</table>")


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1500px}table{border-collapse:collapse;"
        "margin:0.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}"
        "th{background:#f3f3f3}img{max-width:100%}")


def default_out(runs: list[Run]) -> str:
    """RUN_DIR/report.html for one run (the directory `load_run` found, also when a metrics.jsonl
    was named); ./report.html for a comparison."""
    return os.path.join(runs[0].path, "report.html") if len(runs) == 1 else "report.html"
