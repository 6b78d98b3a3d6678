"""Next-token cross-entropy, and how the output projection and loss run (`train.cross_entropy`).

- `xla`: the model returns float32 logits `[B, L, V]`; log-sum-exp and the target logit in XLA.
  Simple, and the logits (plus their softmax in the backward) are the largest activation of a
  small model at vocab 128k.
- `fused`: the model hands over its last hidden states and output weights instead; the loss runs
  `maxtrain.kernels.cross_entropy.linear_cross_entropy` (the projection done `chunk` vocab columns
  at a time, forward and backward): logits never exist whole in any dtype.
- `pallas`: bf16 logits per device, reduced by the Pallas online-log-sum-exp kernel (no float32
  copy, no softmax in memory).

`fused` and `pallas` run inside `shard_map`, vocab-parallel (a Pallas call or a chunked scan is
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
from jax import lax
from jax.sharding import PartitionSpec as P

from maxtrain.config import ConfigError
from maxtrain.sharding import Rules, constrain, entry_axes, logical_to_spec

IMPLS = ("xla", "fused", "pallas")


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


def fused_token_losses(h_BLD, w_DV, targets_BL, *, impl: str, chunk: int, act_rules: Rules, param_rules: Rules):
    """Per-token (nll, lse) float32 of `h @ w` against targets without logits in float32.

    h `[B, L, D]` (compute dtype), w `[D, V]` (the output projection, compute dtype)."""
    local = functools.partial(_LOCAL[impl], chunk=chunk)
    B, L, D = h_BLD.shape
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        loss, lse = local(h_BLD.reshape(B * L, D), w_DV, targets_BL.reshape(-1))
        return loss.reshape(B, L), lse.reshape(B, L)

    tok, token_axes = _token_spec(act_rules)
    vocab_axes, _ = vocab_shards(act_rules, dict(mesh.shape))
    # the weights' embed (FSDP) axes that also split tokens are gathered inside; any others at the boundary
    embed_axes = tuple(a for a in entry_axes(logical_to_spec(("embed",), param_rules)[0])
                       if a in token_axes and mesh.shape[a] > 1)
    vary_axes = token_axes + vocab_axes  # size-1 axes too: the cotangents arriving through out_specs vary over them
    check = impl != "pallas"  # the Pallas interpreter cannot type varying axes

    def shard(h, w, t):
        if embed_axes:  # FSDP: gather the embed dim here so the gradient is reduce-scattered
            w = lax.all_gather(w, embed_axes, axis=0, tiled=True)
        if vocab_axes:  # this shard holds vocab columns [offset, offset + V_local); others select nothing
            t = t - lax.axis_index(vocab_axes) * w.shape[1]
            t = jnp.where((t >= 0) & (t < w.shape[1]), t, -1)
        b, l, _ = h.shape
        # every operand varies over the token and vocab axes: the transposes sum the partial gradients
        if check:
            h, w, t = (_vary(x, vary_axes) for x in (h, w, t))
        loss, lse = local(h.reshape(b * l, D), w, t.reshape(-1))
        if vocab_axes:
            loss, lse = _combine(loss, lse, vocab_axes)
        return loss.reshape(b, l), lse.reshape(b, l)

    w_spec = P(embed_axes or None, vocab_axes or None)
    return jax.shard_map(shard, mesh=mesh, in_specs=(P(tok[0], tok[1], None), w_spec, tok),
                         out_specs=(tok, tok), check_vma=check)(h_BLD, w_DV, targets_BL)


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
    """The fused losses need the vocabulary to split evenly over their vocab axes."""
    if cfg.train.cross_entropy == "xla":
        return
    axes, n = vocab_shards(cfg.sharding.activations, sizes)
    if cfg.model.vocab_size % n:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} does not divide into {n} vocab shards over "
                          f"mesh axes {', '.join(axes)} (train.cross_entropy={cfg.train.cross_entropy}); pad the "
                          f"vocabulary, change sharding.activations.vocab, or use train.cross_entropy=xla")


def model_loss(model, params, batch: dict, cfg, z_loss: float):
    """(total, stats, aux) of `model` on a batch with `cfg.train.cross_entropy`'s implementation."""
    t = cfg.train
    if t.cross_entropy == "xla":
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
    if t.cross_entropy == "xla":
        logits = jnp.einsum("bld,dv->blv", h_BLD, w_DV, preferred_element_type=jnp.float32)
        logits = constrain(logits, ("batch", "block_length", "vocab"), act_rules)
        return next_token_loss(logits, batch["targets"], batch["loss_mask"], z_loss)
    nll, lse = fused_token_losses(h_BLD, w_DV, batch["targets"], impl=t.cross_entropy, chunk=t.cross_entropy_chunk,
                                  act_rules=act_rules, param_rules=param_rules)
    return loss_sums(nll, lse, batch["loss_mask"], z_loss)
