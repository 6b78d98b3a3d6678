"""Mutants for the sampling area (tests/test_generate.py) and the losses (tests/test_loss.py)."""
# run by tests/mutate.py --file, which provides M (its Mutant)

G = "maxtrain/generate.py"


def K(sel):
    return ("tests/test_generate.py", "-k", sel)


E2E = K("every_step")
CLI = K("generate_command or errors_are_one_line")
LOSS_PY = "maxtrain/loss.py"
ORACLE = ("tests/test_loss.py", "-k", "numpy_oracle_with_mask")

MUTANTS = [
    M("sample_temperature_multiplies", "sample", G, "logits = logits_BV / temperature",
      "logits = logits_BV * temperature", K("sample_draws and (hot or cold) and not mass")),
    M("sample_temperature_multiplies_e2e", "sample", G, "logits = logits_BV / temperature",
      "logits = logits_BV * temperature", E2E),
    M("sample_top_p_keeps_boundary_token", "sample", G, "before < top_p", "before <= top_p", K("mass_hits_top_p_exactly")),
    M("sample_top_p_keeps_boundary_token_tied", "sample", G, "before < top_p", "before <= top_p", K("nucleus_of_tied_tokens")),
    M("sample_top_p_counts_own_mass", "sample", G, "before = jnp.cumsum(probs, axis=-1) - probs",
      "before = jnp.cumsum(probs, axis=-1)", K("mass_hits_top_p_exactly_hot")),
    M("sample_nucleus_untempered", "sample", G, "probs = jax.nn.softmax(sorted_logits, axis=-1)",
      "probs = jax.nn.softmax(sorted_logits * temperature, axis=-1)", K("nucleus_of_tempered_probs")),
    M("sample_sorts_ascending", "sample", G, "order = jnp.argsort(-logits, axis=-1)",
      "order = jnp.argsort(logits, axis=-1)", K("tiny_top_p")),
    M("sample_unsort_is_a_gather", "sample", G,
      "logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)",
      "logits = jnp.take_along_axis(sorted_logits, order, axis=-1)", K("nucleus_of_tempered_probs")),
    M("sample_unsort_uses_row0_order", "sample", G, "[jnp.arange(logits.shape[0])[:, None], order]",
      "[jnp.arange(logits.shape[0])[:, None], order[:1]]", K("mass_hits_top_p_exactly_cold")),
    M("sample_same_key_every_row", "sample", G, "return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)",
      "return jax.vmap(lambda x: jax.random.categorical(key, x))(logits).astype(jnp.int32)", K("sample_draws and hot and not mass")),
    M("sample_loop_reuses_key", "sample", G, "key, draw = jax.random.split(key)", "_, draw = jax.random.split(key)", E2E),
    M("sample_loop_drops_top_p", "sample", G, "token = sample(last, draw, temperature, top_p)",
      "token = sample(last, draw, temperature, 1.0)", E2E),
    M("sample_loop_keeps_first_logits", "sample", G, "return out, cache, logits[:, -1], key",
      "return out, cache, last, key", E2E),
    M("sample_cli_ignores_top_p", "sample", "maxtrain/cli.py", "                              top_p=args.top_p)",
      "                              top_p=1.0)", CLI),
    M("sample_top_p_zero_accepted", "sample", G, "not 0 < top_p <= 1", "not 0 <= top_p <= 1", CLI),
    M("sample_zero_new_tokens_accepted", "sample", G, "if new_tokens < 1 or", "if new_tokens < 0 or", CLI),
    M("sample_harness_one_key_for_every_request", "sample", "maxtrain/harness.py",
      "return jax.random.fold_in(jax.random.key(0), index)", "return jax.random.key(0)", K("harness_sampling")),
    M("sample_harness_ignores_top_p", "sample", "maxtrain/harness.py",
      'top_p = float(kwargs.get("top_p", 1.0)) if sampled else 1.0', "top_p = 1.0", K("harness_sampling")),
    # part 2: the losses (tests/test_loss.py's numpy oracle with mask and z-loss)
    M("loss_z_sum_unmasked", "sample", LOSS_PY, "z_sum = jnp.sum(jnp.square(lse_BL) * loss_mask_BL)",
      "z_sum = jnp.sum(jnp.square(lse_BL))", ORACLE),
    M("loss_token_count_unmasked", "sample", LOSS_PY, '"tokens": jnp.sum(loss_mask_BL)}', '"tokens": 1.0 * loss_mask_BL.size}',
      ORACLE),
    M("loss_onepass_z_grad_factor", "sample", LOSS_PY, "coef = m * (1.0 + 2.0 * z_loss * lse)",
      "coef = m * (1.0 + z_loss * lse)", ORACLE),
    M("loss_onepass_onehot_unmasked", "sample", LOSS_PY, "jnp.where(hit, m[:, None], 0.0)", "jnp.where(hit, 1.0, 0.0)",
      ORACLE),
    M("loss_onepass_dw_block_edge", "sample", LOSS_PY, "(start + cols >= j * block)", "(start + cols > j * block)", ORACLE),
    M("loss_onepass_dw_unscaled", "sample", LOSS_PY, "(g * dw).astype(dw.dtype)", "dw.astype(dw.dtype)", ORACLE),
]
