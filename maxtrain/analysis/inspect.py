"""The compiled train step as data, without running it: what `maxtrain inspect` and
`bench/step.py` print (parameters, memory, FLOPs, collectives, activation shardings, custom calls,
on a GPU the roofline and the schedule model's step)."""

from __future__ import annotations

import dataclasses

import jax

from maxtrain import sharding
from maxtrain.analysis.hlo import Module, collective_stats, custom_call_counts, gpu_roofline, parse
from maxtrain.analysis.schedule import predict
from maxtrain.devices import device_figures
from maxtrain.config import Config
from maxtrain.models.stack import pipeline_table, scheduled
from maxtrain.parallel import schedules
from maxtrain.mesh import use_mesh
from maxtrain.metrics import memory_breakdown, xla_flops
from maxtrain.targets import device_memory
from maxtrain.step import (Setup, compile_train_step, make_setup, pipeline_summary, step_compiler_options,
                           trace_train_step)


def inspect_step(cfg: Config, devices=None) -> dict:
    """Compiles the sharded train step without running it: parameters, memory, FLOPs, collectives,
    and the activation shardings the model asks for (`sharding.activation_constraints`)."""
    setup = make_setup(cfg, devices)
    with use_mesh(setup.mesh):
        traced = trace_train_step(setup)
        compiled, compile_s = compile_train_step(setup, traced)
    per_device_flops = xla_flops(compiled)
    hlo = step_hlo(compiled.as_text(), cfg)  # once, for the readings below
    pipe = pipeline_summary(cfg)
    return {
        "params": int(sum(x.size for x in jax.tree.leaves(setup.abstract_state.params))),
        "mesh": {k: int(v) for k, v in setup.mesh.shape.items()},
        "devices": int(setup.mesh.size),
        "device_kind": setup.mesh.devices.flat[0].device_kind,
        "device_memory": device_memory(setup.mesh.devices.flat[0]),
        "compile_s": compile_s,
        "memory_per_device": memory_breakdown(compiled),
        "model_flops_per_step": setup.flops_per_step,
        "xla_flops_per_device": per_device_flops,
        "collectives": collective_stats(hlo),
        "activation_shardings": sharding.activation_constraints(traced.jaxpr, dict(setup.mesh.shape)),
        "custom_calls": custom_call_counts(hlo),
        "attention": cfg.model.attention if cfg.model.attention != "auto" else
        f"{setup.cfg.model.attention} (auto: {attention_reason(setup)})",
        "compiler_options": step_compiler_options(setup.cfg, setup.mesh.devices.flat[0].platform),
        **step_performance(hlo, setup, cfg),
        "pipeline_bubble": None if pipe is None else pipe["bubble"],
        "pipeline": pipe,
    }


def step_hlo(text: str, cfg: Config) -> Module:
    """The compiled step's HLO as data; a scheduled pipeline's switch runs one branch per tick and
    stage, not all six (`Module.branch_shares`)."""
    hlo = parse(text)
    if scheduled(cfg):
        shares = schedules.lower(pipeline_table(cfg)).branch_shares()
        hlo = dataclasses.replace(hlo, branch_shares={len(shares): shares})
    return hlo


def step_roofline(hlo: str | Module, setup: Setup, cfg: Config) -> dict | None:
    """The compiled step at its GPU's speed of light (`maxtrain.analysis.hlo.roofline`), None off GPUs."""
    return step_performance(hlo, setup, cfg)["roofline"]


def step_performance(hlo: str | Module, setup: Setup, cfg: Config) -> dict:
    """`roofline`: the compiled step at its GPU's speed of light (`maxtrain.analysis.hlo.roofline`, a
    bound); `schedule`: the schedule model's step, exposed communication and MFU
    (`maxtrain.analysis.schedule.predict`, a prediction). Both None off GPUs."""
    hlo = step_hlo(hlo, cfg) if isinstance(hlo, str) else hlo
    kind = setup.mesh.devices.flat[0].device_kind
    per_host = min(8, setup.mesh.size)
    roof = gpu_roofline(hlo, kind, peak_tflops=cfg.train.peak_tflops, devices_per_host=per_host)
    if roof is None:
        return {"roofline": None, "schedule": None}
    device = device_figures(kind)
    model_flops = setup.flops_per_step / setup.mesh.size
    prediction = predict(hlo, roof, devices_per_host=per_host, link_latency_s=device.link_latency_s,
                         network_latency_s=device.network_latency_s)
    return {"roofline": roof.summary(model_flops), "schedule": prediction.summary(model_flops)}


def attention_reason(setup: Setup) -> str:
    """Why `model.attention: auto` chose what `setup` runs (`auto_attention`, asked again on its mesh)."""
    from maxtrain.config import axes_size
    from maxtrain.layers.attention import auto_attention

    qk, v = setup.cfg.model.attention_head_dims()
    with use_mesh(setup.mesh):
        return auto_attention(qk, v, axes_size(setup.cfg.sharding.activations.get("block_length"),
                                               dict(setup.mesh.shape)))[1]
