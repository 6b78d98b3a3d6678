"""DeepSeek-area mutants (issue 39): MTP internals, MLA, DeepSeek-V3 routing and balancing.
Run: python tests/mutate.py --only dsk_"""

DS = "maxtrain/models/deepseek/model.py"
MOE = "maxtrain/layers/moe.py"
T = "tests/test_deepseek.py"
FAMILY = (T, "-k", "numpy_oracle")
MTP = (T, "-k", "mtp_loss_and_objective")
ROUTE = (T, "-k", "numpy or bias_chooses")
BAL = (T, "-k", "balancing_moves or balance_update_by_hand")
MTP_IN = ('        h_BLD = (dots.einsum("bld,de->ble", rms_norm(e_BLD, p["enorm"], eps), p["proj"][0])\n'
          '                 + dots.einsum("bld,de->ble", rms_norm(h_BLD, p["hnorm"], eps), p["proj"][1]))')

MUTANTS = [
    # the brief's planted bugs
    M("dsk_mtp_norms_swapped", "deepseek", DS, MTP_IN,
      MTP_IN.replace('p["enorm"]', "@E@").replace('p["hnorm"]', 'p["enorm"]').replace("@E@", 'p["hnorm"]'), MTP),
    M("dsk_mtp_concat_order", "deepseek", DS, MTP_IN,
      MTP_IN.replace('p["proj"][0]', "@0@").replace('p["proj"][1]', 'p["proj"][0]').replace("@0@", 'p["proj"][1]'),
      MTP),
    M("dsk_bias_in_weights", "deepseek", MOE, "weights_TK = jnp.take_along_axis(scores, experts_TK, axis=-1)",
      "weights_TK = jnp.take_along_axis(choice, experts_TK, axis=-1)", ROUTE),
    M("dsk_group_score_max", "deepseek", MOE, "group_TG = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)",
      "group_TG = jnp.max(grouped, axis=-1)", ROUTE),
    M("dsk_bias_update_sign", "deepseek", DS, "jnp.sign(1.0 / m.moe.num_experts - load_NE)",
      "jnp.sign(load_NE - 1.0 / m.moe.num_experts)", BAL),
    # MTP
    M("dsk_mtp_not_chained", "deepseek", DS, 'rms_norm(h_BLD, p["hnorm"], eps)', 'rms_norm(x_BLD, p["hnorm"], eps)',
      MTP),
    M("dsk_mtp_embeds_token_t_plus_k_minus_1", "deepseek", DS, "_shift(targets, k), rt)",
      '_shift(batch["inputs"], k), rt)', MTP),
    M("dsk_mtp_target_off_by_one", "deepseek", DS, "token_losses(logits, _shift(targets, k + 1))",
      "token_losses(logits, _shift(targets, k + 2))", MTP),
    M("dsk_mtp_sum_over_depths", "deepseek", DS, "return sum(losses) / len(losses),", "return sum(losses),", MTP),
    M("dsk_mtp_main_final_norm", "deepseek", DS, 'rms_norm(h_BLD, p["final_norm"], eps)',
      'rms_norm(h_BLD, params["final_norm"]["scale"], eps)', MTP),
    M("dsk_mtp_mask_unshifted", "deepseek", DS, "valid = mtp_positions(mask, seg, k + 1)",
      "valid = mtp_positions(mask, seg, k)", MTP),
    M("dsk_mtp_segment_check_off", "deepseek", DS, "valid = valid * (_shift(segment_ids_BL, depth, -1) == segment_ids_BL)",
      "valid = valid * (_shift(segment_ids_BL, depth - 1, -1) == segment_ids_BL)", MTP),
    M("dsk_mtp_moe_loss_dropped", "deepseek", DS, "m.mtp.loss_weight * loss + moe_loss(mtp_stats, m.moe),",
      "m.mtp.loss_weight * loss,", MTP),
    M("dsk_mtp_weight_on_moe_loss", "deepseek", DS, "m.mtp.loss_weight * loss + moe_loss(mtp_stats, m.moe),",
      "m.mtp.loss_weight * (loss + moe_loss(mtp_stats, m.moe)),", MTP),
    # MLA and the layers
    M("dsk_mla_q_kv_norms_swapped", "deepseek", DS, 'rms_norm(cq, p["q_norm"], eps)', 'rms_norm(cq, p["kv_norm"], eps)',
      FAMILY),
    M("dsk_mla_rope_key_unrotated", "deepseek", DS, "apply_rope(k_rope[:, :, None, :], positions_BL, inv_freq)",
      "k_rope[:, :, None, :]", FAMILY),
    M("dsk_mla_attn_norm_is_mlp_norm", "deepseek", DS, 'rms_norm(x_BLD, p["attn_norm"], eps)',
      'rms_norm(x_BLD, p["mlp_norm"], eps)', FAMILY),
    M("dsk_mla_query_not_rotated", "deepseek", DS,
      "q = jnp.concatenate([q[..., :N], apply_rope(q[..., N:], positions_BL, inv_freq)], axis=-1)",
      "q = jnp.concatenate([q[..., :N], apply_rope(q[..., N:], positions_BL * 0, inv_freq)], axis=-1)", FAMILY),
    M("dsk_dense_gate_up_swapped", "deepseek", DS, 'swiglu(h, p["w_gate"], p["w_up"], p["w_down"], rules)',
      'swiglu(h, p["w_up"], p["w_gate"], p["w_down"], rules)', FAMILY),
    M("dsk_shared_gate_up_swapped", "deepseek", MOE, 'swiglu(x_BLD, p["shared_gate"], p["shared_up"],',
      'swiglu(x_BLD, p["shared_up"], p["shared_gate"],', FAMILY),
    # routing
    M("dsk_norm_topk_true_ignored_for_top1", "deepseek", MOE, "if moe.norm_topk if moe.norm_topk is not None else K > 1:",
      "if moe.norm_topk is not False and K > 1:", (T, "-k", "norm_topk")),
    M("dsk_norm_topk_false_ignored", "deepseek", MOE, "if moe.norm_topk if moe.norm_topk is not None else K > 1:",
      "if moe.norm_topk or K > 1:", (T, "-k", "norm_topk")),
    M("dsk_group_rank_without_bias", "deepseek", MOE, "            choice = _group_limited(choice, moe)",
      "            choice = jnp.where(jnp.isinf(_group_limited(scores, moe)), -jnp.inf, choice)", ROUTE),
    M("dsk_balance_prob_unnormalised", "deepseek", MOE,
      "probs = scores / jnp.maximum(jnp.sum(scores, axis=-1, keepdims=True), 1e-9)", "probs = scores", MTP),
    # balancing
    M("dsk_balance_layers_reversed", "deepseek", DS, "step.reshape(bias.shape)", "step[::-1].reshape(bias.shape)", BAL),
    M("dsk_balance_rate_dropped", "deepseek", DS, "step = m.moe.bias_update_rate * jnp.sign(",
      "step = 0.01 * jnp.sign(", BAL),
    M("dsk_load_per_token_not_assignment", "deepseek", MOE, "axis=(0, 1)) / (experts_TK.size)",
      "axis=(0, 1)) / (experts_TK.shape[0])", BAL),
    M("dsk_bias_exists_at_rate_zero", "deepseek", DS, "bias=m.moe.bias_update_rate > 0)}",
      "bias=m.moe.bias_update_rate >= 0)}", (T, "-k", "routing_is_not_trivial")),
]
MUTANTS += [
    # per-device (shard_map) routing
    M("dsk_ep_routes_without_bias", "deepseek", MOE, 'w_TK, e_TK, parts = _route(x_TD, p["router"], moe, p.get("bias"))',
      'w_TK, e_TK, parts = _route(x_TD, p["router"], moe)', ("tests/test_moe.py", "-k", "per_device")),
    M("dsk_ep_load_averaged_over_expert_only", "deepseek", MOE, "parts = jax.lax.pmean(parts, token_axes)",
      'parts = jax.tree.map(lambda v: jax.lax.psum(v, token_axes) / mesh.shape["expert"], parts)',
      ("tests/test_moe.py", "-k", "per_device")),
]
MUTANTS += [
    M("dsk_dense_mlp_normed_by_attn_norm", "deepseek", DS, 'h = constrain(rms_norm(x_BLD, p["mlp_norm"], m.norm_eps), (',
      'h = constrain(rms_norm(x_BLD, p["attn_norm"], m.norm_eps), (', FAMILY),
]
# the brief's planted bugs again, each against the new tests alone (the older ones catch some too)
NEW_ROUTE = (T, "-k", "family_logits or norm_topk")
MUTANTS += [
    M("dsk_new_bias_in_weights", "deepseek", MOE, "weights_TK = jnp.take_along_axis(scores, experts_TK, axis=-1)",
      "weights_TK = jnp.take_along_axis(choice, experts_TK, axis=-1)", NEW_ROUTE),
    M("dsk_new_group_score_max", "deepseek", MOE, "group_TG = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)",
      "group_TG = jnp.max(grouped, axis=-1)", NEW_ROUTE),
    M("dsk_new_bias_update_sign", "deepseek", DS, "jnp.sign(1.0 / m.moe.num_experts - load_NE)",
      "jnp.sign(load_NE - 1.0 / m.moe.num_experts)", (T, "-k", "balancing_moves or balance_update_by_hand")),
    M("dsk_imbalance_mean_not_max", "deepseek", MOE, '"moe_imbalance": E * jnp.max(parts["load"])',
      '"moe_imbalance": E * jnp.mean(parts["load"])', MTP),
]
