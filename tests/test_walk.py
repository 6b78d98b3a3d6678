"""A continued-pretraining user's first day, end to end, from a work directory outside the checkout
(issue 40's walk): convert a small Hugging Face Llama, prepare a JSONL corpus in English,
Devanagari and Tamil with a tokenizer trained on it, continue pretraining on 8 devices with FSDP,
be preempted and resume, report, generate and evaluate from another directory on one device,
and export back to Hugging Face. Each command runs through `cli.main`, as the user types it.

The references are independent of the code under test: the model's settings are the ones written
into the Hugging Face config here, the tokenizer is read back with the `tokenizers` package, and
the export is loaded by `transformers` itself."""

import json
import re

import jax
import numpy as np
import pytest

from maxtrain import cli

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

DOCS = [
    "The river keeps its own time; the town only borrows it.",
    "नदी अपना समय खुद रखती है; शहर तो बस उसे उधार लेता है।",
    "ஆறு தன் நேரத்தைத் தானே வைத்திருக்கிறது; நகரம் அதைக் கடன் வாங்குகிறது.",
    "Every morning the ferry crosses twice, and the market opens between the crossings.",
    "हर सुबह नाव दो बार पार जाती है, और बाज़ार दोनों के बीच खुलता है।",
    "ஒவ்வொரு காலையும் படகு இரண்டு முறை கடக்கிறது, சந்தை இடையில் திறக்கிறது.",
]
NORM_EPS, ROPE_THETA, MAX_POS = 1e-6, 10000.0, 512  # the HF model's; maxtrain's defaults differ


def _hf_llama(path):
    """A small Llama as transformers initialises it (every parameter its own random values)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_POS, rms_norm_eps=NORM_EPS, rope_theta=ROPE_THETA,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False))
    model.save_pretrained(path)


def _errors(err):
    return [line for line in err.splitlines() if line.startswith("maxtrain: error:")]


@pytest.mark.slow
def test_continued_pretraining_walk_from_outside_the_checkout(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository here or above

    # convert
    _hf_llama(work / "hf")
    assert cli.main(["convert", "hf-to-maxtrain", "hf", "ck/base"]) == 0
    capsys.readouterr()

    # prepare, with a tokenizer trained on the corpus (asked for more than the corpus can give)
    (work / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 20))
    assert cli.main(["prepare", "--input", "corpus.jsonl", "--output", "data/corpus", "--train-tokenizer", "1000",
                     "--workers", "1"]) == 0
    out, err = capsys.readouterr()
    assert "--train-tokenizer asked for 1000" in out + err
    manifest = json.loads((work / "data" / "corpus" / "manifest.json").read_text())
    assert str(tmp_path) not in json.dumps(manifest)  # nothing that pins the directory to this machine
    from tokenizers import Tokenizer
    reference = Tokenizer.from_file(str(work / "data" / "corpus" / "tokenizer.json"))
    vocab = reference.get_vocab_size()
    assert vocab <= 512

    # continue pretraining with a config that has no model section: the converted model is the base
    (work / "cpt.yaml").write_text(
        "run_dir: runs/cpt\n"
        "data: {kind: tokens, path: data/corpus}\n"
        "checkpoint: {init_from: ck/base, dir: ck/run, every: 2}\n"
        "mesh: {fsdp: 8}\n"
        "train: {steps: 6, batch_size: 8, seq_len: 64, dtype: float32, log_every: 1}\n"
        "optim: {lr: 1.0e-3, warmup_steps: 2}\n"
        "drills: {preempt_step: 3}\n")  # SIGTERM before step 4: the job saves step 4 and exits 75
    assert cli.main(["train", "cpt.yaml", "--dry-run"]) == 0
    assert "6.74" not in capsys.readouterr().out  # not the default 6.7B model
    assert cli.main(["train", "cpt.yaml"]) == 75
    capsys.readouterr()
    assert cli.main(["train", "cpt.yaml"]) == 0  # the same command resumes
    _, err = capsys.readouterr()
    assert "resumed from" in err and not _errors(err)
    import yaml
    trained = yaml.safe_load((work / "runs" / "cpt" / "config.yaml").read_text())["model"]
    assert (trained["norm_eps"], trained["rope_theta"], trained["vocab_size"]) == (NORM_EPS, ROPE_THETA, 512)

    # report: every save (periodic 2, the preemption's 4, 6), a plain restart's recovery without unknowns
    assert cli.main(["report", "runs/cpt/metrics.jsonl"]) == 0
    page = (work / "runs" / "cpt" / "report.html").read_text()
    rows = re.findall(r"<tr><td>cpt</td><td>(\d+)</td><td>(checkpoint|recovery)</td><td>([^<]*)</td></tr>", page)
    assert [int(s) for s, kind, _ in rows if kind == "checkpoint"] == [2, 4, 6], rows
    assert any("SIGTERM" in d for s, kind, d in rows if s == "4" and kind == "checkpoint")
    assert all("?" not in d for _, kind, d in rows if kind == "recovery")
    capsys.readouterr()

    # generate and eval from another directory, on one device (the training mesh was fsdp=8)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    one = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda *a, **k: one)
    prompt = "नदी अपना"
    assert cli.main(["generate", str(work / "ck" / "run"), "--prompt", prompt, "--max-new-tokens", "4", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "does not fit the 1 device here" in err and not _errors(err)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["prompt_ids"] == reference.encode(prompt).ids  # the corpus's tokenizer, found without --tokenizer
    tasks = elsewhere / "tasks"
    tasks.mkdir()
    (elsewhere / "mc.jsonl").write_text("".join(json.dumps({"q": d[:12], "choices": [d[12:20], "xyz"], "a": 0}) + "\n"
                                                for d in DOCS))
    (tasks / "mc.yaml").write_text(
        "task: walk_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {elsewhere / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{a}}"\nmetric_list:\n  - metric: acc\n')
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["eval", str(work / "ck" / "run"), "--tasks", "walk_mc", "--include-path", str(tasks)]) == 0
    out, err = capsys.readouterr()
    assert "walk_mc" in out and "fatal:" not in err and not _errors(err)

    # export: loads in transformers with its tokenizer, the converted model's settings and context
    assert cli.main(["convert", "maxtrain-to-hf", str(work / "ck" / "run"), "exported"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(elsewhere / "exported")
    model = transformers.AutoModelForCausalLM.from_pretrained(elsewhere / "exported").eval()
    config = json.loads((elsewhere / "exported" / "config.json").read_text())
    assert (config["rms_norm_eps"], config["rope_theta"], config["max_position_embeddings"]) == (
        NORM_EPS, ROPE_THETA, MAX_POS)
    assert tok(prompt)["input_ids"] == reference.encode(prompt).ids
    assert config["eos_token_id"] == tok.eos_token_id == reference.token_to_id("<|endoftext|>")
    with torch.no_grad():  # the exported weights are the trained ones: transformers continues as maxtrain did
        ids = torch.tensor([got["prompt_ids"]])
        new = model.generate(ids, do_sample=False, max_new_tokens=4)[0, ids.shape[1]:].tolist()
    stop = new.index(tok.eos_token_id) + 1 if tok.eos_token_id in new else len(new)
    np.testing.assert_array_equal(new[:stop], got["samples"][0]["ids"][:stop])

    # an object-store path is one line, before anything is written
    monkeypatch.chdir(work)
    assert cli.main(["train", "cpt.yaml", "checkpoint.dir=s3://bucket/ck", "run_dir=runs/s3"]) == 2
    assert len(_errors(capsys.readouterr().err)) == 1 and not (work / "s3:").exists() and not (work / "runs" / "s3").exists()
