"""Attention: one dispatch point over implementations chosen by `model.attention`.

Every implementation takes q `[B, L, H, K]`, k and v `[B, S, KV, K]` (KV divides H: grouped-query
attention without repeating KV), optional segment ids, and returns `[B, L, H, K]` in q's dtype.
"""

from __future__ import annotations

import functools
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxtrain.config import ConfigError, did_you_mean
from maxtrain.sharding import logical_to_spec
from maxtrain.targets import on_gpu


class AttentionFn(Protocol):
    def __call__(self, q, k, v, *, q_segment_ids, kv_segment_ids, causal: bool,
                 sliding_window: int | None, rules=None, **options) -> jax.Array: ...


_IMPLS: dict[str, AttentionFn] = {}
_CHECKS: dict[str, Callable[[], str | None]] = {}


def register_attention(name: str, *, check: Callable[[], str | None] | None = None
                       ) -> Callable[[AttentionFn], AttentionFn]:
    """Decorator that makes an implementation selectable as `model.attention: NAME`.

    `check()` returns why the implementation cannot run here (e.g. no GPU), or None; it runs
    whenever the implementation is looked up, so a bad choice fails before anything compiles."""
    def deco(fn):
        _IMPLS[name] = fn
        if check is not None:
            _CHECKS[name] = check
        return fn
    return deco


AUTO = "auto"


def get_attention(name: str) -> AttentionFn:
    if name == AUTO:
        return _auto_attention
    if name not in _IMPLS:
        raise ConfigError(f"model.attention={name!r} is unknown; {did_you_mean(name, _IMPLS)}choose one of {', '.join(sorted(_IMPLS))}")
    problem = _CHECKS[name]() if name in _CHECKS else None
    if problem:
        raise ConfigError(problem)
    return _IMPLS[name]


def attention(q, k, v, *, impl: str = "xla", segment_ids=None, kv_segment_ids=None,
              causal: bool = True, sliding_window: int | None = None, rules=None, **options) -> jax.Array:
    """Dispatches to the implementation `impl`; `kv_segment_ids` defaults to `segment_ids`.

    `rules` (the activation rules) lets implementations that place data themselves (`ring`)
    know how batch and heads are sharded. `options` are implementation-specific keywords (e.g.
    `ring_layout`); every implementation accepts and ignores the ones it does not know."""
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    return get_attention(impl)(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                               causal=causal, sliding_window=sliding_window, rules=rules, **options)


def auto_attention(head_dim: int, v_head_dim: int | None = None, length_split: int = 1) -> tuple[str, str]:
    """What `model.attention: auto` runs for the program being traced (its mesh's devices,
    `maxtrain.targets`), and why. On Hopper (compute capability 9.x) the Hopper flash kernel
    (`flash_mosaic`: the fastest in the measured step, docs/kernels.md, and the one a deviceless
    `--target` compile can build); before Hopper the Triton flash kernel; cuDNN's fused kernel on a
    real GPU where those cannot run (head dims they do not tile, Blackwell); XLA's attention on CPU
    and TPU, where queries are split along length (`length_split > 1`: context parallelism is
    `ring`, chosen by hand), and where nothing else can run."""
    from maxtrain.kernels.limits import FLASH_HEAD_DIMS
    from maxtrain.targets import compute_capability

    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if not on_gpu():
        return "xla", f"not a GPU ({jax.default_backend()})"
    if length_split > 1:
        return "xla", f"queries split {length_split} ways along length (model.attention=ring for context parallelism)"
    cc = compute_capability()
    major = int(cc.split(".")[0]) if cc else 0
    flash_ok = head_dim in FLASH_HEAD_DIMS and v_head_dim == head_dim
    real = jax.default_backend() == "gpu"
    if major == 9 and flash_ok:
        return "flash_mosaic", f"compute capability {cc}: the Hopper kernel"
    if 0 < major < 9 and flash_ok:
        return "flash", f"compute capability {cc}: the Triton kernel (before Hopper)"
    if real and _cudnn_ok(head_dim, v_head_dim):
        return "cudnn", f"compute capability {cc}, head dims {head_dim}/{v_head_dim}: cuDNN"
    if flash_ok:
        return "flash", f"compute capability {cc or 'unknown'}: the Triton kernel"
    why = "cuDNN cannot be compiled without the device" if not real else "cuDNN cannot run them here"
    return "xla", f"head dims {head_dim}/{v_head_dim}: the flash kernels tile {FLASH_HEAD_DIMS} and {why}"


def _cudnn_ok(head_dim: int, v_head_dim: int) -> bool:
    """Whether cuDNN's fused attention can run these head dims here (cuDNN 8.9.4+ loaded)."""
    if head_dim % 8 or v_head_dim % 8 or max(head_dim, v_head_dim) > 128:
        return False
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        check_cudnn_version()
        return True
    except Exception:  # no cuDNN, too old, or a jax without the check: the flash kernels instead
        return False


def _auto_attention(q, k, v, **kwargs):
    """`model.attention: auto` traced outside `make_setup` (generation, evaluation): decided here
    from the operands' head dims (queries whole along length)."""
    impl, _ = auto_attention(q.shape[-1], v.shape[-1])
    return get_attention(impl)(q, k, v, **kwargs)


def kv_gathered(impl: str) -> bool:
    """Whether keys/values are gathered along length before the implementation runs."""
    return impl not in _KV_SHARDED


_KV_SHARDED = {"ring"}


def attention_mask(q_len: int, kv_len: int, q_segment_ids=None, kv_segment_ids=None, *,
                   causal: bool = True, sliding_window: int | None = None) -> jax.Array | None:
    """Boolean `[B or 1, 1, L, S]` mask: True where query i may attend key j."""
    mask = None
    if causal or sliding_window is not None:
        i = jnp.arange(q_len)[:, None]
        j = jnp.arange(kv_len)[None, :]
        mask = (j <= i) if causal else jnp.ones((q_len, kv_len), bool)
        if sliding_window is not None:
            mask = mask & (i - j < sliding_window)
        mask = mask[None, None]
    if q_segment_ids is not None:
        same = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
        mask = same if mask is None else (mask & same)
    return mask


@register_attention("xla")
def xla_attention(q_BLHK, k_BSGK, v_BSGK, *, q_segment_ids, kv_segment_ids, causal, sliding_window, **_):
    """Plain einsum-softmax attention; scores and softmax in float32. The reference for all others."""
    B, L, H, K = q_BLHK.shape
    S, G = k_BSGK.shape[1], k_BSGK.shape[2]
    q = q_BLHK.reshape(B, L, G, H // G, K)  # query heads grouped under their KV head
    s_BGRLS = jnp.einsum("blgrk,bsgk->bgrls", q, k_BSGK, preferred_element_type=jnp.float32)
    s_BGRLS = s_BGRLS * (K ** -0.5)
    mask = attention_mask(L, S, q_segment_ids, kv_segment_ids, causal=causal, sliding_window=sliding_window)
    if mask is not None:
        s_BGRLS = jnp.where(mask[:, :, None], s_BGRLS, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s_BGRLS, axis=-1).astype(v_BSGK.dtype)
    o = jnp.einsum("bgrls,bsgk->blgrk", p, v_BSGK, preferred_element_type=jnp.float32)
    return o.reshape(B, L, H, K).astype(q_BLHK.dtype)


# K/V gathered along `sequence` by the model's `kv_length` constraint, then plain attention: the
# all-gather variant of context parallelism, best for short sequences.
register_attention("ring_allgather")(xla_attention)


def _needs_gpu(name: str, compiles_without_gpu: bool = True) -> Callable[[], str | None]:
    """A check that the devices compiled for are GPUs; with `compiles_without_gpu=False`, real ones
    (cuDNN plans its kernels on the device, so `maxtrain inspect --target` cannot compile it)."""
    def check() -> str | None:
        if on_gpu() and (compiles_without_gpu or jax.default_backend() == "gpu"):
            return None
        if on_gpu():
            return (f"model.attention={name} cannot be compiled for a GPU this machine lacks (cuDNN plans its "
                    "kernels on the device); inspect with model.attention=flash or xla (flash_mosaic on Hopper)")
        return (f"model.attention={name} needs a GPU (backend is {jax.devices()[0].platform}); "
                "use model.attention=xla or flash")
    return check


@register_attention("cudnn", check=_needs_gpu("cudnn", compiles_without_gpu=False))
def cudnn_attention(q, k, v, *, q_segment_ids, kv_segment_ids, causal, sliding_window, **_):
    """`jax.nn.dot_product_attention` with cuDNN's fused kernel; GPU only (no silent XLA fallback:
    a config asking for cuDNN should not quietly measure something else)."""
    mask = None
    if q_segment_ids is not None:
        mask = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
    window = (sliding_window - 1, 0) if sliding_window is not None else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                        local_window_size=window, implementation="cudnn")


@register_attention("flash")
def flash_attention_impl(q, k, v, *, q_segment_ids, kv_segment_ids, causal, sliding_window, rules=None,
                         backend: str = "triton", **_):
    """`maxtrain.kernels.flash_attention` (Pallas; the interpreter off GPU), run per device.

    A Pallas call is opaque to XLA's partitioner, which would gather its operands onto every
    device; under a mesh it runs inside `shard_map` on the local batch and heads instead. Length
    is not split (queries need their global positions): use `ring` for sequence parallelism."""
    from maxtrain.kernels import flash_attention  # imported on first use: layers stay light

    fn = functools.partial(flash_attention, causal=causal, sliding_window=sliding_window, backend=backend)
    if q_segment_ids is None:
        local = fn
    else:
        def local(q, k, v, q_seg, kv_seg):
            return fn(q, k, v, segment_ids=(q_seg, kv_seg))
    args = (q, k, v) if q_segment_ids is None else (q, k, v, q_segment_ids, kv_segment_ids)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(*args)
    q_spec, kv_spec = _local_head_specs(rules or {})
    seg_spec = P(q_spec[0], None)
    in_specs = (q_spec, kv_spec, kv_spec) + ((seg_spec, seg_spec) if q_segment_ids is not None else ())
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(*args)


# The Hopper kernels (Pallas Mosaic GPU: wgmma, TMA, warp specialisation), kernels/flash_hopper.py.
# GPU only: in the Mosaic GPU interpreter a training step would take minutes.
register_attention("flash_mosaic", check=_needs_gpu("flash_mosaic"))(
    functools.partial(flash_attention_impl, backend="mosaic"))


def _local_head_specs(rules) -> tuple[P, P]:
    """q and k/v specs sharding batch and heads only. Query and KV heads must split the same way
    so that a device's query heads find their KV head locally; otherwise heads stay whole."""
    q_spec = logical_to_spec(("batch", None, "heads", None), rules)
    kv_spec = logical_to_spec(("batch", None, "kv_heads", None), rules)
    if q_spec[2] != kv_spec[2]:
        q_spec, kv_spec = P(q_spec[0], None, None, None), P(kv_spec[0], None, None, None)
    return q_spec, kv_spec
