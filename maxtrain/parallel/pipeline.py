"""Pipeline parallelism over the `pipeline` mesh axis (`mesh.pipeline > 1`).

The layer stack is cut into S x R chunks of N / (S R) layers ("virtual stages"); chunk v = r S + s
lives on stage s (the circular, interleaved placement of `train.pipeline_repeats` = R), so a
microbatch goes round the ring of stages R times. Parameters declare it in their shape: every
layer leaf `[N, ...]` becomes `[R, S, N/(S R), ...]` with logical axes `("repeats", "stages",
"layers", ...)`, and `stages` shards over `pipeline` (`stage_specs`). The values are the same as
the unstaged model's, reshaped, so a pipelined run starts from the same initialisation.

Schedule (`schedule`): at iteration t stage s works on item i = t - s, where item i is microbatch
i mod M of repeat i div M (M = `train.microbatches`). All stages run every iteration in one SPMD
program (`lax.scan` inside a `shard_map` that is manual over `pipeline` only, so fsdp, tensor,
sequence and expert keep working inside each stage); the activation moves to the next stage with
one `ppermute` per iteration, and stage 0 parks what comes back from the last stage until that
microbatch's next repeat (M >= S makes it arrive in time). The backward pass is the same program
transposed by autodiff. M R + S - 1 iterations do M R items of work per stage: the bubble is
(S - 1) / (M R + S - 1).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maxtrain.models.specs import ParamSpec

AXIS = "pipeline"


def schedule(stages: int, microbatches: int, repeats: int) -> np.ndarray:
    """`items[t, s]`: the item stage s works on at iteration t, or -1 when it idles (the bubble)."""
    work = microbatches * repeats
    t = np.arange(work + stages - 1)[:, None]
    i = t - np.arange(stages)[None, :]
    return np.where((i >= 0) & (i < work), i, -1)


def bubble_fraction(stages: int, microbatches: int, repeats: int) -> float:
    """Fraction of stage-iterations that idle: (S - 1) / (M R + S - 1)."""
    return (stages - 1) / (microbatches * repeats + stages - 1)


def stage_specs(layer_specs, stages: int, repeats: int):
    """Every `[N, ...]` layer ParamSpec as `[R, S, N/(S R), ...]` (chunk r*S + s at [r, s]),
    initialised as the unstaged leaf reshaped, so both layouts hold the same numbers."""
    def one(spec: ParamSpec) -> ParamSpec:
        n = spec.shape[0]
        shape = (repeats, stages, n // (stages * repeats)) + spec.shape[1:]
        return dataclasses.replace(spec, shape=shape, axes=("repeats", "stages") + spec.axes,
                                   init=lambda key, _, spec=spec: spec.init(key, spec.shape).reshape(shape))
    return jax.tree.map(one, layer_specs, is_leaf=lambda x: isinstance(x, ParamSpec))


def without_axis(rules: dict, axis: str) -> dict:
    """Sharding rules with `axis` removed (inside the pipeline region it is manual, not a sharding)."""
    def strip(v):
        if isinstance(v, list):
            v = [a for a in v if a != axis]
            return v or None
        return None if v == axis else v
    return {k: strip(v) for k, v in rules.items()}


def _split(x, m: int):
    """[B, ...] -> [M, B/M, ...]; microbatch j holds rows j, j+M, ... so each spans every data shard."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _merge(x):
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _at(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _set_if(buf, i, value, cond):
    """`buf[i] = value` where `cond`, touching one slot (not a select over the whole buffer)."""
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(cond, value, _at(buf, i)), i, 0)


def pipeline_layers(stack_fn, x_BLD, layers, rows: dict, *, stages: int, repeats: int, microbatches: int,
                    remat_stage: bool = False):
    """Runs the staged layer stack over the batch: `stack_fn(x, chunk_params, rows) -> (x, stats)`.

    `layers`: leaves `[R, S, c, ...]`; `rows`: per-row arrays `[B, ...]` the layers need (positions,
    segment ids), cut into microbatches like `x`. Returns `(x_BLD, stats)` with stats averaged over
    every (microbatch, chunk) the stack ran on (None when `stack_fn` returns None).

    `remat_stage`: the backward recomputes each stage visit's forward from its input, so a stage
    keeps one activation per in-flight microbatch instead of every layer's saved residuals (the
    layers' own `model.remat` still bounds the memory of one recomputed visit)."""
    S, R, M = stages, repeats, microbatches
    mesh = jax.sharding.get_abstract_mesh()
    x_M = _split(x_BLD, M)
    rows_M = jax.tree.map(lambda a: _split(a, M), rows)
    work = M * R
    perm = [(j, (j + 1) % S) for j in range(S)]
    chunk0 = jax.tree.map(lambda a: a[0, 0], layers)
    stats_shape = jax.eval_shape(stack_fn, x_M[0], chunk0, jax.tree.map(lambda a: a[0], rows_M))[1]

    def visit(inp, layers, r, rows):
        # the chunk is indexed inside, so a rematerialised visit saves its input, not a weight copy
        return stack_fn(inp, jax.tree.map(lambda a: _at(a, r), layers), rows)

    if remat_stage:
        visit = jax.checkpoint(visit, prevent_cse=False)

    def local(x_M, layers, rows_M):
        layers = jax.tree.map(lambda a: a[:, 0], layers)  # this stage's chunks, one per repeat
        s = jax.lax.axis_index(AXIS)

        def iteration(carry, t):
            state, parked, out, stats_sum = carry
            i = t - s
            valid = (i >= 0) & (i < work)
            i = jnp.clip(i, 0, work - 1)
            m, r = i % M, i // M
            first = jnp.where(r == 0, _at(x_M, m), _at(parked, m))
            inp = jnp.where(s == 0, first, state)
            y, stats = visit(inp, layers, r, jax.tree.map(lambda a: _at(a, m), rows_M))
            out = _set_if(out, m, y, valid & (s == S - 1) & (r == R - 1))
            state = jax.lax.ppermute(y, AXIS, perm)
            # stage 0 just received the item the last stage finished; park it for its next repeat
            back = t - (S - 1)
            parked = _set_if(parked, back % M, state, (s == 0) & (back >= 0) & (back < work - M))
            if stats is not None:
                stats_sum = jax.tree.map(lambda a, b: a + jnp.where(valid, b, 0.0), stats_sum, stats)
            return (state, parked, out, stats_sum), None

        zeros = jnp.zeros_like(x_M)
        stats0 = None if stats_shape is None else jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats_shape)
        carry = (zeros[0], zeros, zeros, stats0)
        (_, _, out, stats_sum), _ = jax.lax.scan(iteration, carry, jnp.arange(work + S - 1))
        if stats_sum is not None:
            stats_sum = jax.tree.map(lambda a: jax.lax.psum(a, AXIS) / (work * S), stats_sum)
        return out[None], stats_sum

    layer_specs = jax.tree.map(lambda _: P(None, AXIS), layers)
    stats_specs = None if stats_shape is None else jax.tree.map(lambda _: P(), stats_shape)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), layer_specs, P()), out_specs=(P(AXIS), stats_specs),
                       axis_names=frozenset({AXIS}), check_vma=False)
    out, stats = fn(x_M, layers, rows_M)
    return _merge(out[S - 1]), stats
