"""The run's records: each logged step's metrics (read one step late, so the host never waits on
the device), evaluations and samples in the same record, written to metrics.jsonl, TensorBoard or
W&B, the log line and the progress bar."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from maxtrain.config import to_dict
from maxtrain.metrics import MetricsSink, Progress, TimeBreakdown, format_line, peak_tflops, throughput
from maxtrain.run.context import Callback, Run, StepInfo, is_eval_step, is_log_step, is_sample_step
from maxtrain.step import evaluate, make_eval_step, pipeline_bubble

if TYPE_CHECKING:
    from maxtrain.run.checks import Stragglers

log = logging.getLogger("maxtrain")


def _number_or_list(v):
    """A metric for metrics.jsonl: a float, or a list of floats for a per-layer vector."""
    a = np.asarray(v)
    return float(a) if a.ndim == 0 else [round(float(x), 6) for x in a.reshape(-1)]


class Metrics(Callback):
    """Metric records: read one step late (the host never waits on the device), written to
    metrics.jsonl, TensorBoard/W&B, the log line and the progress bar; evaluations and stops
    are read at once, with nothing to overlap."""

    def __init__(self, run: Run, stragglers: "Stragglers", evaluation: "Evaluation | None", sampler=None):
        cfg = run.cfg
        self.stragglers, self.evaluation, self.sampler = stragglers, evaluation, sampler
        self.peak = peak_tflops(jax.devices()[0].device_kind, cfg.train.peak_tflops)
        self.bubble = pipeline_bubble(cfg)
        lg = cfg.logging
        self.sink = MetricsSink(cfg.run_dir, lg.tensorboard, lg.wandb, lg.wandb_project, to_dict(cfg),
                                run_id=run.run_id) if run.is_main else None
        self.progress = Progress(cfg.train.steps) if run.is_main else None
        self.breakdown = TimeBreakdown(run.first, lg.breakdown_every)
        self.late: tuple[int, dict] | None = None
        self.epochs: list[int] | None = None  # each mixture source's epoch at the last record

    def after_step(self, run, info):
        if self.late is not None:  # the previous logged step, read now that this one is queued behind it
            self.record(run, *self.late)
            self.late = None
        return None

    def log_now_or_late(self, run: Run, info: StepInfo) -> None:
        """The second half of a step's metrics work, after the saves (see `default_callbacks`)."""
        if not is_log_step(run.cfg, info, run.first):
            return
        evaluate_now = self.evaluation is not None and (is_eval_step(run.cfg, info.step) or
                                                          (info.final and run.cfg.train.eval_every > 0))
        sample_now = self.sampler is not None and is_sample_step(run.cfg, info.step)
        if evaluate_now or sample_now or info.stopping or info.final:  # these read this step's params
            self.record(run, info.step, info.metrics, info.state.params if evaluate_now or sample_now else None)
        else:
            self.late = (info.step, _copy_to_host_async(info.metrics))

    def on_end(self, run, info):
        if self.late is not None:
            self.record(run, *self.late)
            self.late = None

    def record(self, run: Run, step: int, metrics: dict, params=None) -> None:
        """Reads step `step`'s metrics (waiting for the device to finish it) and writes its record."""
        cfg, setup, clock = run.cfg, run.setup, run.clock
        jax.block_until_ready(metrics)  # time waited here is the jitted step, not host overhead
        now = time.perf_counter()
        metrics = jax.device_get(metrics)
        guard = metrics.pop("guard", None)  # None: no guard is on
        if guard is not None:
            run.guard.read(run, guard)  # may halt
        timing = clock.interval(step, now)
        record = {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                  "lr": float(metrics["lr"]),
                  **throughput(timing.pop("step_time_s"), setup.tokens_per_step, setup.flops_per_step,
                               setup.mesh.size, self.peak), **timing}
        host = time.perf_counter() - now
        if guard is not None and guard["skipped"]:
            record["skipped_updates"] = float(guard["skipped"])
        if self.stragglers.watch.last:  # from the latest cross-process comparison
            record["stragglers"] = list(self.stragglers.watch.last)
        if self.stragglers.watch.slow_compute:
            record["stragglers_compute"] = list(self.stragglers.watch.slow_compute)
        if run.mixture is not None:
            record["tokens_per_source"] = run.mixture.tokens_seen(step)
            self._note_epochs(run, step)
        if params is not None and self.evaluation is not None and (is_eval_step(cfg, step) or step == run.last):
            record.update(self.evaluation.run(run, params))
        if params is not None and self.sampler is not None and is_sample_step(cfg, step):
            record["sample"] = self._sample(run, step, params)
        if cfg.train.z_loss:
            record["z_loss"] = float(metrics["z_loss"])
        record.update({k: _number_or_list(v) for k, v in metrics.items() if k.startswith(("moe_", "mtp_", "fp8_"))})
        if self.bubble is not None:
            record["pipeline_bubble"] = self.bubble
        if not np.isfinite(record["loss"]):
            log.warning("loss is %s at step %d", record["loss"], step)
        run.history.append(record)
        t_write = time.perf_counter()
        if self.sink:
            run.goodput.write(step, final=False)  # an attempt that dies later still leaves its account
            self.sink.write(record)
            self.progress.clear()
            times = self.breakdown.add(record)
            log.info(format_line(record, cfg.train.steps) + (f" | {times}" if times else ""))
            self.progress.update(step, record["loss"])
        clock.host += host + time.perf_counter() - t_write  # counts in the next record's interval

    def _note_epochs(self, run: Run, step: int) -> None:
        """Logs each mixture source that started another pass over its data since the last record."""
        now = run.mixture.epochs(step)
        before = self.epochs if self.epochs is not None else run.mixture.epochs(run.first)
        for name, a, b in zip(run.mixture.names(), before, now):
            if b > a and run.is_main:
                log.info("data: source %s ran out and started epoch %d (by step %d)", name, b + 1, step)
        self.epochs = now

    def _sample(self, run: Run, step: int, params) -> str:
        """`train.sample_every`'s text, timed as evaluation (not step time)."""
        t0 = time.perf_counter()
        with run.watchdog.long_work():  # the first sample compiles the decoder
            text = self.sampler.run(params)
        run.goodput.add("eval", time.perf_counter() - t0)
        run.clock.restart()
        if run.is_main:
            log.info("sample at step %d: %r", step, text)
        return text

    def close(self, run, failed):
        if self.sink:
            self.sink.close()
            self.progress.close()


class LogNow(Callback):
    """The metrics callback's place after the saves: what it logs must not wait on a save."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def after_step(self, run, info):
        self.metrics.log_now_or_late(run, info)


class Evaluation:
    """Mean loss over `train.eval_steps` batches of the eval data, at `is_eval_step` steps (run
    from the metrics record of that step, so it lands in the same record)."""

    def __init__(self, run: Run, source):
        self.source, self.fn = source, make_eval_step(run.setup)

    def run(self, run: Run, params) -> dict:
        t_eval = time.perf_counter()
        with run.watchdog.long_work():  # the first evaluation also compiles its step
            out = evaluate(run.setup, self.fn, params, self.source, *run.rows)
        run.goodput.add("eval", time.perf_counter() - t_eval)
        run.clock.restart()  # evaluation time is not training step time
        return out


def _copy_to_host_async(metrics: dict) -> dict:
    """Starts each metric's device-to-host copy, to happen as soon as the step produces it."""
    for x in jax.tree.leaves(metrics):
        x.copy_to_host_async()
    return metrics
