"""Normalisation layers."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxtrain.sharding import logical_to_spec


def rms_norm(x_BLD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in the input dtype."""
    x = x_BLD.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    scale = scale_D.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + scale_D.shape)
    return (y * scale).astype(x_BLD.dtype)


def fused_add_rms_norm(x_BLD: jax.Array, residual_BLD: jax.Array, scale_D: jax.Array, eps: float,
                       rules: dict) -> tuple[jax.Array, jax.Array]:
    """`(rms_norm(x + residual) * scale, x + residual)` by one kernel (`maxtrain.kernels.rms_norm`),
    per device: a Pallas call is opaque to XLA's partitioner, so under a mesh it runs inside
    `shard_map` on the local rows (batch and length as `rules` shard them; the feature dim whole)."""
    from maxtrain.kernels.rms_norm import rms_norm as kernel  # on first use: layers stay light

    def local(x, r, scale):
        return kernel(x, scale, eps=eps, residual=r)

    mesh = jax.sharding.get_abstract_mesh()
    spec = logical_to_spec(("batch", "length", None), rules)
    if mesh.empty or mesh.size == 1:
        return local(x_BLD, residual_BLD, scale_D)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, P()), out_specs=(spec, spec),
                         check_vma=False)(x_BLD, residual_BLD, scale_D)
