"""Fused RMSNorm (+ residual add) in Pallas, with a jax-triton forward on GPU.

`rms_norm(x, scale, residual=r)` computes `h = x + r` and `y = h * rsqrt(mean(h^2) + eps) * scale`
in one pass over memory and returns `(y, h)`: the pre-norm transformer's "add the sublayer output
to the residual stream, normalise for the next sublayer", which XLA otherwise runs as an add, a
reduction and a scale that each read `[tokens, d_model]` again. Without `residual` it returns `y`.
Statistics are float32; outputs keep x's dtype.

Forward: one program per block of rows (the whole feature dimension in registers). On a GPU with
jax-triton installed it is a `triton.jit` kernel called through `jax_triton.triton_call`
(`kernels/rms_norm_triton.py`); elsewhere the Pallas kernel (interpreted off GPU), with one log
line saying which. Backward (custom VJP, Pallas): per row block `dh = rstd * (g - x_hat * mean(g *
x_hat))` with `g = dy * scale`, plus the residual output's cotangent, and a per-block partial sum of
`dy * x_hat` for the scale's gradient, summed over blocks by XLA.

The feature dimension must be a power of two (Triton tensors are); other widths use the plain-JAX
reference, logged once.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from maxtrain.errors import ConfigError
from maxtrain.targets import on_gpu

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

log = logging.getLogger(__name__)
IMPLS = ("auto", "triton", "pallas")


def reference_rms_norm(x, scale, *, eps: float = 1e-5, residual=None):
    """Plain JAX, float32 statistics (what `maxtrain.layers.norms.rms_norm` computes, plus the add)."""
    h = x if residual is None else (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    hf = h.astype(jnp.float32)
    y = hf * jax.lax.rsqrt(jnp.mean(jnp.square(hf), axis=-1, keepdims=True) + eps)
    y = (y * scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + scale.shape)).astype(x.dtype)
    return y if residual is None else (y, h)


def rms_norm(x, scale, *, eps: float = 1e-5, residual=None, impl: str = "auto", interpret: bool | None = None,
             block_rows: int | None = None):
    """Fused RMSNorm over the last axis of x `[..., D]` with scale `[D]`; with `residual` (x's shape)
    returns `(norm(x + residual) * scale, x + residual)`. `impl`: auto (jax-triton forward on GPU
    when installed, else Pallas), triton, pallas."""
    if impl not in IMPLS:
        raise ConfigError(f"rms_norm: impl={impl!r} is not valid; choose one of {', '.join(IMPLS)}")
    D = x.shape[-1]
    if scale.shape != (D,) or (residual is not None and (residual.shape, residual.dtype) != (x.shape, x.dtype)):
        raise ConfigError(f"rms_norm: scale must be [{D}] and residual x's shape and dtype {x.dtype}{list(x.shape)}, "
                          f"got {scale.shape} and {None if residual is None else (residual.dtype, residual.shape)}")
    if D & (D - 1) or D < 16:
        _log_once(f"rms_norm: feature dim {D} is not a power of two >= 16; using the plain-JAX reference")
        return reference_rms_norm(x, scale, eps=eps, residual=residual)
    if block_rows is None:  # ~8k float32 values per program: whole rows in registers, no spills
        block_rows = max(1, min(16, 8192 // D))
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ConfigError(f"rms_norm: block_rows must be a power of two, got {block_rows}")
    interpret = not on_gpu() if interpret is None else bool(interpret)
    use_triton = _choose_triton(impl, interpret)
    st = _Static(eps=float(eps), block_rows=block_rows, interpret=interpret, triton=use_triton,
                 has_residual=residual is not None)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, D)
    r2 = None if residual is None else residual.reshape(-1, D)
    y, h = _padded_call(x2, r2, scale, st)
    y = y.reshape(*lead, D)
    return y if residual is None else (y, h.reshape(*lead, D))


@dataclasses.dataclass(frozen=True)
class _Static:
    eps: float
    block_rows: int
    interpret: bool
    triton: bool
    has_residual: bool


_LOGGED: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        log.info(msg)


def _choose_triton(impl: str, interpret: bool) -> bool:
    """jax-triton for the forward when asked (auto) and possible; otherwise says why, once."""
    if impl == "pallas":
        return False
    if interpret or jax.default_backend() != "gpu":
        if impl == "triton":
            raise ConfigError(f"rms_norm(impl='triton') needs a GPU (backend is {jax.default_backend()}); "
                              "use impl='auto' or 'pallas'")
        _log_once(f"rms_norm: jax-triton needs a GPU (backend is {jax.default_backend()}); using the Pallas kernel")
        return False
    problem = _triton_import_problem()
    if problem:
        if impl == "triton":
            raise ConfigError(f"rms_norm(impl='triton'): jax-triton is not usable here ({problem}); "
                              "pip install -e '.[gpu]' or use impl='pallas'")
        _log_once(f"rms_norm: jax-triton is not usable here ({problem}); using the Pallas kernel")
        return False
    return True


@functools.lru_cache(maxsize=1)
def _triton_import_problem() -> str | None:
    try:
        from maxtrain.kernels import rms_norm_triton  # noqa: F401  (imports jax_triton, triton)
    except Exception as e:  # ImportError, or a jax-triton built against another jaxlib
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


@functools.partial(jax.jit, static_argnums=(3,))
def _padded_call(x, r, scale, st: _Static):
    """Pads rows to the block multiple (zeros: finite statistics), runs the kernel, slices back."""
    N = x.shape[0]
    pad = -N % st.block_rows
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        r = None if r is None else jnp.pad(r, ((0, pad), (0, 0)))
    y, h = _fused(x, r, scale, st)
    return y[:N], (None if h is None else h[:N])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused(x, r, scale, st):
    y, h, _ = _forward(x, r, scale, st)
    return y, h


def _fused_fwd(x, r, scale, st):
    y, h, rstd = _forward(x, r, scale, st)
    return (y, h), (x if h is None else h, scale, rstd)


def _fused_bwd(st, res, cts):
    h, scale, rstd = res
    dy, dh_out = cts
    dh, dscale_parts = _backward(h, scale, rstd, dy, dh_out, st)
    dscale = jnp.sum(dscale_parts, axis=0).astype(scale.dtype)
    return dh, (dh if st.has_residual else None), dscale


_fused.defvjp(_fused_fwd, _fused_bwd)


def _forward(x, r, scale, st: _Static):
    """(y, h or None, rstd [N] f32)."""
    if st.triton:
        from maxtrain.kernels import rms_norm_triton
        return rms_norm_triton.forward(x, r, scale, eps=st.eps, block_rows=st.block_rows)
    return _pallas_forward(x, r, scale, st)


def _row_spec(bn, D):
    return pl.BlockSpec((bn, D), lambda i: (i, 0))


def _compiler_params(st: _Static):
    if st.interpret or plgpu is None:
        return None
    return plgpu.CompilerParams(num_warps=8, num_stages=1)  # ~8k values per program: 32 per thread


def _forward_kernel(*refs, st: _Static):
    if st.has_residual:
        x_ref, r_ref, w_ref, y_ref, h_ref, rstd_ref = refs
        h = (x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)).astype(h_ref.dtype)
        h_ref[...] = h
        h = h.astype(jnp.float32)  # normalise what the residual stream holds (x's dtype)
    else:
        x_ref, w_ref, y_ref, rstd_ref = refs
        h = x_ref[...].astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(h * h, axis=1) + st.eps)
    y = h * rstd[:, None] * w_ref[...].astype(jnp.float32)[None, :]
    y_ref[...] = y.astype(y_ref.dtype)
    rstd_ref[...] = rstd


def _pallas_forward(x, r, scale, st: _Static):
    N, D = x.shape
    bn = st.block_rows
    in_specs = [_row_spec(bn, D)] + ([_row_spec(bn, D)] if r is not None else []) + [pl.BlockSpec((D,), lambda i: (0,))]
    out_specs = [_row_spec(bn, D)] + ([_row_spec(bn, D)] if r is not None else []) + [pl.BlockSpec((bn,), lambda i: (i,))]
    out_shape = [jax.ShapeDtypeStruct((N, D), x.dtype)] * (2 if r is not None else 1)
    out_shape = out_shape + [jax.ShapeDtypeStruct((N,), jnp.float32)]
    outs = pl.pallas_call(
        functools.partial(_forward_kernel, st=st),
        grid=(N // bn,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(st),
        interpret=st.interpret,
        name="rms_norm_fwd",
    )(*([x] + ([r] if r is not None else []) + [scale]))
    if r is None:
        y, rstd = outs
        return y, None, rstd
    return tuple(outs)


def _backward_kernel(*refs, st: _Static):
    if st.has_residual:
        h_ref, w_ref, rstd_ref, dy_ref, dho_ref, dh_ref, dw_ref = refs
    else:
        h_ref, w_ref, rstd_ref, dy_ref, dh_ref, dw_ref = refs
        dho_ref = None
    rstd = rstd_ref[...][:, None]
    x_hat = h_ref[...].astype(jnp.float32) * rstd
    dy = dy_ref[...].astype(jnp.float32)
    g = dy * w_ref[...].astype(jnp.float32)[None, :]
    dh = rstd * (g - x_hat * jnp.mean(g * x_hat, axis=1)[:, None])
    if dho_ref is not None:
        dh = dh + dho_ref[...].astype(jnp.float32)
    dh_ref[...] = dh.astype(dh_ref.dtype)
    dw_ref[...] = jnp.sum(dy * x_hat, axis=0)


def _backward(h, scale, rstd, dy, dh_out, st: _Static):
    N, D = h.shape
    bn = st.block_rows
    nb = N // bn
    args = [h, scale, rstd, dy] + ([dh_out] if st.has_residual else [])
    in_specs = [_row_spec(bn, D), pl.BlockSpec((D,), lambda i: (0,)), pl.BlockSpec((bn,), lambda i: (i,)),
                _row_spec(bn, D)] + ([_row_spec(bn, D)] if st.has_residual else [])
    return pl.pallas_call(
        functools.partial(_backward_kernel, st=st),
        grid=(nb,),
        in_specs=in_specs,
        out_specs=[_row_spec(bn, D), pl.BlockSpec((None, D), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((N, D), h.dtype), jax.ShapeDtypeStruct((nb, D), jnp.float32)],
        compiler_params=_compiler_params(st),
        interpret=st.interpret,
        name="rms_norm_bwd",
    )(*args)
