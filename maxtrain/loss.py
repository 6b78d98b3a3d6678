"""Next-token cross-entropy, and how the output projection and loss run (`train.cross_entropy`).

- `xla`: the model returns float32 logits `[B, L, V]`; log-sum-exp and the target logit in XLA.
  Simple, and the logits (plus their softmax in the backward) are the largest activation of a
  small model at vocab 128k.
- `fused`: the model hands over its last hidden states and output weights instead; the loss runs
  `maxtrain.kernels.cross_entropy.linear_cross_entropy` (the projection done `chunk` vocab columns
  at a time, forward and backward): logits never exist whole in any dtype.
- `pallas`: bf16 logits per device, reduced by the Pallas online-log-sum-exp kernel (no float32
  copy, no softmax in memory).
- `onepass`: the projection done `cross_entropy_tokens` tokens at a time over the whole (local)
  vocabulary, and the loss's gradients with respect to the hidden states and the output weights
  computed in the same pass, in the forward (`onepass_loss`): float32 logits of one chunk at a
  time, no recomputation in the backward (which only scales the saved gradients), the weight
  gradient reduce-scattered to its shard as soon as it is complete.

`fused`, `pallas` and `onepass` run inside `shard_map`, vocab-parallel (a Pallas call or a chunked scan is
opaque to XLA's partitioner, which would otherwise gather the vocab): each device projects its
tokens onto its slice of the vocabulary (the mesh axes of the `vocab` activation rule), computes a
partial log-sum-exp and target logit, and those are combined with a `pmax`/`psum` over the vocab
axes. Output weights sharded over `embed` (FSDP) are all-gathered inside, so their gradient is
reduce-scattered back. Every quantity is the same as `xla`'s up to float rounding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from maxtrain.config import ConfigError
from maxtrain.layers import dots
from maxtrain.sharding import Rules, constrain, entry_axes, logical_to_spec

IMPLS = ("xla", "fused", "pallas", "onepass")
AUTO_MIN_TOKENS = 128  # `cross_entropy_tokens: 0`: a quarter of a device's tokens, at least this many


def chosen_impl(cross_entropy: str, has_features: bool, vocab_size: int, act_rules: Rules,
                sizes: dict[str, int]) -> str:
    """`train.cross_entropy` made concrete: `auto` is `onepass` where the model hands over its final
    hidden states and output weights (`features`/`head`) and the vocabulary splits evenly over the
    vocab shards, else `xla`."""
    if cross_entropy != "auto":
        return cross_entropy
    if not has_features:
        return "xla"
    _, n = vocab_shards(act_rules, sizes)
    return "onepass" if vocab_size % n == 0 else "xla"


def _mesh_sizes() -> dict[str, int]:
    mesh = jax.sharding.get_abstract_mesh()
    return {} if mesh.empty else dict(mesh.shape)


def loss_sums(nll_BL, lse_BL, loss_mask_BL, z_loss: float):
    """Sums (not means) of cross-entropy and z-loss over masked tokens, and the token count."""
    nll_sum = jnp.sum(nll_BL * loss_mask_BL)
    z_sum = jnp.sum(jnp.square(lse_BL) * loss_mask_BL)
    return nll_sum + z_loss * z_sum, {"nll_sum": nll_sum, "z_sum": z_sum, "tokens": jnp.sum(loss_mask_BL)}


def token_losses(logits_BLV, targets_BL):
    """Per-token (nll, lse) float32 from logits, in XLA."""
    logits = logits_BLV.astype(jnp.float32)
    lse_BL = jax.nn.logsumexp(logits, axis=-1)
    # one-hot contraction rather than a gather: partitions cleanly when vocab is sharded
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets_BL, logits.shape[-1], dtype=logits.dtype), axis=-1)
    return lse_BL - target_logit, lse_BL


def next_token_loss(logits_BLV, targets_BL, loss_mask_BL, z_loss: float):
    """`loss_sums` of the logits' per-token losses (the `xla` path)."""
    nll_BL, lse_BL = token_losses(logits_BLV, targets_BL)
    return loss_sums(nll_BL, lse_BL, loss_mask_BL, z_loss)


# ---------------------------------------------------------------- vocab-parallel fused losses


def _local_fused(h_ND, w_DV, targets_N, chunk: int):
    from maxtrain.kernels.cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h_ND, w_DV, targets_N, chunk=chunk)


def _local_pallas(h_ND, w_DV, targets_N, chunk: int):
    from maxtrain.kernels.cross_entropy import cross_entropy

    logits = jnp.dot(h_ND, w_DV, preferred_element_type=jnp.float32).astype(h_ND.dtype)
    block = 1 << (min(chunk, 1024).bit_length() - 1)  # the kernel's vocab tile: a power of two
    return cross_entropy(logits, targets_N, block_vocab=block)


_LOCAL = {"fused": _local_fused, "pallas": _local_pallas}


def _vary(x, axes: tuple[str, ...]):
    """Marks x as varying over `axes` (inside shard_map): the transpose of this is the `psum` that
    sums the partial gradients the devices along those axes compute."""
    aval = jax.typeof(x)
    varying = aval.vma if hasattr(aval, "vma") else aval.manual_axis_type.varying  # jax < 0.10 | >= 0.10
    missing = tuple(a for a in axes if a not in varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def _combine(loss_l, lse_l, vocab_axes: tuple[str, ...]):
    """Per-shard (loss, lse) over disjoint vocab slices -> the full vocabulary's (loss, lse)."""
    picked = lax.psum(lse_l - loss_l, vocab_axes)  # the target logit: 0 on shards without it
    m = lax.pmax(lax.stop_gradient(lse_l), vocab_axes)
    lse = m + jnp.log(lax.psum(jnp.exp(lse_l - m), vocab_axes))
    return lse - picked, lse


def _vocab_parallel_layout(mesh, act_rules: Rules, param_rules: Rules):
    """`(tok, token_axes, vocab_axes, embed_axes, w_spec)` of the vocab-parallel losses' `shard_map`:
    tokens split as the activations are, the vocabulary over the `vocab` rule's axes, and the
    weights' embed (FSDP) axes that also split tokens gathered inside (any others at the boundary)."""
    tok, token_axes = _token_spec(act_rules)
    vocab_axes, _ = vocab_shards(act_rules, dict(mesh.shape))
    embed_axes = tuple(a for a in entry_axes(logical_to_spec(("embed",), param_rules)[0])
                       if a in token_axes and mesh.shape[a] > 1)
    return tok, token_axes, vocab_axes, embed_axes, P(embed_axes or None, vocab_axes or None)


def _local_operands(w, t, embed_axes: tuple[str, ...], vocab_axes: tuple[str, ...]):
    """Inside the `shard_map`: w with its embed dim gathered (so its gradient is reduce-scattered)
    and the targets as this shard's column ids (-1 where the target is in another vocab shard)."""
    if embed_axes:
        w = lax.all_gather(w, embed_axes, axis=0, tiled=True)
    if vocab_axes:  # this shard holds vocab columns [offset, offset + V_local); others select nothing
        t = t - lax.axis_index(vocab_axes) * w.shape[1]
        t = jnp.where((t >= 0) & (t < w.shape[1]), t, -1)
    return w, t


def fused_token_losses(h_BLD, w_DV, targets_BL, *, impl: str, chunk: int, act_rules: Rules, param_rules: Rules):
    """Per-token (nll, lse) float32 of `h @ w` against targets without logits in float32.

    h `[B, L, D]` (compute dtype), w `[D, V]` (the output projection, compute dtype)."""
    local = functools.partial(_LOCAL[impl], chunk=chunk)
    B, L, D = h_BLD.shape
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        loss, lse = local(h_BLD.reshape(B * L, D), w_DV, targets_BL.reshape(-1))
        return loss.reshape(B, L), lse.reshape(B, L)

    tok, token_axes, vocab_axes, embed_axes, w_spec = _vocab_parallel_layout(mesh, act_rules, param_rules)
    vary_axes = token_axes + vocab_axes  # size-1 axes too: the cotangents arriving through out_specs vary over them
    check = impl != "pallas"  # the Pallas interpreter cannot type varying axes

    def shard(h, w, t):
        w, t = _local_operands(w, t, embed_axes, vocab_axes)
        b, l, _ = h.shape
        # every operand varies over the token and vocab axes: the transposes sum the partial gradients
        if check:
            h, w, t = (_vary(x, vary_axes) for x in (h, w, t))
        loss, lse = local(h.reshape(b * l, D), w, t.reshape(-1))
        if vocab_axes:
            loss, lse = _combine(loss, lse, vocab_axes)
        return loss.reshape(b, l), lse.reshape(b, l)

    return jax.shard_map(shard, mesh=mesh, in_specs=(P(tok[0], tok[1], None), w_spec, tok),
                         out_specs=(tok, tok), check_vma=check)(h_BLD, w_DV, targets_BL)


# ---------------------------------------------------------------- onepass: loss and head gradients together


def _add_columns(dw, h_DC, g, block: int):
    """`dw + h_DC @ g` (`[D, V]` float32), `block` columns at a time, updated in place: never a
    second `[D, V]` for the product. The last block overlaps the one before and adds only its
    new columns."""
    V = g.shape[1]
    block = min(block, V)
    cols = jnp.arange(block)

    def add(j, dw):
        start = jnp.minimum(j * block, V - block)
        g_j = lax.dynamic_slice_in_dim(g, start, block, axis=1)
        g_j = jnp.where((start + cols >= j * block)[None, :], g_j, jnp.zeros_like(g_j))
        update = lax.dynamic_slice_in_dim(dw, start, block, axis=1) + jnp.dot(h_DC, g_j, preferred_element_type=jnp.float32)
        return lax.dynamic_update_slice_in_dim(dw, update, start, axis=1)

    return lax.fori_loop(0, -(-V // block), add, dw)


def _onepass_local(h_ND, w_DV, t_N, m_N, *, tokens: int, block: int, z_loss: float, vocab_axes: tuple[str, ...],
                   grads: bool):
    """One shard's `(nll_sum, z_sum)` over its tokens and its vocab columns (`t_N`: local column
    ids, -1 where the target is in another shard), and with `grads` the gradients of
    `nll_sum + z_loss * z_sum` w.r.t. h (`[N, D]` float32, complete) and w (`[D, V]` float32, this
    shard's tokens' part). The logits exist `tokens` rows at a time, in float32; the weight
    gradient is accumulated `block` columns at a time."""
    N, D = h_ND.shape
    c = min(tokens or max(AUTO_MIN_TOKENS, -(-N // 4)), N)
    n = -(-N // c)
    pad = n * c - N
    if pad:  # padded rows: no target, no weight, zero gradient
        h_ND = jnp.pad(h_ND, ((0, pad), (0, 0)))
        t_N = jnp.pad(t_N, (0, pad), constant_values=-1)
        m_N = jnp.pad(m_N, (0, pad))
    cols = jnp.arange(w_DV.shape[1])
    # on CPU, bf16: the loop's products take w^T and h^T as arrays of their own, made once
    # outside the loop, so that each contracts its operands' inner dimensions (`layers.dots`)
    hoist = grads and dots.hoist_transposes(w_DV.dtype)
    w_VD = w_DV.T if hoist else None

    def body(dw, xs):
        h, h_DC, t, m = xs
        logits = jnp.dot(h, w_DV, preferred_element_type=jnp.float32)
        mx = jnp.max(logits, axis=1)
        if vocab_axes:
            mx = lax.pmax(mx, vocab_axes)
        e = jnp.exp(logits - mx[:, None])
        hit = cols[None, :] == t[:, None]
        sums = jnp.stack([jnp.sum(e, axis=1), jnp.sum(jnp.where(hit, logits, 0.0), axis=1)])
        if vocab_axes:
            sums = lax.psum(sums, vocab_axes)
        lse = mx + jnp.log(sums[0])
        out = jnp.stack([jnp.sum((lse - sums[1]) * m), jnp.sum(jnp.square(lse) * m)])
        if not grads:
            return dw, (out, None)
        # d(nll + z lse^2)/dlogits = (1 + 2 z lse) softmax - onehot(target), per token weight m
        coef = m * (1.0 + 2.0 * z_loss * lse)
        g = (e * (coef / sums[0])[:, None] - jnp.where(hit, m[:, None], 0.0)).astype(h.dtype)
        dh = jnp.dot(g, w_DV.T if w_VD is None else w_VD, preferred_element_type=jnp.float32)
        if vocab_axes:  # each vocab shard holds part of every token's gradient
            dh = lax.psum(dh, vocab_axes)
        return _add_columns(dw, h.T if h_DC is None else h_DC, g, block), (out, dh)

    h_NCD = h_ND.reshape(n, c, D)
    xs = (h_NCD, jnp.swapaxes(h_NCD, 1, 2) if hoist else None, t_N.reshape(n, c), m_N.reshape(n, c))
    dw0 = lax.full_like(w_DV, 0, jnp.float32) if grads else None
    dw, (sums, dh) = lax.scan(body, dw0, xs)
    sums = jnp.sum(sums, axis=0)
    if not grads:
        return sums, None, None
    return sums, dh.reshape(n * c, D)[:N], dw


def onepass_loss(h_BLD, w_DV, targets_BL, mask_BL, *, tokens: int, z_loss: float, act_rules: Rules,
                 param_rules: Rules, block: int = 4096):
    """`(total, nll_sum, z_sum)` of `h @ w` against the targets, where `total = nll_sum + z_loss *
    z_sum` carries the gradient (the sums are statistics: their gradients are not defined).

    Differentiated, the forward computes the gradients too (one pass over the logits, `tokens`
    rows at a time) and the backward scales them by the cotangent of `total`."""
    B, L, D = h_BLD.shape
    mesh = jax.sharding.get_abstract_mesh()
    local = functools.partial(_onepass_local, tokens=tokens, block=block, z_loss=z_loss)
    mask_BL = mask_BL.astype(jnp.float32)
    targets_BL = targets_BL.astype(jnp.int32)

    if mesh.empty or mesh.size == 1:
        def run(h, w, t, m, grads):
            sums, dh, dw = local(h.reshape(B * L, D), w, t.reshape(-1), m.reshape(-1), vocab_axes=(), grads=grads)
            return sums, (None if dh is None else dh.reshape(B, L, D)), dw
    else:
        run = _onepass_sharded(local, mesh, act_rules, param_rules, D)

    @jax.custom_vjp
    def total_and_sums(h, w, t, m):
        sums, _, _ = run(h, w, t, m, False)
        return sums[0] + z_loss * sums[1], sums

    def fwd(h, w, t, m):
        sums, dh, dw = run(h, w, t, m, True)
        # the gradients are kept in the operands' dtypes: [B, L, D] and w's shard, not logits
        return (sums[0] + z_loss * sums[1], sums), (dh.astype(h.dtype), dw.astype(w.dtype), t, m)

    def bwd(res, cts):
        dh, dw, t, m = res
        g = cts[0]  # the sums' cotangents are dropped: they are statistics (stop_gradient below)
        return ((g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), np.zeros(t.shape, jax.dtypes.float0),
                jnp.zeros_like(m))

    total_and_sums.defvjp(fwd, bwd)
    total, sums = total_and_sums(h_BLD, w_DV, targets_BL, mask_BL)
    sums = lax.stop_gradient(sums)
    return total, sums[0], sums[1]


def _onepass_sharded(local, mesh, act_rules: Rules, param_rules: Rules, D: int):
    """`run(h, w, t, m, grads)` of `_onepass_local` in `shard_map`: tokens split as the activations
    are, the vocabulary over the `vocab` rule's axes, w's embed (FSDP) dim gathered inside; the
    weight gradient is reduce-scattered back to w's layout and summed over the other token axes
    before it leaves (never a whole `[D, V]` per device after the forward)."""
    tok, token_axes, vocab_axes, embed_axes, w_spec = _vocab_parallel_layout(mesh, act_rules, param_rules)
    other_token_axes = tuple(a for a in token_axes if a not in embed_axes and mesh.shape[a] > 1)
    h_spec = P(tok[0], tok[1], None)

    def shard(h, w, t, m, *, grads):
        w, t = _local_operands(w, t, embed_axes, vocab_axes)
        b, l, _ = h.shape
        sums, dh, dw = local(h.reshape(b * l, D), w, t.reshape(-1), m.reshape(-1), vocab_axes=vocab_axes, grads=grads)
        sums = lax.psum(sums, token_axes) if token_axes else sums
        if not grads:
            return sums
        if embed_axes:
            dw = lax.psum_scatter(dw, embed_axes, scatter_dimension=0, tiled=True)
        if other_token_axes:
            dw = lax.psum(dw, other_token_axes)
        return sums, dh.reshape(b, l, D), dw

    def run(h, w, t, m, grads):
        out = jax.shard_map(functools.partial(shard, grads=grads), mesh=mesh, in_specs=(h_spec, w_spec, tok, tok),
                            out_specs=(P(), h_spec, w_spec) if grads else P(), check_vma=False)(h, w, t, m)
        return out if grads else (out, None, None)

    return run


def vocab_shards(act_rules: Rules, sizes: dict[str, int]) -> tuple[tuple[str, ...], int]:
    """The mesh axes the fused losses split the vocabulary over (those of the `vocab` activation
    rule that do not also split tokens), and how many shards that makes."""
    _, token_axes = _token_spec(act_rules)
    axes = tuple(a for a in entry_axes(logical_to_spec(("vocab",), act_rules)[0])
                 if a not in token_axes and sizes.get(a, 1) > 1)
    return axes, math.prod(sizes[a] for a in axes)


def _token_spec(act_rules: Rules):
    """The `[batch, length]` spec of token arrays inside the output projection (`block_length`) and
    the mesh axes it splits tokens over."""
    tok = logical_to_spec(("batch", "block_length"), act_rules)
    return tok, entry_axes(tok[0]) + entry_axes(tok[1])


def check_mesh(cfg, sizes: dict[str, int]) -> None:
    """The fused losses need the vocabulary to split evenly over their vocab axes (`auto` falls
    back to `xla` where it does not)."""
    if cfg.train.cross_entropy in ("xla", "auto"):
        return
    axes, n = vocab_shards(cfg.sharding.activations, sizes)
    if cfg.model.vocab_size % n:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} does not divide into {n} vocab shards over "
                          f"mesh axes {', '.join(axes)} (train.cross_entropy={cfg.train.cross_entropy}); pad the "
                          f"vocabulary, change sharding.activations.vocab, or use train.cross_entropy=xla")


def model_loss(model, params, batch: dict, cfg, z_loss: float):
    """(total, stats, aux) of `model` on a batch with `cfg.train.cross_entropy`'s implementation."""
    t = cfg.train
    impl = chosen_impl(t.cross_entropy, model.features is not None, cfg.model.vocab_size, cfg.sharding.activations,
                       _mesh_sizes())
    if impl == "xla":
        logits, aux = model.apply(params, batch, cfg)
        total, stats = next_token_loss(logits, batch["targets"], batch["loss_mask"], z_loss)
        return total, stats, aux
    h_BLD, aux = model.features(params, batch, cfg)
    total, stats = hidden_loss(h_BLD, model.head(params, cfg), batch, t, cfg.sharding.activations,
                               cfg.sharding.params, z_loss)
    return total, stats, aux


def hidden_loss(h_BLD, w_DV, batch: dict, t, act_rules: Rules, param_rules: Rules, z_loss: float):
    """(total, stats) of the final hidden states `h` `[B, L, D]` under the output projection `w`
    `[D, V]`, with `t.cross_entropy`'s implementation (`t`: the train config)."""
    impl = chosen_impl(t.cross_entropy, True, w_DV.shape[1], act_rules, _mesh_sizes())
    if impl == "xla":
        logits = jnp.einsum("bld,dv->blv", h_BLD, w_DV, preferred_element_type=jnp.float32)
        logits = constrain(logits, ("batch", "block_length", "vocab"), act_rules)
        return next_token_loss(logits, batch["targets"], batch["loss_mask"], z_loss)
    if impl == "onepass":
        total, nll_sum, z_sum = onepass_loss(h_BLD, w_DV, batch["targets"], batch["loss_mask"],
                                             tokens=t.cross_entropy_tokens, z_loss=z_loss, act_rules=act_rules,
                                             param_rules=param_rules, block=t.cross_entropy_chunk)
        return total, {"nll_sum": nll_sum, "z_sum": z_sum, "tokens": jnp.sum(batch["loss_mask"])}
    nll, lse = fused_token_losses(h_BLD, w_DV, batch["targets"], impl=impl, chunk=t.cross_entropy_chunk,
                                  act_rules=act_rules, param_rules=param_rules)
    return loss_sums(nll, lse, batch["loss_mask"], z_loss)
