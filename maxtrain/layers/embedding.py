"""Token embedding lookup whose gradient is summed in float32.

The backward of a gather is a scatter-add of the output cotangents into the table. In bf16 every
addition rounds to 8 mantissa bits, so a row hit by many tokens in a batch (spaces, newlines,
EOS) stops growing: 20,000 unit cotangents sum to 256. `lookup` gathers in the table's (compute)
dtype and scatter-adds the cotangents into a float32 table, rounding once at the end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def lookup(table_VD: jax.Array, tokens: jax.Array, grad_spec: PartitionSpec | None = None) -> jax.Array:
    """`table_VD[tokens]`; the table's gradient is accumulated in float32 and laid out as
    `grad_spec` (the table's sharding) when a mesh is in context."""
    return _lookup(table_VD, tokens, (table_VD.shape[0], grad_spec))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table_VD, tokens, static):
    return jnp.take(table_VD, tokens, axis=0)


def _lookup_fwd(table_VD, tokens, static):
    return jnp.take(table_VD, tokens, axis=0), tokens


def _lookup_bwd(static, tokens, g):
    vocab, spec = static
    grad = jnp.zeros((vocab, g.shape[-1]), jnp.float32)
    mesh = jax.sharding.get_abstract_mesh()
    if spec is not None and not mesh.empty and mesh.size > 1:
        grad = jax.lax.with_sharding_constraint(grad, spec)
    grad = grad.at[tokens.reshape(-1)].add(g.reshape(-1, g.shape[-1]).astype(jnp.float32))
    return grad.astype(g.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
