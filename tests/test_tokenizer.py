"""`maxtrain tokenizer extend` and `maxtrain tokenizer stats` (issue 48, part): a byte-level BPE
tokenizer trained here on this repository's English docs is extended with tokens learned on the
first twelve lines of a Hindi and a Tamil sample (tests/fixtures/text, written for the tests), and
judged on their last eight lines. Every base id and every base tokenization of text without those
scripts (English, and Bengali, Cyrillic, Greek, symbols) is kept; the new scripts take fewer
tokens per word."""

import glob
import json
import os
import random

import pytest

from conftest import ROOT
from maxtrain.cli import main
from maxtrain.data import scripts as sc
from maxtrain.data import tokenizers

pytest.importorskip("tokenizers")
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

TEXT = os.path.join(ROOT, "tests", "fixtures", "text")
TRAIN_LINES, HELD_LINES = 12, 8


def _lines(name):
    with open(os.path.join(TEXT, name), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _english():
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            out.append(f.read())
    return out


@pytest.fixture(scope="module")
def extended(tmp_path_factory):
    """(base tokenizer.json, extended directory, held-apart Indic text, the CLI's output)."""
    work = tmp_path_factory.mktemp("tok")
    base = work / "base" / "tokenizer.json"
    tokenizers.train_bpe(_english(), 800, str(base))
    corpus, held = work / "corpus", work / "held.txt"
    corpus.mkdir()
    for name in ("hindi.txt", "tamil.txt"):
        (corpus / name).write_text("\n".join(_lines(name)[:TRAIN_LINES]) + "\n", encoding="utf-8")
    held.write_text("\n".join(_lines("hindi.txt")[TRAIN_LINES:] + _lines("tamil.txt")[TRAIN_LINES:]) + "\n",
                    encoding="utf-8")
    out = work / "ext"
    assert main(["tokenizer", "extend", str(base.parent), "--corpus", str(corpus), "--add", "400",
                 "--out", str(out)]) == 0
    return base, out, held


def test_every_base_id_and_merge_is_kept_and_new_ids_follow(extended):
    base, out, _ = extended
    old, new = json.loads(base.read_text()), json.loads((out / "tokenizer.json").read_text())
    old_vocab, new_vocab = old["model"]["vocab"], new["model"]["vocab"]
    assert all(new_vocab[t] == i for t, i in old_vocab.items())
    added = {t: i for t, i in new_vocab.items() if t not in old_vocab}
    first = 1 + max([*old_vocab.values(), *(t["id"] for t in old["added_tokens"])])
    assert sorted(added.values()) == list(range(first, first + len(added))) and len(added) > 50
    assert new["model"]["merges"][:len(old["model"]["merges"])] == old["model"]["merges"]
    assert len(new["model"]["merges"]) == len(old["model"]["merges"]) + len(added)


def test_text_without_the_new_scripts_tokenizes_exactly_as_before(extended):
    base, out, _ = extended
    old, new = HFTokenizer.from_file(str(base)), HFTokenizer.from_file(str(out / "tokenizer.json"))
    new_scripts = {"Devanagari", "Tamil"}
    english = [t for t in _english() if not any(sc.script_of(c) in new_scripts for c in t)]  # a doc quotes Hindi
    assert len(english) > 10
    texts = english + _lines("other_scripts.txt")  # Bengali shares its lead byte with both scripts
    for text in texts:
        assert new.encode(text).ids == old.encode(text).ids, text[:80]
    # and the new scripts do change: the extension is not a no-op
    hindi = _lines("hindi.txt")[-1]
    assert len(new.encode(hindi).ids) < len(old.encode(hindi).ids)
    assert new.decode(new.encode(hindi).ids) == hindi


def test_the_new_scripts_take_fewer_tokens_per_word_on_held_apart_text(extended):
    base, out, held = extended
    before = tokenizers.script_stats(tokenizers.load_tokenizer(str(base)), [held.read_text()])
    after = tokenizers.script_stats(tokenizers.load_tokenizer(str(out / "tokenizer.json")), [held.read_text()])
    for script in ("Devanagari", "Tamil"):
        assert after[script]["words"] == before[script]["words"] > 20
        assert after[script]["tokens_per_word"] < 0.6 * before[script]["tokens_per_word"], (script, before, after)
        assert after[script]["byte_fallback_share"] < before[script]["byte_fallback_share"]
        assert before[script]["byte_fallback_share"] > 0.9  # an English-only BPE splits every Indic character


def test_stats_against_an_independent_count(tmp_path, capsys):
    """The byte tokenizer's figures are UTF-8 byte counts: tokens per word is the mean UTF-8 length
    of the words, and every byte of a multi-byte character is a fallback byte."""
    text = "\n".join(_lines("hindi.txt")[:3] + _lines("other_scripts.txt")[2:3])
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    assert main(["tokenizer", "stats", "byte", str(tmp_path / "t.txt"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["byte"]
    words = text.split()
    for script in ("Devanagari", "Cyrillic"):
        mine = [w for w in words if sc.word_script(w) == script]
        n_bytes = sum(len(w.encode()) for w in mine)
        multi = sum(len(c.encode()) for w in mine for c in w if len(c.encode()) > 1)
        assert got[script]["words"] == len(mine)
        assert got[script]["tokens_per_word"] == pytest.approx(n_bytes / len(mine))
        assert got[script]["byte_fallback_share"] == pytest.approx(multi / n_bytes)
    assert main(["tokenizer", "stats", "byte", str(tmp_path / "t.txt"), "--against", "byte"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith("script") and "Devanagari" in table and "Cyrillic" in table


def test_scripts_and_anchors():
    assert [sc.script_of(c) for c in "aनதব।Жα5"] == ["Latin", "Devanagari", "Tamil", "Bengali", "Common",
                                                    "Cyrillic", "Greek", "Common"]
    deva = sc.ranges_of(["Devanagari"])
    assert sc.anchored_prefix("न".encode()[:2], deva)  # E0 A4: only Devanagari starts with it
    assert not sc.anchored_prefix("न".encode()[:1], deva)  # E0 starts Bengali, Tamil, Thai too
    assert not sc.anchored_prefix("ব".encode(), deva)
    assert not sc.anchored_prefix("।".encode(), deva)  # the danda is every Indic script's
    assert not sc.anchored_prefix("ी".encode()[:2], deva) and sc.anchored_prefix("ी".encode(), deva)  # E0 A5: the dandas too
    assert not sc.anchored_prefix("ab".encode() + "न".encode()[1:], deva)  # continuation bytes alone
    with pytest.raises(ValueError, match="Klingon"):
        sc.ranges_of(["Klingon"])


def _naive_merges(words, add, allowed, known, min_count=2):
    """BPE learning by recounting every pair each time (the reference for `learn_merges`)."""
    seqs = {tuple(w): n for w, n in words.items()}
    out = []
    known = set(known)
    while len(out) < add:
        counts = {}
        for s, n in seqs.items():
            for p in zip(s, s[1:]):
                counts[p] = counts.get(p, 0) + n
        ok = [(c, p) for p, c in counts.items() if c >= min_count and p[0] + p[1] not in known and allowed(p[0] + p[1])]
        if not ok:
            break
        best = max(c for c, _ in ok)
        pair = min(p for c, p in ok if c == best)
        out.append(pair)
        known.add(pair[0] + pair[1])
        merged = {}
        for s, n in seqs.items():
            t, j = [], 0
            while j < len(s):
                if j + 1 < len(s) and (s[j], s[j + 1]) == pair:
                    t.append(s[j] + s[j + 1])
                    j += 2
                else:
                    t.append(s[j])
                    j += 1
            merged[tuple(t)] = merged.get(tuple(t), 0) + n
        seqs = merged
    return out


def test_learned_merges_equal_a_naive_bpe():
    rng = random.Random(0)
    for trial in range(5):
        words = {}
        for _ in range(60):
            w = tuple(rng.choice("abcde") for _ in range(rng.randint(1, 7)))
            words[w] = words.get(w, 0) + rng.randint(1, 4)
        allowed = (lambda t: True) if trial % 2 else (lambda t: "a" in t or "b" in t)
        got = tokenizers.learn_merges(words, 25, allowed, {"cd"})
        assert got == _naive_merges(words, 25, allowed, {"cd"}), trial


def test_what_cannot_be_extended_is_one_line(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    wp.save(str(tmp_path / "wp.json"))
    corpus = os.path.join(TEXT, "hindi.txt")
    base = tmp_path / "b" / "tokenizer.json"
    tokenizers.train_bpe(_english()[:2], 300, str(base))
    (tmp_path / "m.model").write_bytes(b"not a model")
    english = tmp_path / "en.txt"
    english.write_text("only latin letters here\n" * 20)
    cases = [(["tokenizer", "extend", str(tmp_path / "wp.json"), "--corpus", corpus], "model type WordPiece"),
             (["tokenizer", "extend", str(tmp_path / "m.model"), "--corpus", corpus], "does not load as SentencePiece"),
             (["tokenizer", "extend", str(_spm(tmp_path, "unigram")), "--corpus", corpus], "UNIGRAM model cannot"),
             (["tokenizer", "extend", str(base), "--corpus", corpus, "--scripts", "Klingon"], "unknown script"),
             (["tokenizer", "extend", str(base), "--corpus", str(english)], "no script besides Latin"),
             (["tokenizer", "extend", str(tmp_path / "none.json"), "--corpus", corpus], "not found")]
    for argv, message in cases:
        assert main(argv + ["--add", "10", "--out", str(tmp_path / "out")]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("maxtrain: error:") and message in err[0], (argv, err)
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_prepare_prints_the_per_script_figures_of_its_corpus(tmp_path, capsys):
    corpus = tmp_path / "in"
    corpus.mkdir()
    for name in ("hindi.txt", "tamil.txt"):
        (corpus / name).write_text(open(os.path.join(TEXT, name), encoding="utf-8").read(), encoding="utf-8")
    assert main(["prepare", "--input", str(corpus), "--output", str(tmp_path / "out"), "--workers", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("per script, on the first") and out[2].startswith("script")
    rows = {line.split()[0]: line.split() for line in out[3:]}
    assert set(rows) == {"Devanagari", "Tamil", "Common"} or set(rows) == {"Devanagari", "Tamil"}, out
    assert rows["Devanagari"][4] == "3.000"  # the byte tokenizer: 3 UTF-8 bytes per Devanagari character
    assert rows["Devanagari"][5] == "100.0%"


def _spm(tmp_path, kind="bpe"):
    spm = pytest.importorskip("sentencepiece")
    prefix = tmp_path / f"spm_{kind}"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_english()), model_prefix=str(prefix), vocab_size=600,
                                   model_type=kind, byte_fallback=True, character_coverage=1.0,
                                   max_sentence_length=1 << 20, minloglevel=2)
    return prefix.with_suffix(".model")


def test_a_sentencepiece_bpe_model_is_extended_keeping_every_piece_and_old_segmentation(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2 as pb

    base = _spm(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(_lines("hindi.txt")[:TRAIN_LINES] + _lines("tamil.txt")[:TRAIN_LINES]), encoding="utf-8")
    # for Devanagari only: the Tamil half of the corpus must leave no trace
    assert main(["tokenizer", "extend", str(base), "--corpus", str(corpus), "--add", "300", "--out",
                 str(tmp_path / "ext"), "--scripts", "Devanagari"]) == 0
    old, new = pb.ModelProto(), pb.ModelProto()
    old.ParseFromString(base.read_bytes())
    new.ParseFromString((tmp_path / "ext" / "tokenizer.model").read_bytes())
    assert [(p.piece, p.score, p.type) for p in new.pieces[:len(old.pieces)]] == [
        (p.piece, p.score, p.type) for p in old.pieces]
    added = new.pieces[len(old.pieces):]
    assert len(added) > 50 and max(p.score for p in added) < min(p.score for p in old.pieces if p.type == 1)
    a = spm.SentencePieceProcessor(model_file=str(base))
    b = spm.SentencePieceProcessor(model_file=str(tmp_path / "ext" / "tokenizer.model"))
    untouched = [t for t in _english() if not any(sc.script_of(c) in ("Devanagari", "Tamil") for c in t)]
    for text in untouched + _lines("other_scripts.txt") + _lines("tamil.txt"):
        assert b.encode(text) == a.encode(text), text[:80]
    held = "\n".join(_lines("hindi.txt")[TRAIN_LINES:] + _lines("tamil.txt")[TRAIN_LINES:])
    before = tokenizers.script_stats(tokenizers.load_tokenizer(str(base)), [held])
    after = tokenizers.script_stats(tokenizers.load_tokenizer(str(tmp_path / "ext" / "tokenizer.model")), [held])
    assert after["Devanagari"]["tokens_per_word"] < 0.6 * before["Devanagari"]["tokens_per_word"], (before, after)
    assert after["Tamil"] == before["Tamil"]
    assert b.decode(b.encode(held)) == a.decode(a.encode(held))  # the same text back (after SentencePiece's NFKC)


def test_tokens_for_one_script_leave_another_of_the_corpus_untouched(extended, tmp_path):
    """Devanagari only, on the Hindi and Tamil corpus: Tamil (same UTF-8 lead byte) tokenizes as before."""
    base, _, held = extended
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(_lines("hindi.txt")[:TRAIN_LINES] + _lines("tamil.txt")[:TRAIN_LINES]), encoding="utf-8")
    assert main(["tokenizer", "extend", str(base), "--corpus", str(corpus), "--add", "200", "--out",
                 str(tmp_path / "ext"), "--scripts", "Devanagari"]) == 0
    old, new = HFTokenizer.from_file(str(base)), HFTokenizer.from_file(str(tmp_path / "ext" / "tokenizer.json"))
    for line in _lines("tamil.txt"):
        assert new.encode(line).ids == old.encode(line).ids, line
    hindi = _lines("hindi.txt")[-1]
    assert len(new.encode(hindi).ids) < 0.6 * len(old.encode(hindi).ids)
