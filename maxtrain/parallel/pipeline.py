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
(S - 1) / (M R + S - 1). This is `train.pipeline_schedule=gpipe`, and the forward of every schedule
(evaluation).

The other schedules (1f1b, interleaved, zero_bubble) train through `execute`, which runs a
`schedules.Lowered` table: forwards, the loss of each microbatch on the last chunk, and a
backward scheduled by hand (see its docstring and docs/parallelism.md#schedules).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maxtrain.models.specs import ParamSpec
from maxtrain.parallel import schedules as sch

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


def split_microbatches(x, m: int):
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
    x_M = split_microbatches(x_BLD, M)
    rows_M = jax.tree.map(lambda a: split_microbatches(a, M), rows)
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
        stats0 = None if stats_shape is None else _zeros(stats_shape)
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


# ---------------------------------------------------------------------------------------------------
# Scheduled pipelines (`train.pipeline_schedule`: 1f1b, interleaved, zero_bubble): the forward and a
# hand-scheduled backward in one SPMD program that executes a `schedules.Lowered` table.


def _residuals(pull, refs: list):
    """A `jax.vjp` pullback's residual leaves, split into those that are one of `refs` (the chunk's
    weights and the microbatch's rows: present again at the backward, never stored per microbatch)
    and the rest, which a forward stores. Returns (stored leaves, where, treedef): `where[i]` is
    the index in `refs` of leaf i, or -1 for a stored one."""
    leaves, tree = jax.tree.flatten(pull)
    index = {id(r): i for i, r in enumerate(refs)}
    where = tuple(index.get(id(leaf), -1) for leaf in leaves)
    return [leaf for leaf, w in zip(leaves, where) if w < 0], where, tree


def _pullback(stage, chunk, msg, rows, stored: list):
    """The pullback of `stage` at a forward whose residuals were `stored`: the forward is traced
    again for the pullback's structure only (its values are replaced by the stored ones, so the
    compiler drops its computation)."""
    _, pull = jax.vjp(lambda c, x: stage(c, x, rows), chunk, msg)
    refs = jax.tree.leaves((chunk, rows))
    fresh, where, tree = _residuals(pull, refs)
    if [(a.shape, a.dtype) for a in fresh] != [(a.shape, a.dtype) for a in stored]:
        raise AssertionError("pipeline: a stage's residuals changed structure between its forward and backward")
    stored = iter(stored)
    return jax.tree.unflatten(tree, [refs[w] if w >= 0 else next(stored) for w in where])


def _zeros(tree, dtype=None):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree)


def _struct(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


_LOWERED_FIELDS = ("kind", "branch", "microbatch", "repeat", "first", "inbox_slot", "saved_slot", "grads_slot", "recv_inbox",
                   "recv_grads")


def execute(stack_fn, tail_fn, layers, tail_params, x_M, rows_M, batch_M, lowered):
    """Runs a lowered schedule: every microbatch's forward through the staged layers, its loss on
    the last chunk, and its backward, in the table's order, in one `shard_map` over `pipeline`.

    - `stack_fn(x, chunk, rows) -> (y, stats or None)`: one chunk of layers (leaves `[c, ...]`);
    - `tail_fn(tail_params, y, stats, batch) -> (total, loss_stats)`: the loss of one microbatch
      from the last chunk's output, `stats` the layers' statistics averaged over the whole stack;
    - `layers`: leaves `[R, S, c, ...]`; `x_M` `[M, b, ...]` the embedded microbatches; `rows_M`
      and `batch_M` per-microbatch pytrees `[M, b, ...]`.

    Returns `((total, loss_stats), (d_layers, d_tail_params, d_x_M), trace)`: the losses summed
    over microbatches, their gradients (float32 sums), and `trace` `[S, ticks]`, the kind of
    operation each stage executed at each tick (`schedules.IDLE` ...).

    A forward keeps its chunk's `jax.vjp` residuals in a slot of the stage's `saved` buffer (the
    model's remat policy decides how large they are; the chunk's weights are not copied) until its
    backward; activations and gradients wait in `inbox`/`grads_in` slots from the tick their
    neighbour sends them (one `ppermute` each way per tick) until they are used. Slot counts are the
    table's, so a 1F1B stage holds at most S microbatches' residuals, not M."""
    mesh = jax.sharding.get_abstract_mesh()
    tables = {k: jnp.asarray(getattr(lowered, k)) for k in _LOWERED_FIELDS}
    layer_specs = jax.tree.map(lambda _: P(None, AXIS), layers)
    fn = jax.shard_map(functools.partial(_run_stage, stack_fn, tail_fn, lowered), mesh=mesh,
                       in_specs=(layer_specs, P(), P(), P(), P(), P()),
                       out_specs=(P(), layer_specs, P(), P(), P(AXIS)), axis_names=frozenset({AXIS}),
                       check_vma=False)
    loss, d_layers, d_tail, dx_M, trace = fn(layers, tail_params, x_M, rows_M, batch_M, tables)
    return loss, (d_layers, d_tail, dx_M), trace


def _run_stage(stack_fn, tail_fn, lowered, layers, tail_params, x_M, rows_M, batch_M, tables):
    """One stage's part of `execute` (inside the `shard_map`): its operations, the scan of `_tick`
    over the table's rows, and the sums over stages of what it accumulated."""
    S, R = lowered.table.stages, lowered.table.repeats
    layers = jax.tree.map(lambda a: a[:, 0], layers)  # this stage's R chunks
    s = jax.lax.axis_index(AXIS)
    ops, saved_s, loss_s = _stage_ops(stack_fn, tail_fn, S * R, layers, tail_params, x_M, rows_M, batch_M)
    perms = ([(j, (j + 1) % S) for j in range(S)], [(j, (j - 1) % S) for j in range(S)])
    carry = _empty_carry(lowered.slots, ops.msg0, saved_s, layers, tail_params, loss_s, x_M)
    tick = functools.partial(_tick, ops, s, layers, (x_M, rows_M, batch_M), perms)
    c, trace = jax.lax.scan(tick, carry, tables)
    # the loss's gradients live on the last stage, the inputs' on the first: summed over stages
    # (zeros elsewhere), they leave replicated like the inputs came in
    acc_tail, acc_loss, dx_M = jax.lax.psum((c.acc_tail, c.acc_loss, c.dx_M), AXIS)
    return (acc_loss, jax.tree.map(lambda a: a[:, None], c.acc_layers), acc_tail, dx_M, trace[None])


def _chunk_stage(stack_fn, chunk, msg, rows):
    """One chunk's layers on a message (activation, statistics summed over the chunks so far)."""
    x, acc = msg
    y, stats = stack_fn(x, chunk, rows)
    return y, (acc if stats is None else jax.tree.map(jnp.add, acc, stats))


def _tail_loss(tail_fn, visits, tail_params, msg, batch):
    """The loss of the last chunk's message, its statistics averaged over the `visits` chunks of
    the stack (None: the layers keep none)."""
    y, acc = msg
    mean = None if visits is None else jax.tree.map(lambda a: a / visits, acc)
    return tail_fn(tail_params, y, mean, batch)


def _forward_saving(stage, chunk, msg, rows):
    """The chunk's output and the residuals its backward needs that a forward stores."""
    y, pull = jax.vjp(lambda c, x: stage(c, x, rows), chunk, msg)
    return y, _residuals(pull, jax.tree.leaves((chunk, rows)))[0]


class _Operands(NamedTuple):
    """What a tick's operation reads (every branch of the switch gets the same)."""
    chunk: Any  # this stage's chunk of the tick's repeat
    msg: Any  # the forward's input message: the microbatch's embedding on the first chunk
    dy: Any  # the backward's output gradient (zeros where the tick has no backward)
    saved: list  # the residuals in the tick's saved slot
    rows: Any
    batch: Any
    loss_here: Any  # a FORWARD_LOSS tick: the last chunk, whose loss counts


@dataclasses.dataclass(frozen=True)
class _StageOps:
    """The operations a stage can run at a tick, as the branches of one `lax.switch`, each
    returning every output of a tick (`idle`'s zeros where it has nothing to give)."""
    stage: Any  # (chunk, msg, rows) -> msg
    tail_grad: Any  # (tail_params, msg, batch) -> ((total, stats), (d_tail_params, d_msg))
    tail_params: Any
    msg0: tuple  # a zero message: activation and statistics
    idle: dict

    @property
    def branches(self):
        """In the order of the table's branch codes (`schedules.IDLE` ... `BACKWARD_WEIGHTS`)."""
        return [lambda ops: self.idle, lambda ops: self.forward(ops, False), lambda ops: self.forward(ops, True),
                lambda ops: self.backward(ops, sch.BACKWARD), lambda ops: self.backward(ops, sch.BACKWARD_INPUT),
                lambda ops: self.backward(ops, sch.BACKWARD_WEIGHTS)]

    def forward(self, ops: _Operands, with_loss: bool):
        """The chunk's forward, keeping its residuals; `with_loss`: also the microbatch's loss and
        its gradients (the tail's, and the output gradient the backward starts from)."""
        f32 = jnp.float32
        y, saved = _forward_saving(self.stage, ops.chunk, ops.msg, ops.rows)
        out = dict(self.idle, send_f=y, saved=saved, code=jnp.int32(sch.FORWARD_LOSS if with_loss else sch.FORWARD))
        if not with_loss:
            return out
        # an aligned forward tick runs the loss on every stage; only the last chunk's counts
        y_loss = jax.tree.map(lambda a: jnp.where(ops.loss_here, a, jnp.zeros_like(a)), y)
        loss, (dtail, dy) = self.tail_grad(self.tail_params, y_loss, ops.batch)
        keep = lambda tree: jax.tree.map(lambda a: jnp.where(ops.loss_here, a, jnp.zeros_like(a)), tree)  # noqa: E731
        return dict(out, loss=keep(loss), dtail=keep(_as(dtail, f32)), dy_self=dy)

    def backward(self, ops: _Operands, code: int):
        """The chunk's backward from its stored residuals: the input gradient it sends back
        (unless `code` is BACKWARD_WEIGHTS) and the chunk's weight gradient (unless BACKWARD_INPUT)."""
        pull = _pullback(self.stage, ops.chunk, self.msg0, ops.rows, ops.saved)
        dchunk, dmsg = pull(ops.dy)
        out = dict(self.idle, code=jnp.int32(code))
        if code != sch.BACKWARD_WEIGHTS:
            out["send_b"] = dmsg
        if code != sch.BACKWARD_INPUT:
            out["dchunk"] = _as(dchunk, jnp.float32)
        return out


def _stage_ops(stack_fn, tail_fn, visits: int, layers, tail_params, x_M, rows_M, batch_M):
    """A stage's `_StageOps`, and the shapes of the residuals a forward stores and of a loss (the
    carry's buffers). `layers`: the stage's chunks `[R, c, ...]`; `visits`: chunks per microbatch."""
    chunk_s = _struct(jax.tree.map(lambda a: a[0], layers))
    rows_s, batch_s = _struct(jax.tree.map(lambda a: a[0], rows_M)), _struct(jax.tree.map(lambda a: a[0], batch_M))
    stats_s = jax.eval_shape(stack_fn, _struct(x_M[0]), chunk_s, rows_s)[1]
    msg0 = (jnp.zeros_like(x_M[0]), () if stats_s is None else _zeros(stats_s))
    stage = functools.partial(_chunk_stage, stack_fn)
    tail = functools.partial(_tail_loss, tail_fn, None if stats_s is None else visits)
    saved_s = jax.eval_shape(functools.partial(_forward_saving, stage), chunk_s, _struct(msg0), rows_s)[1]
    loss_s = jax.eval_shape(tail, _struct(tail_params), _struct(msg0), batch_s)
    f32 = jnp.float32
    idle = dict(send_f=msg0, send_b=msg0, saved=_zeros(saved_s), dchunk=_zeros(chunk_s, f32),
                dtail=_zeros(tail_params, f32), loss=_zeros(loss_s), dy_self=msg0, code=jnp.int32(sch.IDLE))
    tail_grad = jax.value_and_grad(tail, argnums=(0, 1), has_aux=True)
    return _StageOps(stage, tail_grad, tail_params, msg0, idle), saved_s, loss_s


class _Carry(NamedTuple):
    """A stage's state from tick to tick: slots of arrived activations (`inbox`) and output
    gradients (`grads_in`), stored forward residuals (`saved`), and the sums `execute` returns."""
    inbox: Any
    grads_in: Any
    saved: list
    acc_layers: Any
    acc_tail: Any
    acc_loss: Any
    dx_M: Any


def _empty_carry(slot_counts, msg0, saved_s, layers, tail_params, loss_s, x_M) -> _Carry:
    """Empty slots (the table's counts, at least one each) and zero sums."""
    n_inbox, n_grads, n_saved = slot_counts
    slots = lambda n, tree: jax.tree.map(lambda a: jnp.zeros((max(n, 1),) + a.shape, a.dtype), tree)  # noqa: E731
    f32 = jnp.float32
    return _Carry(slots(n_inbox, msg0), slots(n_grads, msg0),
                  [jnp.zeros((max(n_saved, 1),) + a.shape, a.dtype) for a in saved_s],
                  _zeros(layers, f32), _zeros(tail_params, f32), _zeros(loss_s), jnp.zeros_like(x_M))


class _Row(NamedTuple):
    """This stage's entries of one tick of the lowered table (`schedules.Lowered`), -1s clamped."""
    kind: Any
    branch: Any
    first: Any  # the microbatch's first chunk: its input is the embedding, its input gradient dx
    m: Any
    r: Any
    in_slot: Any
    saved_slot: Any
    grads_slot: Any
    recv_inbox: Any  # the slot an arriving activation goes to, -1: none arrives
    recv_grads: Any

    @classmethod
    def of(cls, row: dict, s) -> _Row:
        at = {k: _at(v, s) for k, v in row.items()}
        first = at["first"] > 0
        m, r = jnp.maximum(at["microbatch"], 0), jnp.maximum(at["repeat"], 0)
        in_slot, saved_slot, grads_slot = (jnp.maximum(at[k], 0) for k in ("inbox_slot", "saved_slot", "grads_slot"))
        return cls(at["kind"], at["branch"], first, m, r, in_slot, saved_slot, grads_slot, at["recv_inbox"],
                   at["recv_grads"])


def _tick(ops: _StageOps, s, layers, inputs, perms, carry: _Carry, row: dict):
    """One tick on stage s: gather the operands, run the table's operation, keep what it left,
    exchange messages with the neighbours. Returns the carry and the operation's code."""
    t = _Row.of(row, s)
    out = jax.lax.switch(t.branch, ops.branches, _operands(ops, t, carry, layers, inputs))
    carry = _exchange(_keep(carry, t, out), t, out, perms)
    return carry, jnp.where(t.kind == sch.IDLE, sch.IDLE, out["code"])


def _operands(ops: _StageOps, t: _Row, carry: _Carry, layers, inputs) -> _Operands:
    """The tick's chunk, its input message (fresh on a first chunk, else the one that arrived),
    output gradient and stored residuals, and the microbatch's rows and batch."""
    x_M, rows_M, batch_M = inputs
    chunk = jax.tree.map(lambda a: _at(a, t.r), layers)
    arrived = jax.tree.map(lambda b: _at(b, t.in_slot), carry.inbox)
    # a stage without a backward this tick (an aligned table's) pulls back a zero gradient:
    # its weight gradient and the input gradient it sends are zeros
    backward_here = t.kind >= sch.BACKWARD
    dy = jax.tree.map(lambda b: jnp.where(backward_here, _at(b, t.grads_slot), 0), carry.grads_in)
    msg = jax.tree.map(lambda fresh, a: jnp.where(t.first, fresh, a), (_at(x_M, t.m), ops.msg0[1]), arrived)
    return _Operands(chunk, msg, dy, [_at(b, t.saved_slot) for b in carry.saved],
                     jax.tree.map(lambda a: _at(a, t.m), rows_M), jax.tree.map(lambda a: _at(a, t.m), batch_M),
                     t.kind == sch.FORWARD_LOSS)


def _keep(c: _Carry, t: _Row, out: dict) -> _Carry:
    """What the tick's operation leaves on its stage: a forward's residuals in their slot, the
    gradient and loss sums, and a first chunk's input gradient."""
    forward_ran = (t.kind == sch.FORWARD) | (t.kind == sch.FORWARD_LOSS)
    saved = [_set_if(b, t.saved_slot, v, forward_ran) for b, v in zip(c.saved, out["saved"])]
    acc_layers = jax.tree.map(lambda a, d: jax.lax.dynamic_update_index_in_dim(a, _at(a, t.r) + d, t.r, 0),
                              c.acc_layers, out["dchunk"])
    acc_tail = jax.tree.map(jnp.add, c.acc_tail, out["dtail"])
    acc_loss = jax.tree.map(jnp.add, c.acc_loss, out["loss"])
    input_grad = (t.kind == sch.BACKWARD) | (t.kind == sch.BACKWARD_INPUT)
    dx_M = _set_if(c.dx_M, t.m, out["send_b"][0], input_grad & t.first)
    return c._replace(saved=saved, acc_layers=acc_layers, acc_tail=acc_tail, acc_loss=acc_loss, dx_M=dx_M)


def _exchange(c: _Carry, t: _Row, out: dict, perms) -> _Carry:
    """Sends the tick's activation to the next stage and its input gradient to the previous one
    (one `ppermute` each way), and files what arrives, and a loss's own output gradient, in the
    slots the table names."""
    fwd_perm, bwd_perm = perms
    got_f = jax.lax.ppermute(out["send_f"], AXIS, fwd_perm)
    got_b = jax.lax.ppermute(out["send_b"], AXIS, bwd_perm)
    recv_in, recv_gr = t.recv_inbox, t.recv_grads
    inbox = jax.tree.map(lambda b, v: _set_if(b, jnp.maximum(recv_in, 0), v, recv_in >= 0), c.inbox, got_f)
    grads_in = jax.tree.map(lambda b, v: _set_if(b, jnp.maximum(recv_gr, 0), v, recv_gr >= 0), c.grads_in, got_b)
    grads_in = jax.tree.map(lambda b, v: _set_if(b, t.grads_slot, v, t.kind == sch.FORWARD_LOSS), grads_in,
                            out["dy_self"])
    return c._replace(inbox=inbox, grads_in=grads_in)


def _as(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype), tree)


def scheduled_loss(stack_fn, tail_fn, layers, tail_params, x_M, rows_M, batch_M, lowered):
    """`(total, loss_stats)` of `execute`, differentiable: its backward returns the gradients the
    schedule computed (scaled by the total's cotangent), so `jax.value_and_grad` of a loss built
    on it runs the hand-scheduled backward instead of transposing the forward."""
    def run(layers, tail_params, x_M):
        return execute(stack_fn, tail_fn, layers, tail_params, x_M, rows_M, batch_M, lowered)

    @jax.custom_vjp
    def loss(layers, tail_params, x_M):
        return run(layers, tail_params, x_M)[0]

    def fwd(layers, tail_params, x_M):
        value, grads, _ = run(layers, tail_params, x_M)
        like = (layers, tail_params, x_M)
        return value, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, like)

    def bwd(grads, cotangent):
        g = cotangent[0]  # the total's; the statistics are not differentiated
        return jax.tree.map(lambda d: (g * d).astype(d.dtype), grads)

    loss.defvjp(fwd, bwd)
    return loss(layers, tail_params, x_M)
