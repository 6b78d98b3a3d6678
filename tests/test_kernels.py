"""Custom kernels against their plain-JAX references (Pallas interpreter on CPU).

`MAXTRAIN_KERNEL_INTERPRET=0` runs the kernels compiled (Triton) instead, on a GPU machine
(`bench/gpu_check.sh`); unset, the kernels choose: the interpreter unless the backend is a GPU.
Shapes are tiny and blocks small (16/32) so that padding, several blocks per row and block
skipping all happen within the CI time budget.
"""

import itertools
import os

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from conftest import SMALL, TINY
from maxtrain import load_config, train
from maxtrain.config import ConfigError
from maxtrain.kernels import BlockSizes, HopperBlocks, flash_attention, reference_attention
from maxtrain.kernels import flash as fa_mod

pytestmark = pytest.mark.slow  # Pallas kernels in the interpreter, forward and backward: `-m "not slow"` leaves them out

INTERPRET = {"0": False, "1": True}.get(os.environ.get("MAXTRAIN_KERNEL_INTERPRET", ""))


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """References and XLA paths in true float32 (GPUs default float32 matmuls to TF32)."""
    with jax.default_matmul_precision("highest"):
        yield


def _inputs(seed, B, L, H, G, D, dtype, segments):
    r = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(r.normal(size=(B, L, n, D)), dtype) for n in (H, G, G))
    seg = None
    if segments:  # sorted ids: packed documents of random lengths, a few per row
        seg = jnp.asarray(np.sort(r.integers(0, 4, (B, L)), axis=1), jnp.int32)
    do = jnp.asarray(r.normal(size=(B, L, H, D)), jnp.float32)
    dlse = jnp.asarray(r.normal(size=(B, H, L)), jnp.float32)
    return q, k, v, seg, do, dlse


def _value_and_grads(attn, q, k, v, do, dlse):
    """(out, lse, dq, dk, dv) of `sum(out * do) + sum(lse * dlse)`: both outputs' backward paths."""
    def loss(q, k, v):
        o, lse = attn(q, k, v)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(lse * dlse), (o, lse)

    (_, (o, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (o, lse) + grads


def _assert_close(got, want, tol):
    """Max abs error relative to the reference's scale (per array)."""
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert g.shape == w.shape
        scale = max(1.0, float(np.abs(w).max()))
        err = float(np.abs(g - w).max())
        assert err <= tol * scale, (err, scale)


# (B, L, H, KV, D, causal, window, segments, dtype, blocks as (q, k, bwd_q, bwd_k))
CASES = {
    "pad_mha_causal": (2, 37, 2, 2, 64, True, None, False, jnp.float32, (16, 32, 32, 16)),
    "gqa2_segments": (1, 50, 4, 2, 64, False, None, True, jnp.float32, (16, 16, 16, 32)),
    "gqa4_window_segments": (1, 64, 4, 1, 64, True, 9, True, jnp.float32, (16, 32, 16, 16)),
    "window_not_causal": (1, 45, 2, 1, 64, False, 13, False, jnp.float32, (32, 16, 16, 16)),
    "bf16_gqa2_segments": (2, 33, 4, 2, 64, True, None, True, jnp.bfloat16, (16, 16, 16, 16)),
    "bf16_d128_window": (1, 70, 2, 1, 128, True, 20, False, jnp.bfloat16, (32, 16, 16, 32)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flash_attention_matches_reference(name):
    B, L, H, G, D, causal, window, segments, dtype, blocks = CASES[name]
    q, k, v, seg, do, dlse = _inputs(len(name), B, L, H, G, D, dtype, segments)
    opts = dict(causal=causal, segment_ids=seg, sliding_window=window)

    def kernel(q, k, v):
        return flash_attention(q, k, v, **opts, interpret=INTERPRET, block_sizes=BlockSizes(*blocks),
                               return_lse=True)

    def reference(q, k, v):  # exact math on the same (possibly bf16) values
        o, lse = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **opts)
        return o, lse

    got = jax.jit(lambda *a: _value_and_grads(kernel, *a))(q, k, v, do, dlse)
    want = jax.jit(lambda *a: _value_and_grads(reference, *a))(q, k, v, do, dlse)
    assert got[0].dtype == dtype and got[2].dtype == dtype and got[3].dtype == dtype
    _assert_close(got, want, 1e-5 if dtype == jnp.float32 else 1e-2)


def _hopper_or_cpu() -> str | None:
    """Why the Mosaic GPU (sm_90) kernels cannot run here, or None: on a CPU they run in jax's
    Mosaic GPU interpreter, on a GPU they need a Hopper."""
    if jax.default_backend() != "gpu":
        from maxtrain.kernels import mgpu_interpret
        try:
            mgpu_interpret.install()
        except ImportError as e:  # another jax's interpreter: kernels/mgpu_interpret.py knows 0.10's
            return str(e)
        return None
    cc = getattr(jax.devices()[0], "compute_capability", "")
    return None if str(cc).startswith("9") else f"needs a Hopper GPU (sm_90), this is sm_{cc}"


# (B, L, H, KV, D, causal, window, segments, dtype): padding, GQA, both head dims, window, not
# causal, packed documents
MOSAIC_CASES = {  # sized for the interpreter: 2 query blocks of 128 rows (3 with the window), one batch row
    "bf16_gqa2_pad_causal_d128": (1, 200, 2, 1, 128, True, None, False, jnp.bfloat16),
    "bf16_window_segments_d64": (1, 260, 1, 1, 64, True, 100, True, jnp.bfloat16),  # key block 0 skipped by q block 2
    "f16_not_causal_pad_segments_d64": (1, 130, 1, 1, 64, False, None, True, jnp.float16),
    "bf16_k128_bwdq128_causal_segments_d128": (1, 200, 1, 1, 128, True, None, True, jnp.bfloat16),
    "f16_one_stage_bwdq128_segments_d64": (1, 200, 2, 1, 64, True, None, True, jnp.float16),
}
# explicit HopperBlocks (bench/kernel_bench.py --only tiles times them all on a GPU): 128-key blocks
# and 128-query dK/dV blocks at D=128, a single-slot ring at D=64; the other cases run the defaults
MOSAIC_TILES = {
    "bf16_k128_bwdq128_causal_segments_d128": HopperBlocks(k=128, bwd_q=128, stages=2),
    "f16_one_stage_bwdq128_segments_d64": HopperBlocks(k=64, bwd_q=128, stages=1),
}


@pytest.fixture
def mosaic_races(monkeypatch):
    """On a CPU, interprets the Mosaic GPU kernels with jax's happens-before race detector (and the
    shim's asynchronous wgmma: operands read at the wait, kernels/mgpu_interpret.py); yields the
    list of each interpreted kernel's race state. Compiled (on a GPU) the list stays empty."""
    from maxtrain.kernels import flash_hopper
    found = []
    if jax.default_backend() == "gpu":
        yield found
        return
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    params, state = flash_hopper._interpret_params, gpu_callbacks.RaceDetectionState

    def recorded(**kw):
        found.append(state(**kw))
        return found[-1]

    monkeypatch.setattr(flash_hopper, "_interpret_params",
                        lambda interpret: params(interpret) and InterpretGPUParams(detect_races=True))
    monkeypatch.setattr(gpu_callbacks, "RaceDetectionState", recorded)
    yield found
    assert all(r.reads for r in found), "the race detector saw no reads: was it on?"


@pytest.mark.skipif(_hopper_or_cpu() is not None, reason=str(_hopper_or_cpu()))
@pytest.mark.parametrize("name", list(MOSAIC_CASES))
def test_mosaic_flash_attention_matches_reference(name, mosaic_races):
    """backend="mosaic" (kernels/flash_hopper.py: TMA producer, wgmma consumers, key-major dK/dV):
    output, lse and all three gradients (through both outputs) against the float32 reference; in
    the interpreter, with no data race between warpgroups in the forward, dQ or dK/dV kernel."""
    B, L, H, G, D, causal, window, segments, dtype = MOSAIC_CASES[name]
    q, k, v, seg, do, dlse = _inputs(len(name), B, L, H, G, D, dtype, segments)
    opts = dict(causal=causal, sliding_window=window, segment_ids=seg)

    def kernel(q, k, v):
        return flash_attention(q, k, v, **opts, backend="mosaic", interpret=INTERPRET, return_lse=True,
                               block_sizes=MOSAIC_TILES.get(name))

    def reference(q, k, v):
        return reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **opts)

    got = jax.jit(lambda *a: _value_and_grads(kernel, *a))(q, k, v, do, dlse)
    want = jax.jit(lambda *a: _value_and_grads(reference, *a))(q, k, v, do, dlse)
    assert got[0].dtype == dtype and got[2].dtype == dtype and got[3].dtype == dtype
    _assert_close(got, want, 1e-2)
    if jax.default_backend() != "gpu":
        assert len(mosaic_races) >= 3 and not any(r.races_found for r in mosaic_races), \
            "a data race (RACE DETECTED above)"


def _ring_matmuls(a, b, release, params):
    """A two-warpgroup Mosaic GPU kernel in the flash kernels' pattern: a TMA producer
    (`flash_hopper._produce`) streams the tiles b[t] through one shared-memory slot, a consumer
    computes a @ b[t] by wgmma and releases the slot. `release`: "after_wait" (after reading the
    accumulator, which waits for the wgmma: correct), "before_wait" (between issue and wait), or
    "before_refill" (between issue and wait, and waits for the refill before reading: the
    overwrite is then ordered before the wait, but not before the operand read)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from maxtrain.kernels import flash_hopper as fh

    T, M, N = b.shape[0], a.shape[0], b.shape[2]

    def kernel(a_ref, b_ref, o_ref, a_s, b_s, o_s, a_bar, ready, free):
        w = lax.axis_index("wg")

        @pl.when(w == 0)
        def _consumer():
            plgpu.copy_gmem_to_smem(a_ref, a_s, a_bar.at[0])
            plgpu.barrier_wait(a_bar.at[0])
            plgpu.barrier_wait(ready.at[0])
            for t in range(T):
                def product(acc):
                    plgpu.wgmma(acc, a_s, b_s.at[0])
                    if release != "after_wait":
                        plgpu.barrier_arrive(free.at[0])
                        if release == "before_refill" and t + 1 < T:
                            plgpu.barrier_wait(ready.at[0])
                    return acc[...]

                o_s.at[t][...] = pl.run_scoped(product, plgpu.ACC((M, N), jnp.float32))
                if release == "after_wait":
                    plgpu.barrier_arrive(free.at[0])
                if release != "before_refill" and t + 1 < T:
                    plgpu.barrier_wait(ready.at[0])
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_ref)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(w == 1)
        def _producer():
            fh._produce([lambda t: b_ref.at[t]], [b_s], [ready], [free], T, 1)

    def entry(a_ref, b_ref, o_ref):
        pl.run_scoped(lambda *scratch: kernel(a_ref, b_ref, o_ref, *scratch),
                      fh._smem(a.shape, a.dtype), fh._smem((1,) + b.shape[1:], b.dtype),
                      plgpu.SMEM((T, M, N), jnp.float32), plgpu.Barrier(num_barriers=1),
                      plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=1), collective_axes="wg")

    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((T, M, N), jnp.float32), num_threads=2,
                        thread_name="wg", interpret=params)(a, b)


@pytest.mark.skipif(jax.default_backend() == "gpu" or _hopper_or_cpu() is not None,
                    reason=str(_hopper_or_cpu() or "tests the CPU interpreter"))
@pytest.mark.parametrize("release", ["after_wait", "before_wait", "before_refill"])
def test_mosaic_interpreter_runs_wgmma_asynchronously(release, mosaic_races):
    """The shim (kernels/mgpu_interpret.py) treats a wgmma's operand reads as happening anywhere
    between issue and wait, as the hardware may: freeing the operand's slot in that window is a
    data race the detector reports, also when the refill is awaited before the accumulator read
    (jax's own interpreter reads at issue, unseen by the detector, and misses both); freeing it
    after the wait is race-free and gives a @ b."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    from maxtrain.kernels import flash_hopper
    flash_hopper._interpret_params(True)  # installs the shim (and checks the thread pool)
    r = np.random.default_rng(0)
    a = jnp.asarray(r.normal(size=(64, 64)), jnp.bfloat16)
    b = jnp.asarray(r.normal(size=(3, 64, 64)), jnp.bfloat16)
    out = _ring_matmuls(a, b, release, InterpretGPUParams(detect_races=True))
    assert len(mosaic_races) == 1 and mosaic_races[0].races_found == (release != "after_wait")
    if release == "after_wait":
        want = jnp.einsum("mk,tkn->tmn", a.astype(jnp.float32), b.astype(jnp.float32))
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_mosaic_flash_attention_lowers_for_sm90(monkeypatch):
    """Forward and both backward kernels go through Pallas' Mosaic GPU lowering for CUDA on this
    CPU-only machine, at training sizes (GQA, padding, window; both head dims)."""
    from jax import export
    from maxtrain.kernels import flash_hopper
    monkeypatch.setattr(fa_mod, "_resolve_interpret", lambda interpret: False)
    monkeypatch.setattr(flash_hopper, "_gpu_facts", lambda: ("9.0", 12091))  # lowering for an H100, CUDA 12.9.1
    for D in (64, 128):
        q = jax.ShapeDtypeStruct((2, 1000, 8, D), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((2, 1000, 2, D), jnp.bfloat16)
        seg = jax.ShapeDtypeStruct((2, 1000), jnp.int32) if D == 64 else None  # packed documents at D=64

        def grads(q, k, v, s=None):
            return jax.grad(lambda q, k, v: jnp.sum(flash_attention(
                q, k, v, sliding_window=300, segment_ids=s, backend="mosaic").astype(jnp.float32)),
                argnums=(0, 1, 2))(q, k, v)

        exp = export.export(jax.jit(grads), platforms=["cuda"])(q, kv, kv, *(() if seg is None else (seg,)))
        assert exp.mlir_module().count("custom_call @mosaic_gpu") == 3, D

    def lower(blocks):
        q = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
        f = lambda q: jax.grad(lambda q: jnp.sum(flash_attention(  # noqa: E731
            q, q, q, backend="mosaic", block_sizes=blocks).astype(jnp.float32)))(q)
        return export.export(jax.jit(f), platforms=["cuda"])(q).mlir_module()

    # the largest tiles HopperBlocks.check accepts at D=128 fit Mosaic's own shared-memory check ...
    assert lower(HopperBlocks(k=128, bwd_q=128, stages=2)).count("custom_call @mosaic_gpu") == 3
    # ... and the next size up, which check refuses, does not
    monkeypatch.setattr(flash_hopper, "SMEM_BYTES", 1 << 30)
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lower(HopperBlocks(k=128, bwd_q=128, stages=3))


def test_mosaic_flash_attention_bad_input_is_one_line_errors(monkeypatch):
    q = jnp.zeros((1, 32, 2, 64), jnp.bfloat16)
    with pytest.raises(ConfigError, match="backend must be one of triton, mosaic, got 'cuda'") as e:
        flash_attention(q, q, q, backend="cuda")
    assert "\n" not in str(e.value)
    f32 = q.astype(jnp.float32)
    with pytest.raises(ConfigError, match="takes bfloat16 or float16 inputs"):
        flash_attention(f32, f32, f32, backend="mosaic")
    with pytest.raises(ConfigError, match="block_sizes for backend='mosaic' are a flash_hopper.HopperBlocks"):
        flash_attention(q, q, q, backend="mosaic", block_sizes=BlockSizes())
    with pytest.raises(ConfigError, match="block_sizes for backend='triton' are a BlockSizes, got HopperBlocks"):
        flash_attention(q, q, q, block_sizes=HopperBlocks(64, 64, 2))
    with pytest.raises(ConfigError, match="needs k and bwd_q of 64 or 128 and 1-4 stages"):
        flash_attention(q, q, q, backend="mosaic", block_sizes=HopperBlocks(96, 64, 2))
    with pytest.raises(ConfigError, match="at head dim 128 needs 265 KiB of shared memory, a Hopper SM has 227"):
        HopperBlocks(k=128, bwd_q=128, stages=3).check(128)
    from maxtrain.kernels.flash_hopper import check_gpu
    with pytest.raises(ConfigError, match="needs a Hopper GPU \\(sm_90\\), this is sm_8.0; use backend='triton'"):
        check_gpu(True, "8.0", 12090)
    with pytest.raises(ConfigError, match="CUDA runtime 12080 is in 12.8.0-12.9.0"):
        check_gpu(True, "9.0", 12080)
    check_gpu(False, "9.0", 12080)  # only causal masks are affected
    check_gpu(True, "9.0", 12091)
    if jax.default_backend() != "gpu":  # the interpreter would deadlock on too few XLA:CPU threads
        monkeypatch.setenv("NPROC", "2")
        with pytest.raises(ConfigError, match="needs >= 16 XLA CPU threads, this machine has 2: set NPROC=32"):
            flash_attention(q, q, q, backend="mosaic", interpret=True)


def test_flash_attention_matches_jax_dot_product_attention():
    """Against `jax.nn.dot_product_attention` (its XLA path): GQA, causal + documents + window."""
    B, L, H, G, D, window = 2, 48, 4, 2, 64, 11
    q, k, v, seg, do, _ = _inputs(7, B, L, H, G, D, jnp.float32, True)

    def ours(q, k, v):
        return flash_attention(q, k, v, segment_ids=seg, sliding_window=window, interpret=INTERPRET,
                               block_sizes=BlockSizes(16, 16, 16, 16))

    def theirs(q, k, v):
        mask = (seg[:, :, None] == seg[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=(window - 1, 0),
                                            implementation="xla")

    def with_grads(fn):
        return jax.jit(lambda q, k, v: (fn(q, k, v),) + jax.grad(
            lambda *a: jnp.sum(fn(*a) * do), argnums=(0, 1, 2))(q, k, v))

    _assert_close(with_grads(ours)(q, k, v), with_grads(theirs)(q, k, v), 1e-5)


def _brute_mask(L, causal, window, seg_row):
    i = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    m = (j <= i) if causal else np.ones((L, L), bool)
    if window is not None:
        m = m & (i - j < window)
    if seg_row is not None:
        m = m & (seg_row[:, None] == seg_row[None, :])
    return m


@pytest.mark.parametrize("causal,window,segmented", [(True, None, False), (False, 7, False), (True, 21, False),
                                                     (True, None, True)])
def test_block_skipping_ranges_are_exact(causal, window, segmented):
    """The loop bounds skip exactly the blocks with no visible score, and the unmasked middle
    range holds only blocks with no masked score (checked block by block against the full mask)."""
    L, bq, bk = 75, 16, 32
    padded = 96
    st = fa_mod._Static(length=L, padded=padded, causal=causal, window=window, segmented=segmented, group=1,
                        scale=1.0, blocks=BlockSizes(bq, bk, bq, bk), interpret=True, num_warps=4, num_stages=2)
    seg = np.repeat(np.arange(4), 24)[:padded] if segmented else None
    full = np.zeros((padded, padded), bool)
    full[:L, :L] = _brute_mask(L, causal, window, None if seg is None else seg[:L])
    full[L:, :L] = _brute_mask(padded, causal, window, seg)[L:, :L]  # padded rows see real keys only

    def check(ranges, n_blocks, block_of):
        lo, b, c, hi = (int(x) for x in ranges)
        assert lo <= b <= c <= hi <= n_blocks
        for blk in range(n_blocks):
            tile = block_of(blk)
            if not lo <= blk < hi:
                assert not tile.any(), (blk, (lo, b, c, hi))
            if b <= blk < c:
                assert tile.all(), (blk, (lo, b, c, hi))
        if hi > lo and not segmented:  # tight: the first and last block looped over hold a visible score
            assert block_of(lo).any() and block_of(hi - 1).any()

    for i in range(-(-L // bq)):
        rows = full[i * bq:(i + 1) * bq]
        check(fa_mod._q_major_ranges(jnp.int32(i), bq, bk, st), padded // bk,
              lambda j: rows[:, j * bk:(j + 1) * bk])
    for j in range(padded // bk):
        cols = full[:L, j * bk:(j + 1) * bk]  # dK/dV: padded rows carry no cotangent
        check(fa_mod._kv_major_ranges(jnp.int32(j), bq, bk, st), -(-L // bq),
              lambda i: cols[i * bq:(i + 1) * bq])


@pytest.mark.parametrize("shapes,match", [
    (((1, 32, 4, 96), (1, 32, 2, 96)), "head_dim=96 is not supported; use one of 64, 128"),
    (((1, 32, 4, 64), (1, 32, 3, 64)), "kv_heads=3 does not divide heads=4"),
    (((1, 32, 4, 64), (1, 16, 2, 64)), "does not match q shape"),
    (((1, 32, 4, 64), (32, 2, 64)), "must be \\[batch, length, heads, head_dim\\]"),
])
def test_flash_attention_bad_shapes_are_one_line_errors(shapes, match):
    q = jnp.zeros(shapes[0], jnp.float32)
    kv = jnp.zeros(shapes[1], jnp.float32)
    with pytest.raises(ConfigError, match=match) as e:
        flash_attention(q, kv, kv)
    assert "\n" not in str(e.value)


def test_flash_attention_bad_settings_are_one_line_errors():
    q = jnp.zeros((1, 32, 2, 64), jnp.float32)
    with pytest.raises(ConfigError, match="segment_ids must be integer"):
        flash_attention(q, q, q, segment_ids=jnp.zeros((1, 31), jnp.int32))
    with pytest.raises(ConfigError, match="powers of two"):
        flash_attention(q, q, q, block_sizes=BlockSizes(24, 32, 32, 32))
    with pytest.raises(ConfigError, match="sliding_window must be a positive integer"):
        flash_attention(q, q, q, sliding_window=0)
    if jax.default_backend() != "gpu":
        with pytest.raises(ConfigError, match="interpret=False\\) needs a GPU"):
            flash_attention(q, q, q, interpret=False)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN is available on a GPU")
@pytest.mark.parametrize("impl", ["cudnn", "flash_mosaic"])
def test_gpu_attention_off_gpu_is_a_config_error(small_overrides, impl):
    with pytest.raises(ConfigError, match=f"model.attention={impl} needs a GPU \\(backend is cpu\\); "
                                          "use model.attention=xla or flash"):
        train(load_config(TINY, small_overrides + [f"model.attention={impl}"]))


def test_training_with_flash_matches_xla(tmp_path):
    """A few float32 steps with model.attention=flash (sharded: per-device kernels under shard_map
    over batch and heads) give the losses of the xla reference on one device."""
    base = SMALL + ["model.head_dim=64", "train.steps=2", "train.batch_size=8"]
    ref = train(load_config(TINY, base + ["mesh.data=1", f"run_dir={tmp_path / 'xla'}"]), devices=jax.devices()[:1])
    got = train(load_config(TINY, base + ["model.attention=flash", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                          f"run_dir={tmp_path / 'flash'}"]))
    for a, b in itertools.zip_longest(got.history, ref.history):
        assert a["step"] == b["step"]
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-4)


# ---------------------------------------------------------------- RMSNorm, cross-entropy


def _grads_close(fn, ref, args, cotangents, tol):
    """fn and ref agree in value and in the gradient of sum(outputs * cotangents) w.r.t. every arg."""
    def run(f):
        def loss(*a):
            outs = jax.tree.leaves(f(*a))
            return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cotangents)), outs
        return jax.jit(jax.grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)

    (g1, o1), (g2, o2) = run(fn), run(ref)
    _assert_close(list(o1) + list(g1), list(o2) + list(g2), tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_with_residual_matches_reference(dtype):
    from maxtrain.kernels.rms_norm import reference_rms_norm, rms_norm
    r = np.random.default_rng(1)
    x, res = (jnp.asarray(r.normal(size=(3, 11, 64)), dtype) for _ in range(2))  # 33 rows: padded to 48
    w = jnp.asarray(1 + 0.1 * r.normal(size=(64,)), jnp.float32)
    cts = [jnp.asarray(r.normal(size=x.shape), jnp.float32) for _ in range(2)]
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    _grads_close(lambda x, res, w: rms_norm(x, w, residual=res, interpret=INTERPRET),
                 lambda x, res, w: reference_rms_norm(x, w, residual=res), (x, res, w), cts, tol)
    _grads_close(lambda x, w: rms_norm(x, w, interpret=INTERPRET, block_rows=8),
                 lambda x, w: reference_rms_norm(x, w), (x, w), cts[:1], tol)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the jax-triton path may be taken")
def test_rms_norm_off_gpu_logs_its_pallas_fallback_once(caplog):
    from maxtrain.kernels import rms_norm as mod
    mod._LOGGED.clear()
    x = jnp.ones((16, 32), jnp.float32)
    with caplog.at_level("INFO", logger=mod.__name__):
        mod.rms_norm(x, jnp.ones((32,)))
        mod.rms_norm(x, jnp.ones((32,)))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["rms_norm: jax-triton needs a GPU (backend is cpu); using the Pallas kernel"]
    with pytest.raises(ConfigError, match="impl='triton'\\) needs a GPU"):
        mod.rms_norm(x, jnp.ones((32,)), impl="triton")


@pytest.mark.parametrize("scale", [3.0, 300.0])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_kernels_match_reference(dtype, scale):
    """Pallas CE over logits and the chunked linear CE: loss and lse, gradients of both; vocab 300
    is not a multiple of the chunk (padding / an overlapping last chunk), one target is ignored;
    logits of magnitude ~10 and ~1000 (where exp overflows without the running max)."""
    from maxtrain.kernels.cross_entropy import (cross_entropy, linear_cross_entropy, reference_cross_entropy,
                                                reference_linear_cross_entropy)
    r = np.random.default_rng(2)
    shape, V, D = (3, 7), 300, 32
    t = jnp.asarray(r.integers(0, V, shape), jnp.int32).at[0, 0].set(-1)
    cts = [jnp.asarray(r.normal(size=shape), jnp.float32) for _ in range(2)]
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    x = jnp.asarray(scale * r.normal(size=shape + (V,)), dtype)
    _grads_close(lambda x: cross_entropy(x, t, block_rows=8, block_vocab=128, interpret=INTERPRET),
                 lambda x: reference_cross_entropy(x, t), (x,), cts, tol)
    h = jnp.asarray(r.normal(size=shape + (D,)), dtype)
    w = jnp.asarray(scale / 10 * r.normal(size=(D, V)), dtype)
    _grads_close(lambda h, w: linear_cross_entropy(h, w, t, chunk=128),
                 lambda h, w: reference_linear_cross_entropy(h, w, t), (h, w), cts, tol)


def test_kernels_lower_to_triton_for_a_gpu(monkeypatch):
    """Every kernel goes through Pallas' Triton lowering for CUDA on this CPU-only machine (no GPU
    needed to lower): catches a primitive the Triton backend cannot lower before any GPU run.
    `bench/triton_lowering.py --compile` goes on to compile them to sm_90 with the triton package."""
    from jax import export
    from maxtrain.kernels.cross_entropy import cross_entropy
    from maxtrain.kernels.rms_norm import rms_norm
    monkeypatch.setattr(fa_mod, "_resolve_interpret", lambda interpret: False)
    target = "__gpu$xla.gpu.triton"
    q = jax.ShapeDtypeStruct((2, 200, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 200, 2, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 200), jnp.int32)

    def attention_grads(q, k, v, s):
        return jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, segment_ids=s, sliding_window=64)
                                                .astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

    def norm_grads(x, r, w):
        return jax.grad(lambda x, r, w: jnp.sum(rms_norm(x, w, residual=r, impl="pallas", interpret=False)[0]
                                                .astype(jnp.float32)), argnums=(0, 1, 2))(x, r, w)

    def ce_grads(x, t):
        return jax.grad(lambda x: jnp.sum(cross_entropy(x, t, interpret=False)[0]))(x)

    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    for fn, args, kernels in [(attention_grads, (q, kv, kv, seg), 3),
                              (norm_grads, (x, x, jax.ShapeDtypeStruct((256,), jnp.float32)), 2),
                              (ce_grads, (jax.ShapeDtypeStruct((64, 1000), jnp.bfloat16),
                                          jax.ShapeDtypeStruct((64,), jnp.int32)), 2)]:
        exp = export.export(jax.jit(fn), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(*args)
        assert exp.mlir_module().count(target) == kernels, fn.__name__
