"""train.cross_entropy: the fused losses against XLA's, values and gradients, sharded and not."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL, TINY
from maxtrain import load_config, models, train
from maxtrain.config import ConfigError
from maxtrain.loss import fused_token_losses, hidden_loss, model_loss, next_token_loss, onepass_loss, token_losses
from maxtrain.mesh import use_mesh
from maxtrain.step import compile_train_step, init_state, make_setup

RULES = load_config(TINY, []).sharding


def _hw(N=2, L=13, D=16, V=300, seed=0):
    r = np.random.default_rng(seed)
    h = jnp.asarray(r.normal(size=(N, L, D)), jnp.float32)
    w = jnp.asarray(r.normal(size=(D, V)) * 0.5, jnp.float32)
    t = jnp.asarray(r.integers(0, V, (N, L)), jnp.int32)
    return h, w, t


@pytest.mark.parametrize("impl,chunk", [("fused", 64), ("fused", 300), ("fused", 4096), ("pallas", 128)])
def test_fused_token_losses_match_xla_values_and_gradients(impl, chunk):
    h, w, t = _hw()  # V=300: chunks that do not divide the vocab

    def total(fn):
        def f(h, w):
            nll, lse = fn(h, w)
            return jnp.sum(nll * jnp.cos(nll)) + 0.1 * jnp.sum(lse ** 2), (nll, lse)
        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)

    (_, ref), ref_g = total(lambda h, w: token_losses(jnp.einsum("nld,dv->nlv", h, w,
                                                                 precision="highest"), t))(h, w)
    (_, got), got_g = jax.jit(total(lambda h, w: fused_token_losses(
        h, w, t, impl=impl, chunk=chunk, act_rules=RULES.activations, param_rules=RULES.params)))(h, w)
    for a, b in zip(got + got_g, ref + ref_g):  # nll, lse, dh, dw
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype,tokens", [(jnp.float32, 7), (jnp.float32, 4096), (jnp.bfloat16, 8)])
def test_onepass_loss_matches_xla_values_and_gradients(dtype, tokens):
    """The forward's precomputed gradients, scaled in the backward, equal autodiff of XLA's loss:
    with z-loss, masked tokens, a chunk that does not divide the tokens (padding) and one chunk."""
    h, w, t = _hw(N=3, L=9)  # 27 tokens
    h, w = h.astype(dtype), w.astype(dtype)
    mask = jnp.asarray(np.random.default_rng(1).random(t.shape) > 0.3, jnp.float32)
    z = 1e-2

    def ref(h, w):
        logits = jnp.einsum("nld,dv->nlv", h, w, preferred_element_type=jnp.float32, precision="highest")
        total, stats = next_token_loss(logits, t, mask, z)
        return 3.0 * total, (stats["nll_sum"], stats["z_sum"])

    def got(h, w):
        total, nll_sum, z_sum = onepass_loss(h, w, t, mask, tokens=tokens, z_loss=z, act_rules=RULES.activations,
                                             param_rules=RULES.params, block=128)  # 300 columns: the last overlaps
        return 3.0 * total, (nll_sum, z_sum)  # a cotangent other than 1 reaches the backward

    (r_total, r_sums), r_grads = jax.value_and_grad(ref, argnums=(0, 1), has_aux=True)(h, w)
    (g_total, g_sums), g_grads = jax.jit(jax.value_and_grad(got, argnums=(0, 1), has_aux=True))(h, w)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(g_total, r_total, rtol=tol)
    np.testing.assert_allclose(g_sums, r_sums, rtol=tol)
    for a, b in zip(g_grads, r_grads):  # dh, dw
        assert a.dtype == dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol,
                                   atol=tol * float(jnp.abs(b.astype(jnp.float32)).max()))
    # without differentiation (evaluation) the same sums, no gradients made
    total, nll_sum, _ = jax.jit(lambda h, w: onepass_loss(h, w, t, mask, tokens=tokens, z_loss=z,
                                                          act_rules=RULES.activations, param_rules=RULES.params))(h, w)
    np.testing.assert_allclose([total, nll_sum], [r_total / 3.0, r_sums[0]], rtol=tol)


def _batch(cfg, seed=0):
    B, L, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    r = np.random.default_rng(seed)
    seg = np.sort(r.integers(1, 3, (B, L)), axis=1).astype(np.int32)
    return {"inputs": r.integers(0, V, (B, L)).astype(np.int32), "targets": r.integers(0, V, (B, L)).astype(np.int32),
            "loss_mask": (r.random((B, L)) > 0.1).astype(np.float32), "segment_ids": seg,
            "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy()}


def _loss_and_grads(overrides, devices=None):
    cfg = load_config(TINY, SMALL + ["train.z_loss=1e-3", "train.cross_entropy_chunk=48"] + overrides)
    setup = make_setup(cfg, devices)
    with use_mesh(setup.mesh):
        params = init_state(setup, 0).params
        fn = jax.jit(jax.value_and_grad(lambda p, b: model_loss(setup.model, p, b, cfg, cfg.train.z_loss)[:2],
                                        has_aux=True),
                     in_shardings=(setup.state_shardings.params, setup.batch_sharding))
        (total, stats), grads = fn(params, _batch(cfg))
    return float(total), jax.tree.map(np.asarray, grads)


@functools.cache
def _one_device_loss_and_grads(model_overrides: tuple):
    """The XLA reference of each model below (3 for the 9 cases), computed once per test worker (read,
    never changed)."""
    return _loss_and_grads(["mesh.data=1", *model_overrides], devices=jax.devices()[:1])


@pytest.mark.parametrize("impl,mesh", [
    ("fused", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    ("fused", ["mesh.data=1", "mesh.fsdp=2", "mesh.sequence=2", "mesh.tensor=2", "model.tie_embeddings=true"]),
    ("fused", ["mesh.data=4", "mesh.tensor=2", "sharding.activations.vocab=[data, tensor]"]),
    ("onepass", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.cross_entropy_tokens=24"]),
    ("onepass", ["mesh.data=1", "mesh.fsdp=2", "mesh.sequence=2", "mesh.tensor=2", "model.tie_embeddings=true"]),
    ("onepass", ["mesh.data=4", "mesh.tensor=2", "sharding.activations.vocab=[data, tensor]"]),
    ("pallas", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    ("pallas", ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "model.tie_embeddings=true"]),
    # a vocab shard (96 columns) that is not a multiple of the kernel's tile: padded columns must
    # never match a target that belongs to the next shard
    ("pallas", ["mesh.data=2", "mesh.tensor=4", "model.vocab_size=384", "model.n_kv_heads=4",
                "train.cross_entropy_chunk=4096"]),
])
def test_sharded_fused_loss_matches_single_device_xla(impl, mesh):
    tied = [o for o in mesh if o.startswith("model.")]  # model changes apply to the reference too
    ref_total, ref_grads = _one_device_loss_and_grads(tuple(tied))
    total, grads = _loss_and_grads(mesh + [f"train.cross_entropy={impl}"])
    np.testing.assert_allclose(total, ref_total, rtol=1e-5)
    flat_ref = jax.tree_util.tree_flatten_with_path(ref_grads)[0]
    for (path, g), (_, r) in zip(jax.tree_util.tree_flatten_with_path(grads)[0], flat_ref):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_fused_and_onepass_training_with_pipeline_and_accumulation_match_xla(tmp_path):
    common = SMALL + ["train.steps=3", "train.grad_accum=2", "mesh.data=2", "mesh.pipeline=2", "mesh.tensor=2",
                      "train.cross_entropy_chunk=32"]
    runs = {impl: train(load_config(TINY, common + [f"run_dir={tmp_path / impl}", f"train.cross_entropy={impl}"]))
            for impl in ("xla", "fused", "onepass")}
    for impl in ("fused", "onepass"):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose([r[key] for r in runs[impl].history], [r[key] for r in runs["xla"].history],
                                       rtol=2e-5, err_msg=f"{impl} {key}")


def test_fused_and_onepass_losses_shrink_compiled_memory_at_large_vocab():
    big_vocab = SMALL + ["model.vocab_size=16384", "train.batch_size=8", "train.seq_len=128", "mesh.data=1"]

    def temp_bytes(impl):
        setup = make_setup(load_config(TINY, big_vocab + [f"train.cross_entropy={impl}",
                                                          "train.cross_entropy_chunk=1024",  # 4 MiB chunks
                                                          "train.cross_entropy_tokens=64"]), jax.devices()[:1])
        with use_mesh(setup.mesh):
            return compile_train_step(setup)[0].memory_analysis().temp_size_in_bytes

    xla, fused, onepass = temp_bytes("xla"), temp_bytes("fused"), temp_bytes("onepass")
    logits_f32 = 8 * 128 * 16384 * 4  # one float32 copy of the logits: 64 MiB
    assert xla > 2 * logits_f32 and fused < xla / 4 and onepass < xla / 4, (xla, fused, onepass)


def test_cross_entropy_config_errors():
    with pytest.raises(ConfigError, match="train.cross_entropy='fast' is not valid"):
        load_config(TINY, ["train.cross_entropy=fast"])
    with pytest.raises(ConfigError, match="train.cross_entropy_chunk must be a positive integer"):
        load_config(TINY, ["train.cross_entropy_chunk=0"])
    with pytest.raises(ConfigError, match=r"train.cross_entropy_tokens must be >= 0 \(0: automatic\), got -1"):
        load_config(TINY, ["train.cross_entropy_tokens=-1"])
    with pytest.raises(ConfigError, match=r"model.vocab_size=100 does not divide into 8 vocab shards over mesh axes "
                                          r"tensor \(train.cross_entropy=fused\)"):
        make_setup(load_config(TINY, ["model.vocab_size=100", "mesh.data=1", "mesh.tensor=8", "model.n_heads=8",
                                      "model.n_kv_heads=8", "train.cross_entropy=fused",
                                      "sharding.params.vocab=null"]))
    llama = models.get("llama")
    models.register("logits_only", init=llama.init, apply=llama.apply, logical_axes=llama.logical_axes)
    with pytest.raises(ConfigError, match="needs model 'logits_only' to register features= and head="):
        make_setup(load_config(TINY, ["model.name=logits_only", "train.cross_entropy=fused"]))
    with pytest.raises(ValueError, match="give both features and head"):
        models.register("half", init=llama.init, apply=llama.apply, logical_axes=llama.logical_axes,
                        features=llama.features)


def _np_token_losses(logits, targets):
    """float64 numpy oracle: per-token (nll, lse) and d(sum(nll * c1 + lse * c2))/dlogits."""
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(x, np.asarray(targets)[..., None], -1)[..., 0]
    return lse - picked, lse


LARGE = {  # path -> f(h, w, t) giving (nll, lse): every loss implementation of the trainer and the kernels
    "xla": lambda h, w, t: token_losses(jnp.einsum("nld,dv->nlv", h, w, preferred_element_type=jnp.float32), t),
    "fused": lambda h, w, t: fused_token_losses(h, w, t, impl="fused", chunk=128, act_rules=RULES.activations,
                                                param_rules=RULES.params),
    "pallas": lambda h, w, t: fused_token_losses(h, w, t, impl="pallas", chunk=128, act_rules=RULES.activations,
                                                 param_rules=RULES.params),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("path", list(LARGE))
def test_losses_at_large_logits_match_a_float64_oracle(path, dtype):
    """Logits of magnitude several hundred (exp overflows float32 past 88): finite, and equal to a
    float64 numpy log-sum-exp; the gradient (softmax minus one-hot) too. Without the max
    subtraction every path gives inf here."""
    r = np.random.default_rng(5)
    N, L, D, V = 2, 5, 16, 300
    h = jnp.asarray(r.normal(size=(N, L, D)), dtype)
    w = jnp.asarray(r.normal(size=(D, V)) * 60.0, dtype)  # logits with std ~240
    t = jnp.asarray(r.integers(0, V, (N, L)), jnp.int32)
    logits = np.einsum("nld,dv->nlv", np.asarray(h, np.float64), np.asarray(w, np.float64))
    assert np.abs(logits).max() > 300
    nll_np, lse_np = _np_token_losses(logits, t)
    (nll, lse), vjp = jax.vjp(lambda h, w: LARGE[path](h, w, t), h, w)
    assert bool(jnp.isfinite(nll).all() & jnp.isfinite(lse).all())
    scale = np.abs(logits).max()
    tol = 3e-6 if dtype == jnp.float32 else 3e-3  # bf16 logits (pallas) are rounded to 8 bits
    np.testing.assert_allclose(lse, lse_np, atol=tol * scale, rtol=0)
    np.testing.assert_allclose(nll, nll_np, atol=tol * scale, rtol=0)
    # d(sum nll)/dh = (softmax - onehot) @ w^T
    p = np.exp(logits - lse_np[..., None])
    p[np.arange(N)[:, None], np.arange(L)[None], np.asarray(t)] -= 1.0
    dh_np = p @ np.asarray(w, np.float64).T
    dh, _ = vjp((jnp.ones_like(nll), jnp.zeros_like(lse)))
    assert bool(jnp.isfinite(dh).all())
    np.testing.assert_allclose(np.asarray(dh, np.float64), dh_np, atol=(1e-4 if dtype == jnp.float32 else 3e-2)
                               * np.abs(dh_np).max(), rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_onepass_at_large_logits_matches_a_float64_oracle(dtype):
    """`onepass` at logits of magnitude several hundred: its summed loss and d(sum nll)/dh equal
    the float64 oracle's (the same setting as the per-token paths' test above)."""
    r = np.random.default_rng(5)
    N, L, D, V = 2, 5, 16, 300
    h = jnp.asarray(r.normal(size=(N, L, D)), dtype)
    w = jnp.asarray(r.normal(size=(D, V)) * 60.0, dtype)
    t = jnp.asarray(r.integers(0, V, (N, L)), jnp.int32)
    logits = np.einsum("nld,dv->nlv", np.asarray(h, np.float64), np.asarray(w, np.float64))
    nll_np, lse_np = _np_token_losses(logits, t)
    total, vjp = jax.vjp(lambda h: onepass_loss(h, w, t, jnp.ones(t.shape), tokens=4, z_loss=0.0,
                                                act_rules=RULES.activations, param_rules=RULES.params)[0], h)
    scale = np.abs(logits).max()
    np.testing.assert_allclose(total, nll_np.sum(), atol=(3e-6 if dtype == jnp.float32 else 3e-3) * scale * N * L)
    p = np.exp(logits - lse_np[..., None])
    p[np.arange(N)[:, None], np.arange(L)[None], np.asarray(t)] -= 1.0
    dh_np = p @ np.asarray(w, np.float64).T
    (dh,) = vjp(jnp.ones_like(total))
    assert bool(jnp.isfinite(dh).all())
    np.testing.assert_allclose(np.asarray(dh, np.float64), dh_np, atol=(1e-4 if dtype == jnp.float32 else 3e-2)
                               * np.abs(dh_np).max(), rtol=0)


def _np_loss_and_grads(h, w, t, mask, z, cotangent):
    """float64 numpy oracle of the training loss `sum(mask * (lse - x_target)) + z * sum(mask * lse^2)`
    of the logits `x = h @ w`, and its gradients w.r.t. h and w times `cotangent`: from
    d/dx = mask * ((1 + 2 z lse) softmax(x) - onehot(target)), then dh = G w^T, dw = h^T G."""
    h, w, mask = (np.asarray(a, np.float64) for a in (h, w, mask))
    x = np.einsum("nld,dv->nlv", h, w)
    nll, lse = _np_token_losses(x, t)
    nll_sum, z_sum = (mask * nll).sum(), (mask * lse ** 2).sum()
    g = np.exp(x - lse[..., None]) * (1.0 + 2.0 * z * lse)[..., None]
    g[np.arange(x.shape[0])[:, None], np.arange(x.shape[1])[None], np.asarray(t)] -= 1.0
    g *= cotangent * mask[..., None]
    return nll_sum + z * z_sum, nll_sum, z_sum, g @ w.T, np.einsum("nld,nlv->dv", h, g)


# `fused` and `pallas` share `xla`'s sums (`loss_sums`) and are held to its per-token values and
# gradients above: the oracle for `xla` reaches them too. `onepass` computes all of it itself.
@pytest.mark.parametrize("impl,dtype", [("xla", jnp.float32), ("onepass", jnp.float32), ("onepass", jnp.bfloat16)])
def test_each_cross_entropy_matches_a_numpy_oracle_with_mask_and_z_loss(impl, dtype):
    """`hidden_loss` (the trainer's loss of the final hidden states, every `train.cross_entropy`):
    the total, its nll and z sums, the token count, and the gradients w.r.t. the hidden states and
    the output weights, against the float64 oracle above (none of maxtrain.loss's helpers). Masked
    tokens, z-loss 1e-2 (it scales each softmax term of the gradient by 1 + 2 z lse, ~1.14 here), a cotangent of 3,
    27 tokens in chunks of 7 (`onepass`: padding) and 300 vocab columns in blocks of 128 (the last
    overlaps), targets on the first and last columns and on both sides of the block edges."""
    r = np.random.default_rng(21)
    N, L, D, V, z = 3, 9, 16, 300, 1e-2
    h = jnp.asarray(r.normal(size=(N, L, D)), dtype)
    w = jnp.asarray(r.normal(size=(D, V)) * 0.5, dtype)
    t = r.integers(0, V, (N, L)).astype(np.int32)
    t[0, :7] = [0, V - 1, 127, 128, 171, 172, 256]
    mask = (r.random((N, L)) > 0.3).astype(np.float32)
    mask[0, :7] = 1.0
    cfg = load_config(TINY, [f"train.cross_entropy={impl}", "train.cross_entropy_tokens=7",
                             "train.cross_entropy_chunk=128"])
    batch = {"targets": jnp.asarray(t), "loss_mask": jnp.asarray(mask)}

    def loss(h, w):
        total, stats = hidden_loss(h, w, batch, cfg.train, RULES.activations, RULES.params, z)
        return 3.0 * total, stats

    (total, stats), (dh, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(h, w)
    want_total, nll_sum, z_sum, dh_np, dw_np = _np_loss_and_grads(h, w, t, mask, z, 3.0)
    # the sums come from float32 logits of the (bf16-exact) operands in either dtype
    np.testing.assert_allclose(float(total), 3.0 * want_total, rtol=2e-5)
    np.testing.assert_allclose([float(stats["nll_sum"]), float(stats["z_sum"])], [nll_sum, z_sum], rtol=2e-5)
    assert float(stats["tokens"]) == mask.sum()
    for got, want, what in ((dh, dh_np, "dh"), (dw, dw_np, "dw")):
        assert got.dtype == dtype, what
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0,
                                   atol=(2e-5 if dtype == jnp.float32 else 2e-2) * np.abs(want).max(),
                                   err_msg=what)  # bf16: the gradient products round g to 8 bits
    assert not np.asarray(dh)[mask == 0].any()  # a masked token's hidden state gets no gradient
