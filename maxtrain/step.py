"""The pure training step: the train state, what the config and devices make of it (`Setup`),
its initialisation, the jitted train and eval steps, and their ahead-of-time compilation.

Nothing here knows about a run: no run directory, no checkpoints, no loop (those are
`maxtrain.run`). Given a config and devices, `make_setup` derives the mesh, optimizer, abstract
state and shardings; `init_state` makes the state in its shardings; `make_train_step` is the pure
`(state, batch) -> (state, metrics)` function that `compile_train_step` compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from maxtrain import models, optim, reliability, sharding
from maxtrain.config import Config, ConfigError, axes_size, validate_for_mesh
from maxtrain.data import HostRows
from maxtrain.layers import precision
from maxtrain.layers.attention import AUTO, auto_attention, get_attention
from maxtrain.loss import check_mesh as check_loss_mesh, chosen_impl, model_loss
from maxtrain.mesh import build_mesh, mesh_sizes, use_mesh
from maxtrain.parallel import schedules
from maxtrain.parallel.ring_attention import from_ring_layout, ring_layout_shards, to_ring_layout
from maxtrain.reliability import drills
from maxtrain.targets import device_memory

log = logging.getLogger("maxtrain")

BATCH_AXES = ("batch", "length")  # every batch array is [batch, length]
# XLA options the train step compiles with. The GPU compiler of jax >= 0.11 fuses a custom call
# whose result a scanned layer stacks as a residual into a `dynamic-slice-fusion`, and clones the
# call to do it: our flash kernels ran their forward twice per layer (the 1B step on an H200 lost
# 43 ms, 6%). Without the fusion the result is stacked by one copy (a few hundred microseconds).
STEP_COMPILER_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": False}
# On GPUs (`train.gpu_overlap`, on by default): what makes XLA hide the FSDP all-gathers and
# reduce-scatters, the tensor-parallel all-reduces and the gradient all-reduces behind the layers'
# compute. Chosen by the exposed communication of the compiled schedules (`maxtrain.analysis.schedule`;
# per flag, with and without, in docs/performance.md#overlap).
GPU_OVERLAP_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,  # schedule collectives as early/late as their data allows
    # move the next layer's all-gather and the previous layer's reduce-scatter / all-reduce out of
    # the scanned layer's critical path, into the loop iteration before / after
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    # fewer, larger collectives outside the layer loop (the optimizer's, the embedding's)
    "xla_gpu_all_gather_combine_threshold_bytes": 128 * 2**20,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 64 * 2**20,
    "xla_gpu_all_reduce_combine_threshold_bytes": 128 * 2**20,
    # let the scheduler keep two collectives in flight, not one (an FSDP gather beside a
    # tensor-parallel one: 70B on 64 H100s, exposed 980 -> 861 ms)
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
}
# Not a default: unrolling the layer loop by two (`xla_gpu_enable_while_loop_unrolling=
# WHILE_LOOP_UNROLLING_DOUBLE_BUFFER`) saves the pipelined gathers' copies (8B on 8 H100s: -18 ms)
# but clones GEMMs whose outputs the backward keeps (remat=none: +17% on the 1B, +21% on the 8B).
_UNKNOWN_OPTION = re.compile(r"No such compile option: '([^']+)'")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["step", "params", "opt_state", "guard", "precision"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array  # completed optimizer steps
    params: Any
    opt_state: Any
    guard: Any = None  # numerical-guard statistics (reliability.init_guard) while a guard is on; not checkpointed
    # a precision recipe's state between steps, `{its checkpoint key: tree}` (`maxtrain.layers.precision`;
    # FP8 delayed scaling: the amax histories), saved with opt_state; None when the recipe keeps none
    precision: Any = None

    def apply_gradients(self, grads, tx: optax.GradientTransformation, precision=None, after=None) -> "TrainState":
        """The optimizer's update; `precision`: the recipe's state after this step (None: unchanged);
        `after(params) -> params`: the model's own update of what it does not learn (MoE balancing)."""
        updates, opt_state = tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        return dataclasses.replace(self, step=self.step + 1, params=params if after is None else after(params),
                                   opt_state=opt_state, precision=self.precision if precision is None else precision)

    def skipped(self) -> "TrainState":
        """This state one step on with nothing applied (a guarded step that was skipped)."""
        return dataclasses.replace(self, step=self.step + 1)

    @property
    def saved_opt_state(self):
        """What a checkpoint stores as `opt_state`: the optimizer's, and beside it, under its own
        key, the state of a precision recipe that keeps one (`with_saved_opt_state` reads it back)."""
        return self.opt_state if self.precision is None else {"optimizer": self.opt_state, **self.precision}


def with_saved_opt_state(step, params, saved, guard, with_precision: bool) -> TrainState:
    """A train state from a checkpoint's params and `opt_state` (`TrainState.saved_opt_state`);
    `with_precision`: the run's recipe keeps a state (saved beside the optimizer's)."""
    if with_precision:
        return TrainState(step, params, saved["optimizer"], guard, {k: v for k, v in saved.items() if k != "optimizer"})
    return TrainState(step, params, saved, guard)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything derived from the config and the devices before any array exists."""
    cfg: Config
    mesh: Mesh
    model: models.Model
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    abstract_state: TrainState
    state_shardings: TrainState
    batch_sharding: NamedSharding
    flops_per_step: float
    phase: tuple = ((), ())  # what optim.groups hold back in `tx` (`optim.phase`): see `at_step`

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.batch_size * self.cfg.train.seq_len


def make_setup(cfg: Config, devices=None, step: int = 0) -> Setup:
    """Validates the config against the devices and derives mesh, optimizer (for the update of step
    `step`: `at_step`) and shardings."""
    model = models.get(cfg.model.name)
    if cfg.train.cross_entropy not in ("xla", "auto") and model.features is None:
        raise ConfigError(f"train.cross_entropy={cfg.train.cross_entropy} needs model {model.name!r} to register "
                          "features= and head= (see maxtrain.models.register); use train.cross_entropy=xla")
    mesh = build_mesh(cfg.mesh, devices)
    sizes = mesh_sizes(mesh)
    with use_mesh(mesh):  # the implementation's check asks about the mesh's devices (maxtrain.targets)
        cfg = concrete_attention(cfg, sizes)
        get_attention(cfg.model.attention)
    precision.check(cfg, model, mesh.devices.flat[0])
    if sizes["pipeline"] > 1 and "pipeline" not in model.supports:
        raise ConfigError(f"mesh.pipeline={sizes['pipeline']} needs a model that splits its layers into stages, and "
                          f"model {model.name!r} is not registered with supports=('pipeline',); use mesh.pipeline=1")
    validate_for_mesh(cfg, sizes)
    check_loss_mesh(cfg, sizes)
    if cfg.train.cross_entropy == "auto":
        log.debug("train.cross_entropy=auto: %s", chosen_impl(cfg.train.cross_entropy, model.features is not None,
                                                             cfg.model.vocab_size, cfg.sharding.activations, sizes))
    axes = model.logical_axes(cfg)
    schedule = _shift_by_one(optim.make_schedule(cfg.optim, cfg.train.steps))
    param_shardings = sharding.tree_shardings(mesh, axes, cfg.sharding.params)
    batch_sharding = sharding.named_sharding(mesh, BATCH_AXES, cfg.sharding.activations)
    flops = models.flops_per_token(cfg, cfg.train.seq_len) * cfg.train.batch_size * cfg.train.seq_len
    setup = Setup(cfg, mesh, model, None, schedule, None, None, batch_sharding, flops)
    setup = _with_optimizer(setup, param_shardings, step)
    sharding.check_divisible(setup.abstract_state.params, axes, cfg.sharding.params, sizes, "params")
    return setup


def _with_optimizer(setup: Setup, param_shardings, step: int) -> Setup:
    """`setup` with the optimizer of step `step`'s phase (`optim.phase`), its abstract state and shardings."""
    cfg, model, mesh = setup.cfg, setup.model, setup.mesh
    axes = model.logical_axes(cfg)
    tx = optim.make_optimizer(cfg.optim, setup.schedule, axes, cfg.sharding.params,
                              None if model.learned is None else model.learned(cfg), step=step)
    abstract = jax.eval_shape(functools.partial(_init_state, cfg, model, tx), jax.random.key(0))
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = TrainState(
        step=replicated,
        params=param_shardings,
        opt_state=_opt_state_shardings(abstract.opt_state, param_shardings, mesh),
        guard=jax.tree.map(lambda _: replicated, abstract.guard),
        precision=jax.tree.map(lambda _: replicated, abstract.precision),
    )
    return dataclasses.replace(setup, tx=tx, abstract_state=abstract, state_shardings=shardings,
                               phase=optim.phase(cfg.optim.groups, step))


def at_step(setup: Setup, step: int) -> Setup:
    """The setup whose optimizer is the one for the update of step `step` (from 0): `setup` itself
    unless `optim.groups` change phase in between (a frozen group starts learning, a row mask ends)."""
    if optim.phase(setup.cfg.optim.groups, step) == setup.phase:
        return setup
    return _with_optimizer(setup, setup.state_shardings.params, step)


def conform_state(setup: Setup, state: TrainState) -> TrainState:
    """`state` with its optimizer state in `setup`'s layout: unchanged when it is already, else the
    moments it holds carried over and the rest freshly initialised (`optim.carry_over`): a group
    that starts learning gets its moments only now."""
    if jax.tree.structure(state.opt_state) == jax.tree.structure(setup.abstract_state.opt_state):
        return state
    convert = jax.jit(lambda old, params: optim.carry_over(old, setup.tx.init(params)),
                      out_shardings=setup.state_shardings.opt_state, donate_argnums=0)
    return dataclasses.replace(state, opt_state=convert(state.opt_state, state.params))


def phase_steps(cfg: Config) -> list[int]:
    """The steps at which `optim.groups` change phase (a run rebuilds its optimizer there)."""
    g = cfg.optim.groups  # a change at or past train.steps is never reached
    steps = {int(x.get(k) or 0) for x in g for k in ("frozen_until", "rows_until")}
    return sorted(k for k in steps if 0 < k < cfg.train.steps)


def concrete_attention(cfg: Config, sizes: dict[str, int]) -> Config:
    """`cfg` with `model.attention: auto` replaced by what it runs on the mesh in context
    (`maxtrain.layers.attention.auto_attention`), logged; other choices as they are."""
    if cfg.model.attention != AUTO:
        return cfg
    qk, v = cfg.model.attention_head_dims()
    impl, why = auto_attention(qk, v, axes_size(cfg.sharding.activations.get("block_length"), sizes))
    log.info("model.attention=auto: %s (%s)", impl, why)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=impl))


def state_bytes_per_device(setup: Setup) -> tuple[int, int]:
    """(params, optimizer state) bytes one device holds: the shard of each leaf it gets."""
    def held(tree, shardings) -> int:
        return sum(math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                   for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))
    st, sh = setup.abstract_state, setup.state_shardings
    return held(st.params, sh.params), held(st.opt_state, sh.opt_state)


def memory_per_device(device) -> tuple[int | None, str]:
    """(bytes, where the figure comes from): the allocator's on a GPU; on CPU, the host's
    memory split over its devices (fake CPU devices share it); None when unknown."""
    limit = device_memory(device)
    if limit:
        return limit, f"{device.device_kind}'s allocator"
    if device.platform == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        n = len(jax.local_devices())
        return total // n, f"this host's {_gib(total)} of memory over {n} CPU device{'s' * (n > 1)}"
    return None, ""


def state_bytes_by_phase(setup: Setup) -> list[tuple[int, int, int]]:
    """(from step, params bytes, optimizer bytes) per device for each phase of `optim.groups` (one
    entry without phases): a frozen group holds no moments until it starts learning."""
    return [(k, *state_bytes_per_device(at_step(setup, k))) for k in [0, *phase_steps(setup.cfg)]]


def check_state_fits(setup: Setup) -> None:
    """Refuses, before anything is allocated, a train state larger than a device's memory (in its
    largest phase)."""
    _, params, opt = max(state_bytes_by_phase(setup), key=lambda p: p[1] + p[2])
    limit, where = memory_per_device(setup.mesh.devices.flat[0])
    if limit and params + opt > limit:
        raise ConfigError(f"the train state needs {_gib(params + opt)} per device (params {_gib(params)} + optimizer "
                          f"state {_gib(opt)}), more than the {_gib(limit)} a device has ({where}); shrink the model "
                          f"(model.*) or shard it over more devices (mesh.fsdp, mesh.tensor); `maxtrain inspect` "
                          f"shows the whole step's memory")


def _gib(n: float) -> str:
    return f"{n / 2**40:,.1f} TiB" if n >= 2**40 else f"{n / 2**30:,.2f} GiB"


def _shift_by_one(schedule: optax.Schedule) -> optax.Schedule:
    """optax counts updates from 0; shift so the first update uses the warmup's first non-zero lr."""
    return lambda count: schedule(count + 1)


def _init_state(cfg: Config, model: models.Model, tx, key) -> TrainState:
    params = model.init(cfg, key)
    guard = reliability.init_guard() if reliability.guards_on(cfg.reliability) else None
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), guard, precision_state(cfg, model))


def precision_state(cfg: Config, model: models.Model):
    """The precision recipe's state at step 0 (`maxtrain.layers.precision`), None when it keeps none."""
    recipe = precision.training_recipe(cfg, model)
    return None if recipe is None else recipe.state()


def _opt_state_shardings(opt_state, param_shardings, mesh: Mesh):
    """Optimizer leaves that mirror a parameter (Adam moments) take its sharding; others replicate."""
    by_path = {tuple(p): s for p, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())

    def pick(path, leaf):
        for start in range(len(path)):
            s = by_path.get(tuple(path[start:]))
            if s is not None and len(s.spec) <= leaf.ndim:
                return s
        return replicated

    return jax.tree_util.tree_map_with_path(pick, opt_state)


def init_state(setup: Setup, seed: int) -> TrainState:
    """Creates the train state directly in its shardings (no full copy on any one device)."""
    fn = functools.partial(_init_state, setup.cfg, setup.model, setup.tx)
    return jax.jit(fn, out_shardings=setup.state_shardings)(jax.random.key(seed))


# ---------------------------------------------------------------- loss and step


def split_microbatches(batch: dict, n: int) -> dict:
    """[B, L] -> [n, B/n, L] where microbatch m holds rows m, m+n, ...: each stays on its devices."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1), batch)


def make_grads_fn(cfg: Config, model: models.Model):
    """`grads_of(params, meta, batch) -> (grads, probe gradients or None, stats)`: the summed loss's
    gradient, and those of the precision recipe's probes in the layers' meta (`meta`, None without
    a recipe: their gradients are its statistics)."""
    recipe = precision.training_recipe(cfg, model)

    def objective(total, stats, aux):
        n = stats["tokens"]
        # model losses (MoE balance, router z) are means: weight by tokens like the summed CE
        total = total + aux.get("loss", 0.0) * n
        stats = {**stats, **{k: v * n for k, v in aux.get("metrics", {}).items()}}
        return total, stats

    def loss_fn(params, meta, batch):
        batch = to_ring_layout(batch, ring_layout_shards(cfg.model.attention, cfg.model.ring_layout))
        params = models.stack.with_layer_meta(params, meta)
        if model.layered is not None and models.stack.scheduled(cfg):
            # the pipeline's schedule runs each microbatch's loss and backward itself
            return models.stack.scheduled_loss(model.layered, params, batch, cfg, objective)
        total, stats, aux = model_loss(model, params, batch, cfg, cfg.train.z_loss)
        return objective(total, stats, aux)

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def grads_of(params, meta, batch):
        (_, stats), (grads, meta_grads) = grad_fn(params, meta, batch)
        probes = None if meta is None else recipe.probes_of(meta_grads)
        return grads, probes, stats

    return grads_of


def precision_statistics(setup: Setup, state: TrainState, batch: dict):
    """One batch's statistics of the precision recipe per projection and layer (FP8: a tree like
    the layers' meta whose leaves are `[layers..., 9]`: amaxes, underflow and saturation shares of
    x, w and g), from the state's params and recipe state.
    None without a recipe (or pipelined: no statistics there)."""
    recipe = precision.training_recipe(setup.cfg, setup.model)
    probes = None if recipe is None else recipe.probes()
    if probes is None:
        return None
    grads_of = make_grads_fn(setup.cfg, setup.model)
    fn = jax.jit(lambda params, state_, b: grads_of(params, recipe.layer_meta(probes, state_), b)[1])
    return fn(state.params, state.precision, batch)


def make_train_step(cfg: Config, model: models.Model, tx, schedule):
    """`train_step(state, batch) -> (state, metrics)`: loss, grad, (accumulation), AdamW update."""
    rules = cfg.sharding.activations
    grads_of = make_grads_fn(cfg, model)
    recipe = precision.training_recipe(cfg, model)  # None: plain precision

    def accumulate(params, meta, batch):
        """(grads, probe gradients, stats) summed over the microbatches (the probes combined)."""
        if cfg.train.grad_accum == 1:
            return grads_of(params, meta, batch)

        def body(carry, mb):
            mb = jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES, rules), mb)
            grads, probes, stats = grads_of(params, meta, mb)
            acc_grads, acc_probes, acc_stats = carry
            acc_probes = None if probes is None else recipe.combine(acc_probes, probes)
            return (jax.tree.map(jnp.add, acc_grads, grads), acc_probes, jax.tree.map(jnp.add, acc_stats, stats)), None

        mbs = split_microbatches(batch, cfg.train.grad_accum)
        stats_shape = jax.eval_shape(lambda p, b: grads_of(p, meta, b)[2], params, jax.tree.map(lambda x: x[0], mbs))
        probes0 = None if meta is None else jax.tree.map(jnp.zeros_like, recipe.probes_of(meta))
        zeros = (jax.tree.map(jnp.zeros_like, params), probes0,
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape))
        (grads, probes, stats), _ = jax.lax.scan(body, zeros, mbs)
        return grads, probes, stats

    def grads_and_metrics(state: TrainState, batch: dict):
        probes = None if recipe is None else recipe.probes()  # zeros: their gradients are the statistics
        meta = None if probes is None else recipe.layer_meta(probes, state.precision)
        grads, probes, stats = accumulate(state.params, meta, batch)
        n = jnp.maximum(stats["tokens"], 1.0)
        scale = 1.0 / n
        # mean over all tokens of the global batch, in the parameters' dtype (the float32 scale would
        # promote bf16 gradients, and with them the bf16 moments of `train.param_dtype=bfloat16`)
        grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
        loss = stats["nll_sum"] * scale * n / n  # this rounding is pinned bitwise by tests/test_loop.py
        metrics = {
            "loss": loss,
            "z_loss": stats["z_sum"] / n,
            "grad_norm": optax.tree.norm(grads),
            "lr": schedule(state.step),
            "tokens": stats["tokens"],
            **{k: v / n for k, v in stats.items() if k.startswith(("moe_", "mtp_"))},
            **({} if probes is None else recipe.metrics(probes, cfg.train.grad_accum)),
        }
        return grads, metrics, probes

    drill = drills.step_faults(cfg.drills)  # the identity unless a NaN or spike drill is configured
    update = _guarded_update(tx, cfg.reliability) if reliability.guards_on(cfg.reliability) else _update(tx)

    def train_step(state: TrainState, batch: dict):
        grads, metrics, probes = grads_and_metrics(state, batch)
        grads, metrics = drill(grads, metrics, state.step)
        recipe_state = None if state.precision is None else recipe.next_state(state.precision, probes)
        after, metrics = _balancing(cfg, model, state.params, metrics)
        return update(state, grads, metrics, recipe_state, after)

    return train_step


def _balancing(cfg: Config, model: models.Model, params, metrics: dict):
    """`(after, metrics)`: the model's update of its routing state after the optimizer (`Model.balance`,
    from each MoE layer's load: `moe_load_per_layer`, taken out of the metrics) or None, and the
    metrics with the balancing bias's range per layer before this step (`moe_bias_min/max_per_layer`)."""
    load = metrics.pop("moe_load_per_layer", None)
    metrics.pop("moe_load", None)
    if model.balance is None or load is None:
        return None, metrics
    bias = params["layers"]["moe"]["bias"]
    metrics.update(moe_bias_min_per_layer=jnp.min(bias, axis=-1), moe_bias_max_per_layer=jnp.max(bias, axis=-1))
    return functools.partial(model.balance, load=load, cfg=cfg), metrics


def _update(tx):
    return lambda state, grads, metrics, recipe_state, after: (
        state.apply_gradients(grads, tx, recipe_state, after), metrics)


def _guarded_update(tx, rcfg):
    """The update behind the numerical guards: a non-finite or spiking step keeps the old params,
    moments and precision recipe state (no host sync; a conditional, so a normal step pays nothing
    for the skip path)."""
    def update(state: TrainState, grads, metrics, recipe_state, after):
        apply, guard = reliability.check_step(state.guard, metrics["loss"], metrics["grad_norm"], state.step, rcfg)
        new = jax.lax.cond(apply, lambda s, g: s.apply_gradients(g, tx, recipe_state, after), lambda s, g: s.skipped(),
                           state, grads)
        return dataclasses.replace(new, guard=guard), {**metrics, "guard": guard}

    return update


def batch_shapes(cfg: Config, batch_sharding) -> dict:
    B, L = cfg.train.batch_size, cfg.train.seq_len
    dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "loss_mask": jnp.float32,
              "segment_ids": jnp.int32, "positions": jnp.int32}
    return {k: jax.ShapeDtypeStruct((B, L), d, sharding=batch_sharding) for k, d in dtypes.items()}


def trace_train_step(setup: Setup):
    """The sharded step (state donated) traced for the setup's shapes: `.jaxpr`, `.lower()`."""
    step = make_train_step(setup.cfg, setup.model, setup.tx, setup.schedule)
    jitted = jax.jit(step, in_shardings=(setup.state_shardings, setup.batch_sharding),
                     out_shardings=(setup.state_shardings, None), donate_argnums=0)
    return jitted.trace(sharded_abstract_state(setup), batch_shapes(setup.cfg, setup.batch_sharding))


def compile_train_step(setup: Setup, traced=None):
    """Ahead-of-time compiles the sharded step (state donated); returns (compiled, seconds)."""
    t0 = time.perf_counter()
    options = step_compiler_options(setup.cfg, setup.mesh.devices.flat[0].platform)
    compiled = (traced or trace_train_step(setup)).lower().compile(compiler_options=options)
    return compiled, time.perf_counter() - t0


def step_compiler_options(cfg: Config, platform: str, xla_flags: str | None = None) -> dict:
    """The XLA options the train step compiles with: `STEP_COMPILER_OPTIONS`, on GPUs
    `GPU_OVERLAP_OPTIONS` (unless `train.gpu_overlap=false`), then `train.compiler_options` over
    them. An option the user names in XLA_FLAGS is left to XLA_FLAGS (compile options would win over
    it); defaults this jaxlib does not know are dropped (jax 0.10 and 0.11 know different sets), a
    `train.compiler_options` key it does not know is a ConfigError."""
    options = dict(STEP_COMPILER_OPTIONS)
    if platform in ("gpu", "cuda", "rocm") and cfg.train.gpu_overlap:
        options.update(GPU_OVERLAP_OPTIONS)
    user = dict(cfg.train.compiler_options)
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    named = set(re.findall(r"--(xla_\w+)", flags))
    defaults = {k: v for k, v in options.items() if k not in named and k not in user}
    wanted = {**defaults, **user}
    unknown = (frozenset() if set(wanted) <= set(STEP_COMPILER_OPTIONS)  # known to jax 0.10 and 0.11
               else unknown_compiler_options(tuple(sorted(wanted.items()))))
    if set(user) & unknown:
        import jaxlib

        raise ConfigError(f"train.compiler_options: the XLA of jaxlib {jaxlib.__version__} has no option "
                          f"{', '.join(sorted(set(user) & unknown))}; check the name against XLA's DebugOptions "
                          f"(xla/xla.proto) or remove it")
    if unknown:
        log.debug("XLA options this jaxlib does not know, left out: %s", ", ".join(sorted(unknown)))
    return {k: v for k, v in wanted.items() if k not in unknown}


@functools.cache
def unknown_compiler_options(options: tuple[tuple[str, Any], ...]) -> frozenset[str]:
    """The names among `options` ((name, value) pairs) that this jaxlib's XLA rejects as unknown:
    a one-line program compiled with them (XLA names the first unknown option it meets, so once
    more per unknown one). Options XLA knows for any backend are accepted on any."""
    unknown: set[str] = set()
    probe = jax.jit(lambda x: x + 1).lower(np.float32(0))
    while True:
        try:
            probe.compile(compiler_options={k: v for k, v in options if k not in unknown})
            return frozenset(unknown)
        except Exception as e:  # XlaRuntimeError/ValueError, by jax version
            m = _UNKNOWN_OPTION.search(str(e))
            if not m or m.group(1) in unknown:
                return frozenset(unknown)  # something else: the step's own compile will say it
            unknown.add(m.group(1))


def host_rows(batch_sharding: NamedSharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """The contiguous range of global batch rows this process's devices hold."""
    spans = {(s.start or 0, global_shape[0] if s.stop is None else s.stop)
             for s in (idx[0] for idx in batch_sharding.addressable_devices_indices_map(global_shape).values())}
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    covered = set().union(*(range(a, b) for a, b in spans))
    if len(covered) != hi - lo:  # this process's rows are not one block (unusual hybrid meshes)
        log.warning("this process's batch rows are not contiguous; it reads rows %d-%d, some not its own", lo, hi)
    return lo, hi


def put_batch(batch: dict[str, np.ndarray], batch_sharding: NamedSharding,
              global_rows: int | None = None) -> dict[str, jax.Array]:
    """This process's rows (see `host_rows`) -> global jax.Arrays, each device its slice."""
    return {k: jax.make_array_from_process_local_data(batch_sharding, v, (global_rows or v.shape[0],) + v.shape[1:])
            for k, v in batch.items()}


def make_eval_step(setup: Setup):
    """Jitted `(params, batch) -> (nll_sum, tokens)` with the training shardings."""
    cfg, model = setup.cfg, setup.model

    def eval_step(params, batch):
        batch = to_ring_layout(batch, ring_layout_shards(cfg.model.attention, cfg.model.ring_layout))
        _, stats, _ = model_loss(model, params, batch, cfg, 0.0)
        return stats["nll_sum"], stats["tokens"]

    return jax.jit(eval_step, in_shardings=(setup.state_shardings.params, setup.batch_sharding))


def evaluate(setup: Setup, eval_fn, params, source, lo: int, hi: int) -> dict:
    """Mean loss over the first `train.eval_steps` batches of the eval source (the same each time)."""
    cfg = setup.cfg
    B = cfg.train.batch_size
    nll, tokens = 0.0, 0.0
    rows = HostRows(source, B, lo, hi)
    for k in range(cfg.train.eval_steps):
        batch = put_batch(rows(k), setup.batch_sharding, B)
        n, t = eval_fn(params, batch)
        nll, tokens = nll + float(n), tokens + float(t)
    loss = nll / max(tokens, 1.0)
    return {"eval_loss": loss, "eval_ppl": float(np.exp(min(loss, 80.0)))}


# ---------------------------------------------------------------- shapes and the forward alone


def sharded_abstract_state(setup: Setup) -> TrainState:
    """The state's shapes and dtypes with their target shardings (nothing allocated)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        setup.abstract_state, setup.state_shardings)


def forward(cfg: Config, params, tokens, segment_ids=None, positions=None) -> jax.Array:
    """Logits `[batch, length, vocab]` in float32 for `tokens` `[batch, length]`."""
    model = models.get(cfg.model.name)
    batch = {"inputs": jnp.asarray(tokens)}
    if segment_ids is not None:
        batch["segment_ids"] = jnp.asarray(segment_ids)
    if positions is not None:
        batch["positions"] = jnp.asarray(positions)

    def run(p, b):
        n = ring_layout_shards(cfg.model.attention, cfg.model.ring_layout)
        return from_ring_layout(model.apply(p, to_ring_layout(b, n), cfg)[0], n)

    return jax.jit(run)(params, batch).astype(jnp.float32)


def pipeline_table(cfg: Config) -> schedules.Table | None:
    """The pipeline schedule's table (`train.pipeline_schedule`), None without pipeline parallelism."""
    return None if cfg.mesh.pipeline == 1 else models.stack.pipeline_table(cfg)


def pipeline_bubble(cfg: Config) -> float | None:
    """Idle fraction of the pipeline schedule's table, None without pipeline parallelism."""
    table = pipeline_table(cfg)
    return None if table is None else table.bubble()


def pipeline_summary(cfg: Config) -> dict | None:
    """The schedule as `inspect` and the start-up log report it: name, bubble, the most (microbatch,
    chunk) activations each stage holds at once, and the executor's buffer slots."""
    table = pipeline_table(cfg)
    if table is None:
        return None
    summary = {"schedule": table.name + (" (aligned)" if table.aligned else ""), "ticks": table.length,
               "bubble": table.bubble(), "peak_activations": table.peak_activations()}
    if models.stack.scheduled(cfg):
        summary["slots"] = dict(zip(("inbox", "grads", "saved"), schedules.lower(table).slots))
    return summary
