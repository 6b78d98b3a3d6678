"""Rotary position embeddings (rotate-half layout, as in Hugging Face Llama checkpoints)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from maxtrain.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Per-pair inverse frequencies `theta^(-2i/d)`, with optional Llama-3 long-context scaling."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    # Llama 3.1: wavelengths longer than the original context / low_freq_factor are slowed by
    # `factor`, shorter than context / high_freq_factor are kept, and the band between is blended.
    old = scaling.original_max_position
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    return jnp.where(wavelen < high_wavelen, inv, jnp.where(wavelen > low_wavelen, inv / scaling.factor, blended))


def apply_rope(x_BLHK: jax.Array, positions_BL: jax.Array, inv_freq_K2: jax.Array) -> jax.Array:
    """Rotates each (i, i + K/2) pair of `x` by `position * inv_freq[i]`; computed in float32."""
    angle = positions_BL.astype(jnp.float32)[:, :, None, None] * inv_freq_K2[None, None, None, :]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x = x_BLHK.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)
