"""Growing a model to an extended tokenizer (`maxtrain convert hf-to-maxtrain HF OUT --tokenizer EXT`,
issue 48 item 3): a tiny random Llama (transformers) with a byte-level BPE trained here on this
repository's docs, its tokenizer extended on Hindi text (tests/fixtures/text), converted twice,
plainly and grown. The grown model's logits over the old ids equal the plain conversion's on
old-vocabulary input (float32), each new row is the mean of the base pieces it replaces, the export
loads in transformers with the extended tokenizer and gives maxtrain's logits on Hindi text, and
training starts from the grown checkpoint with `checkpoint.init_from`."""

import glob
import json
import os

import numpy as np
import pytest

from conftest import ROOT, randomized_hf_model
from maxtrain import cli, forward, load_checkpoint
from maxtrain.data import tokenizers

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

TEXT = os.path.join(ROOT, "tests", "fixtures", "text")
MODEL_VOCAB = 320  # more rows than the base tokenizer's 300 tokens, as many released models have
PROMPT = "भारत की राजधानी"  # Devanagari: ids above the base tokenizer's 300 after the extension


def _english():
    return [open(p, encoding="utf-8").read() for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def _hindi():
    with open(os.path.join(TEXT, "hindi.txt"), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _measured_lines():
    """Held-apart Hindi (the extension learned on the first 12 lines), and English the base knows."""
    english = [x.strip() for x in _english()[0].splitlines() if len(x.strip()) > 40][:6]
    return _hindi()[12:] + english


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def grown(request, tmp_path_factory):
    """(work dir, plain step dir, grown step dir, base tokenizer.json, extended dir)."""
    tied = request.param
    work = tmp_path_factory.mktemp("grow")
    hf = work / "hf"
    base = tokenizers.train_bpe(_english(), 300, str(hf / "tokenizer.json"))
    assert base.vocab_size == 300
    torch.manual_seed(1)
    model = randomized_hf_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=MODEL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=tied)).eval())
    model.save_pretrained(hf, safe_serialization=True)
    (work / "hi.txt").write_text("\n".join(_hindi()[:12]), encoding="utf-8")
    assert cli.main(["tokenizer", "extend", str(hf), "--corpus", str(work / "hi.txt"), "--add", "60",
                     "--out", str(work / "ext")]) == 0
    assert cli.main(["convert", "hf-to-maxtrain", str(hf), str(work / "plain"), "train.dtype=float32"]) == 0
    (work / "measure.txt").write_text("\n".join(_measured_lines()), encoding="utf-8")
    assert cli.main(["convert", "hf-to-maxtrain", str(hf), str(work / "ck"), "--tokenizer", str(work / "ext"),
                     "--measure", str(work / "measure.txt"), "train.dtype=float32"]) == 0
    return work, str(work / "plain" / "0"), str(work / "ck" / "0"), hf / "tokenizer.json", work / "ext"


def test_old_ids_keep_their_logits_on_old_vocabulary_input(grown):
    _, plain, big, _, ext = grown
    cfg0, p0 = load_checkpoint(plain)
    cfg1, p1 = load_checkpoint(big)
    n_ext = HFTokenizer.from_file(str(ext / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert cfg0.model.vocab_size == MODEL_VOCAB and cfg1.model.vocab_size == max(MODEL_VOCAB, n_ext) > MODEL_VOCAB
    tokens = np.random.default_rng(0).integers(0, 300, (2, 24))
    old = np.asarray(forward(cfg0, p0, tokens), np.float32)
    new = np.asarray(forward(cfg1, p1, tokens), np.float32)
    assert new.shape[-1] == cfg1.model.vocab_size
    # the 300 ids of the base tokenizer (rows 300-319 were the model's unused padding, now new tokens)
    np.testing.assert_allclose(new[..., :300], old[..., :300], rtol=1e-6, atol=1e-6 * np.abs(old).max())
    # every old embedding row (and output column) is the plain conversion's, bit for bit
    np.testing.assert_array_equal(np.asarray(p1["embed"]["embedding"])[:300], np.asarray(p0["embed"]["embedding"])[:300])
    if not cfg1.model.tie_embeddings:
        np.testing.assert_array_equal(np.asarray(p1["lm_head"]["kernel"])[:, :300],
                                      np.asarray(p0["lm_head"]["kernel"])[:, :300])


def test_each_new_row_is_the_mean_of_the_base_pieces_it_replaces(grown):
    _, plain, big, base_path, ext = grown
    _, p0 = load_checkpoint(plain)
    _, p1 = load_checkpoint(big)
    base, new = HFTokenizer.from_file(str(base_path)), HFTokenizer.from_file(str(ext / "tokenizer.json"))
    old_vocab = base.get_vocab(with_added_tokens=True)
    added = {t: i for t, i in new.get_vocab(with_added_tokens=True).items() if t not in old_vocab}
    assert len(added) > 20 and min(added.values()) == 300  # ids 300..319 were padding rows of the model
    e0, e1 = np.asarray(p0["embed"]["embedding"], np.float64), np.asarray(p1["embed"]["embedding"], np.float64)
    for token, i in added.items():
        spelled = [t.id for t in base.model.tokenize(token)]
        assert len(spelled) > 1 and max(spelled) < 300
        np.testing.assert_allclose(e1[i], e0[spelled].mean(axis=0), rtol=1e-6, atol=1e-7)


def test_the_export_loads_in_transformers_with_the_extended_tokenizer(grown):
    work, _, big, _, _ = grown
    out = work / f"export_{os.path.basename(str(work))}"
    assert cli.main(["convert", "maxtrain-to-hf", str(work / "ck"), str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    text = _hindi()[-1]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert max(ids) >= 300 and tok.decode(ids) == text  # the new tokens are used, and read back
    assert ids == HFTokenizer.from_file(str(work / "ext" / "tokenizer.json")).encode(text).ids
    cfg, params = load_checkpoint(big)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == cfg.model.vocab_size
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.float().numpy()
    ours = np.asarray(forward(cfg, params, np.asarray([ids])))
    np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=1e-4)


def test_a_two_phase_cli_run_on_a_scheduled_mixture_resumes_bitwise_and_exports(grown, tmp_path, capsys):
    """The issue's whole path from the CLI, on the grown checkpoint (`checkpoint.init_from`, no model
    section): English and Hindi prepared with the extended tokenizer, a mixture moving from mostly
    English to mostly Hindi, phase one training only the new rows of the embedding and head (the
    rest frozen, without moments) and phase two everything. Preempted in phase one and resumed with
    the same command, it equals an uninterrupted run bitwise across the phase change; the export
    loads in transformers with the extended tokenizer, whose greedy continuation of a Devanagari
    prompt equals `maxtrain generate`'s."""
    work, _, big, _, ext = grown
    if json.loads((work / "hf" / "config.json").read_text())["tie_word_embeddings"]:
        pytest.skip("the untied model walks the path (the tied one shares every step but the head)")
    tok = str(ext / "tokenizer.json")
    (tmp_path / "en.txt").write_text("\n\n".join(_english()[:3]), encoding="utf-8")
    for name, src in (("en", str(tmp_path / "en.txt")), ("hi", os.path.join(TEXT, "hindi.txt"))):
        assert cli.main(["prepare", "--input", src, "--output", str(tmp_path / name), "--tokenizer", tok,
                         "--workers", "1"]) == 0

    def config(name: str, extra: str = "") -> str:
        (tmp_path / f"{name}.yaml").write_text(  # no model section: checkpoint.init_from's (grown) model
            f"run_dir: {tmp_path / 'runs' / name}\n"
            f"data: {{kind: tokens, path: [{{path: {tmp_path / 'en'}, weights: {{0: 0.8, 4: 0.3}}}}, "
            f"{{path: {tmp_path / 'hi'}, weights: {{0: 0.2, 4: 0.7}}}}]}}\n"
            f"checkpoint: {{init_from: {big}, dir: {tmp_path / 'ck' / name}, every: 1}}\n"
            "mesh: {data: 2, fsdp: 4}\ntrain: {steps: 6, batch_size: 8, seq_len: 16, dtype: float32, log_every: 1}\n"
            "optim: {lr: 1.0e-2, warmup_steps: 1, groups: [{params: '^(embed|lm_head)/', rows_from: 300, "
            "rows_until: 3}, {params: '.', frozen_until: 3}]}\n"
            f"reliability: {{compilation_cache: null}}\n{extra}")
        return str(tmp_path / f"{name}.yaml")

    def losses(name: str) -> list[float]:
        with open(tmp_path / "runs" / name / "metrics.jsonl") as f:
            return [r["loss"] for r in map(json.loads, f) if "loss" in r]

    assert cli.main(["train", config("whole")]) == 0
    assert cli.main(["train", config("parts", "drills: {preempt_step: 1}\n")]) == 75  # saves step 2, in phase one
    assert cli.main(["train", config("parts", "drills: {preempt_step: 1}\n")]) == 0  # the same command resumes
    assert len(losses("whole")) == 6 and all(np.isfinite(losses("whole")))
    assert losses("parts") == losses("whole")
    out = tmp_path / "export"
    assert cli.main(["convert", "maxtrain-to-hf", str(tmp_path / "ck" / "whole"), str(out)]) == 0
    ids = _greedy_equals_transformers(tmp_path / "ck" / "whole", out, 8, capsys)
    assert ids == HFTokenizer.from_file(tok).encode(PROMPT).ids  # the extended tokenizer


def test_a_tokenizer_that_is_not_an_extension_is_refused(grown, tmp_path, capsys):
    work, *_ = grown
    other = tokenizers.train_bpe(_hindi(), 400, str(tmp_path / "other" / "tokenizer.json"))
    assert other.vocab_size > 0
    code = cli.main(["convert", "hf-to-maxtrain", str(work / "hf"), str(tmp_path / "ck"), "--tokenizer",
                     str(tmp_path / "other")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is not an extension of" in err[0], err
    assert not (tmp_path / "ck").exists()


def test_greedy_generation_on_new_script_text_equals_transformers(grown, capsys):
    """`maxtrain generate --prompt` in Devanagari on the grown checkpoint (its kept, extended tokenizer)
    continues with exactly the tokens transformers' greedy `generate` picks on the export."""
    work, _, _, _, _ = grown
    out = work / "export_generate"
    if not out.exists():
        assert cli.main(["convert", "maxtrain-to-hf", str(work / "ck"), str(out)]) == 0
    _greedy_equals_transformers(work / "ck", out, 12, capsys)



def _greedy_equals_transformers(checkpoint, export, new: int, capsys) -> list[int]:
    """`maxtrain generate --prompt PROMPT` on `checkpoint` (its kept tokenizer) continues with exactly
    the `new` tokens transformers' greedy `generate` picks on `export`; returns the prompt's ids."""
    tok = transformers.AutoTokenizer.from_pretrained(export)
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    hf.generation_config.eos_token_id = None  # all `new` tokens, as maxtrain generates
    hf.generation_config.pad_token_id = 0
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    assert max(ids) >= 300  # new tokens in the prompt
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new)[0, len(ids):].tolist()
    capsys.readouterr()
    assert cli.main(["generate", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", str(new), "--json",
                     "train.dtype=float32"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["prompt_ids"] == ids and got["samples"][0]["ids"] == want
    return ids


def test_a_padded_vocabulary_trains_padded_and_exports_without_the_padding(grown, tmp_path):
    """--pad-vocab-to 64: 360 tokens become 384 rows (zeros past 360); the export writes 360 and
    transformers' logits equal maxtrain's over them."""
    work, _, big, _, ext = grown
    assert cli.main(["convert", "hf-to-maxtrain", str(work / "hf"), str(tmp_path / "ck"), "--tokenizer", str(ext),
                     "--pad-vocab-to", "64", "train.dtype=float32"]) == 0
    cfg, params = load_checkpoint(str(tmp_path / "ck" / "0"))
    _, unpadded = load_checkpoint(big)
    tokens = HFTokenizer.from_file(str(ext / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert tokens == 360 and cfg.model.vocab_size == 384
    e = np.asarray(params["embed"]["embedding"])
    np.testing.assert_array_equal(e[:tokens], np.asarray(unpadded["embed"]["embedding"]))
    assert not e[tokens:].any()
    assert cli.main(["convert", "maxtrain-to-hf", str(tmp_path / "ck"), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == tokens
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = [[5, 301, 340, 17, 359, 2]]
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.float().numpy()
    ours = np.asarray(forward(cfg, params, np.asarray(ids)))[..., :tokens]
    np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=1e-4)


def test_plain_mean_and_empty_spellings_use_the_base_rows_only():
    """`mean` averages the base tokenizer's rows, not a model's unused padding rows; a token spelled by
    no base piece gets that mean rather than NaN; every old row is kept."""
    from maxtrain.config import load_config
    from maxtrain.convert import grow_vocab

    m = load_config(None, ["model.vocab_size=6", "model.tie_embeddings=true"]).model
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    table[4:] = 1000.0  # rows 4, 5: padding, past the base tokenizer's 4 tokens
    mean = table[:4].mean(axis=0)
    for init, pieces in (("mean", {4: [0, 1], 6: [2]}), ("pieces", {4: [], 6: [1, 3]})):
        params, grown_m = grow_vocab({"embed": {"embedding": table}}, m, pieces, init, base_size=4)
        e = params["embed"]["embedding"]
        assert grown_m.vocab_size == 7 and np.isfinite(e).all()
        np.testing.assert_array_equal(e[:4], table[:4])
        np.testing.assert_allclose(e[4], mean)
        np.testing.assert_allclose(e[6], mean if init == "mean" else table[[1, 3]].mean(axis=0))


def test_the_grown_model_is_measured_against_the_base_on_its_own_tokenization(grown):
    """`--measure FILE`: bits per byte of each script's lines under the base model on the base
    tokenization and the grown model on the extended one, kept in the meta: equal to transformers'
    log-probabilities (the HF source, and the grown model's export) with the tokenizers library's ids,
    each line scored after a newline token."""
    from maxtrain.checkpoint import Checkpointer

    work, _, big, base_path, ext = grown
    ck = Checkpointer(str(work / "ck"))
    try:
        measured = ck.read_meta(0)["grown_vocab"]["measured"]
    finally:
        ck.close()
    assert set(measured) == {"Devanagari", "Latin"}, measured
    out = work / f"measured_export_{os.path.basename(str(work))}"
    assert cli.main(["convert", "maxtrain-to-hf", str(work / "ck"), str(out)]) == 0
    for name, model_dir, tok_path in (("base", work / "hf", base_path), ("grown", out, ext / "tokenizer.json")):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        tok = HFTokenizer.from_file(str(tok_path))
        sep = tok.encode("\n").ids[-1]
        for script, lines in (("Devanagari", _hindi()[12:]), ("Latin", _measured_lines()[len(_hindi()[12:]):])):
            nats = 0.0
            for line in lines:
                ids = [sep] + tok.encode(line).ids
                with torch.no_grad():
                    logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits.double(), -1)[0]
                nats -= float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
            bpb = nats / np.log(2) / sum(len(x.encode()) for x in lines)
            assert measured[script]["bytes"] == sum(len(x.encode()) for x in lines)
            np.testing.assert_allclose(measured[script][f"{name}_bits_per_byte"], bpb, rtol=1e-4, err_msg=(name, script))
