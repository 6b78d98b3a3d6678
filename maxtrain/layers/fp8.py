"""FP8 projections: current (tensorwise, rowwise) and delayed scaling, forward and backward in FP8.

`fp8_project(x, w, n, recipe, meta)` contracts the last `n` dimensions of `x` with the first `n`
of `w` (every projection of the model has this form: `bld,dhk->blhk`, `blhk,hkd->bld`,
`blf,fd->bld`) as one `[M, K] @ [K, N]` GEMM in FP8, forward and backward:

- forward `y = x @ w`: both operands in `float8_e4m3fn`;
- backward, by a custom VJP, `dx = g @ w^T` and `dw = x^T @ g`: the incoming gradient `g` in
  `float8_e5m2` (its range, not its precision, is what gradients need);
- accumulation in float32 (`preferred_element_type`), the result scaled back and cast to `x`'s
  dtype. XLA's GPU compiler turns such a dot of FP8 operands into an FP8 GEMM (cuBLASLt or a
  Triton GEMM) on Hopper; `maxtrain.analysis.hlo` counts them (`fp8_gemms`).

Recipes (a scale maps an amax to the format's largest finite value; beyond it values saturate,
below the smallest subnormal they flush to zero):

- `tensorwise`: one scale per operand from this tensor's absolute maximum (no state). The
  backward reuses the forward's FP8 `x` (one scale serves both contracting dims), so the
  activation a layer keeps for its backward is FP8, half of bf16; `w` is quantized again (the
  layer keeps its own sharded weight, not a gathered copy);
- `rowwise`: one scale per row of the left operand and per column of the right one, i.e. along
  each GEMM's contracting dimension, so every GEMM quantizes its operands again along the
  dimension it sums over (the residuals are the high-precision `x` and `w`);
- `delayed`: tensorwise, the scale from the largest amax in a history of the last
  `amax_history` steps (`meta["history"]`, `[3, H]`: x, w, g; carried in the train state). An
  empty history (the first step) falls back to the current amax.

Statistics, and the delayed recipe's new amaxes, leave the GEMM through the gradient of
`meta["probe"]` (zeros `[9]`, `PROBE`): its cotangent is this call's amaxes of x, w and g and the
shares of each that flushed to zero (underflow) or were clipped (saturation), at the scales the
forward and the dgrad GEMM use (rowwise: per row of x and of g, per column of w). The trainer reads
them from the gradient it computes anyway (`stats_from_probes`, `updated_histories`).

`fp8_project_reference` is the forward written plainly (quantise, dequantise, float32 dot) that
the tests compare against. `gather_spec` (FSDP FP8 all-gather): the weight is quantized in its
stored (sharded) layout, so the all-gather before the GEMM moves FP8 bytes, half of bf16's.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp

from maxtrain.config import FP8_RECIPES, ConfigError
from maxtrain.targets import fp8_support

E4M3 = jnp.float8_e4m3fn  # activations and weights: more precision
E5M2 = jnp.float8_e5m2  # gradients: more range
RECIPES = tuple(r for r in FP8_RECIPES if r != "none")  # train.fp8.recipe's, less "none"
# what a probe's cotangent holds, in order
PROBE = ("x_amax", "w_amax", "g_amax", "x_underflow", "w_underflow", "g_underflow",
         "x_saturation", "w_saturation", "g_saturation")


def _fmax(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def amax_of(x, axis: int | None = None):
    x32 = jnp.abs(x.astype(jnp.float32))
    return jnp.max(x32) if axis is None else jnp.max(x32, axis=axis, keepdims=True)


def scale_for(amax, dtype):
    """The scale that maps `amax` to the format's largest value; 1 where that scale would not be a
    normal float32 (an all-zero tensor, or a row of values so small that `amax / fmax` flushes to
    zero on hardware without subnormals and `x / scale` would be 0/0): their values flush to zero
    in FP8 at any scale a GEMM could use."""
    fmax = _fmax(dtype)
    return jnp.where(amax >= fmax * float(jnp.finfo(jnp.float32).tiny), amax / fmax, 1.0)


def cast(x, scale, dtype):
    """`x / scale` saturated to the format's range and rounded to it."""
    fmax = _fmax(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def quantize(x, dtype, axis: int | None):
    """`(q, scale)` with `q * scale ~ x`, `q` in the FP8 `dtype`: one scale for the whole tensor
    (`axis=None`) or one per slice along `axis` (the amax taken over that axis)."""
    scale = scale_for(amax_of(x, axis), dtype)
    return cast(x, scale, dtype), scale


def shares(x, q, scale, dtype):
    """(underflow, saturation): the shares of `x`'s elements that became 0 though non-zero, and
    that lay beyond the format's range at this scale (by more than a rounding of the scale)."""
    x32 = x.astype(jnp.float32)
    n = float(x.size)  # a Python int past 2**31 overflows as a jit argument
    under = jnp.sum((q.astype(jnp.float32) == 0) & (x32 != 0)) / n
    sat = jnp.sum(jnp.abs(x32) > scale * (_fmax(dtype) * (1 + 1e-5))) / n  # not the amax's own rounding
    return under, sat


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one projection runs (static): the recipe, the contracting dims, and the stored layout
    of the weight to quantize it in before its FSDP all-gather (None: gather in the compute dtype)."""
    recipe: str
    n: int = 1
    gather_spec: Any = None
    x_shape: tuple = ()  # x's and w's shapes and dtypes (for the backward's results)
    w_shape: tuple = ()
    x_dtype: Any = None
    w_dtype: Any = None


def _delayed_scale(history_H, current_amax, dtype):
    past = jnp.max(history_H)
    return scale_for(jnp.where(past > 0, past, current_amax), dtype)


def _tensor_scales(x2, w, meta, plan: Plan):
    """The x and w scales of a tensorwise or delayed GEMM and the current amaxes."""
    ax, aw = amax_of(x2), amax_of(w)
    if plan.recipe == "delayed":
        h = meta["history"]
        return _delayed_scale(h[0], ax, E4M3), _delayed_scale(h[1], aw, E4M3), ax, aw
    return scale_for(ax, E4M3), scale_for(aw, E4M3), ax, aw


def _matrices(x, w, n: int):
    lead, inner = x.shape[:x.ndim - n], x.shape[x.ndim - n:]
    if w.shape[:n] != inner:
        raise ValueError(f"fp8_project: x's last {n} dims {inner} do not match w's first {w.shape[:n]}")
    return x.reshape(-1, math.prod(inner)), lead, w.shape[n:]


def _weight(w, sw, plan: Plan):
    """`w` in e4m3 as a `[K, N]` matrix; with `gather_spec`, quantized in its stored (sharded)
    layout, so that the all-gather XLA inserts before the GEMM moves FP8."""
    qw = cast(w, sw, E4M3)
    if plan.gather_spec is not None:
        qw = jax.lax.with_sharding_constraint(qw, plan.gather_spec)
    return qw.reshape(math.prod(w.shape[:plan.n]), -1)


def _gemm(qa, qb, sa, sb, dtype):
    """`qa @ qb` of FP8 operands (float32 accumulation inside the GEMM) written in `dtype`, then
    scaled. The GEMM writes the result dtype, not float32, as a bf16 GEMM does: XLA reduces a
    sharded contraction's partial products (the FSDP weight gradient's reduce-scatter, tensor
    parallelism's all-reduce) and saves the remat policy's dot outputs in that dtype."""
    # float16 cannot hold an unscaled product of FP8 values (448 x 448 > 65504): float32 there
    out = jnp.float32 if jnp.dtype(dtype) == jnp.float16 else dtype
    y = jax.lax.dot(qa, qb, preferred_element_type=out)
    return (y.astype(jnp.float32) * (sa * sb)).astype(dtype)


def _rowwise_gemm(a, b, a_dtype, b_dtype, dtype):
    """`a [M, K] @ b [K, N]` with one scale per row of `a` and per column of `b`."""
    qa, sa = quantize(a, a_dtype, 1)
    qb, sb = quantize(b, b_dtype, 0)
    return _gemm(qa, qb, sa, sb, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _project(x, w, meta, plan: Plan):
    return _project_fwd(x, w, meta, plan)[0]


def _project_fwd(x, w, meta, plan: Plan):
    x2, lead, tail = _matrices(x, w, plan.n)
    K = x2.shape[1]
    if plan.recipe == "rowwise":
        w2 = w.reshape(K, -1)
        ax_rows, aw_cols = amax_of(x2, 1), amax_of(w2, 0)  # one pass each: the tensor's amax is their max
        sx, sw = scale_for(ax_rows, E4M3), scale_for(aw_cols, E4M3)
        qx, qw = cast(x2, sx, E4M3), cast(w2, sw, E4M3)
        ax, aw = jnp.max(ax_rows), jnp.max(aw_cols)
        saved = (x2, w2)
    else:
        sx, sw, ax, aw = _tensor_scales(x2, w, meta, plan)
        qx, qw = cast(x2, sx, E4M3), _weight(w, sw, plan)
        saved = (qx, sx, w, sw)  # w, not qw: the layer's own weight (sharded), quantized again below
    (ux, tx), (uw, tw) = shares(x2, qx, sx, E4M3), shares(w.reshape(K, -1), qw, sw, E4M3)
    y = _gemm(qx, qw, sx, sw, x.dtype).reshape(lead + tail)
    stats = jnp.stack([ax, aw, ux, uw, tx, tw]).astype(jnp.float32)
    return y, (saved, stats, meta)


def _project_bwd(plan: Plan, res, g):
    saved, stats, meta = res
    g2 = g.reshape(-1, math.prod(plan.w_shape[plan.n:]))
    ag = amax_of(g2)
    if plan.recipe == "rowwise":
        x2, w2 = saved
        qg, sg = quantize(g2, E5M2, 1)  # the dgrad GEMM's g, one scale per row (and its statistics)
        qw_t, sw_t = quantize(w2.T, E4M3, 0)
        dx = _gemm(qg, qw_t, sg, sw_t, plan.x_dtype)
        dw = _rowwise_gemm(x2.T, g2, E4M3, E5M2, plan.w_dtype)
    else:
        qx, sx, w, sw = saved
        qw = _weight(w, sw, plan)
        sg = _delayed_scale(meta["history"][2], ag, E5M2) if plan.recipe == "delayed" else scale_for(ag, E5M2)
        qg = cast(g2, sg, E5M2)
        dx = _gemm(qg, qw.T, sg, sw, plan.x_dtype)
        dw = _gemm(qx.T, qg, sx, sg, plan.w_dtype)
    ug, tg = shares(g2, qg, sg, E5M2)
    ax, aw, ux, uw, tx, tw = stats
    probe = jnp.stack([ax, aw, ag, ux, uw, ug, tx, tw, tg]).astype(jnp.float32)
    d_meta = jax.tree.map(jnp.zeros_like, meta)
    d_meta["probe"] = probe
    return dx.astype(plan.x_dtype).reshape(plan.x_shape), dw.astype(plan.w_dtype).reshape(plan.w_shape), d_meta


_project.defvjp(_project_fwd, _project_bwd)


def fp8_project(x, w, n: int = 1, recipe: str = "tensorwise", meta: dict | None = None, gather_spec=None):
    """`x` contracted over its last `n` dims with `w`'s first `n`, as one FP8 GEMM (see the module
    docstring); the result has `x`'s leading and `w`'s trailing dims. `meta`: `{"probe": [9]}`
    (and `"history": [3, H]` for `delayed`), whose gradient carries the statistics."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}: choose one of {', '.join(RECIPES)}")
    if recipe == "delayed" and (meta is None or "history" not in meta):
        raise ValueError("fp8 recipe 'delayed' needs meta['history'] (the amax history [3, H])")
    meta = {"probe": jnp.zeros(len(PROBE), jnp.float32)} if meta is None else dict(meta)
    if recipe == "rowwise":
        gather_spec = None
    return _project(x, w, meta, Plan(recipe, n, gather_spec, x.shape, w.shape, jnp.dtype(x.dtype), jnp.dtype(w.dtype)))


def fp8_project_reference(x, w, n: int = 1, recipe: str = "tensorwise", history=None):
    """The forward of `fp8_project` written plainly: quantise, dequantise, a float32 dot."""
    x2, lead, tail = _matrices(x, w, n)
    w2 = w.reshape(x2.shape[1], -1)
    if recipe == "delayed":
        sx = _delayed_scale(history[0], amax_of(x2), E4M3)
        sw = _delayed_scale(history[1], amax_of(w2), E4M3)
        qx, qw = cast(x2, sx, E4M3), cast(w2, sw, E4M3)
    else:
        rowwise = recipe == "rowwise"
        qx, sx = quantize(x2, E4M3, 1 if rowwise else None)
        qw, sw = quantize(w2, E4M3, 0 if rowwise else None)
    y = (qx.astype(jnp.float32) * sx) @ (qw.astype(jnp.float32) * sw)
    return y.astype(x.dtype).reshape(lead + tail)


# ---------------------------------------------------------------- the model's side


def project(x, w, n: int, fp8: "Fp8Runtime | None", meta: dict | None, w_spec=None):
    """A model projection: `x`'s last `n` dims contracted with `w`'s first `n`, in FP8 when the
    runtime says so (`meta`: the projection's entry of the layer's `fp8` params in the train step;
    None elsewhere, e.g. evaluation, which then scales by the current amaxes), as a plain einsum
    otherwise. `w_spec`: the weight's stored PartitionSpec (for the FP8 all-gather)."""
    if fp8 is None or fp8.recipe == "none":
        letters = "abcdefghijklmnopqrstuvwxyz"
        xs, ws = letters[:x.ndim], letters[x.ndim - n:x.ndim - n + w.ndim]
        return jnp.einsum(f"{xs},{ws}->{xs[:x.ndim - n]}{ws[n:]}", x, w)
    recipe = fp8.recipe
    if recipe == "delayed" and (meta is None or "history" not in meta):
        recipe = "tensorwise"  # outside the train step (evaluation, `forward`): an empty history's scales
    return fp8_project(x, w, n, recipe, meta, w_spec if fp8.all_gather else None)


@dataclasses.dataclass(frozen=True)
class Fp8Runtime:
    """`train.fp8` as a model sees it (`stack.Runtime.fp8`)."""
    recipe: str = "none"
    amax_history: int = 16
    all_gather: bool = False


def meta_spec_shapes(lead: tuple[int, ...], recipe: str, history: int) -> dict:
    """The shapes of one projection's FP8 meta (its stacked leading dims `lead` first)."""
    shapes = {"probe": lead + (len(PROBE),)}
    if recipe == "delayed":
        shapes["history"] = lead + (3, history)
    return shapes


def updated_histories(histories, probes):
    """The delayed recipe's histories after a step: each rolled by one, this step's amaxes of x, w
    and g (the probe gradients' first three fields) at the front."""
    def roll(h, p):
        return jnp.concatenate([p[..., :3, None], h[..., :-1]], axis=-1).astype(h.dtype)

    return jax.tree.map(roll, histories, probes)


def combine_probes(a, b):
    """Two microbatches' probe gradients as one: amaxes by max, shares summed (`stats_from_probes`
    divides by the microbatch count)."""
    return jax.tree.map(lambda p, q: jnp.concatenate([jnp.maximum(p[..., :3], q[..., :3]), p[..., 3:] + q[..., 3:]],
                                                     axis=-1), a, b)


def stats_from_probes(probes, microbatches: int = 1) -> dict:
    """Step metrics from the probe gradients of every projection: the shares of x, w and g values
    that underflowed or saturated (means over the projections), and their largest amaxes."""
    leaves = [p.reshape(-1, len(PROBE)) for p in jax.tree.leaves(probes)]
    if not leaves:
        return {}
    allp = jnp.concatenate(leaves, axis=0)
    out = {}
    for i, name in enumerate(PROBE):
        col = allp[:, i]
        out[f"fp8_{name}"] = jnp.max(col) if name.endswith("amax") else jnp.mean(col) / microbatches
    return out


# ---------------------------------------------------------------- the train step's side


def _is_meta(part: str):
    return lambda x: isinstance(x, dict) and part in x


@dataclasses.dataclass(frozen=True)
class TrainingRecipe:
    """FP8 as the train step runs it, behind the interface every precision recipe offers
    (`maxtrain.layers.precision`): what it carries between steps (`state`: the delayed recipe's
    amax histories, saved with the optimizer state under `CHECKPOINT_KEY`), the probes whose
    gradients are its per-step statistics, the meta tree the layers read, and the metrics."""

    CHECKPOINT_KEY = "fp8"  # the key of its state in a checkpoint's opt_state (on-disk: keep it)

    recipe: str  # train.fp8.recipe
    specs: Any  # the model's FP8 meta specs (`Model.fp8_specs`): per projection {"probe": spec[, "history": spec]}
    pipelined: bool  # a stage's probe would be used once per microbatch and bubble: no statistics then

    def _zeros(self, part: str):
        """The specs' leaves named `part` as float32 zeros, in the meta's tree; None when there are none."""
        is_meta = _is_meta(part)
        picked = jax.tree.map(lambda m: jnp.zeros(m[part].shape, jnp.float32) if is_meta(m) else None, self.specs,
                              is_leaf=lambda x: is_meta(x) or hasattr(x, "shape"))
        return picked if jax.tree.leaves(picked) else None

    def state(self) -> dict | None:
        """The recipe's state at step 0 (`{CHECKPOINT_KEY: histories}`), None when it keeps none."""
        histories = self._zeros("history")
        return None if histories is None else {self.CHECKPOINT_KEY: histories}

    def probes(self):
        """Zeros whose gradients are this step's statistics; None when pipelined (and `config`
        refuses the delayed recipe there)."""
        return None if self.pipelined else self._zeros("probe")

    def layer_meta(self, probes, state: dict | None):
        """The meta tree the layers read: each projection's probe, and its history when there is one."""
        if state is None:
            return jax.tree.map(lambda p: {"probe": p}, probes)
        return jax.tree.map(lambda p, h: {"probe": p, "history": h}, probes, state[self.CHECKPOINT_KEY])

    @staticmethod
    def probes_of(meta):
        """The probe leaves of a meta tree (of its gradient: the statistics)."""
        return jax.tree.map(lambda m: m["probe"], meta, is_leaf=_is_meta("probe"))

    @staticmethod
    def combine(a, b):
        return combine_probes(a, b)

    @staticmethod
    def metrics(probe_grads, microbatches: int) -> dict:
        return stats_from_probes(probe_grads, microbatches)

    def next_state(self, state: dict | None, probe_grads) -> dict | None:
        """The state after a step (the histories rolled, this step's amaxes in front)."""
        if state is None:
            return None
        return {self.CHECKPOINT_KEY: updated_histories(state[self.CHECKPOINT_KEY], probe_grads)}


def training_recipe(fp8_cfg, specs, pipelined: bool) -> TrainingRecipe | None:
    """`train.fp8` as the train step's recipe; None for `recipe: none` or a model without FP8
    projections (`specs` None)."""
    if fp8_cfg.recipe == "none" or specs is None:
        return None
    return TrainingRecipe(fp8_cfg.recipe, specs, pipelined)


def check_support(recipe: str, model_name: str, has_projections: bool, device) -> None:
    """`train.fp8` needs a model with FP8 projections and devices that multiply FP8 (on CPU it is
    emulated, with the same rounding: one warning line)."""
    if recipe == "none":
        return
    if not has_projections:
        raise ConfigError(f"train.fp8.recipe={recipe}: model {model_name!r} has no FP8 projections (a layered family "
                          f"declares their meta under layers['fp8'] and runs them through maxtrain.layers.fp8.project; "
                          f"docs/models.md); use train.fp8.recipe=none")
    support = fp8_support(device)
    if support == "none":
        raise ConfigError(f"train.fp8.recipe={recipe}: {device.device_kind} has no FP8 tensor cores (compute "
                          f"capability 8.9+: H100, H200, L40S, B200); use train.fp8.recipe=none")
    if support == "emulated":
        logging.getLogger("maxtrain").warning("train.fp8.recipe=%s on %s: FP8 is emulated (the same rounding, no "
                                              "speed-up)", recipe, device.platform.upper())
