"""Seeing a run: TensorBoard scalars, the profiler window and HLO dump, the step-time breakdown,
`maxtrain report`, and W&B wiring (with a fake module: no network)."""

import base64
import json
import os
import re
import signal
import sys
import types

import jax
import pytest

from conftest import SMALL, TINY
from maxtrain import cli, load_config, train
from maxtrain.config import ConfigError
from maxtrain.run import Callback
from maxtrain.metrics import MetricsSink, TimeBreakdown, tensorboard_tag, time_fractions

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two 3-step runs on one device that differ only in seed; the first also profiles step 2."""
    base = tmp_path_factory.mktemp("runs")
    runs = []
    for seed, extra in ((0, ["profile.start_step=2", "profile.steps=1", "profile.dump_hlo=true"]), (1, [])):
        run_dir = base / f"seed{seed}"
        cfg = load_config(TINY, SMALL + [f"run_dir={run_dir}", "train.steps=3", f"seed={seed}", *extra])
        runs.append((run_dir, train(cfg, devices=jax.devices()[:1])))
    return runs


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_has_every_logged_scalar(two_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, result = two_runs[0]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3] and result.history == records
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {tensorboard_tag(k) for k, v in records[0].items() if k != "step" and isinstance(v, (int, float))}
    assert {"train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s", "perf/host_overhead_s"} <= expected
    assert expected <= tags, expected - tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]  # the run's id, as the report shows it
    assert acc.Tensors("run_id/text_summary")[0].tensor_proto.string_val == [run_id.encode()]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_profile_window_writes_trace_memory_profile_and_hlo(two_runs):
    run_dir, _ = two_runs[0]
    traces = list((run_dir / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
    assert list((run_dir / "profile" / "plugins" / "profile").glob("*/perfetto_trace.json.gz"))
    assert (run_dir / "profile" / "memory_step2.prof").stat().st_size > 0
    assert "HloModule" in (run_dir / "train_step.hlo.txt").read_text()[:2000]
    assert not (two_runs[1][0] / "profile").exists()  # no window configured: nothing traced


def test_records_carry_the_step_time_breakdown(two_runs):
    for r in _records(two_runs[1][0]):
        assert min(r["dispatch_s"], r["host_overhead_s"], r["data_wait_s"]) >= 0 and r["step_time_s"] > 0
        f = time_fractions(r["step_time_s"], r["dispatch_s"], r["data_wait_s"], r["host_overhead_s"],
                           r["ckpt_block_s"])
        assert 0 <= f["step"] <= 1 and sum(f.values()) == pytest.approx(1.0)


def test_report_html_embeds_both_runs_curves(two_runs, tmp_path, capsys):
    out = tmp_path / "cmp" / "report.html"
    assert cli.main(["report", *(str(d) for d, _ in two_runs), "--out", str(out)]) == 0
    page = out.read_text()
    assert "seed0" in page and "seed1" in page
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert len(images) >= 2  # loss curves, throughput
    assert all(base64.b64decode(img).startswith(PNG_SIGNATURE) for img in images)
    loss_png = (out.parent / "report_loss.png").read_bytes()
    assert loss_png.startswith(PNG_SIGNATURE) and len(loss_png) > 10_000
    assert ">seed<" in page  # the config diff names the key the runs differ in
    assert "report.html" in capsys.readouterr().out


def test_report_text_summary(two_runs, capsys):
    assert cli.main(["report", "--text", *(str(d) for d, _ in two_runs)]) == 0
    out = capsys.readouterr().out
    assert "seed0" in out and "seed1" in out and "seed: 0 | 1" in out


def test_report_of_a_metrics_file_reports_its_run(two_runs, tmp_path, capsys):
    """`maxtrain report runs/x/metrics.jsonl` (the file a user has open) reports run x; any other
    file is one line asking for a run directory."""
    run_dir = two_runs[0][0]
    assert cli.main(["report", "--text", str(run_dir / "metrics.jsonl")]) == 0
    assert run_dir.name in capsys.readouterr().out
    assert cli.main(["report", str(run_dir / "metrics.jsonl")]) == 0  # the HTML goes beside it, in the run directory
    assert (run_dir / "report.html").is_file() and "report.html" in capsys.readouterr().out
    (tmp_path / "notes.txt").write_text("x")
    assert cli.main(["report", str(tmp_path / "notes.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file; give a run directory" in err[0], err


def test_report_without_metrics_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("maxtrain: error:") and "metrics.jsonl" in err[0]
    assert not (tmp_path / "empty" / "report.html").exists()


class _SigtermAt(Callback):
    """Sends this process SIGTERM before step `step` reads its batch: a preemption in the middle of a run."""

    def __init__(self, step):
        self.step = step

    def before_step(self, run, step):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_report_lists_every_save_of_a_preempted_and_restarted_run(tmp_path, capsys):
    """Saves at steps 2 (periodic), 3 (on SIGTERM: after step 3, before any record that could carry
    its blocking time) and 4, 6 after a plain restart (not under `maxtrain launch`). The events
    table lists all four with their kind, and the restart's recovery row has no unknown figures."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ck"
    over = SMALL + [f"run_dir={run_dir}", f"checkpoint.dir={ckpt}", "checkpoint.every=2", "train.log_every=100",
                    "checkpoint.async=false"]
    first = train(load_config(TINY, over + ["train.steps=6"]), devices=jax.devices()[:1], callbacks=[_SigtermAt(3)])
    assert first.preempted and first.checkpoint_saved
    train(load_config(TINY, over + ["train.steps=6"]), devices=jax.devices()[:1])
    assert cli.main(["report", str(run_dir), "--out", str(tmp_path / "report.html")]) == 0
    page = (tmp_path / "report.html").read_text()
    rows = re.findall(r"<tr><td>run</td><td>(\d+)</td><td>(checkpoint|recovery)</td><td>([^<]*)</td></tr>", page)
    saves = [(int(step), detail) for step, kind, detail in rows if kind == "checkpoint"]
    assert [s for s, _ in saves] == [2, 3, 4, 6], rows
    assert "SIGTERM" in saves[1][1] and "periodic" in saves[0][1]
    recovery = [detail for _, kind, detail in rows if kind == "recovery"]
    assert len(recovery) == 1 and "?" not in recovery[0] and "not split" in recovery[0], recovery
    assert cli.main(["report", "--text", str(run_dir)]) == 0
    assert "4 checkpoints, 1 recovery, 1 restart" in capsys.readouterr().out


@pytest.mark.parametrize("which", [[0], [0, 1]])
@pytest.mark.parametrize("draw", ["goodput_figure", "throughput_figure"])
def test_report_plot_legends_cover_no_title_label_or_axes(two_runs, draw, which):
    """Each legend's box, drawn as the report saves it, overlaps no axes' title, axis labels or
    plotting area, for one run (the shortest figure) and two."""
    from maxtrain.analysis import report

    runs = report.load_runs([str(two_runs[i][0]) for i in which])
    fig = getattr(report, draw)(runs)
    fig.set_dpi(100)  # the report's
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            texts = [ax.title, ax.xaxis.label, ax.yaxis.label]
            covered = [t.get_text() for t in texts if t.get_text() and box.overlaps(t.get_window_extent(renderer))]
            assert not covered, f"{draw}: the legend covers {covered}"
            if ax.get_legend() is not legend:  # a legend inside its own axes is fine; over another one's is not
                assert not box.overlaps(ax.get_window_extent(renderer)), f"{draw}: a legend covers another plot"


def test_wandb_requested_but_missing_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails
    with pytest.raises(ConfigError, match="logging.wandb"):
        load_config(TINY, ["logging.wandb=true"])


def test_wandb_sink_logs_every_numeric_field(monkeypatch, tmp_path):
    logged, inits = [], []

    class FakeRun:
        def log(self, values, step):
            logged.append((step, values))

        def finish(self):
            logged.append("finished")

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: inits.append(kw) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = MetricsSink(str(tmp_path), tensorboard=False, wandb=True, wandb_project="p", config={"seed": 0})
    sink.write({"step": 3, "loss": 2.5, "mfu": None, "tokens_per_s": 10.0})
    sink.close()
    assert inits[0]["project"] == "p" and inits[0]["config"] == {"seed": 0}
    assert logged == [(3, {"train/loss": 2.5, "perf/tokens_per_s": 10.0}), "finished"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_breakdown_every_n_steps():
    b = TimeBreakdown(first_step=0, every=4)
    rec = lambda s: {"step": s, "step_time_s": 1.0, "dispatch_s": 0.05, "data_wait_s": 0.1,  # noqa: E731
                     "host_overhead_s": 0.2, "ckpt_block_s": 0.0}
    assert b.add(rec(2)) is None
    assert b.add(rec(4)) == "time: step 65% dispatch 5% data 10% host 20% ckpt 0%"
    assert TimeBreakdown(0, None).add(rec(1)) is not None  # None: on every log line


# ---------------------------------------------------------------- a run directory belongs to one run


def _cli_train(tmp_path, capsys, *overrides) -> tuple[int, str]:
    code = cli.main(["train", TINY, *SMALL, "train.steps=2", "mesh.data=1", "logging.tensorboard=false",
                     *overrides])
    return code, capsys.readouterr().err


def test_a_run_dir_holding_another_model_is_refused_and_left_untouched(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _cli_train(tmp_path, capsys, f"run_dir={run_dir}")[0] == 0
    run = json.loads((run_dir / "run.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{12}", run["run_id"]) and run["identity"]["model.d_model"] == 64
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    code, err = _cli_train(tmp_path, capsys, f"run_dir={run_dir}", "model.d_model=32")
    lines = [x for x in err.splitlines() if x.startswith("maxtrain: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"run_dir {run_dir} holds run {run['run_id']}" in lines[0] and "model.d_model 64 -> 32" in lines[0]
    assert "{run_id}" in lines[0]  # how to get a fresh directory
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before  # nothing written

    code, _ = _cli_train(tmp_path, capsys, f"run_dir={run_dir}", "seed=7")  # another seed: another run too
    assert code == 2
    # the same model and seed is the same run: it appends, under the same id (train.steps may change)
    assert _cli_train(tmp_path, capsys, f"run_dir={run_dir}", "train.steps=3")[0] == 0
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == run["run_id"]
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 1, 2, 3]


def test_a_run_dir_of_an_earlier_version_is_recognised_by_its_config(tmp_path, capsys):
    run_dir = tmp_path / "old"
    assert _cli_train(tmp_path, capsys, f"run_dir={run_dir}")[0] == 0
    (run_dir / "run.json").unlink()  # as written before run.json existed
    code, err = _cli_train(tmp_path, capsys, f"run_dir={run_dir}", "model.n_layers=1")
    assert code == 2 and "holds another run" in err and "model.n_layers 2 -> 1" in err


def test_run_dir_placeholders_give_each_start_a_fresh_directory(tmp_path, capsys):
    pattern = str(tmp_path / "r-{run_id}-{timestamp}")
    assert _cli_train(tmp_path, capsys, f"run_dir={pattern}")[0] == 0
    assert _cli_train(tmp_path, capsys, f"run_dir={pattern}", "model.d_model=32")[0] == 0
    made = sorted(tmp_path.glob("r-*"))
    assert len(made) == 2
    for d in made:
        run_id = json.loads((d / "run.json").read_text())["run_id"]
        assert re.fullmatch(rf"r-{run_id}-\d{{8}}-\d{{6}}", d.name)
        assert load_config(d / "config.yaml").run_dir == str(d)  # the resolved path, not the pattern
    assert cli.main(["report", "--text", *map(str, made)]) == 0
    out = capsys.readouterr().out
    assert all(json.loads((d / "run.json").read_text())["run_id"] in out for d in made)  # the report names them
    assert _cli_train(tmp_path, capsys, f"run_dir={tmp_path / 'x-{nope}'}")[0] == 2


# Which keys make a run directory "another run". Oracle: the documented rule (maxtrain/rundir.py's
# docstring, docs/config.md's `run_dir` row): the model section and the seed identify a run, except the
# model keys that only choose how the same model is computed; data, optimizer, mesh, checkpoint and
# cadence settings may change between attempts. The model keys come from the public config schema
# (dataclasses.fields of ModelConfig and its nested sections), not from rundir's own lists.
HOW_COMPUTED_KEYS = {"model.attention", "model.ring_layout", "model.remat", "model.fused_norm"}


def _schema_leaves(cls, prefix):
    """Every leaf key of a config dataclass, nested sections (also optional ones) expanded."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.metadata.get('key', f.name)}"
        nested = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if dataclasses.is_dataclass(t)]
        out += _schema_leaves(nested[0], key) if nested else [key]
    return out


def _full_model_config():
    """tiny.yaml as a DeepSeek config dict (the family with the most model keys) with every optional
    model section filled in (MoE, MLA, MTP, RoPE scaling at their defaults) and a custom model
    setting, so every model key has a value to change."""
    import dataclasses
    import typing

    from maxtrain.config import to_dict
    from maxtrain.models.deepseek.config import DeepSeekConfig

    config = to_dict(load_config(TINY))
    config["model"]["name"] = "deepseek"
    hints = typing.get_type_hints(DeepSeekConfig)
    for f in dataclasses.fields(DeepSeekConfig):
        config["model"].setdefault(f.name, None)
        nested = [t for t in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(t)]
        if nested and config["model"][f.name] is None:
            config["model"][f.name] = to_dict(nested[0]())
    config["model"]["extra"] = {"custom_knob": 3}
    return config


def _leaves(value, prefix=""):
    if isinstance(value, dict) and value:
        return [k for name, v in value.items() for k in _leaves(v, f"{prefix}.{name}" if prefix else name)]
    return [prefix]


def _changed(config, key):
    """`config` (a deep copy) with the value at dotted `key` replaced by a different one of its kind."""
    import copy

    out = copy.deepcopy(config)
    *parents, last = key.split(".")
    node = out
    for p in parents:
        node = node[p]
    v = node[last]
    if isinstance(v, bool):
        new = not v
    elif isinstance(v, (int, float)):
        new = v * 2 + 1
    elif isinstance(v, str):
        new = v + "_other"
    elif isinstance(v, list):
        new = v + ["other"]
    elif isinstance(v, dict):
        new = {**v, "other": 1}
    else:
        new = 7  # None: a value set
    node[last] = new
    return out


def test_every_model_key_and_the_seed_identify_a_run_and_nothing_else_does(tmp_path):
    from maxtrain import rundir
    from maxtrain.models.deepseek.config import DeepSeekConfig

    base = _full_model_config()
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    rundir.write(run_dir, rundir.claim(run_dir, base, "0123456789ab", 1.0))
    assert rundir.claim(run_dir, base, "ffffffffffff", 2.0)["run_id"] == "0123456789ab"  # the same run

    model_keys = _schema_leaves(DeepSeekConfig, "model")
    assert {"model.norm_eps", "model.moe.top_k", "model.mla.kv_lora_rank", "model.mtp.depth",
            "model.rope_scaling.factor", "model.extra", *HOW_COMPUTED_KEYS} <= set(model_keys)
    model_keys = [k for k in model_keys if k != "model.extra"] + ["model.extra.custom_knob", "model.extra"]
    others = _leaves({s: v for s, v in base.items() if s not in ("model", "seed")})
    assert {"optim.lr", "train.steps", "data.path", "mesh.fsdp", "checkpoint.every",
            "checkpoint.local.dir"} <= set(others)
    wrong = []
    for key in model_keys + ["seed"] + others:
        another = key.startswith(("model.", "seed")) and key not in HOW_COMPUTED_KEYS
        try:
            run = rundir.claim(run_dir, _changed(base, key), "ffffffffffff", 2.0)
        except ConfigError as e:
            if not another:
                wrong.append(f"{key}: refused ({e})")
            elif "of another model or seed" not in str(e) or not re.search(rf"\({re.escape(key)}[ .]", str(e)):
                wrong.append(f"{key}: refused without naming it ({e})")
            continue
        if another:
            wrong.append(f"{key}: accepted as the same run")
        elif run["run_id"] != "0123456789ab":
            wrong.append(f"{key}: accepted under a new run id {run['run_id']}")
    assert not wrong, "\n".join(wrong)


def test_turning_a_model_section_on_or_off_is_another_run(tmp_path):
    """MoE, MLA, MTP or RoPE scaling switched on (null -> a section) or off: another model."""
    from maxtrain import rundir

    full = _full_model_config()
    dense = json.loads(json.dumps(full))
    for section in ("moe", "mla", "mtp", "rope_scaling"):
        dense["model"][section] = None
    for name, (first, then) in {"on": (dense, full), "off": (full, dense)}.items():
        run_dir = str(tmp_path / name)
        os.makedirs(run_dir)
        rundir.write(run_dir, rundir.claim(run_dir, first, "0123456789ab", 1.0))
        for section in ("moe", "mla", "mtp", "rope_scaling"):
            changed = json.loads(json.dumps(first))
            changed["model"][section] = then["model"][section]
            with pytest.raises(ConfigError, match=f"of another model or seed .*model.{section}"):
                rundir.claim(run_dir, changed, "ffffffffffff", 2.0)
