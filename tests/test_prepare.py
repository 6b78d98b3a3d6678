"""`maxtrain prepare` and the tokens pipeline: round trips, packing, mixtures, eval, bad input."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import FAST_COMPILE, ROOT, SMALL, TINY
from maxtrain import cli, load_config, train
from maxtrain.data import Loader, make_source
from maxtrain.data.prepare import prepare, sha256_file, verify
from maxtrain.data.tokens import MIX_BLOCK, Mixture, ShardSet, TokensSource
from maxtrain.config import ConfigError

DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + (i * 7) % 13) + "é\n" for i in range(40)]


def _jsonl(tmp_path, docs=DOCS, name="corpus.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prep")
    prepare(str(_jsonl(tmp)), str(tmp / "out"), "byte", shards=3, val_fraction=0.2, workers=2)
    return tmp / "out"


def _decode(ids):
    return bytes(int(t) for t in ids).decode("utf-8")


def _stream_docs(shard_set):
    stream = shard_set.window(0, shard_set.n_tokens)
    ends = np.flatnonzero(stream == 256)
    return [_decode(stream[s + 1 if k else 0: e]) for k, (s, e) in enumerate(zip(np.r_[-1, ends[:-1]], ends))]


def test_round_trip_recovers_documents(prepared):
    train_docs = _stream_docs(ShardSet(str(prepared), "train"))
    val_docs = _stream_docs(ShardSet(str(prepared), "val"))
    assert sorted(train_docs + val_docs) == sorted(DOCS)
    assert 0 < len(val_docs) < len(DOCS) // 2
    assert verify(str(prepared)) == []


def test_parquet_and_plain_text_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"body": DOCS[:5]}), tmp_path / "in" / "a.parquet")
    prepare(str(tmp_path / "in" / "a.parquet"), str(tmp_path / "pq"), "byte", shards=1, text_field="body", workers=1)
    assert _stream_docs(ShardSet(str(tmp_path / "pq"))) == DOCS[:5]
    for i, d in enumerate(DOCS[:3]):
        (tmp_path / "in" / f"{i}.txt").write_text(d)
    prepare(str(tmp_path / "in" / "*.txt"), str(tmp_path / "txt"), "byte", shards=2, workers=1)
    assert sorted(_stream_docs(ShardSet(str(tmp_path / "txt")))) == sorted(DOCS[:3])


def test_trained_bpe_and_sentencepiece_tokenizers(tmp_path):
    src = _jsonl(tmp_path)
    m = prepare(str(src), str(tmp_path / "bpe"), train_tokenizer=300, shards=1, workers=1)
    assert os.path.isfile(tmp_path / "bpe" / "tokenizer.json") and m["vocab_size"] == 300
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tmp_path / "bpe" / "tokenizer.json"))
    stream = ShardSet(str(tmp_path / "bpe")).window(0, ShardSet(str(tmp_path / "bpe")).n_tokens)
    assert stream.max() < 300 and (stream == m["eos_id"]).sum() == len(DOCS)
    first = stream[: int(np.flatnonzero(stream == m["eos_id"])[0])]
    assert tok.decode(first.tolist()) == DOCS[0]
    assert sum(1 for _ in stream) < sum(len(d.encode()) for d in DOCS)  # BPE compresses

    import sentencepiece as spm
    (tmp_path / "sp.txt").write_text("".join(DOCS))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "sp.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=36, minloglevel=2)
    m = prepare(str(src), str(tmp_path / "spout"), str(tmp_path / "sp.model"), shards=1, workers=1)
    assert m["tokenizer"]["kind"] == "sentencepiece" and m["vocab_size"] == 36
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    s = ShardSet(str(tmp_path / "spout"))
    stream = s.window(0, s.n_tokens)
    assert sp.decode(stream[: int(np.flatnonzero(stream == sp.eos_id())[0])].tolist()) == DOCS[0].strip("\n")
    # no machine path in a manifest: the tokenizer is a copy in the directory, named relative to it, so
    # the directory moves (and the same tokenizer reads alike in two directories: mixtures compare them)
    from maxtrain.data.manifest import manifest_tokenizer, read_manifest
    from maxtrain.data.tokenizers import load_tokenizer
    for out, name in (("bpe", "tokenizer.json"), ("spout", "tokenizer.model")):
        text = (tmp_path / out / "manifest.json").read_text()
        assert json.loads(text)["tokenizer"]["spec"] == name and str(tmp_path) not in text
        os.rename(tmp_path / out, tmp_path / f"{out}-moved")
        moved = str(tmp_path / f"{out}-moved")
        tok = load_tokenizer(manifest_tokenizer(moved, read_manifest(moved)))
        s = ShardSet(moved)
        ids = s.window(0, s.n_tokens)
        assert tok.decode(ids[: int(np.flatnonzero(ids == tok.eos_id)[0])].tolist()).strip("\n") == DOCS[0].strip("\n")
    assert json.loads(text)["tokenizer"]["sha256"] == sha256_file(tmp_path / "sp.model")


def test_packing_respects_documents_and_loses_no_tokens(prepared):
    cfg = load_config(TINY, ["data.kind=tokens", f"data.path={prepared}", "train.seq_len=64", "train.batch_size=4"])
    src = TokensSource(cfg, str(prepared))
    stream = src.window(0, src.n_tokens)
    doc_of = np.searchsorted(src.doc_starts, np.arange(src.n_tokens), side="right") - 1
    seen = np.zeros(src.n_tokens, bool)
    for g in range(src.n_rows):  # one epoch: every row exactly once
        row = src.example(g)
        offset = int(src._order[g]) * 64
        np.testing.assert_array_equal(row["inputs"], stream[offset: offset + 64])
        np.testing.assert_array_equal(row["targets"], stream[offset + 1: offset + 65])
        docs = doc_of[offset: offset + 65]
        # same segment id <=> same document; loss only within a document
        np.testing.assert_array_equal(row["segment_ids"][:, None] == row["segment_ids"][None, :],
                                      docs[:-1, None] == docs[None, :-1])
        np.testing.assert_array_equal(row["loss_mask"] == 1, docs[:-1] == docs[1:])
        seen[offset: offset + 64] = True
    assert seen[: src.n_rows * 64].all() and src.n_tokens - src.n_rows * 64 <= 64  # only the tail < a row


def test_mixture_proportions_are_exact_per_block_and_seeded(prepared, tmp_path):
    prepare(str(_jsonl(tmp_path, [d.upper() for d in DOCS])), str(tmp_path / "b"), "byte", shards=1, workers=1)
    cfg = load_config(TINY, ["data.kind=tokens", f"data.path=[{{path: {prepared}, weight: 3}}, "
                                                 f"{{path: {tmp_path / 'b'}, weight: 1}}]",
                             "train.seq_len=32", "train.batch_size=8"])
    mix = make_source(cfg)
    assert isinstance(mix, Mixture)
    picks = [mix.source_of(g)[0] for g in range(4 * MIX_BLOCK)]
    assert picks.count(0) == 3 * MIX_BLOCK and picks.count(1) == MIX_BLOCK
    # within each source the examples are consecutive global indices: nothing repeated or skipped
    assert sorted(j for g in range(MIX_BLOCK) for s, j in [mix.source_of(g)] if s == 1) == list(range(MIX_BLOCK // 4))
    other = make_source(load_config(TINY, ["seed=1", "data.kind=tokens", f"data.path=[{prepared}, {tmp_path / 'b'}]",
                                           "train.seq_len=32"]))
    assert [other.source_of(g)[0] for g in range(MIX_BLOCK)].count(0) == MIX_BLOCK // 2
    np.testing.assert_array_equal(mix.batch(3)["inputs"], make_source(cfg).batch(3)["inputs"])


def test_a_mixture_compares_tokenizers_by_content_not_by_where_the_manifest_named_them(tmp_path):
    """A directory prepared by an earlier maxtrain (its manifest names the tokenizer by absolute path,
    with no sha256) mixes with one prepared today from the same SentencePiece model; a directory of
    another model is refused in one line."""
    import sentencepiece as spm

    from maxtrain.data.manifest import CHECKSUM, manifest_digest

    (tmp_path / "sp.txt").write_text("".join(DOCS))
    (tmp_path / "sp2.txt").write_text("".join(reversed(DOCS)).upper())
    for name, text in (("sp", "sp.txt"), ("sp2", "sp2.txt")):  # the same size, other pieces: only the file differs
        spm.SentencePieceTrainer.train(input=str(tmp_path / text), model_prefix=str(tmp_path / name),
                                       vocab_size=34, minloglevel=2)
    src = _jsonl(tmp_path)
    for out, model in (("new", "sp"), ("old", "sp"), ("other", "sp2")):
        prepare(str(src), str(tmp_path / out), str(tmp_path / f"{model}.model"), shards=1, workers=1)
    manifest = json.loads((tmp_path / "old" / "manifest.json").read_text())
    manifest["tokenizer"] = {**{k: v for k, v in manifest["tokenizer"].items() if k != "sha256"},
                             "spec": str(tmp_path / "sp.model")}  # as an earlier maxtrain wrote it
    manifest[CHECKSUM] = manifest_digest(manifest)
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(manifest))

    def mix(*dirs):
        return make_source(load_config(TINY, ["data.kind=tokens", f"data.path=[{', '.join(str(tmp_path / d) for d in dirs)}]",
                                              "train.seq_len=16", "train.batch_size=4", "model.vocab_size=64"]))

    assert isinstance(mix("new", "old"), Mixture)
    with pytest.raises(ConfigError, match="different tokenizers"):
        mix("new", "other")


def test_host_slices_cover_the_global_batch_and_loader_is_resumable(prepared):
    cfg = load_config(TINY, ["data.kind=tokens", f"data.path={prepared}", "train.seq_len=32", "train.batch_size=8",
                             "train.steps=50"])
    src = make_source(cfg)
    whole = Loader(src, cfg, 0, 6, 0, 8)
    batches = [whole.next()[0] for _ in range(6)]
    halves = [Loader(src, cfg, 0, 6, 0, 4), Loader(src, cfg, 0, 6, 4, 8)]
    for b in batches:
        parts = [h.next()[0]["inputs"] for h in halves]
        np.testing.assert_array_equal(np.concatenate(parts), b["inputs"])
    resumed = Loader(src, cfg, 4, 6, 0, 8)  # restart mid-epoch at step 4
    np.testing.assert_array_equal(resumed.next()[0]["inputs"], batches[4]["inputs"])


def test_tokens_training_resumes_exactly_and_evaluates(prepared, tmp_path):
    common = SMALL + ["data.kind=tokens", f"data.path={prepared}", "model.vocab_size=257", "train.eval_every=3",
                      "train.eval_steps=2", "optim.decay_steps=6", "data.workers=0"]
    straight = train(load_config(TINY, common + [f"run_dir={tmp_path / 'a'}", "train.steps=6"]))
    train(load_config(TINY, common + [f"run_dir={tmp_path / 'b'}", "train.steps=3", f"checkpoint.dir={tmp_path / 'ck'}"]))
    resumed = train(load_config(TINY, common + [f"run_dir={tmp_path / 'b'}", "train.steps=6",
                                                f"checkpoint.dir={tmp_path / 'ck'}"]))
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history if r["step"] > 3]
    evals = [r for r in straight.history if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[0]["eval_ppl"] == pytest.approx(np.exp(evals[0]["eval_loss"]), rel=1e-6)
    assert all("data_wait_s" in r for r in straight.history)


def test_two_processes_read_disjoint_slices_that_cover_the_batch(prepared, tmp_path):
    """Two real jax processes (gloo CPU collectives) on localhost, 2 devices each, data=4."""
    script = tmp_path / "host.py"
    script.write_text(f"""
import os, sys, numpy as np
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2{FAST_COMPILE}"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize("127.0.0.1:{_free_port()}", num_processes=2, process_id=int(sys.argv[1]))
from maxtrain import load_config
from maxtrain.data import Loader, make_source
from maxtrain.step import host_rows, make_setup, put_batch
cfg = load_config({TINY!r}, ["data.kind=tokens", "data.path={prepared}", "train.seq_len=32",
                             "train.batch_size=8", "train.steps=20", "mesh.data=-1"])
setup = make_setup(cfg)
lo, hi = host_rows(setup.batch_sharding, (8, 32))
loader = Loader(make_source(cfg), cfg, 5, 7, lo, hi)
local = {{f"s{{i}}": loader.next()[0]["inputs"] for i in (5, 6)}}
# the global array assembled from both processes' rows, reduced across them
glob = put_batch({{"inputs": local["s6"]}}, setup.batch_sharding, 8)["inputs"]
total = int(jax.jit(lambda a: (a.astype("int64") * (1 + jax.numpy.arange(8)[:, None])).sum())(glob))
np.savez(sys.argv[2], lo=lo, hi=hi, total=total, **local)
""")
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(tmp_path / f"p{i}.npz")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-2000:] + outs[1][-2000:]
    got = [np.load(tmp_path / f"p{i}.npz") for i in (0, 1)]
    assert (int(got[0]["lo"]), int(got[0]["hi"]), int(got[1]["lo"]), int(got[1]["hi"])) == (0, 4, 4, 8)
    cfg = load_config(TINY, ["data.kind=tokens", f"data.path={prepared}", "train.seq_len=32", "train.batch_size=8"])
    one = make_source(cfg)  # one process reading everything sees the same global batches
    for s in (5, 6):
        np.testing.assert_array_equal(np.concatenate([g[f"s{s}"] for g in got]), one.batch(s)["inputs"])
    want = int((one.batch(6)["inputs"].astype(np.int64) * (1 + np.arange(8)[:, None])).sum())
    assert int(got[0]["total"]) == int(got[1]["total"]) == want  # rows landed in their global places


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- bad input


def _cli(capsys, *argv):
    code = cli.main(list(argv))
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("maxtrain: error:")]
    return code, err


def test_bad_prepare_inputs(tmp_path, capsys):
    code, err = _cli(capsys, "prepare", "--input", str(tmp_path / "nothing*"), "--output", str(tmp_path / "o"))
    assert code == 2 and "matches no files" in err[0]
    (tmp_path / "empty.jsonl").write_text("\n")
    code, err = _cli(capsys, "prepare", "--input", str(tmp_path / "empty.jsonl"), "--output", str(tmp_path / "o2"))
    assert code == 2 and "holds no documents" in err[0]
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    code, err = _cli(capsys, "prepare", "--input", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "o3"))
    assert code == 2 and "line 1" in err[0] and "--text-field" in err[0]
    # the failed run left nothing in the way: fixed input, same --output, and no partial directory
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    assert _cli(capsys, "prepare", "--input", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "o3"))[0] == 0
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]
    assert (tmp_path / "o3" / "manifest.json").is_file()
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    code, err = _cli(capsys, "prepare", "--input", str(tmp_path / "latin1.jsonl"), "--output", str(tmp_path / "o5"))
    assert code == 2 and "is not UTF-8" in err[0]
    code, err = _cli(capsys, "prepare", "--input", str(_jsonl(tmp_path)), "--output", str(tmp_path / "bad.jsonl"))
    assert code == 2 and "not an empty directory" in err[0]
    (tmp_path / "tok.json").write_text("{not a tokenizer")
    code, err = _cli(capsys, "prepare", "--input", str(_jsonl(tmp_path)), "--output", str(tmp_path / "o4"),
                     "--tokenizer", str(tmp_path / "tok.json"))
    assert code == 2 and "does not load" in err[0]


def test_verify_count_opens_shards_without_hashing_them(prepared, monkeypatch):
    """`data.verify: count` (large data on many hosts, after one `prepare --verify`): opening a
    shard checks its record count and never reads the whole file for its sha256."""
    from maxtrain.data import tokens

    shards = ShardSet(str(prepared), "train", verify="count")  # length indexes hashed at construction

    def no_hashing(path):
        raise AssertionError(f"hashed {path}")
    monkeypatch.setattr(tokens, "sha256_file", no_hashing)
    assert shards.window(0, 8).shape == (8,)
    with pytest.raises(AssertionError, match="hashed"):
        ShardSet(str(prepared), "train").reader(0)  # construction reads lengths; sha256 is the default


def _copy(src, dst):
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return dst


def test_bad_training_data_is_caught(prepared, tmp_path, capsys):
    run = ["train", TINY, *SMALL, f"run_dir={tmp_path / 'r'}", "train.steps=1", "data.kind=tokens"]
    code, err = _cli(capsys, *run, f"data.path={prepared}", "model.vocab_size=128")
    assert code == 2 and "vocab size 257 exceeds model.vocab_size=128" in err[0]
    code, err = _cli(capsys, *run, f"data.path={tmp_path}", "model.vocab_size=257")
    assert code == 2 and "manifest.json not found" in err[0]
    corrupt = _copy(prepared, tmp_path / "corrupt")
    shard = corrupt / "train-00001-of-00003.arrayrecord"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, err = _cli(capsys, *run, f"data.path={corrupt}", "model.vocab_size=257", "train.seq_len=256")
    assert code == 2 and "train-00001-of-00003.arrayrecord does not match its manifest checksum" in err[0]
    assert _cli(capsys, "prepare", "--verify", str(corrupt))[0] == 2
    with pytest.raises(ConfigError, match="does not match its manifest checksum"):
        ShardSet(str(corrupt), "train").reader(1)
    with pytest.raises(ConfigError, match="train-00001-of-00003.arrayrecord has 0 records"):
        ShardSet(str(corrupt), "train", verify="count").reader(1)  # counted, not hashed: still refused here
    lengths = _copy(prepared, tmp_path / "lengths")
    np.save(lengths / "train-00000-of-00003.lengths.npy", np.array([1, 2, 3]))
    code, err = _cli(capsys, *run, f"data.path={lengths}", "model.vocab_size=257")
    assert code == 2 and "does not match its manifest checksum" in err[0]
    missing = _copy(prepared, tmp_path / "missing")
    os.remove(missing / "train-00002-of-00003.lengths.npy")
    code, err = _cli(capsys, *run, f"data.path={missing}", "model.vocab_size=257")
    assert code == 2 and "train-00002-of-00003.lengths.npy listed in the manifest is missing" in err[0]
    malformed = _copy(prepared, tmp_path / "malformed")
    (malformed / "manifest.json").write_text(json.dumps({"format": 1, "splits": {"train": {}}}))
    code, err = _cli(capsys, *run, f"data.path={malformed}", "model.vocab_size=257")
    assert code == 2 and "manifest.json is malformed (vocab_size is missing or not of type int)" in err[0], err
    manifest = json.loads((prepared / "manifest.json").read_text())
    del manifest["splits"]["train"]["shards"][1]["sha256"]
    (malformed / "manifest.json").write_text(json.dumps(manifest))
    code, err = _cli(capsys, *run, f"data.path={malformed}", "model.vocab_size=257")
    assert code == 2 and "split 'train' shard 1: sha256 is missing" in err[0], err
    code, err = _cli(capsys, *run, f"data.path=[{{path: {prepared}, weight: abc}}]", "model.vocab_size=257")
    assert code == 2 and "is not a number" in err[0]
    code, err = _cli(capsys, *run, "train.eval_every=2", "data.kind=text", "data.max_bytes=100000",
                     "model.vocab_size=257")
    assert code == 2 and "train.eval_every > 0 needs data.eval_path" in err[0]


def test_verify_flags_out_of_vocab_ids(prepared, tmp_path):
    bad = _copy(prepared, tmp_path / "oov")
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["vocab_size"] = 100  # bytes above 99 now fall outside the vocabulary
    manifest.pop("manifest_sha256", None)  # as an earlier maxtrain wrote it (else the checksum refuses the edit)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    problems = verify(str(bad))
    assert problems and "token id" in problems[0] and ">= vocab size 100" in problems[0]


# ---------------------------------------------------------------- hand-edited or hostile prepared data

CHECKSUM = "manifest_sha256"


def _digest(manifest):
    """The manifest's checksum: sha256 of its canonical JSON without the checksum field."""
    import hashlib
    body = {k: v for k, v in manifest.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _edited(prepared, dst, edit, seal=True):
    """A copy of `prepared` whose manifest `edit` changed; `seal` recomputes its checksum (an edit
    that also forged the checksum), else it is left stale."""
    d = _copy(prepared, dst)
    manifest = json.loads((d / "manifest.json").read_text())
    edit(manifest)
    if seal:
        manifest[CHECKSUM] = _digest(manifest)
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def _unsealed(manifest):  # as written by maxtrain before manifests carried a checksum
    manifest.pop(CHECKSUM, None)


def test_edited_manifest_fails_its_checksum(prepared, tmp_path, capsys):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest[CHECKSUM] == _digest(manifest)
    run = ["train", TINY, *SMALL, f"run_dir={tmp_path / 'r'}", "train.steps=1", "data.kind=tokens",
           "model.vocab_size=257"]
    for name, edit in [("vocab", lambda m: m.update(vocab_size=200)), ("u8", lambda m: m.update(dtype="uint8")),
                       ("i32", lambda m: m.update(dtype="int32"))]:
        bad = _edited(prepared, tmp_path / name, edit, seal=False)
        code, err = _cli(capsys, *run, f"data.path={bad}")
        assert code == 2 and len(err) == 1 and f"{bad / 'manifest.json'}" in err[0], (name, err)
        code, err = _cli(capsys, "prepare", "--verify", str(bad))
        assert code == 2 and "manifest.json" in err[-1], (name, err)
    bad = _edited(prepared, tmp_path / "vocab2", lambda m: m.update(vocab_size=200), seal=False)
    with pytest.raises(ConfigError, match="manifest.json does not match its checksum"):
        ShardSet(str(bad))


def test_manifest_without_checksum_loads_with_a_warning_and_its_facts_are_checked(prepared, tmp_path, capsys,
                                                                                   caplog):
    old = _edited(prepared, tmp_path / "old", _unsealed, seal=False)
    with caplog.at_level("WARNING"):
        shards = ShardSet(str(old))
    assert "no manifest_sha256" in caplog.text and "prepare --verify" in caplog.text
    assert shards.window(0, 64).shape == (64,) and verify(str(old)) == []
    # a dtype that fits the vocabulary but not the shards: each record's size says so when read
    wide = _edited(prepared, tmp_path / "wide", lambda m: (_unsealed(m), m.update(vocab_size=70000, dtype="uint32")),
                   seal=False)
    with pytest.raises(ConfigError, match=r"train-00000-of-00003.arrayrecord record 0 holds \d+ bytes, not \d+ "
                                          r"uint32 tokens"):
        ShardSet(str(wide), verify="count").window(0, 64)
    assert "holds" in verify(str(wide))[0]
    for dtype in ("uint8", "int32"):  # a dtype prepare never writes for this vocabulary
        bad = _edited(prepared, tmp_path / dtype, lambda m: (_unsealed(m), m.update(dtype=dtype)), seal=False)
        with pytest.raises(ConfigError, match=f"malformed \\(dtype '{dtype}' is not uint16"):
            ShardSet(str(bad))
    # a vocab_size lowered below the ids: refused where a window is read, before the model sees an id
    low = _edited(prepared, tmp_path / "low", lambda m: (_unsealed(m), m.update(vocab_size=100)), seal=False)
    code, err = _cli(capsys, "train", TINY, *SMALL, f"run_dir={tmp_path / 'r'}", "train.steps=1", "data.kind=tokens",
                     f"data.path={low}", "model.vocab_size=100", "data.verify=count")
    assert code == 2 and len(err) == 1 and re.search(r"train-0000\d-of-00003.arrayrecord record \d+ holds token id "
                                                     r"\d+ >= vocab size 100", err[0]), err


def test_prepare_refuses_unwritable_outputs_and_non_text_inputs(tmp_path, capsys):
    src = _jsonl(tmp_path, DOCS[:3])
    (tmp_path / "file").write_text("x")
    code, err = _cli(capsys, "prepare", "--input", str(src), "--output", str(tmp_path / "file" / "out"))
    assert code == 2 and len(err) == 1 and "--output" in err[0] and "file/out" in err[0], err
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o555)
        code, err = _cli(capsys, "prepare", "--input", str(src), "--output", str(tmp_path / "ro" / "out"))
        assert code == 2 and "--output" in err[0], err
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("hello\n")
    code, err = _cli(capsys, "prepare", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "in" / "out"))
    assert code == 2 and "is inside --input" in err[0], err
    (tmp_path / "bin.txt").write_bytes(b"a" * 20000 + b"\xff\xfe" + b"b" * 10)
    code, err = _cli(capsys, "prepare", "--input", str(tmp_path / "bin.txt"), "--output", str(tmp_path / "o1"),
                     "--workers", "1")
    assert code == 2 and err == [f"maxtrain: error: {tmp_path / 'bin.txt'} is not UTF-8 text (byte 20000); "
                                 f"convert it or drop it from --input"], err
    (tmp_path / "utf16.txt").write_bytes("hello".encode("utf-16-le"))
    code, err = _cli(capsys, "prepare", "--input", str(tmp_path / "utf16.txt"), "--output", str(tmp_path / "o2"),
                     "--workers", "1")
    assert code == 2 and "utf16.txt is not UTF-8 text (NUL at byte 1" in err[0], err
    big = tmp_path / "big.jsonl"  # past the first read buffer: the offset is the file's, not the chunk's
    big.write_bytes(b"".join(json.dumps({"text": "x" * 100}).encode() + b"\n" for _ in range(500))
                    + b'{"text": "caf\xe9"}\n')
    code, err = _cli(capsys, "prepare", "--input", str(big), "--output", str(tmp_path / "o3"), "--workers", "1")
    assert code == 2 and f"is not UTF-8 text (byte {big.stat().st_size - 4})" in err[0], err
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]
    # CRLF text keeps its old tokenization (newlines as read in text mode)
    (tmp_path / "crlf.txt").write_bytes(b"one\r\ntwo\rthree\n")
    prepare(str(tmp_path / "crlf.txt"), str(tmp_path / "o4"), "byte", shards=1, workers=1)
    assert _stream_docs(ShardSet(str(tmp_path / "o4"))) == ["one\ntwo\nthree\n"]


def test_a_trained_vocabulary_smaller_than_asked_says_why(tmp_path, capsys):
    src = _jsonl(tmp_path, DOCS[:3])
    assert cli.main(["prepare", "--input", str(src), "--output", str(tmp_path / "o"), "--train-tokenizer", "5000",
                     "--workers", "1"]) == 0
    out = capsys.readouterr().out
    vocab = json.loads((tmp_path / "o" / "manifest.json").read_text())["vocab_size"]
    assert vocab < 5000 and f"vocab {vocab})" in out
    assert f"--train-tokenizer asked for 5000: the corpus ran out of pairs to merge at {vocab}" in out, out


def test_prepare_without_the_tokenizers_package(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    src = _jsonl(tmp_path, DOCS[:3])
    (tmp_path / "tokenizer.json").write_text("{}")
    for i, flags in enumerate([("--tokenizer", str(tmp_path / "tokenizer.json")), ("--train-tokenizer", "300")]):
        code, err = _cli(capsys, "prepare", "--input", str(src), "--output", str(tmp_path / f"o{i}"), *flags)
        assert code == 2 and len(err) == 1 and "needs the tokenizers package" in err[0] \
            and "pip install 'maxtrain[data]'" in err[0], err
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]


def test_manifest_shard_paths_stay_inside_the_data_directory(prepared, tmp_path, capsys):
    run = ["train", TINY, *SMALL, f"run_dir={tmp_path / 'r'}", "train.steps=1", "data.kind=tokens",
           "model.vocab_size=257"]
    for i, (key, name) in enumerate([("file", "../../../../../etc/passwd"), ("file", "/etc/passwd"),
                                     ("lengths_file", "/etc/hostname"), ("file", "sub/x.arrayrecord")]):
        bad = _edited(prepared, tmp_path / f"b{i}", lambda m: m["splits"]["train"]["shards"][0].update({key: name}))
        code, err = _cli(capsys, *run, f"data.path={bad}")
        assert code == 2 and len(err) == 1 and f"{key} {name!r} is not a file name in the data directory" in err[0], err
        assert _cli(capsys, "prepare", "--verify", str(bad))[0] == 2


class _Boom:
    """Unpickling this creates a directory: proof that a length index was unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_length_index_must_be_a_plain_integer_array(prepared, tmp_path, capsys):
    from maxtrain.data.prepare import read_lengths

    name = "train-00000-of-00003.lengths.npy"
    good = np.load(prepared / name)
    marker = tmp_path / "unpickled"
    cases = {
        "pickle": (np.array([_Boom(str(marker))], dtype=object), "not a plain .npy integer array"),
        "float": (good.astype(np.float64), "float64, not integer"),
        "2d": (good[None, :], "2-D, not 1-D"),
        "negative": (np.r_[good[:-2], good[-2] + good[-1] + 1, -1], "a length < 1"),
        "zero": (np.r_[good[:-2], good[-2] + good[-1], 0], "a length < 1"),
    }
    for case, (array, message) in cases.items():
        bad = _copy(prepared, tmp_path / case)
        np.save(bad / name, array, allow_pickle=True)
        manifest = json.loads((bad / "manifest.json").read_text())
        manifest["splits"]["train"]["shards"][0]["lengths_sha256"] = sha256_file(str(bad / name))
        manifest[CHECKSUM] = _digest(manifest)
        (bad / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ConfigError, match=re.escape(message)):
            ShardSet(str(bad))
        code, err = _cli(capsys, "prepare", "--verify", str(bad))
        assert code == 2 and len(err) == 1 and name in err[0] and message in err[0], (case, err)
    assert not marker.exists()
    (tmp_path / "text.npy").write_text("not numpy")
    with pytest.raises(ConfigError, match="text.npy is not a plain .npy integer array"):
        read_lengths(str(tmp_path / "text.npy"))


def test_manifest_fields_of_the_wrong_kind(prepared, tmp_path, capsys):
    def shard0(**kv):
        return lambda m: m["splits"]["train"]["shards"][0].update(kv)

    cases = [
        (lambda m: m.update(vocab_size=True), "vocab_size is missing or not of type int"),
        (lambda m: m.update(vocab_size="257"), "vocab_size is missing or not of type int"),
        (lambda m: m.update(vocab_size=0), "vocab_size 0 is not positive"),
        (shard0(documents=3.0), "split 'train' shard 0: documents is missing or not of type int"),
        (shard0(tokens=-5), "split 'train' shard 0: tokens -5 is negative"),
        (shard0(documents=False), "split 'train' shard 0: documents is missing or not of type int"),
        (lambda m: m["splits"]["train"]["shards"].append(m["splits"]["train"]["shards"][0]),
         "train-00000-of-00003.arrayrecord is listed twice"),
    ]
    for i, (edit, message) in enumerate(cases):
        bad = _edited(prepared, tmp_path / f"c{i}", edit)
        with pytest.raises(ConfigError, match=re.escape(message)):
            ShardSet(str(bad))
    bad = _edited(prepared, tmp_path / "nosplits", lambda m: m.update(splits={}))
    with pytest.raises(ConfigError, match="has no 'train' split \\(has none\\)"):
        ShardSet(str(bad))
    bad = _edited(prepared, tmp_path / "noshards", lambda m: m["splits"]["train"].update(shards=[]))
    with pytest.raises(ConfigError, match="split 'train' holds no tokens"):
        ShardSet(str(bad))
    assert "holds no tokens" in verify(str(bad))[0]
    bad = _copy(prepared, tmp_path / "dir")
    os.remove(bad / "train-00001-of-00003.arrayrecord")
    os.mkdir(bad / "train-00001-of-00003.arrayrecord")
    code, err = _cli(capsys, "train", TINY, *SMALL, f"run_dir={tmp_path / 'r'}", "train.steps=1", "data.kind=tokens",
                     f"data.path={bad}", "model.vocab_size=257")
    assert code == 2 and "train-00001-of-00003.arrayrecord listed in the manifest is not a file" in err[0], err


def test_default_shard_count_follows_the_input_size(tmp_path, capsys, monkeypatch):
    """17 documents make one shard, not four mostly empty ones; the summary line says how many, with a
    rate in a unit that shows it (not "0.0 MiB/s")."""
    import maxtrain.data.prepare as prep
    src = _jsonl(tmp_path, DOCS[:17])
    assert cli.main(["prepare", "--input", str(src), "--output", str(tmp_path / "one"), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "17 documents" in out and "in 1 shard," in out and " 0.0 MiB/s" not in out, out
    assert re.search(r"\([\d.,]+ (KiB|MiB|GiB)/s\)", out), out
    monkeypatch.setattr(prep, "SHARD_INPUT_BYTES", 1000)  # as if the input were large
    n = -(-src.stat().st_size // 1000)
    assert prep.default_shards([str(src)]) == min(n, prep.MAX_DEFAULT_SHARDS) > 1
    m = prepare(str(src), str(tmp_path / "many"), "byte", workers=1)
    assert len(m["splits"]["train"]["shards"]) == min(n, prep.MAX_DEFAULT_SHARDS)


# ---------------------------------------------------------------- mixture schedules


def _two_sources(prepared, tmp_path):
    b = tmp_path / "b"
    if not b.exists():
        prepare(str(_jsonl(tmp_path, [d.upper() for d in DOCS])), str(b), "byte", shards=1, workers=1)
    return b


def _scheduled_cfg(a, b, *extra):
    return load_config(TINY, ["data.kind=tokens", f"data.path=[{{path: {a}, weights: {{0: 0.8, 300: 0.2}}}}, "
                                                  f"{{path: {b}, weights: {{0: 0.2, 300: 0.8}}}}]",
                              "train.seq_len=32", "train.batch_size=8", *extra])


def _expected_counts(weights):
    """Largest-remainder counts of MIX_BLOCK for normalised `weights` (written out, not mixture code)."""
    total = sum(weights)
    exact = [w / total * MIX_BLOCK for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[:MIX_BLOCK - sum(counts)]:
        counts[i] += 1
    return counts


def test_a_mixture_schedule_moves_the_proportions_block_by_block(prepared, tmp_path):
    """Weights 80/20 at step 0 -> 20/80 at step 300, linear between: with 8 rows a step, block b of
    1024 examples starts at step 128 b and takes the weights there; each source's examples stay
    consecutive (nothing repeated or skipped) across blocks of different shares."""
    b = _two_sources(prepared, tmp_path)
    mix = make_source(_scheduled_cfg(prepared, b))
    assert isinstance(mix, Mixture) and mix.scheduled
    picks = {0: [], 1: []}
    for block in range(4):
        step = block * MIX_BLOCK // 8
        a_w = 0.8 + (0.2 - 0.8) * min(step, 300) / 300
        got = [mix.source_of(g) for g in range(block * MIX_BLOCK, (block + 1) * MIX_BLOCK)]
        counts = [sum(1 for s, _ in got if s == k) for k in (0, 1)]
        assert counts == _expected_counts([a_w, 1 - a_w]), (block, counts)
        for s, j in got:
            picks[s].append(j)
    for s in (0, 1):
        assert sorted(picks[s]) == list(range(len(picks[s])))
    # random access: a fresh mixture asked for block 3 first agrees, and so do its token counts
    fresh = make_source(_scheduled_cfg(prepared, b))
    assert [fresh.source_of(g) for g in range(3 * MIX_BLOCK, 3 * MIX_BLOCK + 50)] == [
        mix.source_of(g) for g in range(3 * MIX_BLOCK, 3 * MIX_BLOCK + 50)]
    step = 300
    seen = [0, 0]
    for g in range(step * 8):
        seen[mix.source_of(g)[0]] += 1
    names = mix.names()
    assert fresh.tokens_seen(step) == {names[0]: seen[0] * 32, names[1]: seen[1] * 32}
    np.testing.assert_array_equal(fresh.batch(200)["inputs"], mix.batch(200)["inputs"])


def test_a_fixed_mixture_draws_as_before():
    """A schedule of one point per source is the fixed mixture: the same picks, block after block."""
    from maxtrain.data.tokens import Mixture as M

    class Fake:
        def __init__(self, path):
            self.vocab_size, self.seq_len = 10, 4
            self.shards = type("S", (), {"path": path, "manifest": {"tokenizer": {"kind": "byte"}}})()

    import maxtrain.data.tokens as tokens
    old = tokens.tokenizer_identity
    tokens.tokenizer_identity = lambda path, manifest: "same"
    try:
        fixed = M([Fake("a"), Fake("b"), Fake("c")], [3.0, 1.0, 1.5], seed=7, batch_size=8)
        points = M([Fake("a"), Fake("b"), Fake("c")], [{0: 3.0}, {0: 1.0}, {0: 1.5}], seed=7, batch_size=8)
    finally:
        tokens.tokenizer_identity = old
    # the fixed mixture's proportions and draw, written out: each block holds 3 : 1 : 1.5 of 1024
    assert list(fixed.counts) == _expected_counts([3.0, 1.0, 1.5])
    labels = np.random.default_rng([7, 0x313, 2]).permutation(np.repeat(np.arange(3), fixed.counts))
    assert [fixed.source_of(2 * MIX_BLOCK + i)[0] for i in range(MIX_BLOCK)] == labels.tolist()
    assert [fixed.source_of(g) for g in range(3 * MIX_BLOCK)] == [points.source_of(g) for g in range(3 * MIX_BLOCK)]
    # eight sources whose weights numpy's pairwise sum adds up in another last bit than a left-to-right sum
    weights = [0.901, 0.901, 0.501, 0.501, 0.601, 0.401, 0.501, 0.501]
    tokens.tokenizer_identity = lambda path, manifest: "same"
    try:
        eight = M([Fake(str(i)) for i in range(8)], weights, seed=7, batch_size=8)
    finally:
        tokens.tokenizer_identity = old
    assert list(eight.counts) == _expected_counts(weights)


@pytest.mark.parametrize("weights, needle", [
    ("{path: A, weights: {x: 1}}, {path: B, weight: 1}", "step 'x' must be a whole number"),
    ("{path: A, weights: {0: -1, 10: 1}}, {path: B, weights: {0: 1}}", "must be positive numbers"),
    ("{path: A, weights: {0: 1, 10: 0}}, {path: B, weights: {0: 1, 10: 0}}", "every weight is 0 at step 10"),
    ("{path: A, weights: {0: 1}, weight: 2}, {path: B, weight: 1}", "not both"),
    ("{path: A, weights: [1, 2]}, {path: B, weight: 1}", "must be a mapping"),
])
def test_bad_mixture_schedules_are_one_line_errors(prepared, tmp_path, weights, needle):
    b = _two_sources(prepared, tmp_path)
    path = weights.replace("A", str(prepared)).replace("B", str(b))
    with pytest.raises(ConfigError, match=re.escape(needle)):
        make_source(load_config(TINY, ["data.kind=tokens", f"data.path=[{path}]", "train.seq_len=32"]))


def test_a_two_phase_run_on_a_scheduled_mixture_resumes_exactly_across_both_turns(prepared, tmp_path, caplog,
                                                                                  capsys):
    """Phase one (optim.groups: only embedding rows 200.. and nothing else learn for 4 updates), then
    everything, on a mixture whose schedule turns over at step 3: 6 steps equal 3 steps and a resumed
    3 bitwise, and a run resumed from step 4 (the optimizer's new layout) too; the frozen parameters and masked rows are bit for bit as they were through phase one
    and move after it; every record counts the tokens each source gave (as the mixture's picks say),
    the report prints them, and weights summing to 2 are normalised with a warning."""
    b = _two_sources(prepared, tmp_path)
    common = SMALL + ["model.vocab_size=257", "data.kind=tokens", "train.batch_size=8", "optim.decay_steps=8",
                      f"data.path=[{{path: {prepared}, weights: {{0: 1.8, 3: 0.2}}}}, "
                      f"{{path: {b}, weights: {{0: 0.2, 3: 1.8}}}}]",
                      "optim.groups=[{params: ^embed/, rows_from: 200, rows_until: 4}, {params: ., frozen_until: 4}]"]
    with caplog.at_level("WARNING", logger="maxtrain"):
        whole = train(load_config(TINY, common + ["train.steps=6", f"run_dir={tmp_path / 'whole'}"]))
    assert "they are normalised" in caplog.text
    ck = tmp_path / "ck"
    saving = [f"checkpoint.dir={ck}", "checkpoint.every=1", "checkpoint.keep=10", f"run_dir={tmp_path / 'parts'}"]
    train(load_config(TINY, common + ["train.steps=3", *saving]))
    resumed = train(load_config(TINY, common + ["train.steps=6", *saving]))
    assert resumed.start_step == 3
    assert [r["loss"] for r in whole.history[3:]] == [r["loss"] for r in resumed.history]
    # from the checkpoint of step 4, the first in phase two's layout (the moments of what learns now)
    again = train(load_config(TINY, common + ["train.steps=6", f"checkpoint.resume_from={ck / '4'}",
                                              f"checkpoint.dir={tmp_path / 'ck2'}", f"run_dir={tmp_path / 'again'}"]))
    assert again.start_step == 4 and [r["loss"] for r in whole.history[4:]] == [r["loss"] for r in again.history]
    saved = {s: json.loads((ck / str(s) / "manifest" / "metadata").read_text())["checksums"] for s in (3, 4)}
    moments = {s: {k for k in saved[s] if k.startswith("opt_state/") and "/mu/layers/" in k} for s in saved}
    assert not moments[3] and moments[4]  # frozen in phase one: no moments saved for the layers
    from maxtrain import load_checkpoint

    params = {s: jax.device_get(load_checkpoint(str(ck / str(s)))[1]) for s in (1, 4, 5, 6)}
    layers = lambda p: jax.tree.leaves({k: v for k, v in p.items() if k != "embed"})  # noqa: E731
    assert all(np.array_equal(x, y) for x, y in zip(layers(params[1]), layers(params[4])))  # frozen in phase one
    assert not any(np.array_equal(x, y) for x, y in zip(layers(params[4]), layers(params[5])))  # trained from step 5
    e = {s: params[s]["embed"]["embedding"] for s in params}
    np.testing.assert_array_equal(e[1][:200], e[4][:200])  # masked rows: exactly no update
    assert not np.array_equal(e[1][200:], e[4][200:]) and not np.array_equal(e[4][:200], e[6][:200])
    mix = make_source(load_config(TINY, common))
    for r in whole.history:
        seen = [0, 0]
        for g in range(r["step"] * 8):
            seen[mix.source_of(g)[0]] += 1
        assert list(r["tokens_per_source"].values()) == [seen[0] * 32, seen[1] * 32], r["step"]
    assert cli.main(["report", str(tmp_path / "whole"), "--text"]) == 0
    assert "tokens per data source through step 6" in capsys.readouterr().out


@pytest.mark.parametrize("groups, needle", [
    ("[{lr_scale: 2}]", "must be a mapping with a params regex"),
    ("[{params: '(', frozen_until: 2}]", "is not a regular expression"),
    ("[{params: ., frozen: 2}]", "unknown key 'frozen'"),
    ("[{params: ., frozen_until: 1.5}]", "frozen_until=1.5 must be a step >= 0"),
    ("[{params: ., lr_scale: -1}]", "lr_scale=-1 must be a number >= 0"),
    ("[{params: ., rows_until: 3}]", "rows_until needs rows_from"),
])
def test_bad_parameter_groups_are_one_line_errors(groups, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(TINY, [f"optim.groups={groups}"])


def test_rows_from_on_a_parameter_without_a_vocab_axis_is_refused():
    from maxtrain.step import make_setup

    cfg = load_config(TINY, SMALL + ["optim.groups=[{params: ., rows_from: 3}]"])
    with pytest.raises(ConfigError, match="needs a parameter with a vocab axis"):
        make_setup(cfg, jax.devices())


def test_a_source_that_runs_out_starts_its_next_epoch_and_says_so(prepared, tmp_path, caplog):
    """The small source of a scheduled mixture runs out first: its examples continue into a new
    epoch (another order of its rows, every row once per epoch), and the records' log says when."""
    b = _two_sources(prepared, tmp_path)
    mix = make_source(_scheduled_cfg(prepared, b))
    step = next(s for s in range(1, 10_000) if max(mix.epochs(s)) >= 1)
    first = mix.epochs(step).index(1)
    n = len(mix.sources[first])
    picks = sorted(j for g in range(step * 8) for s, j in [mix.source_of(g)] if s == first)
    assert picks[:n] == list(range(n))  # the whole first epoch, nothing skipped
    rows = {mix.sources[first].example(j)["inputs"].tobytes() for j in range(n, 2 * n)}
    assert rows == {mix.sources[first].example(j)["inputs"].tobytes() for j in range(n)}  # the same rows again
    from maxtrain.run.records import Metrics

    class R:  # what Metrics._note_epochs reads of a run
        mixture, first, is_main = mix, 0, True

    m = Metrics.__new__(Metrics)
    m.epochs = None
    with caplog.at_level("INFO", logger="maxtrain"):
        m._note_epochs(R, step - 1)
        m._note_epochs(R, step)
    assert caplog.text.count("ran out and started epoch 2") == 1 and f"by step {step}" in caplog.text


def test_a_source_marked_repeat_false_ends_the_run_before_its_second_pass(prepared, tmp_path, caplog):
    """A `data.path` entry with `repeat: false`: the run stops after the last step whose batches stay
    in that source's first pass (found here by walking the stream example by example), saves there
    and says so once; run again with more train.steps it stops at the same step. A single source
    alone, a source that cannot fill one batch, and an unknown entry key."""
    from maxtrain.data import last_step

    b = _two_sources(prepared, tmp_path)
    entries = (f"[{{path: {prepared}, weights: {{0: 0.8, 300: 0.2}}, repeat: false}}, "
               f"{{path: {b}, weights: {{0: 0.2, 300: 0.8}}}}]")
    mix = make_source(_scheduled_cfg(prepared, b))
    n, taken, end = len(mix.sources[0]), 0, None
    for step in range(1, 1000):
        taken += sum(mix.source_of(g)[0] == 0 for g in range((step - 1) * 8, step * 8))
        if taken > n:
            end = step - 1
            break
    assert end is not None and 10 < end < 100
    ck = tmp_path / "ck"
    common = SMALL + ["model.vocab_size=257", "data.kind=tokens", f"data.path={entries}", "train.seq_len=32",
                      "train.batch_size=8", f"checkpoint.dir={ck}", "checkpoint.every=1000"]
    with caplog.at_level("WARNING", logger="maxtrain"):
        result = train(load_config(TINY, common + ["train.steps=100", f"run_dir={tmp_path / 'r1'}"]))
    assert f"runs out after step {end}: the run stops there, before train.steps=100" in caplog.text
    assert result.history[-1]["step"] == end and int(result.state.step) == end and result.checkpoint_saved
    import yaml

    assert yaml.safe_load((tmp_path / "r1" / "config.yaml").read_text())["train"]["steps"] == 100  # as configured
    again = train(load_config(TINY, common + ["train.steps=200", f"run_dir={tmp_path / 'r2'}"]))
    assert again.start_step == end and not again.history
    n_b = len(mix.sources[1])
    batch = next(k for k in (4, 3, 2, 1) if n_b % k == 0)  # the source ends exactly at a step's end: read whole
    alone = load_config(TINY, ["data.kind=tokens", f"data.path=[{{path: {b}, repeat: false}}]", "train.seq_len=32",
                               f"train.batch_size={batch}", "train.steps=1000"])
    assert len(make_source(alone)) == n_b and last_step(alone, make_source(alone)) == n_b // batch
    big = load_config(TINY, ["data.kind=tokens", f"data.path={entries}", "train.seq_len=32", "train.batch_size=256"])
    with pytest.raises(ConfigError, match="runs out within the first batch of train.batch_size=256"):
        last_step(big, make_source(big))
    with pytest.raises(ConfigError, match="unknown key 'weigth'"):
        make_source(load_config(TINY, ["data.kind=tokens", f"data.path=[{{path: {b}, weigth: 2}}, {prepared}]",
                                       "train.seq_len=32"]))
