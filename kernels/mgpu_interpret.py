"""Teaches jax 0.10's Mosaic GPU interpreter what the Hopper kernels use beyond it.

`jax._src.pallas.mosaic_gpu.interpret` runs Mosaic GPU kernels on a CPU (threads, shared memory,
barriers, TMA copies), but its `wgmma` reads both operands from shared memory through plain
index transforms only. `kernels/flash_hopper.py` also feeds the left operand from registers
(P and dS, as FlashAttention-3 does) and the right one through `plgpu.transpose_ref` (K^T, V^T,
Q^T, dO^T). `install()` replaces the interpreter's wgmma rule with one that takes both, and
gives register-layout casts an identity CPU lowering and `plgpu.load` the state read's rule;
every other rule is jax's own. Only the interpreter changes: what runs on a GPU is the same kernel.

wgmma is asynchronous on the GPU: it reads its shared-memory operands and writes its accumulator
at some point before the warpgroup next waits for it (reading the accumulator, `acc[...]`, waits
for all but `wait_n` of the warpgroup's wgmmas). jax's interpreter runs it at issue, and its
operand reads are invisible to the race detector, which hides the bug of releasing or overwriting
an operand's buffer between issue and wait. Here a wgmma is
only queued at issue (a left operand in registers is taken then: registers are values) and runs
at the wait, the latest moment the hardware may run it, so such a bug reads the new contents; with
`InterpretGPUParams(detect_races=True)` the interpreter's happens-before race detector sees the
operand reads at both ends of the window the hardware may make them in (issue and wait) and
reports a write to the operand inside that window (a release before the wait) as a race. A wgmma
still queued when its warpgroup moves to the next CTA was never awaited: reported the same way.

It reads jax internals (`jax._src`); `install()` raises `ImportError` on a jax whose interpreter
does not look like 0.10's, and callers fall back (tests skip with that reason).
"""

from __future__ import annotations

import functools
import threading
import types
import weakref

import numpy as np

_INSTALLED = False
# Each simulated warpgroup's issued, not yet awaited wgmmas: id(the kernel's shared memory) ->
# (a weak reference to it, {global thread id: [(grid point, thunk)], oldest first}). Only that
# warpgroup's own thread touches its list; a kernel's queues go when its shared memory does.
_PENDING: dict[int, tuple] = {}
_PENDING_LOCK = threading.Lock()


def _split(transforms, noop_types, ndindexer_type):
    """(leading index transforms, everything after them) with tiling/swizzle views dropped: the
    interpreter stores buffers in their logical (untiled) shape."""
    transforms = [t for t in transforms if not isinstance(t, noop_types)]
    lead = 0
    while lead < len(transforms) and isinstance(transforms[lead], ndindexer_type):
        lead += 1
    return transforms[:lead], transforms[lead:]


def _apply_rest(x: np.ndarray, rest, ndindexer_type, transpose_type, to_slice) -> np.ndarray:
    for t in rest:
        if isinstance(t, transpose_type):
            x = np.transpose(x, t.permutation)
        elif isinstance(t, ndindexer_type):
            x = x[tuple(to_slice(i) for i in t.indices)]
        else:
            raise NotImplementedError(f"wgmma operand transform {t} in GPU interpret mode")
    return x


def install() -> None:
    """Puts the shim into jax's Mosaic GPU interpreter, once per process: the asynchronous wgmma
    (`_Wgmma`, through `_wgmma_rule` and `_deref_rule`) and register layouts read as plain values
    (`_teach_layouts`). `ImportError` on a jax whose interpreter is not the one the shim knows."""
    global _INSTALLED
    if _INSTALLED:
        return
    jx = _jax_internals()
    wgmma = _Wgmma(jx)
    jx.ji.JaxprInterpreter._interpret_wgmma_ref_p = functools.partialmethod(_wgmma_rule, wgmma)
    jx.ji.JaxprInterpreter._interpret_wgmma_accumulator_deref_p = functools.partialmethod(_deref_rule, wgmma)
    _teach_layouts(jx)
    _INSTALLED = True


def _jax_internals() -> types.SimpleNamespace:
    """The jax internals the shim reads and replaces, checked to be there as in jax 0.10."""
    try:
        import jax
        import jax.numpy as jnp
        from jax._src import callback
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
        from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as ji
        from jax._src.pallas.mosaic.interpret import utils as iu
        from jax._src.pallas.mosaic.interpret import vector_clock as vc
        from jax._src.pallas.mosaic.interpret import race_detection_state as rd
        from jax._src import source_info_util
        from jax._src.state import indexing
        from jax._src.state import types as state_types
        from jax._src.interpreters import mlir
        from jax._src.pallas.mosaic_gpu import core as mgpu_core
        from jax._src.pallas.mosaic_gpu import primitives as mgpu_primitives
        from jax._src.state import primitives as state_primitives
        noop = gc.NOOP_TRANSFORMS
        ji.JaxprInterpreter._interpret_wgmma_ref_p  # noqa: B018  (the rules being replaced)
        ji.JaxprInterpreter._interpret_wgmma_accumulator_deref_p  # noqa: B018
        mgpu_primitives.wgmma_wait_p  # noqa: B018
        rd._ranges_overlap  # noqa: B018  (used by the wgmma read window check)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"this jax's Mosaic GPU interpreter is not the one the shim knows: {e}") from e
    return types.SimpleNamespace(
        jax=jax, jnp=jnp, callback=callback, gc=gc, ji=ji, iu=iu, vc=vc, rd=rd, source_info_util=source_info_util,
        state_types=state_types, mlir=mlir, mgpu_core=mgpu_core, mgpu_primitives=mgpu_primitives,
        state_primitives=state_primitives, noop=noop, ndx=indexing.NDIndexer, tr=state_types.TransposeTransform)


def _report(races, message):
    """A synchronisation bug, reported as jax's detector reports a race: printed, and
    `races_found` (when detecting; `races` is None otherwise)."""
    print(message, flush=True)
    if races is not None:
        with races.lock:
            races.races_found = True


class _Wgmma:
    """The host side of an asynchronous wgmma (the module's docstring): `issue` queues acc += a @ b
    for the issuing warpgroup, `wait` runs the warpgroup's queue down to `wait_n` and reads the
    accumulator; with race detection, the operand reads span the window between the two."""

    def __init__(self, jx: types.SimpleNamespace):
        self.jx = jx

    def issue(self, *, token, device_id, grid_point_coords, thread_id, acc, acc_transforms, acc_dtype,
              a, a_transforms, a_in_regs, b, b_transforms, source_info=None):
        """Queues acc += a @ b for this warpgroup; `wait` runs it."""
        jx = self.jx
        shared_memory, thread, info = self.context(device_id, grid_point_coords, thread_id, source_info)
        lhs_regs = np.asarray(a) if a_in_regs else None
        acc_key = jx.gc.HostAllocationKey.from_array(acc)
        acc_range = jx.iu.to_range(jx.jax.tree.map(int, jx.gc._remove_noop_transforms(acc_transforms)))
        issued = self.issue_clock(shared_memory, thread)

        def run():
            lhs = lhs_regs if a_in_regs else self.read(shared_memory, a, a_transforms, thread, info, issued)
            rhs = self.read(shared_memory, b, b_transforms, thread, info, issued)
            cur, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, thread, logging_info=info)
            res = cur + np.matmul(lhs.astype(np.float32), rhs.astype(np.float32)).astype(acc_dtype)
            shared_memory.store_buffer_content(acc_key, acc_range, res, thread, logging_info=info)

        self.queue_of(shared_memory, thread, info.grid_point_coords).append((info.grid_point_coords, run))
        return token

    def wait(self, *, token, device_id, grid_point_coords, thread_id, acc, wait_n, source_info=None):
        """Runs this warpgroup's queued wgmmas, oldest first, until at most `wait_n` are left
        (`wait_n=None`: none run), then reads the accumulator."""
        shared_memory, thread, info = self.context(device_id, grid_point_coords, thread_id, source_info)
        queue = self.queue_of(shared_memory, thread, info.grid_point_coords)
        while wait_n is not None and len(queue) > wait_n:
            queue.pop(0)[1]()
        value, _, _ = shared_memory.get_buffer_content(
            self.jx.gc.HostAllocationKey.from_array(acc), (), thread, logging_info=info)
        return token, value

    def context(self, device_id, grid_point_coords, thread_id, source_info):
        """(this kernel's shared memory, the calling warpgroup's global thread id, its logging info)."""
        device_id, thread_id = int(device_id), int(thread_id)
        shared_memory = self.jx.gc._get_shared_memory()
        info = self.jx.iu.GPULoggingInfo(device_id=device_id,
                                         grid_point_coords=tuple(int(x) for x in grid_point_coords),
                                         thread_id=thread_id, source_info=source_info)
        return shared_memory, shared_memory.get_global_thread_id(device_id, thread_id), info

    def issue_clock(self, shared_memory, thread):
        """The issuing warpgroup's vector clock, advanced (None without race detection)."""
        if not shared_memory.detect_races:
            return None
        vc = self.jx.vc
        with shared_memory.lock:
            vc.inc_vector_clock(shared_memory.clocks[thread], thread)
            return vc.copy_vector_clock(shared_memory.clocks[thread])

    def queue_of(self, shared_memory, thread, grid_point):
        """This warpgroup's queue in this kernel's shared memory. A wgmma queued at another grid
        point (CTA) was never awaited, which on the GPU loses its result: reported like a race
        (printed, and `races_found` when detecting), since raising here would hang the other
        simulated threads on their barriers."""
        with _PENDING_LOCK:
            owner, queues = _PENDING.get(id(shared_memory), (None, None))
            if owner is None or owner() is not shared_memory:  # the kernel's first wgmma (ids recycle)
                owner, queues = weakref.ref(shared_memory), {}
                _PENDING[id(shared_memory)] = owner, queues
                weakref.finalize(shared_memory, _PENDING.pop, id(shared_memory), None)
            queue = queues.setdefault(thread, [])
        if queue and queue[0][0] != grid_point:
            _report(self.jx.gc.get_races() if shared_memory.detect_races else None,
                    f"WGMMA NEVER AWAITED\n  issued by warpgroup {thread} at grid point {queue[0][0]}: read "
                    "its accumulator before the CTA ends")
            queue.clear()
        return queue

    def read(self, shared_memory, key_array, transforms, thread, info, issued):
        """A wgmma operand from shared memory, a read the race detector sees (jax's rule skips it)
        over the whole window the hardware may make it in: from the issue (`issued`, that
        moment's vector clock) to the wait (now)."""
        jx = self.jx
        lead, rest = _split(transforms, jx.noop, jx.ndx)
        key, rnge = jx.gc.HostAllocationKey.from_array(key_array), jx.iu.to_range(jx.jax.tree.map(int, lead))
        x, _, clock = shared_memory.get_buffer_content(key, rnge, thread, logging_info=info)
        if shared_memory.detect_races:
            races = jx.gc.get_races()
            races.check_read(info.device_id, info.thread_id, clock, key, rnge, source_info=info.source_info)
            self.check_window(races, key, rnge, issued, clock, info)
        return _apply_rest(np.asarray(x), rest, jx.ndx, jx.tr, jx.iu._transform_slice_or_index)

    def check_window(self, races, key, rnge, issued, waited, info):
        """A write to the operand neither before the issue nor after the wait in happens-before
        order landed while the wgmma may have been reading it. (The detector's own check takes a
        read as one moment, and any write ordered after it as safe.)"""
        vc = self.jx.vc
        with races.lock:
            writes = list(races.writes[key])
        for _, _, w_clock, w_range, w_frame in writes:
            if vc.lt(w_clock, issued) or vc.lt(waited, w_clock) or not self.jx.rd._ranges_overlap(rnge, w_range):
                continue
            where = self.jx.source_info_util.summarize(info.source_info) if info.source_info else "wgmma"
            _report(races, f"RACE DETECTED\n  wgmma operand {key}[{rnge}] read by warpgroup {info.thread_id} "
                           f"between issue (clock {issued}) and wait (clock {waited}), {where}"
                           f"\n  written inside that window: {w_frame}, clock {w_clock}\n")
            return


def _wgmma_rule(interp, wgmma: _Wgmma, eqn, token, get_invals):
    """The interpreter's rule for a wgmma (`interp` is the interpreter): an ordered host callback
    to `_Wgmma.issue`, with the left operand from registers or shared memory."""
    jx = wgmma.jx
    acc, a, b, *leaves = get_invals()
    empty = jx.jax.tree.structure([])
    acc_t, a_t, b_t = jx.jax.tree.unflatten(
        jx.jax.tree_util.treedef_tuple((eqn.params["acc_transforms_tree"] or empty,
                                        eqn.params["a_transforms_tree"] or empty,
                                        eqn.params["b_transforms_tree"] or empty)), leaves)
    a_in_regs = not isinstance(eqn.invars[1].aval, jx.state_types.AbstractRef)
    return jx.callback.io_callback(
        functools.partial(wgmma.issue, acc_dtype=jx.jnp.dtype(eqn.invars[0].aval.dtype),
                          a_in_regs=a_in_regs, source_info=eqn.source_info),
        jx.gc.TOKEN_SHAPE_DTYPE, token=token, device_id=interp.device_info.device_id,
        grid_point_coords=interp.grid_point_coords, thread_id=interp.thread_id,
        acc=acc, acc_transforms=acc_t, a=a, a_transforms=a_t, b=b, b_transforms=b_t,
        ordered=True), []


def _deref_rule(interp, wgmma: _Wgmma, eqn, token, get_invals):
    """The interpreter's rule for reading a wgmma accumulator: an ordered host callback to `_Wgmma.wait`."""
    jx = wgmma.jx
    acc, = get_invals()
    return jx.callback.io_callback(
        functools.partial(wgmma.wait, wait_n=eqn.params["wait_n"], source_info=eqn.source_info),
        (jx.gc.TOKEN_SHAPE_DTYPE, eqn.outvars[0].aval), token=token,
        device_id=interp.device_info.device_id, grid_point_coords=interp.grid_point_coords,
        thread_id=interp.thread_id, acc=acc, ordered=True)


def _teach_layouts(jx: types.SimpleNamespace) -> None:
    """Register layouts mean nothing on a CPU: a layout hint becomes the identity, a load with a
    layout the plain state read; and an explicit `plgpu.wgmma_wait` is refused (jax drops it)."""
    # A register-layout hint (`plgpu.layout_cast`, `broadcasted_iota(layout=)`) means nothing on a
    # CPU; the interpreter binds it as ordinary arithmetic, so it needs an (identity) CPU lowering.
    jx.mlir.register_lowering(jx.mgpu_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")

    # `plgpu.load(ref, idx, layout=...)` is a read of `ref` with a register layout: interpret it
    # as the plain state read (`ref[idx]`) the interpreter knows, at every nesting level.
    load_p, get_p = jx.mgpu_primitives.load_p, jx.state_primitives.get_p
    wait_p = jx.mgpu_primitives.wgmma_wait_p
    base_interpret = jx.ji.JaxprInterpreter.interpret

    def interpret(self, jaxpr, token, *args):
        if any(e.primitive is wait_p for e in jaxpr.eqns):
            # jax's interpreter drops it; queued wgmmas would then run late, at the next read
            raise NotImplementedError("plgpu.wgmma_wait in GPU interpret mode: wait through the "
                                      "accumulator read (acc[...]) instead")
        if any(e.primitive is load_p for e in jaxpr.eqns):
            jaxpr = jaxpr.replace(eqns=[
                e.replace(primitive=get_p, params={"tree": e.params["tree"]}) if e.primitive is load_p else e
                for e in jaxpr.eqns])
        return base_interpret(self, jaxpr, token, *args)

    jx.ji.JaxprInterpreter.interpret = interpret
