"""Layered models: a family written as embed -> a stack of layers -> final, and the trainer's code
that runs the stack, so the family itself holds no parallel wiring.

A layered family is five pure functions of its parameters, its model config `m` (`cfg.model`) and
a `Runtime` (compute dtype, sharding rules, training length), never the whole `Config`:

- `param_specs(m, rt) -> dict` of `ParamSpec`s, the stacked layers under `"layers"` (every leaf
  `[N, ...]`, one entry per element of the stack);
- `embed(params, batch, m, rt) -> (x [B, L, D], rows)`: `rows` is a dict of per-row arrays `[B, ...]`
  the layers need (positions, segment ids);
- `layer(x, layer_params, rows, m, rt) -> (x, stats)`: one element of the stack; `stats` a pytree
  of scalars (e.g. MoE routing statistics) or None;
- `final(params, x, stats, m, rt) -> (hidden [B, L, D], aux)`: `stats` averaged over the stack;
  `aux` may hold a `"loss"` added to the objective and `"metrics"`; a `final` with a `batch`
  keyword also gets the batch (targets, mask: e.g. for multi-token prediction losses);
- `head(params, m, rt) -> [D, V]`, the output projection;
- optionally `balance(params, load, m) -> params`, run after every optimizer step for a family with
  MoE layers whose routing state is not learned (`ParamSpec(learned=False)`, e.g. DeepSeek-V3's
  balancing bias): `load` `[stack, E]` is each layer's share of the step's assignments per expert
  (the layers' `moe_load` statistic).

Params reach them cast to the compute dtype. This module runs the stack: `lax.scan` under the
`model.remat` policy, or, with `mesh.pipeline > 1`, the layers reshaped into stages
(`parallel.pipeline.stage_specs`) and run by the pipeline schedule. Any family registered this
way trains with every parallelism and with the fused losses.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from maxtrain.config import Config, pipeline_microbatches
from maxtrain.kernels.residuals import RESIDUAL_NAMES
from maxtrain.layers.fp8 import Fp8Runtime
from maxtrain.models.specs import axes_from_specs, init_from_specs, learned_from_specs
from maxtrain.loss import hidden_loss
from maxtrain.parallel import pipeline, schedules
from maxtrain.sharding import constrain


@dataclass(frozen=True)
class Runtime:
    """What a model function gets beside its parameters and model config."""
    dtype: Any  # the compute dtype: params arrive cast to it
    rules: dict  # activation sharding rules: logical axis -> mesh axes (`sharding.constrain`)
    param_rules: dict  # parameter sharding rules (for a model that gathers a table itself)
    seq_len: int  # the training length (`train.seq_len`)
    fp8: Fp8Runtime | None = None  # `train.fp8`: FP8 projections (maxtrain.layers.fp8); None: off


def runtime(cfg: Config) -> Runtime:
    f = cfg.train.fp8
    fp8 = None if f.recipe == "none" else Fp8Runtime(f.recipe, f.amax_history, f.all_gather)
    return Runtime(jnp.dtype(cfg.train.dtype), cfg.sharding.activations, cfg.sharding.params, cfg.train.seq_len, fp8)


FP8_KEY = "fp8"  # under "layers": a family's FP8 meta (probes, amax histories), not parameters


def _split_fp8(specs: dict) -> tuple[dict, Any]:
    """The specs without the layers' FP8 meta, and the meta's specs (None without FP8)."""
    layers = dict(specs["layers"])
    meta = layers.pop(FP8_KEY, None)
    return {**specs, "layers": layers}, meta


@dataclass(frozen=True)
class Layered:
    """A layered family's own functions (see the module docstring)."""
    param_specs: Callable
    embed: Callable
    layer: Callable
    final: Callable
    head: Callable
    flops_per_token: Callable[[Any, int], float] | None = None
    balance: Callable | None = None

    def run_final(self, params, x, stats, m, rt, batch: dict | None):
        """`final`, given the batch when it takes one."""
        if "batch" in inspect.signature(self.final).parameters:
            return self.final(params, x, stats, m, rt, batch=batch)
        return self.final(params, x, stats, m, rt)


REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    # keep the projection outputs and the flash kernels' output and log-sum-exp: the backward then
    # recomputes pointwise work (norms, RoPE, SwiGLU) but not the attention forward
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES)),
}


def remat(fn, policy: str):
    """`fn` under `model.remat`: none, full, or save_dots."""
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[policy], prevent_cse=False)


def param_specs(parts: Layered, cfg: Config) -> dict:
    """The family's specs, its stacked layers cut into pipeline stages when `mesh.pipeline > 1`."""
    specs = parts.param_specs(cfg.model, runtime(cfg))
    if "layers" not in specs:
        raise ValueError(f"model {cfg.model.name!r}: param_specs must put the stacked layers under 'layers'")
    if cfg.mesh.pipeline > 1:
        specs["layers"] = pipeline.stage_specs(specs["layers"], cfg.mesh.pipeline, cfg.train.pipeline_repeats)
    return specs


def init(parts: Layered, cfg: Config, key: jax.Array):
    return init_from_specs(_split_fp8(param_specs(parts, cfg))[0], key, jnp.dtype(cfg.train.param_dtype))


def logical_axes(parts: Layered, cfg: Config):
    return axes_from_specs(_split_fp8(param_specs(parts, cfg))[0])


def learned(parts: Layered, cfg: Config):
    """Whether the optimizer updates each parameter (`ParamSpec.learned`), a tree like the params."""
    return learned_from_specs(_split_fp8(param_specs(parts, cfg))[0])


def fp8_specs(parts: Layered, cfg: Config):
    """The specs of the layers' FP8 meta (`train.fp8`), stacked like the layers: per projection a
    `probe` (zeros each step; its gradient carries the statistics) and, for the delayed recipe, a
    `history` of amaxes (train state). None when FP8 is off."""
    return _split_fp8(param_specs(parts, cfg))[1]


def with_layer_meta(params, meta):
    """`params` with the layers' precision meta (FP8: `fp8_specs`) beside the layer weights, as `layer`
    gets it."""
    if meta is None:
        return params
    return {**params, "layers": {**params["layers"], FP8_KEY: meta}}


PER_LAYER = "_per_layer"  # a stats entry's suffix for its value at every element of the stack


def run_layers(parts: Layered, x_BLD, layers, rows: dict, m, rt: Runtime, per_layer: bool = False):
    """The stack (leaves `[n, ...]`) under `lax.scan` and the remat policy; stats averaged over it,
    and with `per_layer` also each stat's `[n]` values as `NAME_per_layer` (e.g. the expert load of
    every MoE layer)."""
    def body(x, layer_params):
        return parts.layer(x, layer_params, rows, m, rt)

    x_BLD, stats = jax.lax.scan(remat(body, m.remat), x_BLD, layers)
    if stats is None:
        return x_BLD, None
    means = jax.tree.map(jnp.mean, stats)
    if per_layer and isinstance(stats, dict):
        means.update({k + PER_LAYER: v for k, v in stats.items()})
    return x_BLD, means


def _compute_copy(parts: Layered, params, cfg: Config, rt: Runtime):
    """The params cast to the compute dtype (the float32 masters stay outside); FP8 meta as it is.

    A cast copy keeps its parameter's sharding: FSDP then gathers the copy, in the compute dtype
    (bf16: half the bytes moved and held), not the float32 master to cast whole after the gather,
    which is where XLA's sharding propagation puts the cast otherwise."""
    params, meta = _split_fp8(params)
    cast = jax.tree.map(lambda p: p.astype(rt.dtype), params)
    masters = jax.tree.leaves(params)
    if all(p.dtype == rt.dtype for p in masters):
        return with_layer_meta(cast, meta)
    leaves, treedef = jax.tree.flatten(cast)
    axes = treedef.flatten_up_to(logical_axes(parts, cfg))
    kept = [c if m.dtype == rt.dtype else constrain(c, a, rt.param_rules) for c, m, a in zip(leaves, masters, axes)]
    return with_layer_meta(jax.tree.unflatten(treedef, kept), meta)


def features(parts: Layered, params, batch: dict, cfg: Config):
    """The final hidden states `[B, L, D]` and aux of a layered family, its stack run by the trainer."""
    m, rt = cfg.model, runtime(cfg)
    params = _compute_copy(parts, params, cfg, rt)
    x_BLD, rows = parts.embed(params, batch, m, rt)
    if cfg.mesh.pipeline > 1:
        # inside the stages `pipeline` is a manual axis, not a sharding: drop it from the rules; a
        # stage sees only its chunks, so the statistics stay means over the stack (no per-layer values)
        inner = dataclasses.replace(rt, rules=pipeline.without_axis(rt.rules, "pipeline"))
        x_BLD, stats = pipeline.pipeline_layers(
            lambda x, chunk, rows: run_layers(parts, x, chunk, rows, m, inner), x_BLD, params["layers"], rows,
            stages=cfg.mesh.pipeline, repeats=cfg.train.pipeline_repeats, microbatches=pipeline_microbatches(cfg),
            remat_stage=cfg.train.pipeline_remat)
        x_BLD = constrain(x_BLD, ("batch", "length", "embed"), rt.rules)
    else:
        x_BLD, stats = run_layers(parts, x_BLD, params["layers"], rows, m, rt, per_layer=True)
    return parts.run_final(params, x_BLD, stats, m, rt, batch)


def scheduled(cfg: Config) -> bool:
    """Whether training runs the layers through a hand-scheduled pipeline (`train.pipeline_schedule`
    other than gpipe, whose backward is autodiff's transpose of the forward scan)."""
    return cfg.mesh.pipeline > 1 and cfg.train.pipeline_schedule != "gpipe"


def pipeline_table(cfg: Config) -> schedules.Table:
    """`train.pipeline_schedule`'s table for this run: aligned (`schedules.make_table`) when the
    stages are sequence-parallel (`mesh.sequence` other than 1): attention split along the length
    puts collective-permutes inside a stage's operation, which need every device in the same
    branch. (Activations split along the length over `tensor`, Megatron's sequence parallelism,
    gather the length for attention and need no alignment.)"""
    return schedules.make_table(cfg.train.pipeline_schedule, cfg.mesh.pipeline, pipeline_microbatches(cfg),
                                cfg.train.pipeline_repeats, aligned=scheduled(cfg) and cfg.mesh.sequence != 1)


def scheduled_loss(parts: Layered, params, batch: dict, cfg: Config, objective):
    """`(total, stats)` of a layered family on `batch` through the scheduled pipeline, differentiable
    (`pipeline.scheduled_loss`): the embedding here, every microbatch's layers and loss inside the
    schedule. `objective(total, stats, aux) -> (total, stats)` adds the model's own losses (MoE
    balance) and metrics to a microbatch's cross-entropy sums."""
    m, rt = cfg.model, runtime(cfg)
    params = _compute_copy(parts, params, cfg, rt)
    x_BLD, rows = parts.embed(params, batch, m, rt)
    inner = dataclasses.replace(rt, rules=pipeline.without_axis(rt.rules, "pipeline"))
    param_rules = pipeline.without_axis(cfg.sharding.params, "pipeline")
    M = pipeline_microbatches(cfg)
    table = pipeline_table(cfg)

    def stack_fn(x, chunk, rows):
        return run_layers(parts, x, chunk, rows, m, inner)

    if cfg.train.pipeline_remat:
        stack_fn = jax.checkpoint(stack_fn, prevent_cse=False)

    def tail_fn(tail_params, y, stats, batch):
        h, aux = parts.run_final(tail_params, y, stats, m, inner, batch)
        total, loss_stats = hidden_loss(h, parts.head(tail_params, m, inner), batch, cfg.train, inner.rules,
                                        param_rules, cfg.train.z_loss)
        return objective(total, loss_stats, aux)

    tail_params = {k: v for k, v in params.items() if k != "layers"}
    split = lambda tree: jax.tree.map(lambda a: pipeline.split_microbatches(a, M), tree)  # noqa: E731
    return pipeline.scheduled_loss(stack_fn, tail_fn, params["layers"], tail_params, split(x_BLD), split(rows),
                                   split(batch), schedules.lower(table))


def head(parts: Layered, params, cfg: Config) -> jax.Array:
    rt = runtime(cfg)
    return parts.head(_compute_copy(parts, params, cfg, rt), cfg.model, rt)


def apply(parts: Layered, params, batch: dict, cfg: Config):
    """Logits `[B, L, V]` in float32, and aux."""
    x_BLD, aux = features(parts, params, batch, cfg)
    logits = jnp.einsum("bld,dv->blv", x_BLD, head(parts, params, cfg), preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "block_length", "vocab"), cfg.sharding.activations), aux
