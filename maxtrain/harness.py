"""`maxtrain eval`: a checkpoint scored by EleutherAI's lm-evaluation-harness (`pip install
'maxtrain[eval]'`).

The harness asks a model three things, answered here on maxtrain's own forward pass:

- `loglikelihood(context, continuation)`: the summed log-probability of the continuation's
  tokens after the context, and whether each was the argmax (multiple-choice tasks);
- `loglikelihood_rolling(text)`: the log-probability of a whole text, scored in windows of the
  training length (perplexity tasks);
- `generate_until(context, until=[...], max_gen_toks=N)`: greedy (or sampled) text from
  `maxtrain.generate`'s KV-cached decoder, cut at the first stop string.

Scoring batches requests (right-padded to a multiple of `PAD_TO`, so few shapes compile) and
keeps the last `train.seq_len + 1` tokens of a long request, as the harness's own models do.
An empty context is preceded by the end-of-text token.
"""

from __future__ import annotations

import contextlib
import math
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain import models
from maxtrain.config import Config, require_module

PAD_TO = 64  # scoring batches are padded to a multiple of this length: one compile per bucket


def make_scorer(cfg: Config):
    """A jitted `(params, inputs, targets, mask) -> (summed logprob [B], all greedy [B])`."""
    model = models.get(cfg.model.name)

    @jax.jit
    def score(params, inputs_BL, targets_BL, mask_BL):
        logits = model.apply(params, {"inputs": inputs_BL}, cfg)[0].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, targets_BL[..., None], axis=-1)[..., 0]
        greedy = (jnp.argmax(logits, axis=-1) == targets_BL) | (mask_BL == 0)
        return jnp.sum(picked * mask_BL, axis=-1), jnp.all(greedy, axis=-1)

    return score


def score_pairs(score, params, pairs: list[tuple[list[int], list[int]]], max_len: int, batch_size: int,
                bos: int) -> list[tuple[float, bool]]:
    """(summed logprob of the continuation, all its tokens greedy) for each (context, continuation) ids."""
    rows = []
    for ctx, cont in pairs:
        ctx = list(ctx) or [bos]
        tokens = (ctx + list(cont))[-(max_len + 1):]
        n_cont = min(len(cont), len(tokens) - 1)
        rows.append((tokens[:-1], tokens[1:], n_cont))
    out: list[tuple[float, bool]] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        length = min(max_len, PAD_TO * math.ceil(max(len(r[0]) for r in chunk) / PAD_TO))
        inputs = np.zeros((batch_size, length), np.int32)
        targets = np.zeros((batch_size, length), np.int32)
        mask = np.zeros((batch_size, length), np.float32)
        for i, (x, y, n_cont) in enumerate(chunk):
            inputs[i, :len(x)], targets[i, :len(y)] = x, y
            mask[i, len(y) - n_cont:len(y)] = 1.0
        lp, greedy = jax.device_get(score(params, inputs, targets, mask))
        out += [(float(lp[i]), bool(greedy[i])) for i in range(len(chunk))]
    return out


def rolling_pairs(ids: list[int], max_len: int, bos: int) -> list[tuple[list[int], list[int]]]:
    """A whole text as disjoint windows of `max_len` scored tokens, each after the token before it
    (the end-of-text token before the first)."""
    full = [bos] + list(ids)
    return [([full[s]], full[s + 1:s + 1 + max_len]) for s in range(0, len(ids), max_len)]


def cut_at(text: str, until: list[str]) -> str:
    """`text` up to the first of the stop strings."""
    ends = [text.find(u) for u in until if u and u in text]
    return text[:min(ends)] if ends else text


def request_key(index: int):
    """The sampling key of the `index`-th generation request: its own draws, so repeated requests
    (lm-eval's `repeats`, the same context twice) are independent samples, and reruns repeat them."""
    return jax.random.fold_in(jax.random.key(0), index)


def make_lm(cfg: Config, params, tokenizer, batch_size: int = 8):
    """An `lm_eval.api.model.LM` over maxtrain's forward and KV-cached decoder."""
    lm_eval_model = require_module("lm_eval.api.model", "lm_eval", "maxtrain eval", "eval")
    from maxtrain.generate import compute_params, make_generator, text_until_eos

    score = make_scorer(cfg)
    max_len = cfg.train.seq_len
    bos = tokenizer.eos_id

    class MaxtrainLM(lm_eval_model.LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            pairs = [(tokenizer.encode(r.args[0]), tokenizer.encode(r.args[1])) for r in requests]
            return score_pairs(score, params, pairs, max_len, batch_size, bos)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            out = []
            for r in requests:
                pairs = rolling_pairs(tokenizer.encode(r.args[0]), max_len, bos)
                out.append(sum(lp for lp, _ in score_pairs(score, params, pairs, max_len, batch_size, bos)))
            return out

        def generate_until(self, requests, disable_tqdm: bool = False):
            if tokenizer.decode is None:
                raise ValueError(f"tokenizer {tokenizer.spec} cannot decode")
            compute = compute_params(params, cfg.train.dtype)
            generators = {}  # one compiled decoder per (new tokens, temperature, top_p), not one per request
            out = []
            for i, r in enumerate(requests):
                context, kwargs = r.args
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                new = int(kwargs.get("max_gen_toks", 256))
                sampled = bool(kwargs.get("do_sample"))
                temperature = float(kwargs.get("temperature", 0.0)) if sampled else 0.0
                top_p = float(kwargs.get("top_p", 1.0)) if sampled else 1.0
                prompt = (tokenizer.encode(context) or [bos])[-max(1, max_len - new):]
                if (new, temperature, top_p) not in generators:
                    generators[new, temperature, top_p] = make_generator(cfg.model, new, temperature, top_p)
                ids = generators[new, temperature, top_p](compute, np.asarray([prompt], np.int32), request_key(i))
                row = np.asarray(jax.device_get(ids))[0, len(prompt):].tolist()
                out.append(cut_at(text_until_eos(tokenizer, row), until))
            return out

    return MaxtrainLM()


def evaluate(lm_eval, lm, tasks: list[str], **kwargs) -> dict:
    """`lm_eval.simple_evaluate` over `lm`, without the harness's stray stderr: it records the
    working directory's git commit by running `git describe` with stderr inherited, which prints
    "fatal: not a git repository" outside one. The same lookup runs here with stderr kept."""
    import lm_eval.evaluator as evaluator

    with _swapped(evaluator, "get_git_commit_hash", git_commit):
        return lm_eval.simple_evaluate(model=lm, tasks=tasks, **kwargs)


def git_commit(cwd: str | None = None) -> str | None:
    """`git describe --always` of `cwd` (default: the working directory), None outside a repository
    or without git; git's own complaints are not printed."""
    try:
        out = subprocess.run(["git", "describe", "--always"], cwd=cwd, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


@contextlib.contextmanager
def _swapped(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
