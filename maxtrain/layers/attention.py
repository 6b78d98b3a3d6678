"""Attention: one dispatch point over implementations chosen by `model.attention`.

Every implementation takes q `[B, L, H, K]`, k and v `[B, S, KV, K]` (KV divides H: grouped-query
attention without repeating KV), optional segment ids, and returns `[B, L, H, K]` in q's dtype.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from maxtrain.config import ConfigError, did_you_mean

log = logging.getLogger(__name__)


class AttentionFn(Protocol):
    def __call__(self, q, k, v, *, q_segment_ids, kv_segment_ids, causal: bool,
                 sliding_window: int | None, rules=None, **options) -> jax.Array: ...


_IMPLS: dict[str, AttentionFn] = {}


def register_attention(name: str) -> Callable[[AttentionFn], AttentionFn]:
    """Decorator that makes an implementation selectable as `model.attention: NAME`."""
    def deco(fn):
        _IMPLS[name] = fn
        return fn
    return deco


def get_attention(name: str) -> AttentionFn:
    if name not in _IMPLS:
        raise ConfigError(f"model.attention={name!r} is unknown; {did_you_mean(name, _IMPLS)}choose one of {', '.join(sorted(_IMPLS))}")
    return _IMPLS[name]


def attention_names() -> list[str]:
    return sorted(_IMPLS)


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


def _on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


@register_attention("cudnn")
def cudnn_attention(q, k, v, *, q_segment_ids, kv_segment_ids, causal, sliding_window, **_):
    """`jax.nn.dot_product_attention` with cuDNN's fused kernel on GPU; XLA's lowering elsewhere."""
    mask = None
    if q_segment_ids is not None:
        mask = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
    impl = "cudnn" if _on_gpu() else None
    if impl is None:
        log.debug("model.attention=cudnn: no GPU, using jax.nn.dot_product_attention's XLA path")
    window = (sliding_window - 1, 0) if sliding_window is not None else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                        local_window_size=window, implementation=impl)
