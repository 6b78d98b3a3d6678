"""Feed-forward blocks."""

import jax

from maxtrain.layers import dots
from maxtrain.sharding import Rules, constrain


def _einsum(name: str, eq: str, x, w):
    return dots.einsum(eq, x, w)


def swiglu(x: jax.Array, w_gate_DF, w_up_DF, w_down_FD, rules: Rules, layout: str = "bld", dot=_einsum) -> jax.Array:
    """SwiGLU MLP: `(silu(x W_gate) * (x W_up)) W_down`, column- then row-parallel over `mlp`.
    `layout` names x's dimensions: "bld" (`[B, L, D]`) or "lbd" (a block run length-major, as
    `llama._enter_block` lays it out under sequence parallelism); the result has the same.
    `dot(name, eq, x, w)` runs each projection (`name`: w_gate, w_up, w_down), e.g. in FP8."""
    inner = layout[:2] + "f"
    gate = dot("w_gate", f"{layout},df->{inner}", x, w_gate_DF)
    up = dot("w_up", f"{layout},df->{inner}", x, w_up_DF)
    axes = {"b": "batch", "l": "block_length"}
    h = constrain(jax.nn.silu(gate) * up, (axes[layout[0]], axes[layout[1]], "mlp"), rules)
    return dot("w_down", f"{inner},fd->{layout}", h, w_down_FD)
