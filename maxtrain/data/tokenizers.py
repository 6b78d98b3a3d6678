"""Tokenizers loaded from local files: `byte`, a Hugging Face `tokenizer.json`, a SentencePiece `.model`."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from maxtrain.config import ConfigError, require_module

BYTE_VOCAB = 256
BYTE_EOS = 256


@dataclass(frozen=True)
class Tokenizer:
    spec: str  # "byte" or the file path it was loaded from
    kind: str  # byte | hf | sentencepiece
    vocab_size: int  # ids are < vocab_size
    eos_id: int
    encode: Callable[[str], list[int]]
    encode_batch: Callable[[list[str]], list[np.ndarray]] | None = None  # faster path, same ids
    decode: Callable[[list[int]], str] | None = None  # ids -> text (`maxtrain generate`)
    token_bytes: Callable[[int], bytes] | None = None  # one token's bytes (`tokenizer stats`' byte fallback)

    def encode_docs(self, docs: list[str]) -> list[np.ndarray]:
        """Token ids of each document with EOS appended, in the shard dtype."""
        dtype = token_dtype(self.vocab_size)
        ids = self.encode_batch(docs) if self.encode_batch else [np.asarray(self.encode(d)) for d in docs]
        return [np.concatenate([np.asarray(x, dtype=dtype), np.array([self.eos_id], dtype)]) for x in ids]

    def describe(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


def _byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _byte_encode_batch(docs: list[str]) -> list[np.ndarray]:
    return [np.frombuffer(d.encode("utf-8"), np.uint8) for d in docs]


def _byte_decode(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", "replace")  # EOS and beyond dropped


def byte_tokenizer() -> Tokenizer:
    return Tokenizer("byte", "byte", BYTE_VOCAB + 1, BYTE_EOS, _byte_encode, _byte_encode_batch, _byte_decode,
                     lambda i: bytes([i]) if i < BYTE_VOCAB else b"")


def load_tokenizer(spec: str) -> Tokenizer:
    """`byte`, a `tokenizer.json` (or a directory holding one), or a SentencePiece `.model` file."""
    if spec == "byte":
        return byte_tokenizer()
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer {spec} not found; give 'byte', a tokenizer.json or a SentencePiece .model")
    if path.endswith(".model"):
        return _sentencepiece(path)
    return _hf(path)


def _hf(path: str) -> Tokenizer:
    HFTokenizer = require_module("tokenizers", "tokenizers", f"the tokenizer {path}", "data").Tokenizer

    try:
        tok = HFTokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001  (the library raises plain Exceptions for bad files)
        raise ConfigError(f"tokenizer {path} does not load: {str(e).splitlines()[0][:200]}") from None
    eos = _special_id(tok.token_to_id, ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[EOS]"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if eos is None:
        raise ConfigError(f"tokenizer {path} has no end-of-text token (</s>, <|endoftext|>, <eos>, ...)")

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def encode_batch(docs: list[str]) -> list[np.ndarray]:  # the Rust side parallelises the batch
        return [np.asarray(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False)]

    to_byte = byte_of_char()

    def token_bytes(i: int) -> bytes:
        piece = tok.id_to_token(int(i)) or ""
        if all(c in to_byte for c in piece):  # byte-level BPE
            return bytes(to_byte[c] for c in piece)
        return _piece_bytes(piece)

    return Tokenizer(path, "hf", vocab, eos, encode, encode_batch, lambda ids: tok.decode(list(ids)), token_bytes)


def _piece_bytes(piece: str) -> bytes:
    """A SentencePiece-style piece's bytes: `<0xNN>` is that byte (byte fallback), `▁` a space."""
    b = fallback_byte(piece)
    return bytes([b]) if b is not None else piece.replace("\u2581", " ").encode("utf-8")


def _special_id(lookup, names: Iterable[str]) -> int | None:
    for name in names:
        i = lookup(name)
        if i is not None:
            return int(i)
    return None


def _sentencepiece(path: str) -> Tokenizer:
    spm = require_module("sentencepiece", "sentencepiece", f"the SentencePiece tokenizer {path}", "data")

    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"tokenizer {path} does not load as SentencePiece: {str(e).splitlines()[0][:200]}") from None
    eos = sp.eos_id()
    if eos < 0:
        raise ConfigError(f"tokenizer {path} has no end-of-sequence id")

    def encode(text: str) -> list[int]:
        return sp.encode(text)

    def encode_batch(docs: list[str]) -> list[np.ndarray]:
        return [np.asarray(x) for x in sp.encode(docs)]

    return Tokenizer(path, "sentencepiece", sp.get_piece_size(), eos, encode, encode_batch,
                     lambda ids: sp.decode([int(i) for i in ids]), lambda i: _piece_bytes(sp.id_to_piece(int(i))))


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str) -> Tokenizer:
    """Trains a byte-level BPE tokenizer with an `<|endoftext|>` token and saves it as tokenizer.json."""
    require_module("tokenizers", "tokenizers", "--train-tokenizer", "data")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tok.save(out_path)
    return _hf(out_path)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# ---------------------------------------------------------------- extending a tokenizer for new scripts


@functools.lru_cache(maxsize=1)
def byte_level_alphabet() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet (`tokenizers`' ByteLevel): the character standing for each byte,
    printable bytes as themselves and the others as code points from 256 on, in byte order; tokens
    in a byte-level tokenizer.json are strings of these."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    out, others = [], 0
    for b in range(256):
        out.append(chr(b) if b in printable else chr(256 + others))
        others += b not in printable
    return tuple(out)


@functools.lru_cache(maxsize=1)
def byte_of_char() -> dict[str, int]:
    """`byte_level_alphabet` inverted: the byte each character stands for."""
    return {c: b for b, c in enumerate(byte_level_alphabet())}


def fallback_byte(piece: str) -> int | None:
    """The byte a SentencePiece-style byte-fallback piece `<0xNN>` stands for, else None."""
    return int(piece[3:5], 16) if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") else None


def _is_byte_level(part: dict | None) -> bool:
    if not part:
        return False
    if part.get("type") == "ByteLevel":
        return True
    return part.get("type") == "Sequence" and any(_is_byte_level(p) for p in part.get("pretokenizers", []))


def extendable_bpe(spec: dict, path: str) -> None:
    """Refuses, in one line, a tokenizer.json whose extension by appended merges could change how
    it splits text it already knows."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigError(f"tokenizer {path}: model type {model.get('type')} cannot be extended; "
                          "`maxtrain tokenizer extend` adds merges to a byte-level BPE tokenizer.json")
    if not _is_byte_level(spec.get("pre_tokenizer")):
        raise ConfigError(f"tokenizer {path}: its BPE is not byte-level (SentencePiece-style, with byte fallback); "
                          "extend the model's tokenizer.model instead (or give the model directory)")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or model.get("dropout"):
        raise ConfigError(f"tokenizer {path}: BPE with continuing_subword_prefix, end_of_word_suffix or dropout "
                          "cannot be extended safely")


def learn_merges(words: dict[tuple[str, ...], int], add: int, allowed: Callable[[str], bool],
                 known: set[str], min_count: int = 2) -> list[tuple[str, str]]:
    """Up to `add` BPE merges learned on `words` (each a word's base tokens -> its count), greedily
    by count (ties by the pair's text), only pairs whose merged text `allowed` passes and is not in
    `known`. Continuing the base's BPE this way keeps its result: appended merges rank after every
    base merge, so the base's merges all apply first."""
    import heapq

    seqs = [list(w) for w in words]
    freq = list(words.values())
    counts: dict[tuple[str, str], int] = {}
    where: dict[tuple[str, str], set[int]] = {}
    for i, s in enumerate(seqs):
        for pair in zip(s, s[1:]):
            counts[pair] = counts.get(pair, 0) + freq[i]
            where.setdefault(pair, set()).add(i)
    heap = [(-c, pair) for pair, c in counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    verdict: dict[tuple[str, str], bool] = {}
    while heap and len(merges) < add:
        c, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -c:
            continue  # stale entry
        if -c < min_count:
            break
        ok = verdict.get(pair)
        if ok is None:
            ok = verdict[pair] = pair[0] + pair[1] not in known and allowed(pair[0] + pair[1])
        if not ok:
            continue
        merged = pair[0] + pair[1]
        merges.append(pair)
        known.add(merged)
        changed: dict[tuple[str, str], int] = {}
        for i in where.pop(pair, set()):
            s, f = seqs[i], freq[i]
            for p in zip(s, s[1:]):
                changed[p] = changed.get(p, 0) - f
            out, j = [], 0
            while j < len(s):
                if j + 1 < len(s) and (s[j], s[j + 1]) == pair:
                    out.append(merged)
                    j += 2
                else:
                    out.append(s[j])
                    j += 1
            seqs[i] = out
            for p in zip(out, out[1:]):
                changed[p] = changed.get(p, 0) + f
                where.setdefault(p, set()).add(i)
        counts.pop(pair, None)
        for p, delta in changed.items():
            if p == pair or not delta:
                continue
            counts[p] = counts.get(p, 0) + delta
            if counts[p] <= 0:
                counts.pop(p)
            else:
                heapq.heappush(heap, (-counts[p], p))
    return merges


def extend(base: str, texts: Iterable[str], add: int, out_dir: str, scripts: list[str] | None = None,
           min_count: int = 2) -> dict:
    """`maxtrain tokenizer extend`: a byte-level BPE tokenizer.json (`extend_bpe`) or a SentencePiece
    BPE model (`extend_sentencepiece`); a model directory's tokenizer.json when it is byte-level BPE,
    else its tokenizer.model."""
    import json

    if os.path.isdir(base):
        tj, tm = os.path.join(base, "tokenizer.json"), os.path.join(base, "tokenizer.model")
        byte_level = False
        if os.path.isfile(tj):
            try:
                with open(tj, encoding="utf-8") as f:
                    byte_level = _is_byte_level(json.load(f).get("pre_tokenizer"))
            except ValueError:
                byte_level = False
        if not byte_level and os.path.isfile(tm):
            return extend_sentencepiece(tm, texts, add, out_dir, scripts, min_count, copy_from=base)
    elif base.endswith(".model"):
        return extend_sentencepiece(base, texts, add, out_dir, scripts, min_count)
    return extend_bpe(base, texts, add, out_dir, scripts, min_count)


def _target_scripts(texts: list[str], scripts: list[str] | None) -> list[str]:
    from maxtrain.data import scripts as sc

    if not scripts:
        scripts = [s for s in sc.script_shares(texts, 0.01) if s not in ("Latin", "Other")]
        if not scripts:
            raise ConfigError("the corpus has no script besides Latin to add tokens for (pass --scripts to choose)")
    sc.ranges_of(scripts)  # unknown names: ValueError
    return scripts


def _copy_tokenizer_side_files(base_dir: str, out_dir: str, skip: tuple[str, ...]) -> None:
    """A model directory's tokenizer_config.json, special_tokens_map.json, ... beside the extended file."""
    import shutil

    for name in os.listdir(base_dir):
        if name not in skip and name.startswith(("tokenizer", "special_tokens")) and name.endswith(".json"):
            shutil.copy(os.path.join(base_dir, name), os.path.join(out_dir, name))


def extend_sentencepiece(path: str, texts: Iterable[str], add: int, out_dir: str, scripts: list[str] | None = None,
                         min_count: int = 2, copy_from: str | None = None) -> dict:
    """A copy of the SentencePiece BPE model `path` with up to `add` pieces for `scripts` appended:
    first the characters of those scripts the base spells with byte fallback, then pieces learned by
    continuing BPE on the base's pieces, each scored below every base piece (SentencePiece's BPE
    merges the highest-scored piece first, so the base's all apply first). Every piece holds a
    character of `scripts`: text without one tokenizes as before. Writes out_dir/tokenizer.model."""
    spm = require_module("sentencepiece", "sentencepiece", "tokenizer extend", "data")
    from sentencepiece import sentencepiece_model_pb2 as pb

    from maxtrain.data import scripts as sc

    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer {path} not found")
    proto = pb.ModelProto()
    try:
        with open(path, "rb") as f:
            proto.ParseFromString(f.read())
        sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    except Exception as e:  # noqa: BLE001  (protobuf and sentencepiece raise plain Exceptions)
        raise ConfigError(f"tokenizer {path} does not load as SentencePiece: {str(e).splitlines()[0][:200]}") from None
    if proto.trainer_spec.model_type != pb.TrainerSpec.BPE:
        kind = pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
        raise ConfigError(f"tokenizer {path}: a SentencePiece {kind} model cannot be extended safely (new pieces "
                          "change a unigram model's segmentation scores); `maxtrain tokenizer extend` adds to BPE models")
    texts = list(texts)
    scripts = _target_scripts(texts, scripts)
    ranges = sc.ranges_of(scripts)
    targeted = lambda piece: any(any(a <= ord(c) <= z for a, z in ranges) for c in piece)  # noqa: E731
    known = {p.piece for p in proto.pieces}
    words: dict[tuple[str, ...], int] = {}
    chars: dict[str, int] = {}
    for text in texts:
        for word in text.split():
            symbols = _spm_symbols(sp, word)
            words[symbols] = words.get(symbols, 0) + 1
            for c in symbols:
                if c not in known and len(c) == 1 and targeted(c):
                    chars[c] = chars.get(c, 0) + 1
    new_chars = sorted((c for c, n in chars.items() if n >= min_count), key=lambda c: (-chars[c], c))[:add]
    known |= set(new_chars)
    segments: dict[tuple[str, ...], int] = {}  # split at symbols that stay unknown: they never merge
    for word, n in words.items():
        run: list[str] = []
        for c in word + ("\0",):
            if c in known:
                run.append(c)
                continue
            if len(run) > 1:
                segments[tuple(run)] = segments.get(tuple(run), 0) + n
            run = []
    merges = learn_merges(segments, add - len(new_chars), targeted, set(known), min_count)
    floor = min((p.score for p in proto.pieces if p.type == pb.ModelProto.SentencePiece.NORMAL), default=0.0)
    first_id = len(proto.pieces)
    for i, piece in enumerate(new_chars + [a + b for a, b in merges]):
        proto.pieces.add(piece=piece, score=floor - 1 - i, type=pb.ModelProto.SentencePiece.NORMAL)
    os.makedirs(out_dir, exist_ok=True)
    if copy_from:
        _copy_tokenizer_side_files(copy_from, out_dir, skip=("tokenizer.json",))  # the .json would be stale
    out = os.path.join(out_dir, "tokenizer.model")
    with open(out + ".tmp", "wb") as f:
        f.write(proto.SerializeToString())
    os.replace(out + ".tmp", out)
    added = len(new_chars) + len(merges)
    return {"base": path, "out": out, "scripts": scripts, "added": added, "asked": add,
            "base_vocab_size": first_id, "vocab_size": first_id + added, "first_new_id": first_id,
            "examples": (new_chars + [a + b for a, b in merges])[:8]}


def _spm_symbols(sp, word: str) -> tuple[str, ...]:
    """`word`'s base pieces, with each run of byte-fallback pieces turned back into its characters."""
    out: list[str] = []
    raw = bytearray()
    for piece in sp.encode(word, out_type=str):
        b = fallback_byte(piece)
        if b is not None:
            raw.append(b)
            continue
        if raw:
            out += list(raw.decode("utf-8", "replace"))
            raw.clear()
        out.append(piece)
    if raw:
        out += list(raw.decode("utf-8", "replace"))
    return tuple(out)


def extend_bpe(base: str, texts: Iterable[str], add: int, out_dir: str, scripts: list[str] | None = None,
               min_count: int = 2) -> dict:
    """A copy of the byte-level BPE `base` (a tokenizer.json or a directory holding one) with up to
    `add` merges learned on `texts` appended after the base's, each new token given the next free
    id: every base token keeps its id, and only text with a character of `scripts` (default: the
    corpus's scripts other than Latin with at least 1% of its letters) can tokenize differently,
    since every new token holds a prefix of such a character that no other character shares.
    Writes out_dir/tokenizer.json (and copies the base directory's other tokenizer files); returns
    what was added."""
    import json

    from maxtrain.data import scripts as sc

    require_module("tokenizers", "tokenizers", "tokenizer extend", "data")
    from tokenizers import Tokenizer as HFTokenizer

    path = os.path.join(base, "tokenizer.json") if os.path.isdir(base) else base
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer {base} not found; give a tokenizer.json or a directory holding one")
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        tok = HFTokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"tokenizer {path} does not load: {str(e).splitlines()[0][:200]}") from None
    extendable_bpe(spec, path)
    texts = list(texts)
    scripts = _target_scripts(texts, scripts)
    ranges = sc.ranges_of(scripts)
    to_byte = byte_of_char()
    anchored = lambda token: sc.anchored_prefix(bytes(to_byte[c] for c in token), ranges)  # noqa: E731
    counts: dict[str, int] = {}
    for text in texts:
        text = tok.normalizer.normalize_str(text) if tok.normalizer else text
        for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text):
            counts[piece] = counts.get(piece, 0) + 1
    words: dict[tuple[str, ...], int] = {}
    for piece, n in counts.items():
        key = tuple(t.value for t in tok.model.tokenize(piece))
        words[key] = words.get(key, 0) + n
    vocab = spec["model"]["vocab"]
    merges = learn_merges(words, add, anchored, set(vocab), min_count)
    next_id = 1 + max([*vocab.values(), *(t["id"] for t in spec.get("added_tokens", []))])
    for i, (a, b) in enumerate(merges):
        vocab[a + b] = next_id + i
    old = spec["model"]["merges"]
    spec["model"]["merges"] = old + [[a, b] if old and isinstance(old[0], list) else f"{a} {b}" for a, b in merges]
    os.makedirs(out_dir, exist_ok=True)
    if os.path.isdir(base):  # the model's tokenizer_config.json, special_tokens_map.json, ...
        _copy_tokenizer_side_files(base, out_dir, skip=("tokenizer.json",))
    out = os.path.join(out_dir, "tokenizer.json")
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    os.replace(out + ".tmp", out)
    new = HFTokenizer.from_file(out)
    return {"base": path, "out": out, "scripts": scripts, "added": len(merges), "asked": add,
            "base_vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "vocab_size": new.get_vocab_size(with_added_tokens=True), "first_new_id": next_id,
            "examples": [bytes(to_byte[c] for c in a + b).decode("utf-8", "backslashreplace") for a, b in merges[:8]]}


# ---------------------------------------------------------------- per-script statistics


def script_stats(tok: Tokenizer, texts: Iterable[str]) -> dict[str, dict[str, float]]:
    """Per script (`maxtrain.data.scripts`, each word by most of its letters): words, characters,
    bytes, tokens, tokens per word and per character, and the share of the bytes that went to
    byte-fallback tokens (a token whose bytes are not whole UTF-8 characters, or `<0xNN>`). Each
    whitespace-separated word is tokenized on its own, the same way for every tokenizer."""
    from maxtrain.data import scripts as sc

    words: dict[str, list[str]] = {}
    for text in texts:
        for w in sc.WORD.findall(text):
            words.setdefault(sc.word_script(w), []).append(w)
    out = {}
    for script, ws in sorted(words.items(), key=lambda kv: -len(kv[1])):
        ids = tok.encode_batch(ws) if tok.encode_batch else [tok.encode(w) for w in ws]
        n_tokens = sum(len(x) for x in ids)
        n_bytes = sum(len(w.encode("utf-8")) for w in ws)
        fallback = 0
        if tok.token_bytes is not None:
            for x in ids:
                for i in x:
                    b = tok.token_bytes(int(i))
                    if _is_fallback(b):
                        fallback += len(b)
        chars = sum(len(w) for w in ws)
        out[script] = {"words": len(ws), "chars": chars, "bytes": n_bytes, "tokens": n_tokens,
                       "tokens_per_word": n_tokens / len(ws), "tokens_per_char": n_tokens / max(chars, 1),
                       "byte_fallback_share": fallback / max(n_bytes, 1) if tok.token_bytes else float("nan")}
    return out


def _is_fallback(b: bytes) -> bool:
    """Bytes that are not whole UTF-8 characters (a multi-byte character split across tokens)."""
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def stats_lines(stats: list[tuple[str, dict]]) -> list[str]:
    """`script_stats` of one or more tokenizers as one table, side by side per script."""
    scripts = []
    for _, st in stats:
        scripts += [s for s in st if s not in scripts]
    head = f"{'script':<12}{'words':>7}{'chars':>7}" + "".join(
        f"  {name[-22:]:>22} tok/word tok/char fallback" for name, _ in stats)
    lines = [head]
    for s in scripts:
        first = next(st[s] for _, st in stats if s in st)
        row = f"{s:<12}{first['words']:>7}{first['chars']:>7}"
        for _, st in stats:
            r = st.get(s)
            row += (f"  {'':>22} {r['tokens_per_word']:>8.2f} {r['tokens_per_char']:>8.3f} "
                    f"{100 * r['byte_fallback_share']:>7.1f}%") if r else f"  {'':>22} {'-':>8} {'-':>8} {'-':>8}"
        lines.append(row)
    return lines


# ---------------------------------------------------------------- an extension's new tokens, in base pieces


def tokenizer_file(spec: str, prefer: str | None = None) -> str:
    """The tokenizer file `spec` names: itself, or in a directory its tokenizer.json (or, with
    `prefer=".model"` or no tokenizer.json, its tokenizer.model)."""
    if not os.path.isdir(spec):
        return spec
    tj, tm = os.path.join(spec, "tokenizer.json"), os.path.join(spec, "tokenizer.model")
    if prefer == ".model" and os.path.isfile(tm):
        return tm
    return tj if os.path.isfile(tj) else tm


def new_token_pieces(base: str, extended: str) -> tuple[int, dict[int, list[int]]]:
    """(the base's vocabulary size, each token of `extended` that `base` lacks -> the base ids that
    spell it): byte-level BPE tokens by the base's BPE of their bytes, SentencePiece pieces by
    their characters (the base's piece for each, or its byte-fallback pieces). Refuses, in one line,
    an `extended` that is not an extension of `base`: a base token with another id, or another kind."""
    ext_path = tokenizer_file(extended)
    base_path = tokenizer_file(base, prefer=".model" if ext_path.endswith(".model") else None)
    for path in (base_path, ext_path):
        if not os.path.isfile(path):
            raise ConfigError(f"tokenizer {path} not found; give a tokenizer.json, a .model or a directory holding one")
    if ext_path.endswith(".model") != base_path.endswith(".model"):
        raise ConfigError(f"{extended} ({os.path.basename(ext_path)}) is not an extension of {base} "
                          f"({os.path.basename(base_path)}): one is SentencePiece, the other not")
    if ext_path.endswith(".model"):
        return _spm_new_pieces(base_path, ext_path, extended)
    return _hf_new_pieces(base_path, ext_path, extended)


def _hf_new_pieces(base_path: str, ext_path: str, extended: str) -> tuple[int, dict[int, list[int]]]:
    require_module("tokenizers", "tokenizers", "growing a model's vocabulary", "data")
    from tokenizers import Tokenizer as HFTokenizer

    base, ext = HFTokenizer.from_file(base_path), HFTokenizer.from_file(ext_path)
    old = base.get_vocab(with_added_tokens=True)
    moved = [t for t, i in old.items() if ext.token_to_id(t) != i]
    if moved:
        raise ConfigError(f"{extended} is not an extension of {base_path}: {len(moved)} base tokens have other ids "
                          f"(e.g. {moved[0]!r}); extend the model's own tokenizer (maxtrain tokenizer extend)")
    size = base.get_vocab_size(with_added_tokens=True)
    new = {i: [t.id for t in base.model.tokenize(tok)] for tok, i in ext.get_vocab(with_added_tokens=True).items()
           if tok not in old}
    return size, new


def _spm_new_pieces(base_path: str, ext_path: str, extended: str) -> tuple[int, dict[int, list[int]]]:
    spm = require_module("sentencepiece", "sentencepiece", "growing a model's vocabulary", "data")

    base = spm.SentencePieceProcessor(model_file=base_path)
    ext = spm.SentencePieceProcessor(model_file=ext_path)
    size = base.get_piece_size()
    moved = [i for i in range(size) if i >= ext.get_piece_size() or ext.id_to_piece(i) != base.id_to_piece(i)]
    if moved:
        raise ConfigError(f"{extended} is not an extension of {base_path}: base piece {moved[0]} "
                          f"({base.id_to_piece(moved[0])!r}) differs; extend the model's own tokenizer")
    unk = base.unk_id()

    def spelled(piece: str) -> list[int]:
        ids = []
        for c in piece:
            i = base.piece_to_id(c)
            if i == unk and c != base.id_to_piece(unk):
                ids += [base.piece_to_id(f"<0x{b:02X}>") for b in c.encode("utf-8")]
            else:
                ids.append(i)
        return ids

    return size, {i: spelled(ext.id_to_piece(i)) for i in range(size, ext.get_piece_size())}
