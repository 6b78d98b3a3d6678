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
from maxtrain.train import init_state, make_setup


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


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    cfg = load_config(TINY, ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=128",
                             "train.steps=2", "train.seq_len=64", "data.max_bytes=100000", f"run_dir={tmp / 'run'}",
                             f"checkpoint.dir={tmp / 'ck'}", "mesh.data=1"])
    train(cfg)
    return tmp / "ck"


def test_generate_command_continues_text_and_samples_by_seed(text_ckpt, capsys):
    assert cli.main(["generate", str(text_ckpt), "--prompt", "def main(", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def main(")  # the byte tokenizer of the text data, decoded after the prompt
    argv = ["generate", str(text_ckpt), "--prompt", "import ", "--max-new-tokens", "8", "--temperature", "1.0",
            "--top-p", "0.9", "--num-samples", "3", "--json"]
    runs = []
    for seed in (0, 0, 1):
        assert cli.main(argv + ["--seed", str(seed)]) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len(runs[0]["samples"]) == 3 and runs[0]["prompt_ids"] == list(b"import ")
    assert all(len(s["ids"]) == 8 for s in runs[0]["samples"])


@pytest.mark.parametrize("argv, needle", [
    ([], "needs --prompt TEXT or --prompt-ids"),
    (["--prompt-ids", "1,x"], "is not a comma-separated list of integers"),
    (["--prompt-ids", "1,100000"], "each in [0, 384)"),
    (["--prompt", "a", "--temperature", "-1"], "--temperature >= 0"),
    (["--prompt", "a", "model.name=nope"], "model.name='nope' has no KV-cache decoder"),
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
    with pytest.raises(ConfigError, match="has no KV-cache decoder"):
        check_supported(dataclasses.replace(load_config(TINY).model, name="gpt"))


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


def test_eval_command_runs_local_harness_tasks(text_ckpt, tmp_path, capsys, monkeypatch):
    """A multiple-choice and a generation task from local files (no download): the harness's accuracy is
    what maxtrain's own log-likelihoods give by hand."""
    from maxtrain.checkpoint import load_checkpoint
    from maxtrain.harness import make_scorer, score_pairs
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = [{"question": f"def f{i}(", "choices": ["x):", "self", " 1 + 2"], "answer": i % 3} for i in range(6)]
    tasks = _local_tasks(tmp_path, docs)
    out = tmp_path / "results.json"
    assert cli.main(["eval", str(text_ckpt), "--tasks", "maxtrain_tiny_mc,maxtrain_tiny_gen", "--include-path",
                     str(tasks), "--batch-size", "4", "--output", str(out)]) == 0
    table = capsys.readouterr().out
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
