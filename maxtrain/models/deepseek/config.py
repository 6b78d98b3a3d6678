"""`model.name: deepseek`'s config: the shared model keys plus multi-head latent attention
(`model.mla`) and multi-token prediction (`model.mtp`), and the family's checks. No jax: read with
the config, before jax loads."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from maxtrain.config import ConfigError, ModelConfig
from maxtrain.kernels.limits import FLASH_HEAD_DIMS

log = logging.getLogger("maxtrain")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values from a low-rank latent, the
    query optionally too, and a decoupled RoPE key shared by every head."""

    q_lora_rank: int | None = 1536  # the query's latent rank; null: a full-rank query projection
    kv_lora_rank: int = 512  # the keys' and values' latent rank
    qk_nope_head_dim: int = 128  # per head, the query/key dims without position
    qk_rope_head_dim: int = 64  # per head, the rotary dims (the key's shared by all heads)
    v_head_dim: int = 128


@dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3): `depth` extra modules, the k-th predicting token t+k+1
    from the (k-1)-th's hidden state and token t+k's embedding, through one more layer."""

    depth: int = 1
    loss_weight: float = 0.3  # the MTP losses' mean over depths times this, added to the objective


@dataclass(frozen=True)
class DeepSeekConfig(ModelConfig):
    mla: MLAConfig | None = None  # multi-head latent attention (required)
    mtp: MTPConfig | None = None  # multi-token prediction; null: none

    def stack_length(self) -> int:
        """The MoE layers: the first `moe.first_dense` run before the stack (in `embed`)."""
        return self.n_layers - self.moe.first_dense

    def attention_head_dims(self) -> tuple[int, int]:
        """Latent attention's query/key head (position-free part plus RoPE part) and value head."""
        a = self.mla
        return (a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim) if a is not None else super().attention_head_dims()

    def validate(self) -> None:
        """Needs `model.mla` and `model.moe`, and sizes that fit them."""
        if self.mla is None or self.moe is None:
            raise ConfigError("model.name=deepseek needs model.mla (latent attention) and model.moe (its experts); "
                              "configs/deepseek-proxy.yaml shows both")
        a = self.mla
        if a.kv_lora_rank < 1 or (a.q_lora_rank is not None and a.q_lora_rank < 1) or a.qk_nope_head_dim < 0 \
                or a.qk_rope_head_dim < 2 or a.qk_rope_head_dim % 2 or a.v_head_dim < 1:
            raise ConfigError(f"model.mla needs positive ranks, qk_nope_head_dim >= 0, an even qk_rope_head_dim >= 2 "
                              f"and v_head_dim >= 1; got {a}")
        if self.moe.every != 1:
            raise ConfigError(f"model.moe.every={self.moe.every}: model.name=deepseek routes every layer after "
                              f"model.moe.first_dense; set every: 1")
        if not 0 <= self.moe.first_dense < self.n_layers:
            raise ConfigError(f"model.moe.first_dense={self.moe.first_dense} must be below "
                              f"model.n_layers={self.n_layers}")
        if mla_attention_impl(self) != self.attention:
            log.warning("model.attention=%s takes query/key heads of 64 or 128 dims, and MLA's are %d "
                        "(qk_nope_head_dim + qk_rope_head_dim): this model runs XLA's attention", self.attention,
                        a.qk_nope_head_dim + a.qk_rope_head_dim)
        if self.mtp is not None and (self.mtp.depth < 1 or self.mtp.loss_weight < 0):
            raise ConfigError(f"model.mtp needs depth >= 1 and loss_weight >= 0 (null: no multi-token prediction); "
                              f"got {self.mtp}")

    def validate_for_mesh(self, cfg, sizes: dict[str, int]) -> None:
        if self.mtp is not None and self.attention == "ring" and self.ring_layout == "zigzag" \
                and sizes.get("sequence", 1) > 1:
            raise ConfigError("model.mtp with zig-zag ring attention: multi-token prediction shifts the targets "
                              "along the sequence, which the zig-zag order reorders; set model.ring_layout=contiguous")


def mla_attention_impl(m: DeepSeekConfig) -> str:
    """`model.attention` for multi-head latent attention, or `xla` where the flash kernels cannot take
    its query/key head dim (`qk_nope_head_dim + qk_rope_head_dim`; DeepSeek-V3's 192)."""
    if m.attention in ("flash", "flash_mosaic") and m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim \
            not in FLASH_HEAD_DIMS:
        return "xla"
    return m.attention
