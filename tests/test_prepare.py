"""`maxtrain prepare` and the tokens pipeline: round trips, packing, mixtures, eval, bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, SMALL, TINY
from maxtrain import cli, load_config, train
from maxtrain.data import Loader, make_source
from maxtrain.data.prepare import prepare, verify
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
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize("127.0.0.1:{_free_port()}", num_processes=2, process_id=int(sys.argv[1]))
from maxtrain import load_config
from maxtrain.data import Loader, make_source
from maxtrain.train import host_rows, make_setup, put_batch
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
    (bad / "manifest.json").write_text(json.dumps(manifest))
    problems = verify(str(bad))
    assert problems and "token id" in problems[0] and ">= vocab size 100" in problems[0]
