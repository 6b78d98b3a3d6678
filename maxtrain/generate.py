"""Sampling from a checkpoint: the prompt in one prefill pass, then one token per step against a
KV cache, all in one jitted program (`lax.fori_loop` over the new tokens).

The decoder is the model family's (`maxtrain.models.registry.Decoder`, in each family's folder:
`init_cache` and `forward_cached`, its layer rewritten for a cache; prefill and decode are the same
function). Its logits for the prompt equal the training forward's, and greedy decoding equals
`transformers`' greedy generation of a converted model (tested for every family). Temperature 0 is
greedy; otherwise softmax sampling at that temperature within the top-p nucleus.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from maxtrain import storage
from maxtrain.config import ConfigError, ModelConfig
from maxtrain.models import registry


def decoder(m: ModelConfig) -> registry.Decoder:
    """`m`'s family's decoder; one line for a family without one."""
    found = registry.get(m.name).decoder
    if found is None:
        raise ConfigError(f"generate: model.name={m.name!r} has no KV-cache decoder (its family registers none: "
                          f"models.register(..., decoder=)); the families that generate: "
                          f"{', '.join(registry.families_with('decoder'))}")
    return found


def check_supported(m: ModelConfig) -> None:
    """One line for a model whose family has no decoder."""
    decoder(m)


def init_cache(m: ModelConfig, batch: int, max_len: int, dtype):
    """The family's empty cache for `batch` rows of up to `max_len` positions."""
    return decoder(m).init_cache(m, batch, max_len, dtype)


def forward_cached(params: dict, tokens_BT, cache, start, m: ModelConfig):
    """Logits `[B, T, V]` (float32) of T tokens at positions `start..`, and the cache with them in."""
    return decoder(m).forward_cached(params, tokens_BT, cache, start, m)


def sample(logits_BV, key, temperature: float, top_p: float):
    """The next token of each row: the argmax at temperature 0, else a draw at that temperature from
    the smallest set of tokens whose probability reaches `top_p` (always at least the likeliest)."""
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the likelier tokens
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate_tokens(params: dict, prompt_BP, key, *, m: ModelConfig, new_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0):
    """`[B, P + new_tokens]`: the prompt and what follows it (prefill, then a KV-cached loop)."""
    return make_generator(m, new_tokens, temperature, top_p)(params, prompt_BP, key)


def make_generator(m: ModelConfig, new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, dtype=None):
    """The jitted `(params, prompt [B, P], key) -> [B, P + new_tokens]`, one compiled program per prompt
    shape (the model config is a constant of it; keep the function to reuse it). `dtype`: cast the
    parameters to it first (float32 masters -> the compute dtype), inside the program."""
    if new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise ConfigError("generate: --max-new-tokens must be >= 1, --temperature >= 0 and --top-p in (0, 1]")

    def run(params, prompt_BP, key):
        if dtype is not None:
            params = compute_params(params, dtype)
        return _generate(params, prompt_BP, key, m=m, new_tokens=new_tokens, temperature=temperature, top_p=top_p)

    return jax.jit(run)


def _generate(params: dict, prompt_BP, key, *, m: ModelConfig, new_tokens: int, temperature: float, top_p: float):
    B, P = prompt_BP.shape
    dtype = next(x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating))
    cache = init_cache(m, B, P + new_tokens, dtype)
    logits, cache = forward_cached(params, prompt_BP, cache, 0, m)
    out = jnp.concatenate([prompt_BP, jnp.zeros((B, new_tokens), prompt_BP.dtype)], axis=1)

    def step(i, carry):
        out, cache, last, key = carry
        key, draw = jax.random.split(key)
        token = sample(last, draw, temperature, top_p).astype(out.dtype)
        out = lax.dynamic_update_slice(out, token[:, None], (0, P + i))
        logits, cache = forward_cached(params, token[:, None], cache, P + i, m)
        return out, cache, logits[:, -1], key

    out, *_ = lax.fori_loop(0, new_tokens, step, (out, cache, logits[:, -1], key))
    return out


def compute_params(params: dict, dtype) -> dict:
    """The parameters in the compute dtype (as the training step casts them)."""
    return jax.tree.map(lambda p: p.astype(dtype), params)


def text_until_eos(tok, ids: list[int]) -> str:
    """The text of generated `ids` up to (not including) the first end-of-text token."""
    return tok.decode(ids[:ids.index(tok.eos_id)] if tok.eos_id in ids else ids)


def flat_layers(params: dict, pipeline: int) -> dict:
    """Parameters with pipeline-staged layers (`[R, S, N/(S R), ...]` when `mesh.pipeline > 1`) in the
    flat `[N, ...]` stack (the staged layout is the flat one reshaped, `parallel.pipeline.stage_specs`)."""
    if pipeline == 1:
        return params
    return {**params, "layers": jax.tree.map(lambda x: x.reshape((-1,) + x.shape[3:]), params["layers"])}


def tokenizer_for(cfg, spec: str | None = None, checkpoint: str | None = None):
    """`spec` (--tokenizer), else the tokenizer kept with `checkpoint` (`checkpoint.saved_tokenizer`),
    else the one the training data was prepared with (its manifest, found from here), else bytes for
    text data; None for data that names no tokenizer (synthetic). Not found: one line naming
    --tokenizer."""
    import os

    from maxtrain.data.tokenizers import load_tokenizer

    hint = "give byte, a tokenizer.json (or a directory holding one) or a SentencePiece .model"
    if spec:
        if spec != "byte" and not os.path.exists(spec):
            raise ConfigError(f"--tokenizer {spec} not found; {hint}")
        return load_tokenizer(spec)
    if checkpoint is not None:
        from maxtrain.checkpoint import saved_tokenizer

        kept = saved_tokenizer(checkpoint)
        if kept is not None:
            return load_tokenizer(kept)
    if cfg.data.kind == "tokens" and cfg.data.path:
        from maxtrain.data.manifest import manifest_tokenizer, read_manifest
        from maxtrain.data.tokens import parse_mixture

        first = parse_mixture(cfg.data.path)[0][0]
        if storage.is_url(first):  # the prefix's node-local copy (object_cache)
            first = storage.stage(first, cfg.object_cache)
        hint = f"pass --tokenizer ({hint.removeprefix('give ')})"
        try:
            found = manifest_tokenizer(first, read_manifest(first))
        except ConfigError as e:
            where = "" if os.path.isabs(first) else ", relative to where training ran,"
            why = f"data.path={first}{where} is not a directory here" if not os.path.isdir(first) else \
                str(e).split(";")[0]
            raise ConfigError(f"the training data's tokenizer is unavailable ({why}); {hint}") from None
        if found != "byte" and not os.path.isfile(found):
            raise ConfigError(f"the training data's tokenizer {found} is not found; {hint}")
        return load_tokenizer(found)
    if cfg.data.kind == "text":
        return load_tokenizer("byte")
    return None


class Sampler:
    """`train.sample_every`: greedy text from `train.sample_prompt` with the current parameters, for
    the metrics record (one compiled program, reused)."""

    def __init__(self, cfg):
        check_supported(cfg.model)
        self.tok = tokenizer_for(cfg)
        t = cfg.train
        bos = self.tok.eos_id if self.tok is not None else 0
        ids = self.tok.encode(t.sample_prompt) if (self.tok is not None and t.sample_prompt) else []
        self.prompt = jnp.asarray([ids or [bos]], jnp.int32)
        self.pipeline = cfg.mesh.pipeline
        self.fn = make_generator(cfg.model, t.sample_tokens, dtype=jnp.dtype(t.dtype))

    def run(self, params) -> str:
        out = jax.device_get(self.fn(flat_layers(params, self.pipeline), self.prompt, jax.random.key(0)))
        new = [int(i) for i in out[0, self.prompt.shape[1]:]]
        if self.tok is None or self.tok.decode is None:
            return " ".join(map(str, new))
        return text_until_eos(self.tok, new)
