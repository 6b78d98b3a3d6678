"""Normalisation layers."""

import jax
import jax.numpy as jnp


def rms_norm(x_BLD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in the input dtype."""
    x = x_BLD.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    scale = scale_D.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + scale_D.shape)
    return (y * scale).astype(x_BLD.dtype)
