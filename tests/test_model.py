"""Model properties: causality, document masking, RoPE, attention implementations, param counts."""

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, SMALL, TINY
from maxtrain import forward, load_config, models
from maxtrain.config import RopeScaling
from maxtrain.layers.attention import attention
from maxtrain.layers.rope import apply_rope, inv_frequencies


@pytest.fixture(scope="module")
def small():
    cfg = load_config(TINY, SMALL)
    params = models.get("llama").init(cfg, jax.random.key(0))
    return cfg, params


def test_causal_masking(small):
    cfg, params = small
    tokens = np.random.default_rng(0).integers(0, 128, (2, 16))
    changed = tokens.copy()
    changed[:, 10] = (changed[:, 10] + 1) % 128
    a, b = forward(cfg, params, tokens), forward(cfg, params, changed)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_causality_through_gradients(small):
    cfg, params = small
    model = models.get("llama")
    tokens = jnp.arange(12)[None]  # token id i sits at position i, so embedding row i <-> position i

    def logits_at_5(table):
        p = {**params, "embed": {"embedding": table}}
        return model.apply(p, {"inputs": tokens}, cfg)[0][0, 5].sum()

    grads = jax.grad(logits_at_5)(params["embed"]["embedding"])  # untied: rows only feed the input
    assert float(jnp.abs(grads[6:12]).max()) == 0.0
    assert float(jnp.abs(grads[:6]).min(axis=1).max()) > 0.0


def test_segment_masking(small):
    cfg, params = small
    rng = np.random.default_rng(1)
    doc_a, doc_b, other = rng.integers(0, 128, 6), rng.integers(0, 128, 10), rng.integers(0, 128, 6)
    seg = np.array([[1] * 6 + [2] * 10])
    pos = np.array([list(range(6)) + list(range(10))])
    packed = forward(cfg, params, np.concatenate([doc_a, doc_b])[None], seg, pos)
    swapped = forward(cfg, params, np.concatenate([other, doc_b])[None], seg, pos)
    alone = forward(cfg, params, doc_b[None])
    # the second document sees neither the first nor its contents; with positions restarting at 0
    # it is computed exactly as if it were alone
    np.testing.assert_allclose(packed[:, 6:], swapped[:, 6:], atol=1e-6)
    np.testing.assert_allclose(packed[:, 6:], alone, atol=1e-5)


def test_rope_relative_property():
    inv = inv_frequencies(16, 10000.0)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

    def score(m, n):
        qm = apply_rope(q, jnp.array([[m]]), inv)
        kn = apply_rope(k, jnp.array([[n]]), inv)
        return float(jnp.sum(qm * kn))

    assert score(3, 1) == pytest.approx(score(10, 8), rel=1e-5)
    assert score(50, 0) == pytest.approx(score(70, 20), rel=1e-4)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)


def test_rope_rotates_pairs_by_hand_computed_angles():
    """head_dim 4, theta 100: pairs (0, 2) turn at 1 rad per position, (1, 3) at 0.1 rad, counter-clockwise
    (rotate-half: [x1 cos - x2 sin, x2 cos + x1 sin]); a rotation the other way keeps the relative
    property but not these numbers."""
    import math
    inv = inv_frequencies(4, 100.0)
    np.testing.assert_allclose(inv, [1.0, 0.1], rtol=1e-7)
    x = jnp.asarray([[[[1.0, 2.0, 3.0, 4.0]]]])
    for p in (0, 1, 5):
        a, b = p * 1.0, p * 0.1
        want = [1 * math.cos(a) - 3 * math.sin(a), 2 * math.cos(b) - 4 * math.sin(b),
                3 * math.cos(a) + 1 * math.sin(a), 4 * math.cos(b) + 2 * math.sin(b)]
        np.testing.assert_allclose(np.asarray(apply_rope(x, jnp.array([[p]]), inv))[0, 0, 0], want, atol=1e-6)


def test_llama3_rope_scaling_matches_formula():
    s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
    got = np.asarray(inv_frequencies(128, 500000.0, s))
    base = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    want = []
    for f in base:  # the published Llama 3.1 rule, written out per frequency
        wavelen = 2 * np.pi / f
        if wavelen < 8192 / 4.0:
            want.append(f)
        elif wavelen > 8192 / 1.0:
            want.append(f / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * f / 8.0 + smooth * f)
    np.testing.assert_allclose(got, np.array(want), rtol=1e-5)
    assert got[0] == pytest.approx(base[0]) and got[-1] == pytest.approx(base[-1] / 8, rel=1e-5)


def _qkv(seed, B=2, L=24, H=8, G=2, K=16, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, L, H, K)), dtype)
    k = jnp.asarray(r.normal(size=(B, L, G, K)), dtype)
    v = jnp.asarray(r.normal(size=(B, L, G, K)), dtype)
    seg = jnp.asarray(np.sort(r.integers(1, 4, (B, L)), axis=1), jnp.int32)
    return q, k, v, seg


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("use_seg", [False, True])
def test_attention_impls_agree(window, use_seg):
    q, k, v, seg = _qkv(3)
    seg = seg if use_seg else None
    ours = attention(q, k, v, impl="xla", segment_ids=seg, sliding_window=window)
    # jax.nn's own XLA path (model.attention=cudnn is GPU-only; flash is checked in test_kernels.py)
    mask = None if seg is None else (seg[:, :, None] == seg[:, None, :])[:, None]
    ref = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla",
                                       local_window_size=None if window is None else (window - 1, 0))
    np.testing.assert_allclose(ours, ref, atol=2e-5)


def test_gqa_equals_repeated_kv_mha():
    q, k, v, seg = _qkv(4)
    rep = 8 // 2
    mha = attention(q, jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2), segment_ids=seg)
    gqa = attention(q, k, v, segment_ids=seg)
    np.testing.assert_allclose(gqa, mha, atol=1e-6)


# Published parameter counts (Hugging Face model cards / config-derived totals).
PUBLISHED = {
    "llama2-7b.yaml": 6_738_415_616,
    "llama3-8b.yaml": 8_030_261_248,
    "llama3-70b.yaml": 70_553_706_496,
    "llama3-405b.yaml": 405_853_388_800,  # Llama 3.1 405B's model card
    "mistral-7b.yaml": 7_241_732_096,
    "llama3-1b.yaml": 1_235_814_400,
    "qwen3-8b.yaml": 8_190_735_360,  # transformers' Qwen3 of that shape: tests/test_hf.py
    "qwen3-0.6b.yaml": 596_049_920,
    "mixtral-8x7b.yaml": 46_702_792_704,
}


def test_every_config_parses():
    files = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    assert {os.path.basename(f) for f in files} >= set(PUBLISHED) | {"tiny.yaml"}
    for f in files:
        load_config(f)


@pytest.mark.parametrize("name, count", sorted(PUBLISHED.items()))
def test_published_param_counts(name, count):
    assert models.param_count(load_config(os.path.join(ROOT, "configs", name))) == count


def test_flops_per_token_llama3_8b():
    cfg = load_config(os.path.join(ROOT, "configs", "llama3-8b.yaml"))
    n_nonembed = models.param_count(cfg) - 2 * 128256 * 4096 - 65 * 4096  # minus embed, head, norms
    fl = models.flops_per_token(cfg, 8192)
    attn = 3 * 32 * 4 * 32 * 128 * (8192 + 1) / 2
    assert fl == pytest.approx(6 * n_nonembed + 6 * 4096 * 128256 + attn, rel=1e-12)


def test_flops_per_token_of_a_tiny_config_by_hand():
    """vocab 10, d 8, 1 layer, 2 heads of 4, 1 KV head, d_ff 12, untied, 6 tokens: matmul weights
    wq 64 + wk 32 + wv 32 + wo 64 + MLP 3*96 = 480, head 80 (the embedding lookup is no matmul);
    6 FLOPs per weight per token, plus causal attention 12 * heads * head_dim * (6 + 1) / 2 = 336."""
    cfg = load_config(None, ["model.vocab_size=10", "model.d_model=8", "model.n_layers=1", "model.n_heads=2",
                             "model.n_kv_heads=1", "model.head_dim=4", "model.d_ff=12",
                             "model.tie_embeddings=false"])
    assert models.param_count(cfg) == 80 + 480 + 80 + 2 * 8 + 8
    assert models.flops_per_token(cfg, 6) == 6 * (480 + 80) + 336


def test_embedding_gradient_is_summed_in_float32():
    """The lookup's backward scatter-adds in float32: a bf16 scatter-add stops at 256 for a row
    hit by 20,000 unit cotangents. Sharded over vocab on 8 devices, the gradient is the same."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from maxtrain.layers.embedding import lookup

    tokens = jnp.zeros((20000,), jnp.int32).at[::7].set(3).at[::11].set(9)
    counts = np.bincount(np.asarray(tokens), minlength=16)

    def grad(table, spec=None):
        return jax.grad(lambda t: lookup(t, tokens, spec).astype(jnp.float32).sum())(table)

    table = jnp.zeros((16, 4), jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(grad(table), np.float32)[:, 0], counts, rtol=2 ** -8)
    bf16_scatter = jax.grad(lambda t: jnp.take(t, tokens, axis=0).astype(jnp.float32).sum())(table)
    assert float(bf16_scatter[0, 0]) == 256  # what the plain gather's gradient gives
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))  # as build_mesh
    with jax.set_mesh(mesh):
        sharded = jax.device_put(table, NamedSharding(mesh, P("fsdp", None)))
        g = jax.jit(lambda t: grad(t, P("fsdp", None)))(sharded)
    assert g.sharding.is_equivalent_to(sharded.sharding, 2)  # the scatter stays split over vocab
    np.testing.assert_array_equal(np.asarray(g), np.asarray(grad(table)))


@pytest.mark.parametrize("mesh", [["mesh.data=1"], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]])
def test_fused_norm_layer_matches_the_unfused_one(mesh):
    """`model.fused_norm`: the attention's residual add and the MLP's norm by the Pallas kernel
    (interpreted here), per device under shard_map: loss and gradients as the unfused model's."""
    from maxtrain.loss import model_loss
    from maxtrain.mesh import use_mesh
    from maxtrain.step import make_setup

    base = SMALL + ["train.dtype=float32", "model.d_model=64", "model.head_dim=16", *mesh]
    batch = {"inputs": np.random.default_rng(3).integers(0, 128, (8, 16)).astype(np.int32)}
    batch["targets"] = np.roll(batch["inputs"], -1, axis=1)
    batch["loss_mask"] = np.ones((8, 16), np.float32)
    out = []
    for fused in (False, True):
        cfg = load_config(TINY, base + [f"model.fused_norm={str(fused).lower()}"])
        setup = make_setup(cfg, jax.devices()[:1] if mesh == ["mesh.data=1"] else None)
        params = setup.model.init(cfg, jax.random.key(0))
        with use_mesh(setup.mesh):
            loss = jax.jit(jax.value_and_grad(lambda p: model_loss(setup.model, p, batch, cfg, 0.0)[0]))
            out.append(loss(params))
            jaxpr = str(jax.make_jaxpr(lambda p: setup.model.apply(p, batch, cfg)[0])(params))
        assert ("pallas_call" in jaxpr) == fused  # the kernel runs only when asked for
    (l0, g0), (l1, g1) = out
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


def _step_gemms(overrides):
    """The compiled train step's matmuls by operand type (`maxtrain.analysis.hlo`'s roofline rows)."""
    from maxtrain.analysis.hlo import roofline
    from maxtrain.mesh import use_mesh
    from maxtrain.step import compile_train_step, make_setup
    setup = make_setup(load_config(TINY, SMALL + overrides))
    with use_mesh(setup.mesh):
        text = compile_train_step(setup)[0].as_text()
    return roofline(text, peak_flops=1e12, bandwidth=1e11, link_bandwidth=1e10).gemms()


def test_cpu_bf16_step_multiplies_its_forward_and_its_loss_in_bf16():
    """XLA:CPU runs a bf16 dot natively only as `bf16 x bf16 -> float32` with both operands
    contracting their inner dimension; any other it converts to a float32 dot (`layers.dots`). In a
    bf16 step every forward matmul (the projections, attention, the onepass loss's three products
    per chunk) has bf16 operands; only the projections' and attention's backward products (a
    transposed operand) are float32."""
    gemms = _step_gemms(["train.dtype=bfloat16", "mesh.data=1", "mesh.fsdp=8", "model.attention=xla",
                         "train.cross_entropy=onepass", "model.remat=full"])
    fwd = gemms["bf16"]["ops"]
    assert any("bld,df->blf" in op for op in fwd) and any("bld,dhk->blhk" in op for op in fwd), fwd
    assert "fwd body/closed_call/dot_general" in fwd, fwd  # the loss's chunk loop (`op_name`: last three parts)
    assert all(op.startswith("bwd") for op in gemms.get("f32", {}).get("ops", [])), gemms["f32"]["ops"]


def test_dots_einsum_rounds_a_float32_product_on_cpu_and_is_plain_elsewhere(monkeypatch):
    """`layers.dots.einsum`: on CPU a bf16 product is the float32 product rounded once (within
    accumulation order of the exact one); for GPUs it is the plain bf16 einsum."""
    from maxtrain.layers import dots
    monkeypatch.setattr(dots, "traced_platform", lambda: "cpu")
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (64, 48), jnp.bfloat16)
    exact = jnp.einsum("bld,df->blf", x.astype(jnp.float32), w.astype(jnp.float32))
    got = jax.jit(lambda x, w: dots.einsum("bld,df->blf", x, w))(x, w)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(exact.astype(jnp.bfloat16), np.float32),
                               rtol=1e-2, atol=1e-2)
    eqns = lambda: jax.make_jaxpr(lambda x, w: dots.einsum("bld,df->blf", x, w))(x, w).eqns  # noqa: E731
    assert [e.params["preferred_element_type"] for e in eqns() if e.primitive.name == "dot_general"] == [jnp.float32]
    monkeypatch.setattr(dots, "traced_platform", lambda: "gpu")
    assert [e.params["preferred_element_type"] for e in eqns() if e.primitive.name == "dot_general"] in (
        [None], [jnp.bfloat16])
    assert not dots.hoist_transposes(jnp.bfloat16) and not dots.hoist_transposes(jnp.float32)
    monkeypatch.setattr(dots, "traced_platform", lambda: "cpu")
    assert dots.hoist_transposes(jnp.bfloat16) and not dots.hoist_transposes(jnp.float32)
    assert not dots.hoist_transposes(jnp.float16)  # XLA:CPU has no float16 dot kernels
    # float32, float16 and mixed operands: the plain einsum (no rounding, the promoted dtype)
    for a, b in ((x.astype(jnp.float32), w.astype(jnp.float32)), (x.astype(jnp.float16), w.astype(jnp.float16)),
                 (x, w.astype(jnp.float32))):
        prims = [e.primitive.name for e in jax.make_jaxpr(lambda a, b: dots.einsum("bld,df->blf", a, b))(a, b).eqns]
        assert prims[-1] == "dot_general", prims
        assert dots.einsum("bld,df->blf", a, b).dtype == jnp.result_type(a, b)
    # the dropless MoE experts' grouped product, likewise
    rows, experts, sizes = x.reshape(32, 64), jnp.stack([w, w]), jnp.array([20, 12], jnp.int32)
    ragged = [e for e in jax.make_jaxpr(dots.ragged_dot)(rows, experts, sizes).eqns if e.primitive.name == "ragged_dot_general"]
    assert [e.params["preferred_element_type"] for e in ragged] == [jnp.float32]
    np.testing.assert_allclose(np.asarray(dots.ragged_dot(rows, experts, sizes), np.float32),
                               np.asarray(jax.lax.ragged_dot(rows, experts, sizes), np.float32), rtol=1e-2, atol=1e-2)
