"""Flash attention for Hopper (sm_90) in Pallas' Mosaic GPU lowering: wgmma, TMA, warp specialisation.

`flash_attention(..., backend="mosaic")` (`kernels/flash.py`) runs these kernels in place of the
Triton ones; masks, padding, block skipping, the custom VJP and the residuals (base-2 log-sum-exp
`[B, H, L]`) are shared with it, so both backends compute the same function and are checked
against the same reference.

Forward, FlashAttention-3 style. One CTA per (128 query rows, batch, head) with three warpgroups:

- a producer warpgroup streams the K and V blocks of the query head's KV head (GQA: never
  repeated) into a ring of `stages` shared-memory slots with TMA, and refills a slot once both
  consumers have released it;
- two consumer warpgroups, 64 query rows each, compute S = Q K^T with wgmma (Q and K from shared
  memory, K^T through a transposed view), the online softmax in float32 registers, and O += P V
  with P straight from registers (no shared-memory round trip);
- a schedule barrier ping-pongs the consumers, so one's softmax overlaps the other's matmuls.

Block skipping is `kernels/flash.py`'s: each consumer computes the key blocks that can hold a
visible score for its rows (causal, sliding window, padding) and masks only the blocks on the
diagonal or window edge. The producer loads the union of both consumers' blocks; a consumer walks
the blocks outside its own range through the same barriers without computing.

Backward, two kernels with the same layout of work as the Triton ones (no atomics):

- dQ: one CTA per (64·C query rows, batch, head); C consumer warpgroups of 64 rows each walk the
  key blocks the producer streams (S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K).
- dK/dV: one CTA per (64·C key rows, batch, KV head); the consumers keep their K, V block and
  walk every query block of every query head of the group the producer streams (Q, dO, lse,
  delta), so dK/dV of a KV head are summed in registers. It works key-major (S^T = K Q^T,
  dV += P^T dO, dK += dS^T Q): P^T and dS^T are left operands straight from registers.

Segment ids (packed documents): each consumer keeps its rows' ids in registers and the producer
streams the ids of each block beside it; with ids every visited block is masked (as in the Triton
kernels, whose ranges these share). On a CPU the kernels run in
jax's Mosaic GPU interpreter (`interpret=True`), extended by `kernels/mgpu_interpret.py` with the
wgmma operand forms used here, and `tests/test_kernels.py` lowers them for sm_90 on any machine.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maxtrain.errors import ConfigError
from maxtrain.kernels.flash_masks import kv_major_ranges, q_major_ranges, score_mask
from maxtrain.targets import compute_capability

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the jax build
    plgpu = None

ROWS = 64  # query rows per consumer warpgroup: one wgmma M tile
CONSUMERS = 2  # consumer warpgroups per CTA
# setmaxnreg split of the 64K-register file over 3 x 128 threads (FlashAttention-3's): the
# producer only issues TMA copies. 240 vs 232 consumer registers cut dK/dV's spills at head dim 128.
CONSUMER_REGS, PRODUCER_REGS = 240, 24
NEG = -1e30  # kernels/flash.py's masked score
LOG2E = 1.4426950408889634
SMEM_BYTES = 227 * 1024  # shared memory one CTA may take on sm_90


@dataclasses.dataclass(frozen=True)
class HopperBlocks:
    """Key/value block of the forward and dQ kernels, query block of the dK/dV kernel (64 or
    128), and the number of shared-memory slots each producer keeps in flight (1-4).
    `flash_attention(..., backend="mosaic", block_sizes=HopperBlocks(...))` overrides the default
    `for_head_dim` (`python bench/kernel_bench.py --only tiles` times the candidates)."""

    k: int
    bwd_q: int
    stages: int

    @classmethod
    def for_head_dim(cls, head_dim: int) -> HopperBlocks:
        # ptxas for sm_90 (`bench/kernel_bench.py --target h200 --only registers`): no spills at D=64;
        # at D=128 dK/dV spills 32-48 bytes (its dK, dV accumulators alone are 128 registers).
        return cls(k=64, bwd_q=64, stages=3) if head_dim > 64 else cls(k=128, bwd_q=64, stages=2)

    @property
    def cta_rows(self) -> int:
        return ROWS * CONSUMERS

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory of the largest of the three kernels (tiles, lse/delta; segment ids add
        up to 2.5 KB, barriers and alignment ~2.7 KB, hence `check`'s 6 KB margin): forward Q + S x (K, V); dQ Q, dO + S x (K, V); dK/dV K, V +
        S x (Q, dO, lse, delta)."""
        rows, D, S = self.cta_rows, head_dim, self.stages
        forward = (rows * D + 2 * S * self.k * D) * itemsize + rows * 4
        dq = (2 * rows * D + 2 * S * self.k * D) * itemsize + 2 * rows * 4
        dkdv = (2 * rows * D + 2 * S * self.bwd_q * D) * itemsize + 2 * S * self.bwd_q * 4
        return max(forward, dq, dkdv)

    def check(self, head_dim: int) -> HopperBlocks:
        """self, or a one-line `ConfigError` for tiles these kernels cannot take."""
        if self.k not in (64, 128) or self.bwd_q not in (64, 128) or not 1 <= self.stages <= 4:
            raise ConfigError(f"flash_attention(backend='mosaic'): {self} needs k and bwd_q of 64 or 128 "
                              "and 1-4 stages")
        need = self.smem_bytes(head_dim) + 6144  # ids <= 2.5 KB; barriers, alignment ~2.7 KB measured
        if need > SMEM_BYTES:
            raise ConfigError(f"flash_attention(backend='mosaic'): {self} at head dim {head_dim} needs "
                              f"{need // 1024} KiB of shared memory, a Hopper SM has {SMEM_BYTES // 1024}; "
                              "use fewer stages or smaller blocks")
        return self


def check_supported(q, *, causal: bool, interpret: bool) -> None:
    """One-line `ConfigError`s for what these kernels cannot run (the Triton backend can)."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ConfigError(f"flash_attention(backend='mosaic') takes bfloat16 or float16 inputs "
                          f"(wgmma), got {q.dtype}; use backend='triton'")
    if plgpu is None:  # pragma: no cover
        raise ConfigError("flash_attention(backend='mosaic'): this jax has no Pallas Mosaic GPU")
    if not interpret:
        check_gpu(causal, *_gpu_facts())


def _gpu_facts() -> tuple[str, int | None]:
    """(compute capability of the devices compiled for, CUDA runtime version or None)."""
    cc = compute_capability()
    try:
        from jax._src.lib import cuda_versions
        runtime = cuda_versions.cuda_runtime_get_version() if cuda_versions is not None else None
    except Exception:  # pragma: no cover - depends on the jaxlib build
        runtime = None
    return cc, runtime


def check_gpu(causal: bool, compute_capability: str, cuda_runtime: int | None) -> None:
    if not compute_capability.startswith("9"):
        raise ConfigError(f"flash_attention(backend='mosaic') needs a Hopper GPU (sm_90), this is "
                          f"sm_{compute_capability or '?'}; use backend='triton' (model.attention=flash)")
    # jax's own Mosaic GPU attention refuses causal masking there: ptxas miscompiles it.
    if causal and cuda_runtime is not None and 12080 <= cuda_runtime < 12091:
        raise ConfigError(f"flash_attention(backend='mosaic', causal=True): CUDA runtime {cuda_runtime} is "
                          "in 12.8.0-12.9.0, whose ptxas miscompiles causal masks in Mosaic GPU kernels; "
                          "upgrade CUDA to >= 12.9.1 or use backend='triton'")


# XLA:CPU pool threads the interpreter may hold blocked at once: the kernel's callback plus one per
# simulated warpgroup, for each interpreted kernel XLA runs concurrently (dQ and dK/dV can be).
MIN_CPU_THREADS = 16


def _interpret_params(interpret: bool):
    if not interpret:
        return False
    threads = int(os.environ.get("NPROC") or os.cpu_count() or 1)
    if threads < MIN_CPU_THREADS:
        # Each simulated warpgroup runs on an XLA:CPU pool thread and blocks there on barriers;
        # with fewer pool threads than that (the pool has one per core) the kernel deadlocks.
        raise ConfigError(f"flash_attention(backend='mosaic', interpret=True) needs >= {MIN_CPU_THREADS} "
                          f"XLA CPU threads, this machine has {threads}: set NPROC={MIN_CPU_THREADS * 2} "
                          "in the environment before jax starts")
    from maxtrain.kernels import mgpu_interpret
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        mgpu_interpret.install()
    except ImportError as e:
        raise ConfigError(f"flash_attention(backend='mosaic', interpret=True): no usable Mosaic GPU "
                          f"interpreter in jax {jax.__version__} ({e}); use backend='triton'") from e
    return InterpretGPUParams()


def _smem(shape, dtype):
    """A shared-memory tile in the 128-byte swizzled layout wgmma and TMA both want."""
    swizzle_elems = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle_elems)),
                                                 plgpu.SwizzleTransform(128)))


def _matmuls(*products):
    """Several independent (a, b, shape) wgmmas issued back to back, then awaited together."""
    def run(*accs):
        for acc, (a, b, _) in zip(accs, products):
            plgpu.wgmma(acc, a, b)
        return tuple(acc[...] for acc in accs)
    return pl.run_scoped(run, *(plgpu.ACC(shape, jnp.float32) for _, _, shape in products))


def _accumulate(acc, a, b, in_place: bool):
    """acc + a @ b. On a GPU the wgmma accumulates into `acc`'s registers (`pl.run_state` with an
    initialised accumulator); jax's interpreter cannot run `run_state`, so interpreted kernels add a
    fresh product instead: the same sum, with one more [rows, cols] float32 tile live."""
    if in_place:
        return pl.run_state(lambda ref: plgpu.wgmma(ref, a, b))(plgpu.ACC.init(acc))
    return acc + _matmuls((a, b, acc.shape))[0]


def _iotas(shape, row0, col0):
    """Global row and column indices of a [rows, cols] wgmma-layout tile, broadcast from vectors.

    Full-tile iotas are loop-invariant, so LLVM hoists them out of the block loop and they hold
    2 x rows*cols/128 registers per thread for the whole kernel (dK/dV at head dim 128 spilled);
    a thread holds 2 rows and cols/4 columns of the tile, which is all the vectors keep live."""
    rows = plgpu.broadcasted_iota(jnp.int32, shape[:1], 0, layout=plgpu.Layout.WGMMA.reduce(1)) + row0
    cols = plgpu.broadcasted_iota(jnp.int32, shape[1:], 0, layout=plgpu.Layout.WGMMA.reduce(0)) + col0
    return lax.broadcast_in_dim(rows, shape, [0]), lax.broadcast_in_dim(cols, shape, [1])


def _row_vector(value, n):
    return plgpu.layout_cast(jnp.full((n,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))


def _zero_tile(cols):
    """A [ROWS, cols] float32 accumulator of zeros in the wgmma register layout."""
    return plgpu.layout_cast(jnp.zeros((ROWS, cols), jnp.float32), plgpu.Layout.WGMMA)


def _col_broadcast(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _launch(entry, out_type, grid, grid_names, st):
    """A kernel of CONSUMERS + 1 warpgroups (axis "wg") over `grid`, compiled or interpreted."""
    return plgpu.kernel(entry, out_type=out_type, grid=grid, grid_names=grid_names,
                        num_threads=CONSUMERS + 1, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True),
                        interpret=_interpret_params(st.interpret))


def _cta_index(axis: str, n: int, causal: bool):
    """The query tile a CTA takes: causal runs the longest rows first, so no long tail is left."""
    p = lax.axis_index(axis)
    return (n - 1 - p) if causal else p


def _union(ranges_fn, cta, bq, bk, st):
    """[lo, hi) of the blocks any consumer of CTA `cta` needs: what its producer streams."""
    first = ranges_fn(cta * CONSUMERS, bq, bk, st)
    last = ranges_fn(cta * CONSUMERS + CONSUMERS - 1, bq, bk, st)
    lo = jnp.minimum(first[0], last[0])
    return lo, jnp.maximum(jnp.maximum(first[3], last[3]), lo)


def _walk(lo_all, ranges, hi_all, step, skip, carry):
    """Runs a consumer over the producer's blocks [lo_all, hi_all): `skip` outside its own range
    (barriers only), `step(j, carry, masked)` inside it, masked only where `ranges` says."""
    lo, b, c, hi = ranges
    lax.fori_loop(lo_all, lo, lambda j, _: skip(j), None)
    carry = lax.fori_loop(lo, b, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(b, c, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(c, hi, functools.partial(step, masked=True), carry)
    lax.fori_loop(hi, hi_all, lambda j, _: skip(j), None)
    return carry


def _produce(sources, slots, ready, free, total, stages):
    """The producer warpgroup: item t in [0, total) of every source (a callable t -> gmem ref
    view) into slot t % stages, first filling the ring, then refilling a slot once its `free`
    barrier says every consumer is done with it, then waiting for the last releases."""
    for t in range(stages):
        @pl.when(t < total)
        def _():
            for src, dst, bar in zip(sources, slots, ready):
                plgpu.copy_gmem_to_smem(src(t), dst.at[t], bar.at[t])

    @pl.loop(0, jnp.maximum(total - stages, 0))
    def _(t):
        slot = lax.rem(t, stages)
        for src, dst, bar, done in zip(sources, slots, ready, free):
            plgpu.barrier_wait(done.at[slot])
            plgpu.copy_gmem_to_smem(src(t + stages), dst.at[slot], bar.at[slot])

    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _(t):  # the last releases: every phase of a barrier is observed before the CTA exits
        for done in free:
            plgpu.barrier_wait(done.at[lax.rem(t, stages)])


def _kv_stream(k_ref, v_ref, ks_ref, k_s, v_s, ks_s, b, g, lo, bk):
    """The producer's (sources, slots) when it streams key blocks lo, lo+1, ... of KV head g: K,
    then (when `ks_ref` is given) the blocks' segment ids, then V. The forward releases K and ids
    before V, so with one stage V must come last: a consumer waiting for ids queued behind V would
    hold up the other consumer's PV (the ping-pong barrier), whose release V waits for."""
    def rows(ref):
        return lambda t: ref.at[b, pl.ds((lo + t) * bk, bk), g]

    sources, slots = [rows(k_ref)], [k_s]
    if ks_ref is not None:
        sources.append(lambda t: ks_ref.at[b, pl.ds((lo + t) * bk, bk)])
        slots.append(ks_s)
    return sources + [rows(v_ref)], slots + [v_s]


def _wait_all(bars, slot):
    for bar in bars:
        plgpu.barrier_wait(bar.at[slot])


def _arrive_all(bars, slot):
    for bar in bars:
        plgpu.barrier_arrive(bar.at[slot])


def _row_load(ref, axis):
    """A vector from shared memory in the layout of a wgmma tile's rows (axis 1 reduced) or
    columns (axis 0 reduced)."""
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(axis))


def _tile_mask(st, shape, row0, col0, row_ids=None, col_ids=None, slot=None, *, key_major=False):
    """kernels/flash.py's mask for a [rows, cols] wgmma tile starting at (row0, col0), or None.

    Rows are queries and columns keys, or the other way round with `key_major` (dK/dV). With
    segment ids, `row_ids` are the rows' ids (registers) and slot `slot` of the ring `col_ids`
    (shared memory) the columns'."""
    rows, cols = _iotas(shape, row0, col0)
    mask = score_mask(cols, rows, None, None, st, shape) if key_major else score_mask(rows, cols, None, None, st, shape)
    if row_ids is None:
        return mask
    ids = _row_load(col_ids.at[slot], 0)
    same = lax.broadcast_in_dim(row_ids, shape, [0]) == lax.broadcast_in_dim(ids, shape, [1])
    return same if mask is None else mask & same


def _id_scratch(segmented: bool, streamed: int, stages: int):
    """Shared memory for segment ids: each consumer's own rows, and the producer's ring of
    `streamed`-long blocks (None, None without segment ids)."""
    if not segmented:
        return None, None
    return plgpu.SMEM((CONSUMERS, ROWS), jnp.int32), plgpu.SMEM((stages, streamed), jnp.int32)


def _barriers(count, stages, consumers=1):
    return tuple(plgpu.Barrier(num_arrivals=consumers, num_barriers=stages) for _ in range(count))


# ---------------------------------------------------------------- forward


def forward(q, k, v, q_seg, k_seg, st, *, blocks: HopperBlocks):
    """(o [B, Lp, H, D], lse2 [B, H, Lp] float32); Lp a multiple of 128 and of blocks.k."""
    B, Lp, H, D = q.shape
    bk, S = blocks.k, blocks.stages
    n_cta = Lp // blocks.cta_rows
    dtype = q.dtype
    seg = st.segmented
    kernel = functools.partial(_forward_kernel, st=st, blocks=blocks, n_cta=n_cta, head_dim=D, dtype=dtype)

    def entry(*refs):
        ids = _id_scratch(seg, bk, S)
        id_bars = ((plgpu.Barrier(num_barriers=CONSUMERS),) + _barriers(1, S) + _barriers(1, S, CONSUMERS)
                   if seg else (None, None, None))
        pl.run_scoped(
            lambda bufs, bars: kernel(*refs, bufs, bars),
            (_smem((CONSUMERS, ROWS, D), dtype), _smem((S, bk, D), dtype), _smem((S, bk, D), dtype),
             plgpu.SMEM((CONSUMERS, ROWS), jnp.float32)) + ids,
            (plgpu.Barrier(num_barriers=CONSUMERS), plgpu.Barrier(num_barriers=S),
             plgpu.Barrier(num_barriers=S), plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=S),
             plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=S), plgpu.Barrier(num_arrivals=CONSUMERS))
            + id_bars,
            collective_axes="wg",
        )

    out_type = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((B, H, Lp), jnp.float32))
    return _launch(entry, out_type, (n_cta, B, H), ("q", "b", "h"), st)(
        q, k, v, *((q_seg, k_seg) if seg else ()))


@dataclasses.dataclass(frozen=True)
class _KVRing:
    """The forward's ring of `stages` shared-memory slots holding streamed key blocks: K and (with
    segment ids) the keys' ids travel and are released together (`k_ready`, `k_done`), V on its
    own (`v_ready`, `v_free`), so a consumer's QK^T starts before V has arrived."""
    k: object
    v: object
    ids: object
    k_ready: list
    k_done: list
    v_ready: object
    v_free: object


def _forward_kernel(*refs, st, blocks: HopperBlocks, n_cta: int, head_dim: int, dtype):
    """One forward CTA: two consumer warpgroups of 64 query rows each, one producer streaming the
    K/V blocks either consumer needs."""
    seg = st.segmented
    if seg:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, bufs, bars = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref, bufs, bars = refs
        qs_ref = ks_ref = None
    q_s, k_s, v_s, lse_s, qs_s, ks_s = bufs
    q_bar, k_bar, v_bar, k_free, v_free, sched, qs_bar, ks_bar, ks_free = bars
    ring = _KVRing(k_s, v_s, ks_s, [k_bar] + ([ks_bar] if seg else []), [k_free] + ([ks_free] if seg else []),
                   v_bar, v_free)
    b, h, w = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
    cta = _cta_index("q", n_cta, st.causal)
    lo_all, hi_all = _union(q_major_ranges, cta, ROWS, blocks.k, st)

    @pl.when(w < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGS, action="increase")
        i = cta * CONSUMERS + w  # this warpgroup's 64-row query block
        r0 = i * ROWS
        q_w, q_ids = _load_query_rows(q_ref.at[b, pl.ds(r0, ROWS), h], q_s.at[w], q_bar.at[w],
                                      None if qs_ref is None else qs_ref.at[b, pl.ds(r0, ROWS)], qs_s, qs_bar, w)
        rows = _QueryRows(q_w, q_ids, r0, ring, sched, lo_all, st, blocks, dtype)
        carry = (_zero_tile(head_dim), _row_vector(NEG, ROWS), _row_vector(0.0, ROWS))

        @pl.when(w == 1)
        def _():
            _ping(sched)

        acc, m, l = _walk(lo_all, q_major_ranges(i, ROWS, blocks.k, st), hi_all, rows.step, rows.skip, carry)

        @pl.when(w == 0)
        def _():
            _ping(sched)

        _write_output_rows(acc, m, l, q_w, lse_s.at[w], o_ref.at[b, pl.ds(r0, ROWS), h],
                           lse_ref.at[b, h, pl.ds(r0, ROWS)], dtype)

    @pl.when(w == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
        g = lax.div(h, st.group)
        sources, slots = _kv_stream(k_ref, v_ref, ks_ref, k_s, v_s, ks_s, b, g, lo_all, blocks.k)
        _produce(sources, slots, ring.k_ready + [v_bar], ring.k_done + [v_free], hi_all - lo_all, blocks.stages)


def _ping(sched):
    """Both consumers meet at the schedule barrier: one's matmul runs while the other does its softmax."""
    plgpu.barrier_arrive(sched)
    plgpu.barrier_wait(sched)


def _load_query_rows(src, q_w, q_bar, ids_src, qs_s, qs_bar, w):
    """Copies a consumer's 64 query rows `src` into its tile `q_w` (and, with `ids_src`, their
    segment ids into slot w of `qs_s`); returns the tile and the ids in registers (or None)."""
    plgpu.copy_gmem_to_smem(src, q_w, q_bar)
    plgpu.barrier_wait(q_bar)
    if ids_src is None:
        return q_w, None
    plgpu.copy_gmem_to_smem(ids_src, qs_s.at[w], qs_bar.at[w])
    plgpu.barrier_wait(qs_bar.at[w])
    return q_w, _row_load(qs_s.at[w], 1)


@dataclasses.dataclass(frozen=True)
class _QueryRows:
    """A forward consumer: its 64 query rows (tile `q` in shared memory, segment `ids` in registers
    or None) from global row `row0`, walking the key blocks of `ring` from the producer's `lo_all`."""
    q: object
    ids: object
    row0: object
    ring: _KVRing
    sched: object
    lo_all: object
    st: object
    blocks: HopperBlocks
    dtype: object

    def skip(self, j):
        """A key block outside this consumer's range: its barriers in the computing order, no math."""
        ring, slot = self.ring, lax.rem(j - self.lo_all, self.blocks.stages)
        _wait_all(ring.k_ready, slot)
        _arrive_all(ring.k_done, slot)
        _ping(self.sched)
        plgpu.barrier_arrive(self.sched)
        plgpu.barrier_wait(ring.v_ready.at[slot])
        plgpu.barrier_wait(self.sched)
        plgpu.barrier_arrive(ring.v_free.at[slot])

    def step(self, j, carry, masked):
        """Key block j: S = Q K^T, the online softmax update of (acc, m, l), then acc += P V."""
        acc, m, l = carry
        ring, bk, slot = self.ring, self.blocks.k, lax.rem(j - self.lo_all, self.blocks.stages)
        _wait_all(ring.k_ready, slot)
        s = self.scores(ring.k.at[slot])
        mask = None
        if masked:
            mask = _tile_mask(self.st, (ROWS, bk), self.row0, j * bk, self.ids, ring.ids, slot)
        _arrive_all(ring.k_done, slot)
        p, acc, m_new, l = _online_softmax(s, mask, m, l, acc)
        p = p.astype(self.dtype)
        plgpu.barrier_arrive(self.sched)
        plgpu.barrier_wait(ring.v_ready.at[slot])
        plgpu.barrier_wait(self.sched)
        acc = _accumulate(acc, p, ring.v.at[slot], not self.st.interpret)
        plgpu.barrier_arrive(ring.v_free.at[slot])
        return acc, m_new, l

    def scores(self, k_j):
        """Q K^T of key block `k_j` in log2 units (K^T through a transposed view); the other
        consumer's turn starts once this wgmma is issued."""
        def qk(acc_ref):
            plgpu.wgmma(acc_ref, self.q, plgpu.transpose_ref(k_j, (1, 0)))
            _ping(self.sched)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, self.blocks.k), jnp.float32))
        return s * (self.st.scale * LOG2E)


def _online_softmax(s, mask, m, l, acc):
    """One key block's scores `s` into the running max `m`, sum `l` and output `acc` (rescaled
    here, P V added by the caller): (p, acc, m_new, l)."""
    if mask is not None:
        s = jnp.where(mask, s, NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp2(s - _col_broadcast(m_new, s.shape))
    if mask is not None:
        p = jnp.where(mask, p, 0.0)  # rows masked so far have m_new = NEG
    alpha = jnp.exp2(m - m_new)
    l = l * alpha + p.sum(axis=1)
    acc = acc * _col_broadcast(alpha, acc.shape)
    return p, acc, m_new, l


def _write_output_rows(acc, m, l, q_w, lse_w, o_dst, lse_dst, dtype):
    """O = acc / l and the rows' base-2 log-sum-exp, staged in the (spent) Q tile and `lse_w` and
    copied to `o_dst`, `lse_dst`."""
    empty = l == 0.0  # a row that saw no key (padding only): output 0, lse +BIG
    l = jnp.where(empty, 1.0, l)
    q_w[...] = (acc / _col_broadcast(l, acc.shape)).astype(dtype)
    lse_w[...] = jnp.where(empty, -NEG, m + jnp.log2(l))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_w, o_dst)
    plgpu.copy_smem_to_gmem(lse_w, lse_dst)
    plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------- backward


def backward_dq(q, k, v, q_seg, k_seg, do, lse2, delta, st, *, blocks: HopperBlocks):
    """dQ [B, Lp, H, D]: consumers own 64 query rows each and walk the streamed K/V blocks."""
    B, Lp, H, D = q.shape
    bk, S, R = blocks.k, blocks.stages, st.group
    n_cta = Lp // blocks.cta_rows
    dtype = q.dtype
    c2 = st.scale * LOG2E
    in_place = not st.interpret

    seg = st.segmented

    def kernel(*refs):
        if seg:
            q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dq_ref, bufs, bars = refs
        else:
            q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, bufs, bars = refs
        q_s, do_s, lse_s, delta_s, k_s, v_s, qs_s, ks_s = bufs
        row_bars, ready, free = bars
        b, h, w = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
        cta = _cta_index("q", n_cta, st.causal)
        lo_all, hi_all = _union(q_major_ranges, cta, ROWS, bk, st)

        @pl.when(w < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGS, action="increase")
            i = cta * CONSUMERS + w
            r0 = i * ROWS
            rows_at = (b, pl.ds(r0, ROWS), h)
            own = [(q_ref.at[rows_at], q_s), (do_ref.at[rows_at], do_s),
                   (lse_ref.at[b, h, pl.ds(r0, ROWS)], lse_s), (delta_ref.at[b, h, pl.ds(r0, ROWS)], delta_s)]
            if seg:
                own.append((qs_ref.at[b, pl.ds(r0, ROWS)], qs_s))
            for n, (src, dst) in enumerate(own):
                plgpu.copy_gmem_to_smem(src, dst.at[w], row_bars[n].at[w])
            _wait_all(row_bars, w)
            lse = _row_load(lse_s.at[w], 1)
            delta = _row_load(delta_s.at[w], 1)
            q_ids = _row_load(qs_s.at[w], 1) if seg else None

            def skip(j):
                slot = lax.rem(j - lo_all, S)
                _wait_all(ready, slot)
                _arrive_all(free, slot)

            def step(j, dq, masked):
                slot = lax.rem(j - lo_all, S)
                _wait_all(ready, slot)
                k_j, v_j = k_s.at[slot], v_s.at[slot]
                s, dp = _matmuls((q_s.at[w], plgpu.transpose_ref(k_j, (1, 0)), (ROWS, bk)),
                                 (do_s.at[w], plgpu.transpose_ref(v_j, (1, 0)), (ROWS, bk)))
                p = jnp.exp2(s * c2 - _col_broadcast(lse, s.shape))  # the forward's probabilities
                if masked:
                    mask = _tile_mask(st, (ROWS, bk), r0, j * bk, q_ids, ks_s, slot)
                    if mask is not None:
                        p = jnp.where(mask, p, 0.0)
                ds = p * (dp - _col_broadcast(delta, dp.shape))
                dq = _accumulate(dq, ds.astype(dtype), k_j, in_place)
                _arrive_all(free, slot)
                return dq

            dq = plgpu.layout_cast(jnp.zeros((ROWS, D), jnp.float32), plgpu.Layout.WGMMA)
            dq = _walk(lo_all, q_major_ranges(i, ROWS, bk, st), hi_all, step, skip, dq)
            q_s.at[w][...] = (dq * st.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_s.at[w], dq_ref.at[rows_at])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(w == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
            g = lax.div(h, R)
            sources, slots = _kv_stream(k_ref, v_ref, ks_ref if seg else None, k_s, v_s, ks_s, b, g, lo_all, bk)
            _produce(sources, slots, ready, free, hi_all - lo_all, S)

    def entry(*refs):
        ids = _id_scratch(seg, bk, S)
        pl.run_scoped(
            lambda bufs, bars: kernel(*refs, bufs, bars),
            (_smem((CONSUMERS, ROWS, D), dtype), _smem((CONSUMERS, ROWS, D), dtype),
             plgpu.SMEM((CONSUMERS, ROWS), jnp.float32), plgpu.SMEM((CONSUMERS, ROWS), jnp.float32),
             _smem((S, bk, D), dtype), _smem((S, bk, D), dtype)) + ids,
            (_barriers(4 + seg, CONSUMERS), _barriers(2 + seg, S), _barriers(2 + seg, S, CONSUMERS)),
            collective_axes="wg",
        )

    return _launch(entry, jax.ShapeDtypeStruct(q.shape, dtype), (n_cta, B, H), ("q", "b", "h"), st)(
        q, k, v, do, lse2, delta, *((q_seg, k_seg) if seg else ()))


def backward_dkdv(q, k, v, q_seg, k_seg, do, lse2, delta, st, *, blocks: HopperBlocks):
    """(dK, dV) [B, Lp, KV, D]: consumers own 64 key rows each and walk the streamed query blocks
    of every query head of their KV head's group, in key-major orientation (S^T = K Q^T), so every
    wgmma takes its left operand from registers and no tile is transposed through memory."""
    B, Lp, H, D = q.shape
    KV = k.shape[2]
    bq, S = blocks.bwd_q, blocks.stages
    n_cta = Lp // blocks.cta_rows
    dtype = q.dtype
    seg = st.segmented
    kernel = functools.partial(_dkdv_kernel, st=st, blocks=blocks, head_dim=D, dtype=dtype)

    def entry(*refs):
        ids = _id_scratch(seg, bq, S)
        pl.run_scoped(
            lambda bufs, bars: kernel(*refs, bufs, bars),
            (_smem((CONSUMERS, ROWS, D), dtype), _smem((CONSUMERS, ROWS, D), dtype),
             _smem((S, bq, D), dtype), _smem((S, bq, D), dtype),
             plgpu.SMEM((S, bq), jnp.float32), plgpu.SMEM((S, bq), jnp.float32)) + ids,
            (_barriers(2 + seg, CONSUMERS), _barriers(4 + seg, S), _barriers(4 + seg, S, CONSUMERS)),
            collective_axes="wg",
        )

    out_type = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype))
    return _launch(entry, out_type, (n_cta, B, KV), ("k", "b", "g"), st)(
        q, k, v, do, lse2, delta, *((q_seg, k_seg) if seg else ()))


@dataclasses.dataclass(frozen=True)
class _QueryRing:
    """The dK/dV kernel's ring of `stages` shared-memory slots holding streamed query blocks: Q, dO,
    the rows' lse and delta and (with segment ids) the rows' ids, filled and released together."""
    q: object
    do: object
    lse: object
    delta: object
    ids: object
    ready: tuple
    free: tuple


def _dkdv_kernel(*refs, st, blocks: HopperBlocks, head_dim: int, dtype):
    """One dK/dV CTA: two consumer warpgroups of 64 key rows each, one producer streaming the query
    blocks of every query head of the KV head's group."""
    if st.segmented:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dk_ref, dv_ref, bufs, bars = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, bufs, bars = refs
        qs_ref = ks_ref = None
    k_s, v_s, q_s, do_s, lse_s, delta_s, ks_s, qs_s = bufs
    kv_bars, ready, free = bars
    ring = _QueryRing(q_s, do_s, lse_s, delta_s, qs_s, ready, free)
    b, g, w = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("wg")
    cta = lax.axis_index("k")
    lo_all, hi_all = _union(kv_major_ranges, cta, blocks.bwd_q, ROWS, st)
    n = hi_all - lo_all  # query blocks per head

    @pl.when(w < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGS, action="increase")
        jb = cta * CONSUMERS + w  # this warpgroup's 64-row key block
        c0 = jb * ROWS
        keys_at = (b, pl.ds(c0, ROWS), g)
        own = [(k_ref.at[keys_at], k_s), (v_ref.at[keys_at], v_s)]
        if ks_ref is not None:
            own.append((ks_ref.at[b, pl.ds(c0, ROWS)], ks_s))
        _load_own_rows(own, kv_bars, w)
        k_ids = None if ks_ref is None else _row_load(ks_s.at[w], 1)
        keys = _KeyRows(k_s.at[w], v_s.at[w], k_ids, c0, kv_major_ranges(jb, blocks.bwd_q, ROWS, st), lo_all,
                        hi_all, n, ring, st, blocks, dtype)
        zeros = _zero_tile(head_dim)
        dk, dv = lax.fori_loop(0, st.group, keys.head, (zeros, zeros))
        _write_key_rows(dk, dv, k_s.at[w], v_s.at[w], dk_ref.at[keys_at], dv_ref.at[keys_at], st.scale, dtype)

    @pl.when(w == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
        sources, slots = _query_stream((q_ref, do_ref, lse_ref, delta_ref, qs_ref), ring, b, g, lo_all, n,
                                       blocks.bwd_q, st.group)
        _produce(sources, slots, ready, free, st.group * n, blocks.stages)


def _load_own_rows(own, bars, w):
    """Copies each (source, tiles) of `own` into slot w of its tiles, then waits for all of them."""
    for i, (src, dst) in enumerate(own):
        plgpu.copy_gmem_to_smem(src, dst.at[w], bars[i].at[w])
    _wait_all(bars, w)


@dataclasses.dataclass(frozen=True)
class _KeyRows:
    """A dK/dV consumer: its 64 key rows (K and V tiles in shared memory, segment `ids` in
    registers or None) from global column `col0`, walking the query blocks `ranges` (of the
    producer's [lo_all, hi_all), `n` per head) of every query head of its group from `ring`."""
    k: object
    v: object
    ids: object
    col0: object
    ranges: tuple
    lo_all: object
    hi_all: object
    n: object
    ring: _QueryRing
    st: object
    blocks: HopperBlocks
    dtype: object

    def head(self, r, carry):
        """Query head r of the group: its query blocks add into the same (dK, dV)."""
        base = r * self.n - self.lo_all  # slot of query block i of head r: (base + i) % S
        return _walk(self.lo_all, self.ranges, self.hi_all, functools.partial(self.step, base),
                     functools.partial(self.skip, base), carry)

    def skip(self, base, i):
        """A query block outside this consumer's range: taken and released, no math."""
        slot = lax.rem(base + i, self.blocks.stages)
        _wait_all(self.ring.ready, slot)
        _arrive_all(self.ring.free, slot)

    def step(self, base, i, carry, masked):
        """Query block i, key-major: S^T = K Q^T and dP^T = V dO^T, then dV += P^T dO, dK += dS^T Q."""
        dk, dv = carry
        ring, bq = self.ring, self.blocks.bwd_q
        slot = lax.rem(base + i, self.blocks.stages)
        _wait_all(ring.ready, slot)
        q_i, do_i = ring.q.at[slot], ring.do.at[slot]
        st_, dpt = _matmuls((self.k, plgpu.transpose_ref(q_i, (1, 0)), (ROWS, bq)),  # S^T
                            (self.v, plgpu.transpose_ref(do_i, (1, 0)), (ROWS, bq)))  # dP^T
        pt = self.probabilities(st_, slot, i, masked)
        delta = _row_load(ring.delta.at[slot], 0)
        dst = (pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))).astype(self.dtype)
        in_place = not self.st.interpret
        dv = _accumulate(dv, pt.astype(self.dtype), do_i, in_place)  # dP^T and P^T float32 dead here
        dk = _accumulate(dk, dst, q_i, in_place)
        _arrive_all(ring.free, slot)
        return dk, dv

    def probabilities(self, st_, slot, i, masked):
        """P^T of the forward from the scores S^T and the query rows' lse, masked where needed."""
        # lse and delta are column vectors here (bq/4 registers each): loaded where they are used,
        # not across the matmuls, whose accumulators are the register peak
        bq = self.blocks.bwd_q
        lse = _row_load(self.ring.lse.at[slot], 0)
        pt = jnp.exp2(st_ * (self.st.scale * LOG2E) - lax.broadcast_in_dim(lse, st_.shape, [1]))
        if masked:
            mask = _tile_mask(self.st, (ROWS, bq), self.col0, i * bq, self.ids, self.ring.ids, slot, key_major=True)
            if mask is not None:
                pt = jnp.where(mask, pt, 0.0)
        return pt


def _write_key_rows(dk, dv, k_w, v_w, dk_dst, dv_dst, scale, dtype):
    """dK (scaled) and dV staged in the (spent) K and V tiles and copied to `dk_dst`, `dv_dst`."""
    k_w[...] = (dk * scale).astype(dtype)
    v_w[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_w, dk_dst)
    plgpu.copy_smem_to_gmem(v_w, dv_dst)
    plgpu.wait_smem_to_gmem(0)


def _query_stream(refs, ring: _QueryRing, b, g, lo, n, bq: int, group: int):
    """The producer's (sources, slots) in the dK/dV kernel: item t is query block lo + t % n of
    query head g * group + t // n: its Q, dO, lse, delta and (with `qs_ref`) segment ids."""
    q_ref, do_ref, lse_ref, delta_ref, qs_ref = refs

    def head_and_block(t):
        nn = jnp.maximum(n, 1)
        return g * group + lax.div(t, nn), (lo + lax.rem(t, nn)) * bq

    def rows_of(ref):
        def src(t):
            h, r0 = head_and_block(t)
            return ref.at[b, pl.ds(r0, bq), h]
        return src

    def row_vector_of(ref):
        def src(t):
            h, r0 = head_and_block(t)
            return ref.at[b, h, pl.ds(r0, bq)]
        return src

    sources = [rows_of(q_ref), rows_of(do_ref), row_vector_of(lse_ref), row_vector_of(delta_ref)]
    slots = [ring.q, ring.do, ring.lse, ring.delta]
    if qs_ref is not None:
        sources.append(lambda t: qs_ref.at[b, pl.ds(head_and_block(t)[1], bq)])
        slots.append(ring.ids)
    return sources, slots
