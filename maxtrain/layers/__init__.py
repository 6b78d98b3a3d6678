"""Building blocks shared by model families: attention dispatch, MLP, norms, RoPE."""
