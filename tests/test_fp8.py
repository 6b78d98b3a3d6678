"""FP8 projections (maxtrain/layers/fp8.py): the GEMM against its plain reference, the gradients
against float32 within FP8's rounding, the scaling recipes and the formats' limits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.layers.fp8 import E4M3, E5M2, fp8_project, fp8_project_reference, quantize


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _data(seed=0, outlier=False):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (2, 16, 64))
    if outlier:  # one row 1e5x larger: one scale pushes the others under e4m3's subnormals, rowwise does not
        x = x.at[0, 0].multiply(1e5)
    w = jax.random.normal(k[1], (64, 4, 8)) * 0.05
    g = jax.random.normal(k[2], (2, 16, 4, 8))
    return x, w, g


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_forward_is_the_quantise_dequantise_reference(recipe):
    x, w, _ = _data()
    got = fp8_project(x, w, 1, recipe)
    assert got.shape == (2, 16, 4, 8) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(fp8_project_reference(x, w, 1, recipe)), rtol=1e-5,
                               atol=1e-6)
    exact = jnp.einsum("bld,dhk->blhk", x, w)
    assert 1e-3 < _rel(got, exact) < 0.05  # really rounded to FP8, and no more than FP8 rounding


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_backward_gemms_are_fp8_and_close_to_float32(recipe):
    x, w, g = _data(1)

    def loss(fn, x, w):
        return jnp.sum(fn(x, w) * g)

    dx, dw = jax.grad(lambda x, w: loss(lambda a, b: fp8_project(a, b, 1, recipe), x, w), argnums=(0, 1))(x, w)
    ex, ew = jax.grad(lambda x, w: loss(lambda a, b: jnp.einsum("bld,dhk->blhk", a, b), x, w), argnums=(0, 1))(x, w)
    assert dx.shape == x.shape and dw.shape == w.shape
    for got, exact in ((dx, ex), (dw, ew)):  # e5m2 gradients: 2 mantissa bits, ~6% per element at most
        assert 1e-3 < _rel(got, exact) < 0.08, (_rel(got, exact), recipe)
    # the backward is the FP8 GEMMs written out: g in e5m2, x and w re-quantized for each GEMM
    g2, w2 = g.reshape(32, 32), w.reshape(64, 32)
    rowwise = recipe == "rowwise"
    qg, sg = quantize(g2, E5M2, 1 if rowwise else None)
    qw, sw = quantize(w2.T, E4M3, 0 if rowwise else None)
    want_dx = (qg.astype(jnp.float32) @ qw.astype(jnp.float32)) * sg * sw
    np.testing.assert_allclose(np.asarray(dx).reshape(32, 64), np.asarray(want_dx), rtol=1e-5, atol=1e-6)


def test_rowwise_keeps_the_rows_an_outlier_would_crush():
    x, w, _ = _data(2, outlier=True)
    exact = jnp.einsum("bld,dhk->blhk", x, w)
    rest = (slice(None), slice(1, None))  # every row but the outlier's
    tensorwise = _rel(fp8_project(x, w, 1, "tensorwise")[rest], exact[rest])
    rowwise = _rel(fp8_project(x, w, 1, "rowwise")[rest], exact[rest])
    assert rowwise < 0.05 and tensorwise > 0.2, (rowwise, tensorwise)  # measured: 0.036 and 0.277


def test_two_contracted_dims_and_the_formats_limits():
    o = jax.random.normal(jax.random.key(3), (2, 16, 4, 8))
    wo = jax.random.normal(jax.random.key(4), (4, 8, 64)) * 0.05
    got = fp8_project(o, wo, 2)  # blhk,hkd->bld
    assert got.shape == (2, 16, 64) and _rel(got, jnp.einsum("blhk,hkd->bld", o, wo)) < 0.05
    q, s = quantize(jnp.array([0.0, 1.0, -1e9]), E4M3, None)  # the amax maps to 448, e4m3's largest
    assert float(jnp.abs(q.astype(jnp.float32)).max()) == 448.0 and float(s) == pytest.approx(1e9 / 448)
    q, s = quantize(jnp.zeros(3), E5M2, None)  # all zeros: scale 1, no division by zero
    assert float(s) == 1.0 and not np.any(np.asarray(q.astype(jnp.float32)))
    with pytest.raises(ValueError, match="do not match"):
        fp8_project(o, wo, 1)
    with pytest.raises(ValueError, match="choose one of tensorwise, rowwise, delayed"):
        fp8_project(o, wo, 2, "blockwise")
    with pytest.raises(ValueError, match="needs meta"):
        fp8_project(o, wo, 2, "delayed")
