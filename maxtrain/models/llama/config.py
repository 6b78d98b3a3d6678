"""`model.name: llama`'s config (Llama 2/3, Mistral, Qwen3, Mixtral, Qwen3-MoE): the shared model
keys, and the family's checks. No jax: read with the config, before jax loads."""

from __future__ import annotations

from dataclasses import dataclass

from maxtrain.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    def validate(self) -> None:
        """Its MoE routes top-k over all experts, softmax or sigmoid: no group-limited routing, dense
        first layers or balancing bias (those are other families' routing)."""
        e = self.moe
        if e is None:
            return
        unused = [k for k, on in (("model.moe.first_dense", e.first_dense > 0), ("model.moe.groups", e.groups > 1),
                                  ("model.moe.bias_update_rate", e.bias_update_rate > 0)) if on]
        if unused:
            raise ConfigError(f"{unused[0]} is set for model.name={self.name}, whose MoE layers do not use it "
                              f"(leave it 0/1 here, or choose a family that routes that way)")
