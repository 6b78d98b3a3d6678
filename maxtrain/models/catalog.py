"""Which module registers each model family, so the registry loads a family on first use. No jax:
a family's package declares itself here when `maxtrain.models` is imported (with its config class,
`maxtrain.config.register_model_config`), and its model, Hugging Face conversion and decoder load
only when something asks for them (`maxtrain.models.registry.get`)."""

from __future__ import annotations

import importlib

_MODULES: dict[str, str] = {}


def declare(name: str, module: str) -> None:
    """Family `name` registers itself (`maxtrain.models.register`) when `module` is imported."""
    _MODULES[name] = module


def load(name: str) -> bool:
    """Imports the module that registers `name`; False when no family of that name was declared."""
    if name not in _MODULES:
        return False
    importlib.import_module(_MODULES[name])
    return True


def declared() -> list[str]:
    return list(_MODULES)
