"""Train state, the jitted train step, and the training loop."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from maxtrain import models, optim, reliability, sharding
from maxtrain.reliability import drills
from maxtrain.checkpoint import PREEMPTED_EXIT_CODE, Checkpointer, CorruptCheckpoint, open_path
from maxtrain.config import Config, ConfigError, save_config, to_dict, validate_for_mesh
from maxtrain.data import HostRows, data_order, data_order_changes
from maxtrain.layers import fp8
from maxtrain.layers.attention import get_attention
from maxtrain.loss import check_mesh as check_loss_mesh, chosen_impl, model_loss, next_token_loss  # noqa: F401  (public here too)
from maxtrain.parallel import schedules
from maxtrain.parallel.ring_attention import from_ring_layout, ring_layout_shards, to_ring_layout
from maxtrain.mesh import build_mesh, mesh_sizes, use_mesh
from maxtrain.targets import device_memory, fp8_support

log = logging.getLogger("maxtrain")

BATCH_AXES = ("batch", "length")  # every batch array is [batch, length]
# XLA options the train step compiles with. The GPU compiler of jax >= 0.11 fuses a custom call
# whose result a scanned layer stacks as a residual into a `dynamic-slice-fusion`, and clones the
# call to do it: our flash kernels ran their forward twice per layer (the 1B step on an H200 lost
# 43 ms, 6%). Without the fusion the result is stacked by one copy (a few hundred microseconds).
STEP_COMPILER_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": False}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["step", "params", "opt_state", "guard", "fp8"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array  # completed optimizer steps
    params: Any
    opt_state: Any
    guard: Any = None  # numerical-guard statistics (reliability.init_guard) while a guard is on; not checkpointed
    fp8: Any = None  # `train.fp8.recipe=delayed`: the projections' amax histories (checkpointed with opt_state)

    def apply_gradients(self, grads, tx: optax.GradientTransformation, fp8=None, after=None) -> "TrainState":
        """The optimizer's update; `fp8`: the amax histories after this step (delayed scaling);
        `after(params) -> params`: the model's own update of what it does not learn (MoE balancing)."""
        updates, opt_state = tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        return dataclasses.replace(self, step=self.step + 1, params=params if after is None else after(params),
                                   opt_state=opt_state, fp8=self.fp8 if fp8 is None else fp8)

    def skipped(self) -> "TrainState":
        """This state one step on with nothing applied (a guarded step that was skipped)."""
        return dataclasses.replace(self, step=self.step + 1)

    @property
    def saved_opt_state(self):
        """What a checkpoint stores as `opt_state`: the optimizer's, and the amax histories when
        delayed FP8 scaling keeps them (`with_saved_opt_state` reads it back)."""
        return self.opt_state if self.fp8 is None else {"optimizer": self.opt_state, "fp8": self.fp8}


def with_saved_opt_state(step, params, saved, guard, delayed: bool) -> TrainState:
    """A train state from a checkpoint's params and `opt_state` (`TrainState.saved_opt_state`)."""
    if delayed:
        return TrainState(step, params, saved["optimizer"], guard, saved["fp8"])
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

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.batch_size * self.cfg.train.seq_len


def make_setup(cfg: Config, devices=None) -> Setup:
    """Validates the config against the devices and derives mesh, optimizer and shardings."""
    model = models.get(cfg.model.name)
    if cfg.train.cross_entropy not in ("xla", "auto") and model.features is None:
        raise ConfigError(f"train.cross_entropy={cfg.train.cross_entropy} needs model {model.name!r} to register "
                          "features= and head= (see maxtrain.models.register); use train.cross_entropy=xla")
    if cfg.train.sample_every:  # before anything compiles: the decoder exists for the llama family only
        from maxtrain.generate import check_supported

        check_supported(cfg.model)
    mesh = build_mesh(cfg.mesh, devices)
    with use_mesh(mesh):  # the implementation's check asks about the mesh's devices (maxtrain.targets)
        get_attention(cfg.model.attention)
    check_fp8(cfg, model, mesh.devices.flat[0])
    sizes = mesh_sizes(mesh)
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
    tx = optim.make_optimizer(cfg.optim, schedule, axes, cfg.sharding.params,
                              None if model.learned is None else model.learned(cfg))
    abstract = jax.eval_shape(functools.partial(_init_state, cfg, model, tx), jax.random.key(0))
    sharding.check_divisible(abstract.params, axes, cfg.sharding.params, sizes, "params")
    param_shardings = sharding.tree_shardings(mesh, axes, cfg.sharding.params)
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = TrainState(
        step=replicated,
        params=param_shardings,
        opt_state=_opt_state_shardings(abstract.opt_state, param_shardings, mesh),
        guard=jax.tree.map(lambda _: replicated, abstract.guard),
        fp8=jax.tree.map(lambda _: replicated, abstract.fp8),
    )
    batch_sharding = sharding.named_sharding(mesh, BATCH_AXES, cfg.sharding.activations)
    flops = models.flops_per_token(cfg, cfg.train.seq_len) * cfg.train.batch_size * cfg.train.seq_len
    return Setup(cfg, mesh, model, tx, schedule, abstract, shardings, batch_sharding, flops)


def check_fp8(cfg: Config, model: models.Model, device) -> None:
    """`train.fp8` needs a model with FP8 projections and devices that multiply FP8 (on CPU it is
    emulated, with the same rounding: one warning line)."""
    recipe = cfg.train.fp8.recipe
    if recipe == "none":
        return
    if model.fp8_specs is None or model.fp8_specs(cfg) is None:
        raise ConfigError(f"train.fp8.recipe={recipe}: model {model.name!r} has no FP8 projections (a layered family "
                          f"declares their meta under layers['fp8'] and runs them through maxtrain.layers.fp8.project; "
                          f"docs/models.md); use train.fp8.recipe=none")
    support = fp8_support(device)
    if support == "none":
        raise ConfigError(f"train.fp8.recipe={recipe}: {device.device_kind} has no FP8 tensor cores (compute "
                          f"capability 8.9+: H100, H200, L40S, B200); use train.fp8.recipe=none")
    if support == "emulated":
        log.warning("train.fp8.recipe=%s on %s: FP8 is emulated (the same rounding, no speed-up)", recipe,
                    device.platform.upper())


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


def check_state_fits(setup: Setup) -> None:
    """Refuses, before anything is allocated, a train state larger than a device's memory."""
    params, opt = state_bytes_per_device(setup)
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
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), guard, fp8_histories(cfg, model))


def fp8_meta(cfg: Config, model: models.Model, part: str):
    """The layers' FP8 meta leaves named `part` (`probe` or `history`) as zeros, in the meta's tree
    (per projection, stacked like the layers); None when there are none."""
    specs = model.fp8_specs(cfg) if model.fp8_specs is not None and cfg.train.fp8.recipe != "none" else None
    if specs is None or (part == "probe" and cfg.mesh.pipeline > 1):
        # pipelined, a stage's probe would be used once per microbatch and bubble, its gradients
        # summed: no statistics there (and no delayed recipe, `config._validate_train`)
        return None
    is_meta = lambda x: isinstance(x, dict) and part in x  # noqa: E731
    picked = jax.tree.map(lambda m: jnp.zeros(m[part].shape, jnp.float32) if is_meta(m) else None, specs,
                          is_leaf=lambda x: is_meta(x) or isinstance(x, models.ParamSpec))
    return picked if jax.tree.leaves(picked) else None


def fp8_histories(cfg: Config, model: models.Model):
    return fp8_meta(cfg, model, "history")


def _meta_with(probes, histories):
    """The meta tree the layers read: each projection's probe, and its history when there is one."""
    if histories is None:
        return jax.tree.map(lambda p: {"probe": p}, probes)
    return jax.tree.map(lambda p, h: {"probe": p, "history": h}, probes, histories)


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


def _microbatches(batch: dict, n: int) -> dict:
    """[B, L] -> [n, B/n, L] where microbatch m holds rows m, m+n, ...: each stays on its devices."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1), batch)


def _grads_of(cfg: Config, model: models.Model):
    """`grads_of(params, meta, batch) -> (grads, probe gradients or None, stats)`: the summed loss's
    gradient, and those of the layers' FP8 probes (`meta`, None without FP8: the statistics)."""
    def objective(total, stats, aux):
        n = stats["tokens"]
        # model losses (MoE balance, router z) are means: weight by tokens like the summed CE
        total = total + aux.get("loss", 0.0) * n
        stats = {**stats, **{k: v * n for k, v in aux.get("metrics", {}).items()}}
        return total, stats

    def loss_fn(params, meta, batch):
        batch = to_ring_layout(batch, ring_layout_shards(cfg.model.attention, cfg.model.ring_layout))
        params = models.stack.with_fp8(params, meta)
        if model.layered is not None and models.stack.scheduled(cfg):
            # the pipeline's schedule runs each microbatch's loss and backward itself
            return models.stack.scheduled_loss(model.layered, params, batch, cfg, objective)
        total, stats, aux = model_loss(model, params, batch, cfg, cfg.train.z_loss)
        return objective(total, stats, aux)

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def grads_of(params, meta, batch):
        (_, stats), (grads, meta_grads) = grad_fn(params, meta, batch)
        probes = None if meta is None else jax.tree.map(lambda m: m["probe"], meta_grads, is_leaf=_is_meta)
        return grads, probes, stats

    return grads_of


def fp8_probes(setup: Setup, state: TrainState, batch: dict):
    """One batch's FP8 statistics per projection and layer: a tree like the layers' FP8 meta whose
    leaves are `[layers..., 9]` (`maxtrain.layers.fp8.PROBE`: amaxes, underflow and saturation
    shares of x, w and g), from the state's params and amax histories. None without FP8."""
    cfg = setup.cfg
    probes = fp8_meta(cfg, setup.model, "probe")
    if probes is None:
        return None
    grads_of = _grads_of(cfg, setup.model)
    fn = jax.jit(lambda params, fp8_state, b: grads_of(params, _meta_with(probes, fp8_state), b)[1])
    return fn(state.params, state.fp8, batch)


def make_train_step(cfg: Config, model: models.Model, tx, schedule):
    """`train_step(state, batch) -> (state, metrics)`: loss, grad, (accumulation), AdamW update."""
    rules = cfg.sharding.activations
    grads_of = _grads_of(cfg, model)

    def accumulate(params, meta, batch):
        """(grads, probe gradients, stats) summed over the microbatches (the probes combined)."""
        if cfg.train.grad_accum == 1:
            return grads_of(params, meta, batch)

        def body(carry, mb):
            mb = jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES, rules), mb)
            grads, probes, stats = grads_of(params, meta, mb)
            acc_grads, acc_probes, acc_stats = carry
            return (jax.tree.map(jnp.add, acc_grads, grads), fp8.combine_probes(acc_probes, probes),
                    jax.tree.map(jnp.add, acc_stats, stats)), None

        mbs = _microbatches(batch, cfg.train.grad_accum)
        stats_shape = jax.eval_shape(lambda p, b: grads_of(p, meta, b)[2], params, jax.tree.map(lambda x: x[0], mbs))
        probes0 = None if meta is None else jax.tree.map(lambda m: jnp.zeros_like(m["probe"]), meta, is_leaf=_is_meta)
        zeros = (jax.tree.map(jnp.zeros_like, params), probes0,
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape))
        (grads, probes, stats), _ = jax.lax.scan(body, zeros, mbs)
        return grads, probes, stats

    def grads_and_metrics(state: TrainState, batch: dict):
        probes = fp8_meta(cfg, model, "probe")  # zeros: their gradients are the FP8 statistics
        meta = None if probes is None else _meta_with(probes, state.fp8)
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
            **({} if probes is None else fp8.stats_from_probes(probes, cfg.train.grad_accum)),
        }
        return grads, metrics, probes

    drill = drills.step_faults(cfg.drills)  # the identity unless a NaN or spike drill is configured
    update = _guarded_update(tx, cfg.reliability) if reliability.guards_on(cfg.reliability) else _update(tx)

    def train_step(state: TrainState, batch: dict):
        grads, metrics, probes = grads_and_metrics(state, batch)
        grads, metrics = drill(grads, metrics, state.step)
        histories = None if state.fp8 is None else fp8.updated_histories(state.fp8, probes)
        after, metrics = _balancing(cfg, model, state.params, metrics)
        return update(state, grads, metrics, histories, after)

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


def _is_meta(x) -> bool:
    return isinstance(x, dict) and "probe" in x


def _update(tx):
    return lambda state, grads, metrics, fp8, after: (state.apply_gradients(grads, tx, fp8, after), metrics)


def _guarded_update(tx, rcfg):
    """The update behind the numerical guards: a non-finite or spiking step keeps the old params,
    moments and amax histories (no host sync; a conditional, so a normal step pays nothing for the
    skip path)."""
    def update(state: TrainState, grads, metrics, fp8, after):
        apply, guard = reliability.check_step(state.guard, metrics["loss"], metrics["grad_norm"], state.step, rcfg)
        new = jax.lax.cond(apply, lambda s, g: s.apply_gradients(g, tx, fp8, after), lambda s, g: s.skipped(), state,
                           grads)
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
    compiled = (traced or trace_train_step(setup)).lower().compile(compiler_options=STEP_COMPILER_OPTIONS)
    return compiled, time.perf_counter() - t0


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


# ---------------------------------------------------------------- restore


def sharded_abstract_state(setup: Setup) -> TrainState:
    """The state's shapes and dtypes with their target shardings (nothing allocated)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        setup.abstract_state, setup.state_shardings)


def _resume_source(cfg: Config, ckpt: Checkpointer | None) -> tuple[Checkpointer | None, list[int] | None]:
    """Where `checkpoint.resume_from` points: (checkpointer, steps to try newest-first or None=all)."""
    where = cfg.checkpoint.resume_from
    if where == "none":
        return None, None
    if where == "latest":
        return ckpt, None
    src, steps = open_path(where, "checkpoint.resume_from")
    if ckpt is not None and ckpt.directory == src.directory:
        src = ckpt  # the run's own directory: its retention must know what was restored
    elif ckpt is not None and ckpt.steps():
        # a restart of a run that began from PATH: its own checkpoints are newer ("run the same
        # command to resume" after a preemption); PATH only seeds a run with none yet
        log.info("checkpoint.dir %s holds this run's checkpoints (newest %d): resuming from them, not from "
                 "checkpoint.resume_from=%s", ckpt.directory, ckpt.steps()[-1], where)
        return ckpt, None
    return src, steps


# a shape mismatch with checkpoint.init_from: its model is the base, so the config set a shape key
INIT_FROM_FIX = ("leave out the model.* keys that change shapes (checkpoint.init_from's model is the base; the "
                 "warnings above name each key set to another value) or point checkpoint.init_from at a checkpoint "
                 "of this model")


def check_start_source(setup: Setup) -> None:
    """Before checkpoint.dir is claimed (created and locked): a `checkpoint.resume_from=PATH` or
    `checkpoint.init_from` checkpoint of another model is refused while nothing is written yet.
    A resume of the run's own directory is left to `restore_or_init` (that directory exists
    already), as is a step whose metadata is unreadable (it falls back to an older good step)."""
    cfg = setup.cfg
    where, own = cfg.checkpoint.resume_from, cfg.checkpoint.dir
    if where != "none" and own and os.path.isdir(own) and Checkpointer(own, read_only=True).steps():
        return  # resumes its own checkpoints
    if where not in ("latest", "none"):
        (src, steps), fix = open_path(where, "checkpoint.resume_from"), None
    elif cfg.checkpoint.init_from:
        (src, steps), fix = open_path(cfg.checkpoint.init_from, "checkpoint.init_from"), INIT_FROM_FIX
    else:
        return
    try:
        src.check_compatible(steps[-1], sharded_abstract_state(setup).params, fix=fix)
    except CorruptCheckpoint:
        return


def restore_or_init(setup: Setup, ckpt: Checkpointer | None, local=None) -> tuple[TrainState, str]:
    """The run's starting state: resumed (from the local tier when it holds a step newer than
    checkpoint.dir's newest), params-only from `init_from`, or freshly initialised."""
    cfg = setup.cfg
    abstract = sharded_abstract_state(setup)
    if local is not None and cfg.checkpoint.resume_from == "latest":
        got = local.restore({"params": abstract.params, "opt_state": abstract.saved_opt_state},
                            newer_than=max(ckpt.steps(), default=0) if ckpt is not None else 0)
        if got is not None:
            step, trees, meta = got
            _check_data_order(cfg, meta, f"the local checkpoint of step {step}")
            step_arr = jax.device_put(jnp.asarray(step, jnp.int32), setup.state_shardings.step)
            state = with_saved_opt_state(step_arr, trees["params"], trees["opt_state"], _fresh_guard(setup),
                                         abstract.fp8 is not None)
            return state, f"resumed from the local tier ({local.dir}) at step {step}"
    src, steps = _resume_source(cfg, ckpt)
    if src is not None and (steps or src.steps()):
        r = src.restore_latest_good(abstract.params, abstract.saved_opt_state, steps=steps)
        if r is None:
            raise ConfigError(f"no checkpoint under {src.directory} passes verification (each is named above); "
                              f"inspect with `maxtrain checkpoint verify {src.directory}` or set "
                              f"checkpoint.resume_from=none and a new checkpoint.dir to start over")
        _refuse_overwrite(ckpt, after=r.step)
        _check_data_order(cfg, r.meta, f"{src.directory}/{r.step}")
        step = jax.device_put(jnp.asarray(r.step, jnp.int32), setup.state_shardings.step)
        state = with_saved_opt_state(step, r.params, r.opt_state, _fresh_guard(setup), abstract.fp8 is not None)
        return state, f"resumed from {src.directory}/{r.step}"
    _refuse_overwrite(ckpt, after=-1)
    if cfg.checkpoint.init_from:
        src, steps = open_path(cfg.checkpoint.init_from, "checkpoint.init_from")
        r = src.restore_latest_good(abstract.params, None, steps=steps, fix=INIT_FROM_FIX)
        if r is None:
            raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from} holds no verified checkpoint")
        opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings.opt_state)(r.params)
        step0 = jax.device_put(jnp.zeros((), jnp.int32), setup.state_shardings.step)
        fresh = jax.jit(lambda: fp8_histories(cfg, setup.model), out_shardings=setup.state_shardings.fp8)()
        return (TrainState(step0, r.params, opt_state, _fresh_guard(setup), fresh),
                f"params from {src.directory}/{r.step}, fresh optimizer")
    return init_state(setup, cfg.seed), "initialised"


def _fresh_guard(setup: Setup, carry=None):
    """Guard statistics start over after a restore (they re-warm within `spike_warmup` steps);
    `carry`: a guard whose event counters (events, skipped updates, the last event) carry over."""
    if not reliability.guards_on(setup.cfg.reliability):
        return None
    guard = reliability.init_guard()
    if carry is not None:
        kept = jax.device_get({k: carry[k] for k in ("skipped", "events", "last_kind", "last_step", "last_value")})
        guard.update({k: jnp.asarray(v, jnp.float32) for k, v in kept.items()})
    return jax.device_put(guard, setup.state_shardings.guard)


def _refuse_overwrite(ckpt: Checkpointer | None, after: int) -> None:
    """A run must not write over another run's (or its own later) checkpoints in checkpoint.dir."""
    newer = [s for s in (ckpt.steps() if ckpt else []) if s > after]
    if newer:
        raise ConfigError(f"checkpoint.dir {ckpt.directory} already holds checkpoints at steps "
                          f"{', '.join(map(str, newer[-3:]))} after the starting step {max(after, 0)}; this run "
                          f"would overwrite them: use a new checkpoint.dir (or move them away)")


class PreemptionFlag:
    """SIGTERM/SIGINT set a flag the loop polls; a second signal while stopping changes nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._old = {}
        self._at_once: str | None = None  # inside exits_at_once(): what is being done

    @contextlib.contextmanager
    def exits_at_once(self, what: str):
        """Work that may block in a read and leaves nothing to save (a restore): a signal exits
        with PREEMPTED_EXIT_CODE there and then (the checkpoints on disk are untouched)."""
        self._at_once = what
        try:
            if self.signum is not None:
                self._exit_now(self.signum)
            yield
        finally:
            self._at_once = None

    def _exit_now(self, signum) -> None:
        log.warning("received %s during %s: nothing to save, exiting %d (restart to resume)",
                    signal.Signals(signum).name, self._at_once, PREEMPTED_EXIT_CODE)
        logging.shutdown()
        os._exit(PREEMPTED_EXIT_CODE)

    def _handle(self, signum, frame):
        if self._at_once is not None:
            self._exit_now(signum)
        if self.signum is None:
            log.warning("received %s: saving a checkpoint and stopping", signal.Signals(signum).name)
        else:
            log.warning("received %s again: still saving, please wait", signal.Signals(signum).name)
        self.signum = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)

    @property
    def set(self) -> bool:
        return self.signum is not None

    def agreed(self) -> bool:
        """Whether any process got a signal: all processes stop after the same step."""
        if jax.process_count() == 1:
            return self.set
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(self.set))))


# ---------------------------------------------------------------- loop


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    history: list[dict]  # every logged metrics record
    compile_s: float
    wall_s: float
    start_step: int = 0
    preempted: bool = False  # stopped early by a signal
    checkpoint_saved: bool = False  # the final step is in checkpoint.dir


def _final_save(cfg: Config, ckpt: Checkpointer, state: TrainState, done: int, first: int, order: dict,
                goodput: reliability.Goodput, kind: str = "final") -> bool:
    """After the loop (finished or preempted): the newest background save commits, then the last
    step is saved synchronously unless it already is. Whether `done` is now checkpointed."""
    ckpt.wait()
    if done > first and done not in ckpt.steps():
        secs = ckpt.save(done, state.params, state.saved_opt_state, _checkpoint_meta(cfg, done, order), wait=True)
        goodput.add("ckpt_block", secs)
        if done in ckpt.steps():
            goodput.saved(done, kind, secs)
            log.info("checkpoint of step %d saved in %.2fs", done, secs)
    saved = done in ckpt.steps()
    if done > first and not saved:
        good = ckpt.steps()
        log.warning("the checkpoint of step %d could not be saved (see above); %s", done,
                    f"the newest good checkpoint is step {good[-1]}: {ckpt.directory}/{good[-1]}" if good
                    else f"{ckpt.directory} holds no complete checkpoint")
    return saved


def _checkpoint_meta(cfg: Config, next_step: int, order: dict) -> dict:
    # the data sources are pure functions of (seed, step): the step is the iterator state, valid
    # for a run with the same `data_order`
    # cwd: where the config's relative paths (init_from, data.path) pointed, for tools run elsewhere
    return {"seed": cfg.seed, "data": {"kind": cfg.data.kind, "next_step": next_step, "order": order},
            "config": to_dict(cfg), "cwd": os.getcwd()}


def _check_data_order(cfg: Config, restored_meta: dict, where: str) -> None:
    """A resumed run continues the saved run's data stream only with the same `data_order`."""
    saved = restored_meta.get("data", {}).get("order")
    if saved is None:  # written before the order was recorded
        return
    changes = data_order_changes(saved, data_order(cfg))
    if not changes:
        return
    what = "; ".join(changes)
    if cfg.checkpoint.allow_data_change:
        log.warning("resuming from %s with other data settings (%s): the data position is step x batch of the "
                    "new stream, so examples are skipped or repeated (checkpoint.allow_data_change=true)", where, what)
        return
    raise ConfigError(f"checkpoint {where} was written with other data settings ({what}): resuming would skip or "
                      f"repeat training data; keep them, or set checkpoint.allow_data_change=true to accept that")


def train(cfg: Config, devices=None, callbacks=()) -> TrainResult:
    """Runs the training loop of `cfg`; the same loop as `maxtrain train`. `callbacks`: more
    `maxtrain.loop.Callback`s, run after the built-in ones (see maxtrain/loop.py)."""
    from maxtrain.loop import train_loop  # the loop imports this module's parts

    return train_loop(cfg, devices, callbacks)


def claim_run_dir(cfg: Config) -> tuple[Config, dict]:
    """`cfg` with `run_dir`'s placeholders filled in (the same on every process), and the run the
    directory is for (`maxtrain.rundir`). Every process checks that the directory holds this run,
    or none (a ConfigError); nothing is written here: `write_run_dir` does, once start-up passed
    every other check."""
    from maxtrain import rundir

    run_id, now = rundir.new_run_id(), time.time()
    if jax.process_count() > 1:  # process 0's id and clock: one directory for the job
        from jax.experimental import multihost_utils

        # jax arrays are 32-bit here: the 48-bit id goes as two 24-bit halves
        agreed = multihost_utils.broadcast_one_to_all(
            np.array([int(run_id[:6], 16), int(run_id[6:], 16), int(now)], np.int32))
        run_id, now = f"{int(agreed[0]):06x}{int(agreed[1]):06x}", float(agreed[2])
    path = rundir.expand(cfg.run_dir, run_id, now)
    if path != cfg.run_dir:
        cfg = dataclasses.replace(cfg, run_dir=path)
    return cfg, rundir.claim(path, to_dict(cfg), run_id, now)


def write_run_dir(cfg: Config, run: dict) -> None:
    """Process 0 creates run_dir and writes run.json and config.yaml."""
    from maxtrain import rundir

    if jax.process_index() == 0:
        _make_run_dir(cfg.run_dir)
        rundir.write(cfg.run_dir, run)
        save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))


def _make_run_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run_dir {path} cannot be created ({e.strerror or e}); give a writable directory") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"run_dir {path} is not writable; give a writable directory")


def _read_guard(cfg: Config, ckpt: Checkpointer | None, guard: dict, seen: int) -> tuple[int, int | None]:
    """`reliability.report_events` on the guard's host values; before a halt propagates, the
    checkpoints of the steps it condemns are deleted, so none of them survives it."""
    try:
        return reliability.report_events(guard, seen, cfg.reliability)
    except reliability.Halted as e:
        if ckpt is not None and e.step is not None:
            ckpt.wait(retention=False)
            undone = ckpt.discard_from(e.step)
            if undone:
                log.warning("halt: deleted the checkpoints of steps %s, saved at or after step %d", undone, e.step)
        raise


def _rollback(setup: Setup, ckpt: Checkpointer | None, event_step: int, now: int, rollbacks: int,
              state: TrainState) -> TrainState:
    """`reliability.*_action: rollback`: the params and moments of the newest verified checkpoint
    before `event_step`, continuing at data position `now` (the batches in between are skipped;
    the step counter, and so the lr schedule, follows the data position). The guard's event
    counters carry over (the host's count of events seen must stay in step with them); its
    statistics re-warm. `state`'s arrays are freed before the restore, so the state is never
    held twice."""
    r = setup.cfg.reliability
    if ckpt is None:
        raise reliability.Halted(f"guard event at step {event_step} asks for a rollback but checkpoint.dir is not set")
    if rollbacks >= r.max_rollbacks:
        raise reliability.Halted(f"guard event at step {event_step} after {rollbacks} rollbacks "
                                 f"(reliability.max_rollbacks={r.max_rollbacks})")
    ckpt.wait(retention=False)  # retention could drop the only checkpoint before the event for a later one
    steps = [s for s in ckpt.steps() if s < event_step]
    if not steps:
        raise reliability.Halted(f"guard event at step {event_step}: no checkpoint before it to roll back to")
    guard = _fresh_guard(setup, carry=state.guard)
    jax.tree.map(lambda x: x.delete(), (state.params, state.opt_state, state.fp8))
    abstract = sharded_abstract_state(setup)
    restored = ckpt.restore_latest_good(abstract.params, abstract.saved_opt_state, steps=steps) if steps else None
    if restored is None:
        raise reliability.Halted(f"guard event at step {event_step}: no verified checkpoint before it to roll back to")
    log.warning("rollback: restored the checkpoint of step %d after the event at step %d; continuing at step %d, "
                "skipping the batches in between", restored.step, event_step, now)
    undone = ckpt.discard_from(event_step)  # saved after the event: a restart must not resume from them
    if undone:
        log.warning("rollback: deleted the checkpoints of steps %s, saved after the event", undone)
    step = jax.device_put(jnp.asarray(now, jnp.int32), setup.state_shardings.step)
    return with_saved_opt_state(step, restored.params, restored.opt_state, guard, abstract.fp8 is not None)


def _replay_check(setup: Setup, replay, state: TrainState, batch: dict, step: int):
    """Runs step `step` twice on the same state and batch (not donated, result dropped) and
    requires bitwise-equal loss and gradient norm (`reliability.Nondeterministic` otherwise).
    Returns the jitted replay function, built on first use, for the next check."""
    if replay is None:
        fn = make_train_step(setup.cfg, setup.model, setup.tx, setup.schedule)
        replay = jax.jit(lambda s, b: {k: v for k, v in fn(s, b)[1].items() if k in ("loss", "grad_norm")},
                         in_shardings=(setup.state_shardings, setup.batch_sharding))
    reliability.check_replay(jax.device_get(replay(state, batch)), jax.device_get(replay(state, batch)), step)
    return replay


def _replica_check(cfg: Config, setup: Setup, state: TrainState, done: int, fingerprint,
                   before_save: bool = False) -> TrainState:
    """Every `reliability.fingerprint_every` steps, and before every checkpoint save while the
    check is on: data-parallel replicas must hold identical parameters (`reliability.Corrupted`
    otherwise). Also where the bit-flip drill strikes."""
    r = cfg.reliability
    d = cfg.drills
    if d.bitflip_step is not None and done == d.bitflip_step + 1 and drills.first_attempt():
        state = dataclasses.replace(state, params=drills.flip_a_bit(state.params))
    if r.fingerprint_every and (before_save or done % r.fingerprint_every == 0):
        reliability.check_replicas(fingerprint, state.params, setup.mesh,
                                   reliability.replica_axes(setup.state_shardings.params, setup.mesh), done)
    return state


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


def _pipeline_bubble(cfg: Config) -> float | None:
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
