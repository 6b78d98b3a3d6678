"""The compiled train step as data, without running it: what `maxtrain inspect` and
`bench/step.py` print (parameters, memory, FLOPs, collectives, activation shardings, custom calls,
the roofline on a GPU)."""

from __future__ import annotations

import dataclasses

import jax

from maxtrain import sharding
from maxtrain.analysis.hlo import Module, collective_stats, custom_call_counts, gpu_roofline, parse
from maxtrain.config import Config
from maxtrain.models.stack import pipeline_table, scheduled
from maxtrain.parallel import schedules
from maxtrain.mesh import use_mesh
from maxtrain.metrics import memory_breakdown, xla_flops
from maxtrain.targets import device_memory
from maxtrain.step import Setup, compile_train_step, pipeline_summary, make_setup, trace_train_step


def inspect_step(cfg: Config, devices=None) -> dict:
    """Compiles the sharded train step without running it: parameters, memory, FLOPs, collectives,
    and the activation shardings the model asks for (`sharding.activation_constraints`)."""
    setup = make_setup(cfg, devices)
    with use_mesh(setup.mesh):
        traced = trace_train_step(setup)
        compiled, compile_s = compile_train_step(setup, traced)
    per_device_flops = xla_flops(compiled)
    hlo = parse(compiled.as_text())  # once, for the three readings below
    if scheduled(cfg):  # the schedule's switch runs one branch per tick and stage, not all six
        shares = schedules.lower(pipeline_table(cfg)).branch_shares()
        hlo = dataclasses.replace(hlo, branch_shares={len(shares): shares})
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
        "roofline": step_roofline(hlo, setup, cfg),
        "pipeline_bubble": None if pipe is None else pipe["bubble"],
        "pipeline": pipe,
    }


def step_roofline(hlo: str | Module, setup: Setup, cfg: Config) -> dict | None:
    """The compiled step at its GPU's speed of light (`maxtrain.analysis.hlo.roofline`), None off GPUs."""
    roof = gpu_roofline(hlo, setup.mesh.devices.flat[0].device_kind, peak_tflops=cfg.train.peak_tflops,
                        devices_per_host=min(8, setup.mesh.size))
    return None if roof is None else roof.summary(setup.flops_per_step / setup.mesh.size)
