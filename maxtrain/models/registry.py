"""The model registry (what model families import; no family here)."""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import jax

from maxtrain.config import Config, ConfigError, did_you_mean, register_model_config
from maxtrain.models import catalog
import maxtrain.models.stack as stack
from maxtrain.parallel import ring_attention as _ring  # noqa: F401  (registers attention "ring")


@dataclass(frozen=True)
class Decoder:
    """A family's KV-cached decoder (`maxtrain generate`, `train.sample_every`, `maxtrain eval`):
    `init_cache(m, batch, max_len, dtype) -> cache` (a pytree of zeros) and
    `forward_cached(params, tokens [B, T], cache, start, m) -> (logits [B, T, V] float32, cache)`:
    T tokens at positions `start..`, each attending over the cache's positions up to its own.
    Prefill (T = the prompt's length) and decode (T = 1) are the same function."""
    init_cache: Callable[..., Any]
    forward_cached: Callable[..., Any]


@dataclass(frozen=True)
class HFConversion:
    """A family's Hugging Face interchange (`maxtrain convert`), host-side numpy:

    - `model_types`: the config.json `model_type`s it reads (e.g. "llama", "mistral")
    - `config_from_hf(hf: dict) -> ModelConfig`; `config_to_hf(m, *, rope_format, dtype, max_position) -> dict`
    - `hf_shapes(m)`: (tensor name, shape) of every tensor a checkpoint of `m` has
    - `check_tensors(found: {name: (dtype, shape)}, m, hf_dir)`: a ConfigError naming what is missing or wrong
    - `params_from_hf(get, m) -> params` (`get(name)` reads one tensor as float32 numpy);
      `params_to_hf(params, m) -> {name: array}`
    - `read_params(hf_dir, m, param_dtype)`: optional, a reader of the family's own (None: the shared one)
    - `tensor_dtype(name, dtype) -> dtype`: optional, the dtype a tensor is written in (None: `dtype`)."""
    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict], Any]
    config_to_hf: Callable[..., dict]
    hf_shapes: Callable[[Any], Any]
    check_tensors: Callable[..., None]
    params_from_hf: Callable[..., dict]
    params_to_hf: Callable[..., dict]
    read_params: Callable[..., dict] | None = None
    tensor_dtype: Callable[[str, str], str] | None = None


@dataclass(frozen=True)
class Model:
    """A registered family as the trainer calls it (functions of the whole `Config`); a layered
    family's are built from its own functions (`layered`) by `maxtrain.models.stack`."""
    name: str
    init: Callable[[Config, jax.Array], Any]
    apply: Callable[[Any, dict, Config], tuple[jax.Array, dict]]
    logical_axes: Callable[[Config], Any]
    # Training FLOPs per token at a sequence length; None: 6 x parameter count.
    flops_per_token: Callable[[Config, int], float] | None = None
    # Last hidden states and output projection (logits = features @ head), for the fused losses.
    features: Callable[[Any, dict, Config], tuple[jax.Array, dict]] | None = None
    head: Callable[[Any, Config], jax.Array] | None = None
    # Parallelism the model supports (FEATURES); anything else asked of it is a config error.
    supports: frozenset = frozenset()
    layered: stack.Layered | None = None
    # The specs of the layers' FP8 meta under `train.fp8` (stack.fp8_specs); None: no FP8 projections.
    fp8_specs: Callable[[Config], Any] | None = None
    # Whether the optimizer updates each parameter (a tree like the params of bools); None: all.
    learned: Callable[[Config], Any] | None = None
    # `balance(params, load, cfg) -> params` after every optimizer step (`stack.Layered.balance`); None: none.
    balance: Callable[[Any, Any, Config], Any] | None = None
    decoder: Decoder | None = None  # None: the family does not generate
    hf: HFConversion | None = None  # None: no Hugging Face conversion


FEATURES = ("pipeline",)  # pipeline: mesh.pipeline > 1 splits the model's layers into stages


_REGISTRY: dict[str, Model] = {}


def register(name: str, *, param_specs=None, embed=None, layer=None, final=None, head=None, flops_per_token=None,
             balance=None, init=None, apply=None, logical_axes=None, features=None, supports=(), config=None,
             decoder: Decoder | None = None, hf: HFConversion | None = None) -> Model:
    """Adds a model family selectable as `model.name: NAME`.

    Layered (the way to write one): `param_specs`, `embed`, `layer`, `final`, `head` and optionally
    `flops_per_token` and `balance`, functions of the model config and a `stack.Runtime`
    (`maxtrain.models.stack` says what each takes). The trainer runs the layer stack, so the family
    gets remat, pipeline stages and the fused losses without code of its own.

    Whole-model (deprecated): `init(cfg, key)`, `apply(params, batch, cfg)`, `logical_axes(cfg)`,
    optionally `features`/`head`, each given the whole Config; `supports` names the FEATURES its
    own code implements (a config asking for another is a one-line error).

    `config`: the family's config class (a `maxtrain.config.ModelConfig` subclass with its own keys
    and checks; default: the shared fields only), `decoder` its KV-cached decoder (`Decoder`), `hf` its
    Hugging Face conversion (`HFConversion`)."""
    if config is not None:
        register_model_config(name, config)
    if layer is not None:
        missing = [k for k, v in dict(param_specs=param_specs, embed=embed, final=final, head=head).items() if v is None]
        extra = [k for k, v in dict(init=init, apply=apply, logical_axes=logical_axes, features=features).items()
                 if v is not None]
        if missing or extra or supports:
            raise ValueError(f"models.register({name!r}, layer=...): a layered model gives param_specs, embed, "
                             f"layer, final and head" + (f"; missing {', '.join(missing)}" if missing else "")
                             + (f"; drop {', '.join(extra + (['supports'] if supports else []))}"
                                if extra or supports else ""))
        parts = stack.Layered(param_specs, embed, layer, final, head, flops_per_token, balance)
        flops = None if flops_per_token is None else (lambda cfg, seq_len: flops_per_token(cfg.model, seq_len))
        model = Model(name, functools.partial(stack.init, parts), functools.partial(stack.apply, parts),
                      functools.partial(stack.logical_axes, parts), flops, functools.partial(stack.features, parts),
                      functools.partial(stack.head, parts), frozenset(FEATURES), parts,
                      functools.partial(stack.fp8_specs, parts), functools.partial(stack.learned, parts),
                      None if balance is None else (lambda params, load, cfg: balance(params, load, cfg.model)),
                      decoder, hf)
    else:
        if balance is not None:
            raise ValueError(f"models.register({name!r}, balance=...): only a layered model (layer=...) has balance")
        if init is None or apply is None or logical_axes is None:
            raise ValueError(f"models.register({name!r}): give layer= (with param_specs, embed, final, head), "
                             f"or init, apply and logical_axes")
        if (features is None) != (head is None):
            raise ValueError(f"models.register({name!r}): give both features and head, or neither")
        unknown = set(supports) - set(FEATURES)
        if unknown:
            raise ValueError(f"models.register({name!r}): supports={sorted(unknown)} unknown; known: {', '.join(FEATURES)}")
        warnings.warn(f"models.register({name!r}, init=, apply=, logical_axes=): whole-Config model functions are "
                      f"deprecated; register param_specs, embed, layer, final and head instead "
                      f"(maxtrain.models.stack; docs/library.md)", DeprecationWarning, stacklevel=2)
        model = Model(name, init, apply, logical_axes, flops_per_token, features, head, frozenset(supports),
                      decoder=decoder, hf=hf)
    _REGISTRY[name] = model
    return model


def get(name: str) -> Model:
    if name not in _REGISTRY:
        catalog.load(name)
    if name not in _REGISTRY:
        raise ConfigError(f"model.name={name!r} is not a registered model; {did_you_mean(name, _REGISTRY)}"
                          f"registered: {', '.join(sorted(_REGISTRY))} (add yours with maxtrain.models.register)")
    return _REGISTRY[name]


def names() -> list[str]:
    """Every family: the declared ones loaded, and those registered."""
    for name in catalog.declared():
        catalog.load(name)
    return sorted(_REGISTRY)


def families_with(part: str) -> list[str]:
    """The families whose registration gives `part` (`"decoder"`, `"hf"`), every declared one loaded."""
    return [n for n in names() if getattr(get(n), part) is not None]


def for_hf_model_type(model_type: str) -> Model:
    """The family that converts Hugging Face checkpoints of `model_type` (config.json)."""
    converters = [get(n) for n in families_with("hf")]
    found = [m for m in converters if model_type in m.hf.model_types]
    if not found:
        known = sorted(t for m in converters for t in m.hf.model_types)
        raise ConfigError(f"config.json model_type={model_type!r} is not supported; convert {', '.join(known)} "
                          f"models (a family's HFConversion adds its own)")
    return found[0]


def param_count(cfg: Config) -> int:
    """Parameter count computed abstractly (no memory is allocated)."""
    model = get(cfg.model.name)
    shapes = jax.eval_shape(lambda k: model.init(cfg, k), jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def flops_per_token(cfg: Config, seq_len: int) -> float:
    model = get(cfg.model.name)
    if model.flops_per_token is not None:
        return model.flops_per_token(cfg, seq_len)
    return 6.0 * param_count(cfg)
