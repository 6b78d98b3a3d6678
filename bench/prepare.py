"""Tokenizing throughput of `maxtrain prepare`, per core: the local engine with one worker process and
the Ray engine on a local cluster of `--cpus` CPUs, for the byte, SentencePiece and Hugging Face
(byte-level BPE) tokenizers, each pair of outputs compared byte for byte.

    python bench/prepare.py --mb 32 --cpus 2

The corpus is the Python standard library's UTF-8 source files, one JSONL document each (so the Ray
engine cuts it into byte ranges of `--piece-mib`). RAYON_NUM_THREADS=1 keeps the Hugging Face
tokenizer's batch encoding on one thread per process, so a worker is one core. The Ray figure
includes starting the local cluster and the count and write rounds: on a small corpus that start
dominates; on terabytes it does not. Prints a table, then one JSON line.
"""

import argparse
import filecmp
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from maxtrain.data.prepare import prepare  # noqa: E402
from maxtrain.data.prepare_ray import prepare_ray  # noqa: E402
from maxtrain.data.text import stdlib_files  # noqa: E402
from maxtrain.data.tokenizers import train_bpe  # noqa: E402


def corpus(path: str, mb: float) -> tuple[int, list[str]]:
    """A JSONL file of up to `mb` MiB of standard-library sources; returns its text bytes and a
    sample of documents (for training the tokenizers)."""
    total, sample = 0, []
    with open(path, "w", encoding="utf-8") as out:
        for f in stdlib_files():
            try:
                with open(f, encoding="utf-8") as fh:
                    text = fh.read()
            except (UnicodeDecodeError, OSError):  # a few are Latin-1: prepare refuses them
                continue
            if not text.strip():
                continue
            if total + len(text.encode()) > mb * 2**20:
                break
            out.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode())
            if len(sample) < 400:
                sample.append(text)
    return total, sample


def sentencepiece_model(sample: list[str], vocab: int, prefix: str) -> str:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(sample), model_prefix=prefix, vocab_size=vocab,
                                   model_type="bpe", byte_fallback=True, max_sentence_length=1 << 20,
                                   minloglevel=2)
    return prefix + ".model"


def same_files(a: str, b: str) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)
                                                  for n in names)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=32.0, help="MiB of text (default 32)")
    p.add_argument("--cpus", type=int, default=os.cpu_count(), help="CPUs of the local Ray cluster")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary of the trained tokenizers")
    p.add_argument("--piece-mib", type=float, default=1.0, help="the Ray engine's piece size (default 1 MiB)")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--tokenizers", default="byte,sentencepiece,hf")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="maxtrain-prepare-bench-")
    rows = []
    try:
        text_bytes, sample = corpus(os.path.join(root, "corpus.jsonl"), args.mb)
        mib = text_bytes / 2**20
        specs = {"byte": lambda: "byte",
                 "sentencepiece": lambda: sentencepiece_model(sample, args.vocab, os.path.join(root, "sp")),
                 "hf": lambda: train_bpe(sample, args.vocab, os.path.join(root, "hf", "tokenizer.json")).spec}
        for name in args.tokenizers.split(","):
            spec = specs[name]()
            out_local, out_ray = os.path.join(root, f"{name}-local"), os.path.join(root, f"{name}-ray")
            t0 = time.perf_counter()
            prepare(os.path.join(root, "corpus.jsonl"), out_local, spec, shards=args.shards, workers=1, progress=False)
            local_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            m = prepare_ray(os.path.join(root, "corpus.jsonl"), out_ray, spec, shards=args.shards, workers=args.cpus,
                            piece_bytes=int(args.piece_mib * 2**20), progress=False)
            ray_s = time.perf_counter() - t0
            tokenize_s = m["rounds"]["tokenize_s"]
            same = same_files(out_local, out_ray)
            rows.append({"tokenizer": name, "engine": "local", "cores": 1, "seconds": local_s,
                         "mib_per_s": mib / local_s, "mib_per_s_per_core": mib / local_s, "identical": same})
            rows.append({"tokenizer": name, "engine": "ray", "cores": args.cpus, "seconds": ray_s,
                         "mib_per_s": mib / ray_s, "mib_per_s_per_core": mib / ray_s / args.cpus, "identical": same,
                         "rounds": m["rounds"], "tokenize_mib_per_s_per_core": mib / tokenize_s / args.cpus})
            shutil.rmtree(out_local)
            shutil.rmtree(out_ray)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"corpus: {mib:,.1f} MiB of text, {os.cpu_count()} cores on this machine")
    print(f"{'tokenizer':<14}{'engine':<8}{'cores':>6}{'seconds':>9}{'MiB/s':>9}{'MiB/s/core':>12}"
          f"{'tokenize round MiB/s/core':>27}  identical")
    for r in rows:
        tok = f"{r['tokenize_mib_per_s_per_core']:.2f}" if "rounds" in r else "-"
        print(f"{r['tokenizer']:<14}{r['engine']:<8}{r['cores']:>6}{r['seconds']:>9.1f}{r['mib_per_s']:>9.2f}"
              f"{r['mib_per_s_per_core']:>12.2f}{tok:>27}  {'yes' if r['identical'] else 'NO'}")
    ray_rows = [r for r in rows if "rounds" in r]
    for r in ray_rows:
        print(f"ray {r['tokenizer']}: " + ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in r["rounds"].items()))
    print(json.dumps({"text_mib": mib, "rows": rows}))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
