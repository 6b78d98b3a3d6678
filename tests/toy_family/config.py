"""The toy family's config: the shared model keys, plus its own."""

from dataclasses import dataclass

from maxtrain.config import ConfigError, ModelConfig

ACTIVATIONS = ("gelu", "relu")


@dataclass(frozen=True)
class ToyConfig(ModelConfig):
    activation: str = "gelu"  # the MLP's nonlinearity: gelu | relu
    max_positions: int = 256  # rows of the learned position table

    def validate(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"model.activation={self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.max_positions < 1:
            raise ConfigError(f"model.max_positions must be positive, got {self.max_positions}")

    def validate_for_mesh(self, cfg, sizes) -> None:
        if cfg.train.seq_len > self.max_positions:
            raise ConfigError(f"train.seq_len={cfg.train.seq_len} is longer than model.max_positions="
                              f"{self.max_positions}; raise model.max_positions")
