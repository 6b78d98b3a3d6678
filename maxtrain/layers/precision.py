"""The reduced-precision recipes the train step runs, behind one interface, so the step names none
of them: `training_recipe(cfg, model)` gives the config's recipe object (None: plain precision),
which says what state it carries between steps (checkpointed with the optimizer state under its
own key), which probes' gradients are its statistics, the meta tree the layers read, and the
metrics. FP8 (`maxtrain.layers.fp8.TrainingRecipe`) is the one today; MXFP8 or NVFP4 would be
another object with the same methods, chosen here.

The interface (duck-typed): `state() -> dict | None`, `probes()`, `layer_meta(probes, state)`,
`probes_of(meta)`, `combine(a, b)`, `metrics(probe_grads, microbatches) -> dict`,
`next_state(state, probe_grads)`.
"""

from __future__ import annotations

from maxtrain.layers import fp8


def training_recipe(cfg, model):
    """The recipe `cfg` asks for, for `model` (a registered `maxtrain.models.Model`); None for none."""
    specs = model.fp8_specs(cfg) if model.fp8_specs is not None and cfg.train.fp8.recipe != "none" else None
    return fp8.training_recipe(cfg.train.fp8, specs, pipelined=cfg.mesh.pipeline > 1)


def check(cfg, model, device) -> None:
    """The config's recipe against the model and the device (a one-line ConfigError, or a warning
    where it is emulated)."""
    has = model.fp8_specs is not None and model.fp8_specs(cfg) is not None
    fp8.check_support(cfg.train.fp8.recipe, model.name, has, device)
