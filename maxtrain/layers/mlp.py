"""Feed-forward blocks."""

import jax
import jax.numpy as jnp

from maxtrain.sharding import Rules, constrain


def swiglu(x_BLD: jax.Array, w_gate_DF, w_up_DF, w_down_FD, rules: Rules) -> jax.Array:
    """SwiGLU MLP: `(silu(x W_gate) * (x W_up)) W_down`, column- then row-parallel over `mlp`."""
    gate = jnp.einsum("bld,df->blf", x_BLD, w_gate_DF)
    up = jnp.einsum("bld,df->blf", x_BLD, w_up_DF)
    h_BLF = constrain(jax.nn.silu(gate) * up, ("batch", "block_length", "mlp"), rules)
    return jnp.einsum("blf,fd->bld", h_BLF, w_down_FD)
