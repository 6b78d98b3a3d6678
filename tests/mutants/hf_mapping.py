# Mutants for the Hugging Face converters (area hf): two parameters of one shape swapped (or one
# read twice, the other dropped), on import, on export, or both ways alike (a round trip stays exact).
#   python tests/mutate.py --only hf_
# `M` is tests/mutate.py's Mutant(name, area, path, old, new, tests).

LAYOUT = ("tests/test_hf.py", "-k", "one_param_slice")
DS_LAYOUT = ("tests/test_hf_deepseek.py", "-k", "one_param_slice")
HFL = "maxtrain/models/llama/hf.py"
HFD = "maxtrain/models/deepseek/hf.py"

LLAMA_IMPORT_ATTN = '''    attn = {"attn_norm": lambda p: get(p + "input_layernorm.weight"),
            "wq": lambda p: get(p + "self_attn.q_proj.weight").T.reshape(D, H, K),
            "wk": lambda p: get(p + "self_attn.k_proj.weight").T.reshape(D, G, K),
            "wv": lambda p: get(p + "self_attn.v_proj.weight").T.reshape(D, G, K),
            "wo": lambda p: get(p + "self_attn.o_proj.weight").T.reshape(H, K, D),
            "mlp_norm": lambda p: get(p + "post_attention_layernorm.weight")}'''
DS_IMPORT_NORMS = '''            "kv_norm": lambda p: get(p + "self_attn.kv_a_layernorm.weight"),
            "wkv_b": lambda p: get(p + "self_attn.kv_b_proj.weight").T.reshape(R, H, N + A),
            "wo": lambda p: get(p + "self_attn.o_proj.weight").T.reshape(H, A, D),
            "mlp_norm": lambda p: get(p + "post_attention_layernorm.weight")}
    if a.q_lora_rank is None:
        attn["wq"] = lambda p: rope(get(p + "self_attn.q_proj.weight").T.reshape(D, H, K))
    else:
        attn.update(wq_a=lambda p: get(p + "self_attn.q_a_proj.weight").T,
                    q_norm=lambda p: get(p + "self_attn.q_a_layernorm.weight"),'''
DS_EXPORT_NORMS = '''                out[p + "self_attn.q_a_layernorm.weight"] = at["q_norm"]
                out[p + "self_attn.q_b_proj.weight"] = rope(at["wq_b"]).reshape(a.q_lora_rank, H * K).T
            out[p + "self_attn.kv_a_proj_with_mqa.weight"] = rope(at["wkv_a"]).T
            out[p + "self_attn.kv_a_layernorm.weight"] = at["kv_norm"]'''


def _swap(text, a, b):
    return text.replace(a, "\0").replace(b, a).replace("\0", b)


MUTANTS = [
    # ---- Llama family (hf_llama.py): host-side layout test
    M("hf_llama_norms_swapped_on_import", "hf", HFL, LLAMA_IMPORT_ATTN,
      _swap(LLAMA_IMPORT_ATTN, "input_layernorm", "post_attention_layernorm"), LAYOUT),
    M("hf_llama_norms_swapped_on_export", "hf", HFL,
      'out[p + "input_layernorm.weight"] = a["attn_norm"]\n        out[p + "post_attention_layernorm.weight"] = a["mlp_norm"]',
      'out[p + "input_layernorm.weight"] = a["mlp_norm"]\n        out[p + "post_attention_layernorm.weight"] = a["attn_norm"]',
      LAYOUT),
    M("hf_llama_k_v_swapped_on_import", "hf", HFL, LLAMA_IMPORT_ATTN,
      _swap(LLAMA_IMPORT_ATTN, "self_attn.k_proj", "self_attn.v_proj"), LAYOUT),
    M("hf_llama_qk_norm_swapped_on_import", "hf", HFL,
      'attn["q_norm"] = lambda p: get(p + "self_attn.q_norm.weight")\n        attn["k_norm"] = lambda p: get(p + "self_attn.k_norm.weight")',
      'attn["q_norm"] = lambda p: get(p + "self_attn.k_norm.weight")\n        attn["k_norm"] = lambda p: get(p + "self_attn.q_norm.weight")',
      LAYOUT),
    M("hf_llama_qk_norm_swapped_on_export", "hf", HFL,
      'out[p + "self_attn.q_norm.weight"] = a["q_norm"]\n            out[p + "self_attn.k_norm.weight"] = a["k_norm"]',
      'out[p + "self_attn.q_norm.weight"] = a["k_norm"]\n            out[p + "self_attn.k_norm.weight"] = a["q_norm"]',
      LAYOUT),
    # both ways alike: the round trip stays exact; only a layout or parity oracle sees it
    M("hf_llama_mixtral_w1_w3_swapped", "hf", HFL, '("w1", "w3", "w2")', '("w3", "w1", "w2")', LAYOUT),
    M("hf_llama_qwen3_moe_gate_up_swapped", "hf", HFL, '"mlp.experts.{j}.", ("gate_proj", "up_proj", "down_proj")',
      '"mlp.experts.{j}.", ("up_proj", "gate_proj", "down_proj")', LAYOUT),
    M("hf_llama_dense_gate_up_swapped", "hf", HFL,
      'DENSE_MLP = (("w_gate", "gate_proj"), ("w_up", "up_proj")', 'DENSE_MLP = (("w_gate", "up_proj"), ("w_up", "gate_proj")',
      LAYOUT),
    M("hf_llama_experts_rotated_on_import", "hf", HFL,
      '[get(f"{p}{expert.format(j=x)}{theirs}.weight").T for x in range(m.moe.num_experts)]',
      '[get(f"{p}{expert.format(j=(x + 1) % m.moe.num_experts)}{theirs}.weight").T for x in range(m.moe.num_experts)]',
      LAYOUT),
    M("hf_llama_moe_blocks_reversed_on_import", "hf", HFL,
      "blocks = [[b * k + j for b in range(NB)] for j in range(k)]",
      "blocks = [[b * k + j for b in reversed(range(NB))] for j in range(k)]", LAYOUT),
    M("hf_llama_lm_head_from_embedding", "hf", HFL, 'params["lm_head"] = {"kernel": get("lm_head.weight").T}',
      'params["lm_head"] = {"kernel": get("model.embed_tokens.weight").T}', LAYOUT),
    M("hf_llama_final_norm_from_last_layer", "hf", HFL, '"final_norm": {"scale": get("model.norm.weight")}}',
      '"final_norm": {"scale": get(f"model.layers.{m.n_layers - 1}.input_layernorm.weight")}}', LAYOUT),
    # ---- the same kinds of bug against transformers only (parity, no layout table)
    M("hf_parity_llama_norms_swapped_on_import", "hf", HFL, LLAMA_IMPORT_ATTN,
      _swap(LLAMA_IMPORT_ATTN, "input_layernorm", "post_attention_layernorm"),
      ("tests/test_hf.py", "-k", "matches_transformers and gqa_untied")),
    M("hf_parity_llama_qk_norm_swapped_on_import", "hf", HFL,
      'attn["q_norm"] = lambda p: get(p + "self_attn.q_norm.weight")\n        attn["k_norm"] = lambda p: get(p + "self_attn.k_norm.weight")',
      'attn["q_norm"] = lambda p: get(p + "self_attn.k_norm.weight")\n        attn["k_norm"] = lambda p: get(p + "self_attn.q_norm.weight")',
      ("tests/test_hf.py", "-k", "matches_transformers and qwen3_untied")),
    M("hf_parity_llama_mixtral_w1_w3_swapped", "hf", HFL, '("w1", "w3", "w2")', '("w3", "w1", "w2")',
      ("tests/test_hf.py", "-k", "matches_transformers and mixtral_top2")),
    M("hf_parity_llama_rope_low_high_freq_swapped", "hf", HFL,
      'low_freq_factor=positive_float(scaling, "low_freq_factor", where=where),\n        high_freq_factor=positive_float(scaling, "high_freq_factor", where=where)',
      'low_freq_factor=positive_float(scaling, "high_freq_factor", where=where),\n        high_freq_factor=positive_float(scaling, "low_freq_factor", where=where)',
      ("tests/test_hf.py", "-k", "matches_transformers and tied_llama3_scaling")),
    # ---- DeepSeek-V3 (hf_deepseek.py): host-side layout test
    M("hf_ds_q_a_kv_a_norms_swapped_on_import", "hf", HFD, DS_IMPORT_NORMS,
      _swap(DS_IMPORT_NORMS, "self_attn.kv_a_layernorm", "self_attn.q_a_layernorm"), DS_LAYOUT),
    M("hf_ds_q_a_kv_a_norms_swapped_on_export", "hf", HFD, DS_EXPORT_NORMS,
      _swap(DS_EXPORT_NORMS, 'at["q_norm"]', 'at["kv_norm"]'), DS_LAYOUT),
    M("hf_ds_norms_swapped_on_export", "hf", HFD,
      'out[p + "input_layernorm.weight"] = at["attn_norm"]\n            out[p + "post_attention_layernorm.weight"] = at["mlp_norm"]',
      'out[p + "input_layernorm.weight"] = at["mlp_norm"]\n            out[p + "post_attention_layernorm.weight"] = at["attn_norm"]',
      DS_LAYOUT),
    M("hf_ds_kv_b_from_q_b_on_import", "hf", HFD,
      '"wkv_b": lambda p: get(p + "self_attn.kv_b_proj.weight")', '"wkv_b": lambda p: get(p + "self_attn.q_b_proj.weight")',
      DS_LAYOUT),
    M("hf_ds_gate_up_swapped", "hf", HFD,
      'DENSE_MLP = (("w_gate", "gate_proj"), ("w_up", "up_proj")', 'DENSE_MLP = (("w_gate", "up_proj"), ("w_up", "gate_proj")',
      DS_LAYOUT),
    M("hf_ds_shared_gate_up_swapped", "hf", HFD,
      'SHARED_MLP = (("shared_gate", "gate_proj"), ("shared_up", "up_proj")',
      'SHARED_MLP = (("shared_gate", "up_proj"), ("shared_up", "gate_proj")', DS_LAYOUT),
    M("hf_ds_shared_from_expert_0_on_import", "hf", HFD,
      'get(f"{p}mlp.shared_experts.{theirs}.weight").T', 'get(f"{p}mlp.experts.0.{theirs}.weight").T', DS_LAYOUT),
    M("hf_ds_layers_reversed_on_import", "hf", HFD,
      'return np.stack([fn(f"model.layers.{i}.") for i in layers])',
      'return np.stack([fn(f"model.layers.{i}.") for i in reversed(layers)])', DS_LAYOUT),
    M("hf_parity_ds_nope_v_head_dims_swapped", "hf", HFD,
      'qk_nope_head_dim=_int(hf, "qk_nope_head_dim"), qk_rope_head_dim=rope_dim,\n                    v_head_dim=_int(hf, "v_head_dim")',
      'qk_nope_head_dim=_int(hf, "v_head_dim"), qk_rope_head_dim=rope_dim,\n                    v_head_dim=_int(hf, "qk_nope_head_dim")',
      ("tests/test_hf_deepseek.py", "-k", "logits_match and rope_halves")),  # a config read: the layout test follows it
    # ---- DeepSeek-V3 against transformers only
    M("hf_parity_ds_q_a_kv_a_norms_swapped_on_import", "hf", HFD, DS_IMPORT_NORMS,
      _swap(DS_IMPORT_NORMS, "self_attn.kv_a_layernorm", "self_attn.q_a_layernorm"),
      ("tests/test_hf_deepseek.py", "-k", "logits_match and rope_halves")),
    M("hf_parity_ds_shared_gate_up_swapped", "hf", HFD,
      'SHARED_MLP = (("shared_gate", "gate_proj"), ("shared_up", "up_proj")',
      'SHARED_MLP = (("shared_gate", "up_proj"), ("shared_up", "gate_proj")',
      ("tests/test_hf_deepseek.py", "-k", "logits_match and rope_halves")),
]
