"""`maxtrain generate`: the KV-cached decoder against the training forward, sampling, the command."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL, TINY
from maxtrain import cli, forward, load_config, train
from maxtrain.config import ConfigError
from maxtrain.generate import forward_cached, generate_tokens, init_cache, sample
from maxtrain.step import init_state, make_setup


@pytest.fixture(scope="module")
def small():
    cfg = load_config(TINY, SMALL + ["mesh.data=1", "model.sliding_window=6"])
    return cfg, init_state(make_setup(cfg, jax.devices()[:1]), 0).params


def test_prefill_and_step_by_step_decode_give_the_training_forward_logits(small):
    cfg, params = small
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 12)).astype(np.int32)
    want = np.asarray(forward(cfg, params, tokens))
    cache = init_cache(cfg.model, 2, 16, jnp.float32)
    got, _ = forward_cached(params, jnp.asarray(tokens), cache, 0, cfg.model)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, rtol=1e-5)
    cache = init_cache(cfg.model, 2, 16, jnp.float32)
    parts, cache = forward_cached(params, jnp.asarray(tokens[:, :5]), cache, 0, cfg.model)
    parts = [parts]
    for t in range(5, 12):  # one token at a time against the cache; the window (6) slides past the prompt
        logits, cache = forward_cached(params, jnp.asarray(tokens[:, t:t + 1]), cache, t, cfg.model)
        parts.append(logits)
    np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in parts], 1), want, atol=1e-6, rtol=1e-5)


def test_greedy_generation_is_the_argmax_of_the_forward(small):
    cfg, params = small
    prompt = np.array([[3, 9, 27, 81, 5]], np.int32)
    out = np.asarray(generate_tokens(params, prompt, jax.random.key(0), m=cfg.model, new_tokens=6))
    assert out.shape == (1, 11) and (out[:, :5] == prompt).all()
    for t in range(5, 11):  # each new token is the argmax of the full forward over what precedes it
        assert out[0, t] == int(np.argmax(np.asarray(forward(cfg, params, out[:, :t]))[0, -1]))


def test_sampling_keeps_to_the_nucleus_and_follows_the_seed():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    draws = np.asarray(sample(logits, jax.random.key(1), 1.0, 0.7))
    assert set(draws.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7: the rest is outside the nucleus
    assert abs((draws == 0).mean() - 0.5 / 0.8) < 0.03
    assert set(np.asarray(sample(logits, jax.random.key(2), 1.0, 0.01)).tolist()) == {0}  # at least the top one
    full = np.asarray(sample(logits, jax.random.key(3), 1.0, 1.0))
    assert abs((full == 3).mean() - 0.05) < 0.015
    np.testing.assert_array_equal(np.asarray(sample(logits, jax.random.key(3), 1.0, 1.0)), full)
    assert (np.asarray(sample(logits, None, 0.0, 1.0)) == 0).all()


# ---------------------------------------------------------------- sampling: draws against the documented distribution

# The oracle: `sample`'s docstring and docs/huggingface.md ("Sampling from a checkpoint"), "a draw at
# that temperature from the smallest set of tokens whose probability reaches top_p (always at least
# the likeliest)", written here as numpy in float64: softmax(logits / T), then the likeliest tokens
# taken one by one until their mass reaches top_p, renormalised. Nothing of maxtrain.generate's is
# used but the function under test.
_B = 50_000  # rows of one batched call: independent draws of the same logits (one key for the batch)
_V = 8
_RANDOM = np.random.default_rng(11).normal(0.0, 1.5, _V)  # distinct values: no ties
# Probabilities that are binary fractions at temperatures 1/2, 1, 2 (logits T * log p): every partial
# sum is exact in float32 too, so whether the mass "reaches" top_p is decidable (checked below).
_HALVES = np.array([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 128])
# each quarter of the batch sees its own permutation of the vocabulary: the nucleus must be
# computed, and mapped back to token ids, row by row (sorted input would hide a wrong unsort)
_PERMS = np.stack([np.random.default_rng(12 + g).permutation(_V) for g in range(4)])


def _documented_probs(logits_V, temperature, top_p):
    """The distribution the docs promise, from the rule in words (a loop, not a cumsum mask)."""
    x = np.asarray(logits_V, np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep, mass = [], 0.0
    for v in sorted(range(len(p)), key=lambda v: -p[v]):
        keep.append(v)
        mass += p[v]
        if mass >= top_p:  # reached: the set is complete (the likeliest is always in)
            break
    q = np.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


def _assert_draws_follow(draws_N, probs_V, what=""):
    """No draw outside the support, and every token's count within 6 binomial standard deviations of
    N p. A right sampler fails this with probability < 1e-8 per token at expected counts in the
    hundreds (the batched cases; normal tail), < 1e-6 at the tens of the end-to-end test's rarest
    tokens (Poisson tail): ~1e-5 over all the tokens of these tests. The wrong rules
    each case below targets (logits * T, the untempered nucleus, one token too many or too few) are
    0.07 to 0.5 away in total variation: over 12,500 draws some token sits 9 to 150 sd off, or
    tokens outside the nucleus are drawn (computed for these cases with numpy while writing them)."""
    N = len(draws_N)
    counts = np.bincount(np.asarray(draws_N), minlength=len(probs_V))
    outside = np.flatnonzero((probs_V == 0) & (counts > 0))
    assert outside.size == 0, f"{what}: drew {outside.tolist()} outside the nucleus {np.flatnonzero(probs_V).tolist()}"
    sd = np.sqrt(N * probs_V * (1 - probs_V))
    z = np.abs(counts - N * probs_V) / np.where(sd > 0, sd, 1.0)
    assert (z < 6).all(), f"{what}: counts {counts.tolist()}, expected {np.round(N * probs_V).tolist()}, z {z.round(1)}"


_sample_jit = jax.jit(sample, static_argnums=(2, 3))


@pytest.mark.parametrize("base, temperature, top_p", [
    # plain softmax at T = 2 and T = 1/2: logits * T instead of / T draws from softmax(2x) instead of
    # softmax(x/2) (or the reverse), 0.44 away in total variation
    (_RANDOM, 2.0, 1.0),
    (_RANDOM, 0.5, 1.0),
    # the mass hits top_p exactly: at T = 1/2 the tempered probabilities are 1/2, 1/4, ...: {1/2, 1/4}
    # reaches 0.75, so the nucleus is those two (2/3, 1/3); one more (`<=`) or one fewer (the token's own
    # mass counted) moves 1/7 to 1/3 of the mass. The untempered probabilities (sqrt p, normalised)
    # would need 4 tokens.
    (0.5 * np.log(_HALVES), 0.5, 0.75),
    # the same at T = 2: tempered 1/2, 1/4, 1/8 reach 0.875 -> 4/7, 2/7, 1/7 (untempered p^2: 2 tokens)
    (2.0 * np.log(_HALVES), 2.0, 0.875),
    # a temperature that is not a power of two, a top_p between partial sums: a nucleus of 2 tokens
    # tempered, of 3 untempered (asserted below)
    (_RANDOM, 0.7, 0.8),
    # a tiny top_p: the likeliest token only, even at a flattening T = 2
    (_RANDOM, 2.0, 1e-6),
], ids=["hot", "cold", "mass_hits_top_p_exactly_cold", "mass_hits_top_p_exactly_hot", "nucleus_of_tempered_probs",
        "tiny_top_p_keeps_the_argmax"])
def test_sample_draws_follow_the_documented_distribution(base, temperature, top_p):
    logits = np.asarray(base, np.float32)
    if 0 < top_p < 1 and temperature in (0.5, 2.0) and base is not _RANDOM:  # the exactness the case relies on
        exact = np.asarray(jax.nn.softmax(jnp.asarray(logits) / temperature))
        np.testing.assert_array_equal(exact, _HALVES.astype(np.float32))
    if temperature == 0.7:  # the case tells the tempered nucleus from the untempered one
        sizes = [(_documented_probs(logits, t, top_p) > 0).sum() for t in (temperature, 1.0)]
        assert sizes == [2, 3], sizes
    rows = logits[_PERMS][np.arange(_B) % 4]  # row i: group i % 4's permutation of the vocabulary
    draws = np.asarray(_sample_jit(jnp.asarray(rows), jax.random.key(3), temperature, top_p))
    assert draws.shape == (_B,) and draws.dtype == np.int32
    for g in range(4):
        _assert_draws_follow(draws[g::4], _documented_probs(logits[_PERMS[g]], temperature, top_p), f"group {g}")


def test_sample_nucleus_of_tied_tokens_has_the_smallest_size():
    """Tied probabilities: which of equally likely tokens fill the nucleus the docs leave open, but not
    how many (the smallest set reaching top_p) nor that they are drawn uniformly. (The temperatures,
    top_p and shapes of cases above: no new compilation.)"""
    flat = jnp.zeros((_B, _V), jnp.float32)  # 1/8 each at any temperature (exact)
    draws = np.asarray(_sample_jit(flat, jax.random.key(4), 0.5, 0.75))
    kept = np.flatnonzero(np.bincount(draws, minlength=_V))
    assert kept.size == 6, kept  # 6 x 1/8 reaches 3/4 exactly: not 7, not 5
    _assert_draws_follow(draws, np.isin(np.arange(_V), kept) / 6.0, "six tied")
    # a tied top pair (3/10 each at T = 2) and a tiny top_p: exactly one token, one of the pair
    top = jnp.asarray(np.tile(2.0 * np.log(np.array([1, 3, 1, 1, 3, 1, 1, 1], np.float32) / 10), (_B, 1)))
    draws = np.asarray(_sample_jit(top, jax.random.key(5), 2.0, 1e-6))
    assert len(set(draws.tolist())) == 1 and draws[0] in (1, 4)


def test_generated_tokens_follow_the_forward_softmax_at_every_step(small):
    """End to end through the KV-cached loop: 8,000 rows continue the same prompt; the first new
    token's counts match softmax(logits / T) in the top-p nucleus of the *training forward's* logits (a
    separate implementation of the model), and so do the second's among the rows that drew the same
    first token, with the logits of that longer prompt: a fresh draw each step (a key reused across
    steps makes the second token follow the first) and each row (the same key per row: one token)."""
    cfg, params = small
    # random init gives nearly flat logits (sd 0.14); a larger head makes a distribution with a shape
    # (here a nucleus of 12 tokens, the likeliest at 0.3)
    params = {**params, "lm_head": {"kernel": params["lm_head"]["kernel"] * 12.0}}
    temperature, top_p, B = 0.7, 0.9, 8_000
    out = np.asarray(generate_tokens(params, np.full((B, 1), 5, np.int32), jax.random.key(7), m=cfg.model,
                                     new_tokens=2, temperature=temperature, top_p=top_p))
    first, second = out[:, 1], out[:, 2]
    common = np.argsort(-np.bincount(first, minlength=cfg.model.vocab_size))[:2]  # the two commonest first tokens
    logits = np.asarray(forward(cfg, params, np.array([[5, common[0]], [5, common[1]]], np.int32)))
    cases = [(logits[0, 0], first, "first token")]  # position 0: the logits after the prompt alone
    cases += [(logits[i, 1], second[first == t], f"second token after {t}") for i, t in enumerate(common)]
    for lg, draws, what in cases:
        _check_margin(lg, temperature, top_p)
        _assert_draws_follow(draws, _documented_probs(lg, temperature, top_p), what)


def _check_margin(logits_V, temperature, top_p):
    """The case is not on a boundary: float32 (the sampler) and float64 (the oracle) agree on the nucleus."""
    x = np.asarray(logits_V, np.float64) / temperature
    p = np.sort(np.exp(x - x.max()) / np.exp(x - x.max()).sum())[::-1]
    assert np.abs(np.cumsum(p) - top_p).min() > 1e-4


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    cfg = load_config(TINY, ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=128",
                             "train.steps=2", "train.seq_len=64", "data.max_bytes=100000", f"run_dir={tmp / 'run'}",
                             f"checkpoint.dir={tmp / 'ck'}", "mesh.data=1", "mesh.fsdp=8"])
    train(cfg)
    return tmp / "ck"


def test_generate_command_continues_text_and_samples_by_seed(text_ckpt, capsys):
    assert cli.main(["generate", str(text_ckpt), "--prompt", "def main(", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def main(")  # the byte tokenizer of the text data, decoded after the prompt
    # --temperature and --top-p reach the sampler: a nucleus below the likeliest token's mass is the
    # argmax at any temperature, so a hot draw with a tiny --top-p is the greedy text, on every row
    assert cli.main(["generate", str(text_ckpt), "--prompt", "def main(", "--max-new-tokens", "8", "--temperature",
                     "5", "--top-p", "1e-6", "--num-samples", "2", "--json"]) == 0
    narrow = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["samples"]
    assert ["def main(" + s["text"] for s in narrow] == [out.rstrip("\n")] * 2
    argv = ["generate", str(text_ckpt), "--prompt", "import ", "--max-new-tokens", "8", "--temperature", "1.0",
            "--top-p", "0.9", "--num-samples", "3", "--json"]
    runs = []
    for seed in (0, 0, 1):
        assert cli.main(argv + ["--seed", str(seed)]) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len(runs[0]["samples"]) == 3 and runs[0]["prompt_ids"] == list(b"import ")
    assert all(len(s["ids"]) == 8 for s in runs[0]["samples"])


FIT = [  # (saved mesh, mesh.* set on the command line, devices here) -> the sizes chosen, and whether a note says so
    (dict(fsdp=-1), {}, 1, dict(fsdp=1), False),  # fits: kept
    (dict(data=2, fsdp=-1, tensor=2), {}, 8, dict(data=2, fsdp=2, tensor=2), False),
    (dict(data=-1, fsdp=8), {}, 1, dict(), True),  # the case: nothing divides, all on fsdp
    (dict(data=-1, fsdp=8), {}, 2, dict(fsdp=2), True),  # the rest on fsdp, not on data
    (dict(data=2, fsdp=2, tensor=2), {}, 4, dict(data=2, tensor=2), True),  # the axes that divide are kept
    (dict(fsdp=3, tensor=2), {}, 8, dict(fsdp=4, tensor=2), True),
    (dict(fsdp=16), {}, 8, dict(fsdp=8), True),
    (dict(fsdp=2, tensor=4), {}, 2, dict(fsdp=2), True),  # innermost first: tensor=4 does not divide 2
    (dict(fsdp=-1, sequence=4, tensor=4), {}, 8, dict(fsdp=2, tensor=4), True),  # tensor=4 leaves 2: sequence=4 goes
    (dict(data=-1, fsdp=8), dict(fsdp=1), 1, dict(), False),  # an explicit size wins ...
    (dict(data=1, fsdp=8, tensor=2), dict(fsdp=2), 8, dict(data=2, fsdp=2, tensor=2), True),  # ... the rest on data
    (dict(fsdp=-1, tensor=2), dict(data=-1), 8, dict(data=4, tensor=2), True),  # an explicit -1 takes the rest
    (dict(fsdp=4), dict(fsdp=8), 1, None, False),  # explicit sizes that do not fit: left for build_mesh to refuse
]


@pytest.mark.parametrize("saved, explicit, n, want, noted", FIT)
def test_fit_mesh_keeps_what_divides_and_puts_the_rest_on_fsdp(saved, explicit, n, want, noted):
    import dataclasses

    from maxtrain.config import MESH_AXES, MeshConfig, resolve_mesh_shape
    from maxtrain.mesh import fit_mesh

    given = dataclasses.replace(MeshConfig(**{"fsdp": 1, **saved}), **explicit)
    out, note = fit_mesh(given, n, set(explicit))
    if want is None:
        assert (out, note) == (given, "")
        return
    assert resolve_mesh_shape(out, n) == {a: want.get(a, 1) for a in MESH_AXES}
    assert bool(note) == noted and (not noted or f"does not fit the {n} device" in note)


def test_generate_fits_the_training_mesh_to_the_devices_here(text_ckpt, capsys, monkeypatch):
    """The checkpoint was trained with mesh.fsdp=8; with one device, generate says what mesh it chose
    and gives the same text, and an explicit mesh.* still wins."""
    argv = ["generate", str(text_ckpt), "--prompt", "def main(", "--max-new-tokens", "8"]
    assert cli.main(argv) == 0
    on_eight = capsys.readouterr().out
    one = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda *a, **k: one)
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == on_eight
    assert "mesh fsdp=8 does not fit the 1 device here; using every axis 1" in err
    assert cli.main(argv + ["mesh.fsdp=2"]) == 2
    assert "mesh sizes fsdp=2" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    ([], "needs --prompt TEXT or --prompt-ids"),
    (["--prompt-ids", "1,x"], "is not a comma-separated list of integers"),
    (["--prompt-ids", "1,100000"], "each in [0, 384)"),
    (["--prompt", "a", "--temperature", "-1"], "--temperature >= 0"),
    (["--prompt", "a", "--temperature", "1", "--top-p", "0"], "--top-p in (0, 1]"),
    (["--prompt", "a", "--temperature", "1", "--top-p", "1.5"], "--top-p in (0, 1]"),
    (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "a", "--num-samples", "0"], "--num-samples must be >= 1"),
    (["--prompt", "a", "model.name=nope"], "model.name='nope' is not a registered model"),
])
def test_generate_errors_are_one_line(text_ckpt, capsys, argv, needle):
    assert cli.main(["generate", str(text_ckpt), *argv]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("maxtrain: error:")]
    assert len(err) == 1 and needle in err[0], err


def test_generate_needs_a_checkpoint(tmp_path, capsys):
    assert cli.main(["generate", str(tmp_path / "none"), "--prompt", "a"]) == 2
    assert "does not exist" in capsys.readouterr().err
    import dataclasses

    from maxtrain.generate import check_supported

    check_supported(load_config(TINY, ["model.moe={num_experts: 4}"]).model)  # MoE models decode
    from maxtrain import models
    from maxtrain.models.llama import model as llama

    models.register("no_decoder", param_specs=llama.param_specs, embed=llama.embed, layer=llama.layer,
                    final=llama.final, head=llama.head)  # a family registered without `decoder=`
    with pytest.raises(ConfigError, match=r"model.name='no_decoder' has no KV-cache decoder .* the families that "
                                          r"generate: deepseek, llama"):
        check_supported(dataclasses.replace(load_config(TINY).model, name="no_decoder"))
    from maxtrain import convert

    with pytest.raises(ConfigError, match=r"model.name='no_decoder' has no Hugging Face conversion; the families "
                                          r"that convert: deepseek, llama"):
        convert.conversion(dataclasses.replace(load_config(TINY).model, name="no_decoder"))


# ---------------------------------------------------------------- maxtrain eval (lm-evaluation-harness)


def test_harness_scores_are_the_forward_log_probabilities(small):
    from maxtrain.harness import make_scorer, rolling_pairs, score_pairs
    cfg, params = small
    rng = np.random.default_rng(1)
    pairs = [(rng.integers(0, 128, n).tolist(), rng.integers(0, 128, k).tolist()) for n, k in ((5, 3), (0, 4), (40, 2))]
    got = score_pairs(make_scorer(cfg), params, pairs, max_len=32, batch_size=2, bos=7)
    for (ctx, cont), (lp, greedy) in zip(pairs, got):
        tokens = ((ctx or [7]) + cont)[-33:]  # the last seq_len + 1 tokens; an empty context gets the bos
        logp = jax.nn.log_softmax(np.asarray(forward(cfg, params, np.asarray([tokens[:-1]])))[0], -1)
        rows = range(len(tokens) - 1 - len(cont), len(tokens) - 1)
        assert lp == pytest.approx(sum(float(logp[i, tokens[i + 1]]) for i in rows), rel=1e-5)
        assert greedy == all(int(np.argmax(logp[i])) == tokens[i + 1] for i in rows)
    windows = rolling_pairs(list(range(10, 80)), 32, bos=7)
    assert [len(c) for _, c in windows] == [32, 32, 6] and windows[0][0] == [7] and windows[1][0] == [41]


def _local_tasks(tmp_path, docs):
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text(f"""task: maxtrain_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (tasks / "gen.yaml").write_text(f"""task: maxtrain_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return tasks


def test_eval_command_runs_local_harness_tasks(text_ckpt, tmp_path, capfd, monkeypatch):
    """A multiple-choice and a generation task from local files (no download): the harness's accuracy is
    what maxtrain's own log-likelihoods give by hand. On 2 devices: the checkpoint's mesh.fsdp=8 is
    fitted to them (fsdp=2), as for generate. Run outside any git repository, as a user's work
    directory often is: nothing the harness's subprocesses print reaches the terminal."""
    from maxtrain.checkpoint import load_checkpoint
    from maxtrain.harness import make_scorer, score_pairs
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = [{"question": f"def f{i}(", "choices": ["x):", "self", " 1 + 2"], "answer": i % 3} for i in range(6)]
    tasks = _local_tasks(tmp_path, docs)
    out = tmp_path / "results.json"
    two = jax.devices()[:2]
    monkeypatch.setattr(jax, "devices", lambda *a, **k: two)
    monkeypatch.chdir(tmp_path)  # /tmp: no repository here or above
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert cli.main(["eval", str(text_ckpt), "--tasks", "maxtrain_tiny_mc,maxtrain_tiny_gen", "--include-path",
                     str(tasks), "--batch-size", "4", "--output", str(out)]) == 0
    table, err = capfd.readouterr()
    assert "fatal:" not in err and "not a git repository" not in err, err
    assert "mesh fsdp=8 does not fit the 2 devices here; using mesh.fsdp=2" in err
    assert "maxtrain_tiny_mc" in table and "maxtrain_tiny_gen" in table
    results = json.loads(out.read_text())["results"]
    cfg, params = load_checkpoint(str(text_ckpt))
    score = make_scorer(cfg)
    correct = 0
    for d in docs:  # the harness joins context and choice with a space (target_delimiter)
        lls = [lp for lp, _ in score_pairs(score, params, [(list(d["question"].encode()), list((" " + c).encode()))
                                                           for c in d["choices"]], cfg.train.seq_len, 4, 256)]
        correct += int(np.argmax(lls)) == d["answer"]
    assert results["maxtrain_tiny_mc"]["acc,none"] == pytest.approx(correct / len(docs))
    assert 0.0 <= results["maxtrain_tiny_gen"]["exact_match,none"] <= 1.0


def test_harness_sampling_draws_each_request_afresh_and_honours_top_p(small):
    """lm-eval's generate_until with do_sample: repeated requests (its `repeats`) are independent
    draws, a tiny top_p leaves only the likeliest token (the forward's greedy continuation), and
    without do_sample it is greedy whatever the temperature."""
    from types import SimpleNamespace

    from maxtrain.data.tokenizers import load_tokenizer
    from maxtrain.harness import make_lm

    cfg, params = small
    params = {**params, "lm_head": {"kernel": params["lm_head"]["kernel"] * 12}}  # a peaked next-token law
    lm = make_lm(cfg, params, load_tokenizer("byte"))

    def ask(n, **kw):
        return lm.generate_until([SimpleNamespace(args=("abc", {"max_gen_toks": 6, "until": [], **kw}))] * n)

    sampled = ask(8, do_sample=True, temperature=3.0)
    assert len(set(sampled)) > 1, sampled  # one key for every request gave 8 equal texts
    ids = np.asarray(generate_tokens(params, np.asarray([list(b"abc")], np.int32), jax.random.key(0), m=cfg.model,
                                 new_tokens=6))
    greedy = bytes(int(t) for t in ids[0, 3:]).decode("utf-8", "replace")  # vocab 128: every id is a byte
    assert ask(2, do_sample=True, temperature=3.0, top_p=1e-6) == [greedy, greedy]
    assert ask(2, do_sample=False, temperature=3.0) == [greedy, greedy]


def test_eval_errors_are_one_line(text_ckpt, capsys):
    assert cli.main(["eval", str(text_ckpt), "--tasks", "no_such_task_xyz"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("maxtrain: error:")]
    assert len(err) == 1 and "unknown harness task(s) no_such_task_xyz" in err[0]


@pytest.mark.parametrize("mesh", [["mesh.data=1"], ["mesh.data=1", "mesh.fsdp=4", "mesh.pipeline=2"]])
def test_sample_every_writes_greedy_text_into_the_record(tmp_path, mesh):
    """`train.sample_every`: the record of every such step holds greedy text from `train.sample_prompt`,
    what `maxtrain generate` gives from that step's parameters (pipeline-staged layers included)."""
    from maxtrain.generate import Sampler
    cfg = load_config(TINY, ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=128",
                             "train.steps=4", "train.log_every=4", "train.seq_len=64", "data.max_bytes=100000",
                             "train.sample_every=2", "train.sample_prompt=def ", "train.sample_tokens=6",
                             "train.dtype=float32", f"run_dir={tmp_path / 'run'}", *mesh])
    result = train(cfg)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    samples = {r["step"]: r["sample"] for r in records if "sample" in r}
    assert sorted(samples) == [2, 4] and all(isinstance(v, str) for v in samples.values())
    assert samples[4] == Sampler(cfg).run(result.state.params)  # the final parameters' greedy text
    assert [r["step"] for r in result.history if "loss" in r] == [1, 2, 4]


def test_sample_every_samples_a_moe_model(tmp_path, capsys):
    """MoE models decode too (each token routed as in training): samples land in the records."""
    code = cli.main(["train", TINY, "train.sample_every=2", "model.moe={num_experts: 4}", "train.steps=2",
                     f"run_dir={tmp_path / 'r'}", "mesh.data=1", "model.d_model=64", "model.n_heads=4"])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "sample" in r] == [2]


def test_generate_from_another_directory_uses_the_tokenizer_kept_with_the_checkpoint(tmp_path, monkeypatch, capsys):
    """Trained with a relative data.path; generate runs from elsewhere (the checkpoint keeps a copy of
    the data's tokenizer), and without that copy the error names --tokenizer."""
    import shutil

    from maxtrain.data.prepare import prepare
    from maxtrain.data.tokenizers import load_tokenizer

    work = tmp_path / "work"
    (work / "raw").mkdir(parents=True)
    (work / "raw" / "c.jsonl").write_text("".join(json.dumps({"text": f"ab {i} abba cab " * 8}) + "\n"
                                                  for i in range(30)))
    monkeypatch.chdir(work)
    prepare("raw/c.jsonl", "data/corpus", train_tokenizer=300, shards=1, workers=1)
    train(load_config(TINY, ["model.d_model=64", "model.n_layers=1", "model.n_heads=4", "model.d_ff=128",
                             "train.steps=2", "train.seq_len=32", "data.kind=tokens", "data.path=data/corpus",
                             "checkpoint.dir=ck", "run_dir=run", "mesh.data=1"]))
    monkeypatch.chdir(tmp_path)
    argv = ["generate", "work/ck", "--prompt", "ab", "--max-new-tokens", "3", "--json"]
    assert cli.main(argv) == 0
    ids = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompt_ids"]
    assert ids == load_tokenizer(str(work / "data" / "corpus" / "tokenizer.json")).encode("ab") and ids != [97, 98]
    shutil.move(work / "ck" / "tokenizer.json", tmp_path / "elsewhere.json")
    assert cli.main(argv) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("maxtrain: error:")]
    assert len(err) == 1 and "--tokenizer" in err[0] and "tokenizer.json" in err[0], err
    assert cli.main(argv[:-1] + ["--tokenizer", "missing.json", "--json"]) == 2
    assert "--tokenizer missing.json not found" in capsys.readouterr().err
    assert cli.main(argv + ["--tokenizer", str(tmp_path / "elsewhere.json")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompt_ids"] == ids
