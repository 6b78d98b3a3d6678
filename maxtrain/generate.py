"""Sampling from a checkpoint: the prompt in one prefill pass, then one token per step against a
KV cache, all in one jitted program (`lax.fori_loop` over the new tokens).

The decoder is the llama family's layer (`maxtrain.models.llama`: RMSNorm, RoPE on the
document's positions, grouped-query attention, SwiGLU) rewritten for a cache: each layer writes
its keys and values for positions `start .. start+T-1` into `[B, S, G, K]` buffers and attends
over the cache with the causal (and sliding-window) mask of absolute positions. Prefill (T = the
prompt's length) and decode (T = 1) are the same function. MoE models (Mixtral, Qwen3-MoE) route
each token as training does and run every expert on it, weighted by the routing (`_moe_mlp`). Its logits for the prompt equal the
training forward's (tested), and greedy decoding equals `transformers`' greedy generation of a
converted model (tested). Temperature 0 is greedy; otherwise softmax sampling at that
temperature within the top-p nucleus.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from maxtrain.config import ConfigError, ModelConfig
from maxtrain.layers.moe import route
from maxtrain.layers.norms import rms_norm
from maxtrain.layers.rope import apply_rope, inv_frequencies
from maxtrain.models.llama import sublayer


def check_supported(m: ModelConfig) -> None:
    """One line for a model this decoder does not run."""
    if m.name != "llama":
        raise ConfigError(f"generate: model.name={m.name!r} has no KV-cache decoder; only llama-family models "
                          f"(Llama, Mistral, Qwen3, and their MoE variants: Mixtral, Qwen3-MoE) generate")


def init_cache(m: ModelConfig, batch: int, max_len: int, dtype) -> dict:
    """Keys and values of every layer: `[N, B, S, G, K]` each, zeros."""
    shape = (m.n_layers, batch, max_len, m.n_kv_heads, m.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _attend(q_BTHK, k_BSGK, v_BSGK, pos_T, sliding_window: int | None):
    """Attention of T queries at absolute positions `pos_T` over the whole cache; a key at position
    j counts when j <= the query's position (and within the window): unwritten slots never do."""
    B, T, H, K = q_BTHK.shape
    G = k_BSGK.shape[2]
    q = q_BTHK.reshape(B, T, G, H // G, K)
    scores = jnp.einsum("btgrk,bsgk->bgrts", q, k_BSGK, preferred_element_type=jnp.float32) / math.sqrt(K)
    j = jnp.arange(k_BSGK.shape[1])
    mask = j[None, :] <= pos_T[:, None]
    if sliding_window is not None:
        mask = mask & (pos_T[:, None] - j[None, :] < sliding_window)
    scores = jnp.where(mask[None, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSGK.dtype)
    return jnp.einsum("bgrts,bsgk->btgrk", probs, v_BSGK).reshape(B, T, H, K)


def _moe_mlp(h_BTD, e: dict, moe):
    """The mixture of experts for a few tokens, exactly as training routes them (`layers.moe.route`),
    every expert run on every token and the outputs weighted by the routing (zero for experts not
    chosen): E/k times the work of a dispatch, no sort, no token dropped."""
    B, T, D = h_BTD.shape
    x = h_BTD.reshape(B * T, D)
    w_TK, e_TK, _ = route(x, e["router"], moe)
    weights_TE = jnp.zeros((B * T, moe.num_experts), jnp.float32).at[jnp.arange(B * T)[:, None], e_TK].add(w_TK)
    gate = jnp.einsum("td,edf->tef", x, e["w_gate"])
    up = jnp.einsum("td,edf->tef", x, e["w_up"])
    y = jnp.einsum("tef,efd,te->td", jax.nn.silu(gate) * up, e["w_down"], weights_TE.astype(x.dtype))
    if moe.shared_experts:
        y = y + _swiglu(x, e["shared_gate"], e["shared_up"], e["shared_down"])
    return y.reshape(B, T, D)


def _swiglu(h, w_gate, w_up, w_down):
    return (jax.nn.silu(h @ w_gate) * (h @ w_up)) @ w_down


def _layer(x_BTD, p: dict, k_BSGK, v_BSGK, start, m: ModelConfig, inv_freq, moe_params=None):
    """One decoder layer over T new positions from `start`; returns x and the updated cache. With
    `moe_params` its MLP is the mixture of experts."""
    B, T, _ = x_BTD.shape
    pos_T = start + jnp.arange(T)
    pos_BT = jnp.broadcast_to(pos_T[None], (B, T))
    h = rms_norm(x_BTD, p["attn_norm"], m.norm_eps)
    q, k = jnp.einsum("btd,dhk->bthk", h, p["wq"]), jnp.einsum("btd,dgk->btgk", h, p["wk"])
    if "q_norm" in p:  # model.qk_norm
        q, k = rms_norm(q, p["q_norm"], m.norm_eps), rms_norm(k, p["k_norm"], m.norm_eps)
    q, k = apply_rope(q, pos_BT, inv_freq), apply_rope(k, pos_BT, inv_freq)
    v = jnp.einsum("btd,dgk->btgk", h, p["wv"])
    k_BSGK = lax.dynamic_update_slice(k_BSGK, k.astype(k_BSGK.dtype), (0, start, 0, 0))
    v_BSGK = lax.dynamic_update_slice(v_BSGK, v.astype(v_BSGK.dtype), (0, start, 0, 0))
    o = _attend(q, k_BSGK, v_BSGK, pos_T, m.sliding_window)
    x_BTD = x_BTD + jnp.einsum("bthk,hkd->btd", o, p["wo"])
    h = rms_norm(x_BTD, p["mlp_norm"], m.norm_eps)
    if moe_params is not None:
        return x_BTD + _moe_mlp(h, moe_params, m.moe).astype(x_BTD.dtype), k_BSGK, v_BSGK
    x_BTD = x_BTD + _swiglu(h, p["w_gate"], p["w_up"], p["w_down"])
    return x_BTD, k_BSGK, v_BSGK


def forward_cached(params: dict, tokens_BT, cache: dict, start, m: ModelConfig):
    """Logits `[B, T, V]` (float32) of T tokens at positions `start..`, and the cache with them in."""
    inv_freq = inv_frequencies(m.head_dim, m.rope_theta, m.rope_scaling)
    x = jnp.take(params["embed"]["embedding"], tokens_BT, axis=0)

    def body(x, layer):
        p, k, v = layer
        x, k, v = _layer(x, p, k, v, start, m, inv_freq)
        return x, (k, v)

    def block(x, layer):  # MoE models: `moe.every` layers, the last one's MLP the experts
        p, k, v = layer
        S = m.moe.every
        ks, vs = [], []
        for j in range(S):
            x, kj, vj = _layer(x, sublayer(p, j, S), k[j], v[j], start, m, inv_freq, p["moe"] if j == S - 1 else None)
            ks.append(kj)
            vs.append(vj)
        return x, (jnp.stack(ks), jnp.stack(vs))

    if m.moe is None:
        x, (ks, vs) = lax.scan(body, x, (params["layers"], cache["k"], cache["v"]))
    else:
        blocks = lambda c: c.reshape(m.n_layers // m.moe.every, m.moe.every, *c.shape[1:])  # noqa: E731
        x, (ks, vs) = lax.scan(block, x, (params["layers"], blocks(cache["k"]), blocks(cache["v"])))
        ks, vs = ks.reshape(cache["k"].shape), vs.reshape(cache["v"].shape)
    h = rms_norm(x, params["final_norm"]["scale"], m.norm_eps)
    w_DV = params["embed"]["embedding"].T if m.tie_embeddings else params["lm_head"]["kernel"]
    logits = jnp.einsum("btd,dv->btv", h, w_DV, preferred_element_type=jnp.float32)
    return logits, {"k": ks, "v": vs}


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
    dtype = params["embed"]["embedding"].dtype
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
