"""What growing a vocabulary does to a trained model before any further training: bits per byte of
held-apart text under the base model on its own tokenization against the grown model on the
extended tokenization, for each `--grow-init` (issue 48 item 3).

    python bench/vocab_growth.py --steps 300

A byte-level BPE of 512 tokens is trained on this repository's English docs; a small Llama is
trained with it on those docs plus the first 12 lines of Hindi and Tamil in tests/fixtures/text
(so it has seen the scripts, as an English-centric base model has, in bytes); it is exported to
Hugging Face, its tokenizer extended on those Hindi and Tamil lines (`maxtrain tokenizer extend
--add N`), and grown three times (`hf-to-maxtrain --tokenizer ... --grow-init pieces|mean|random
--measure`). The measure is the last 8 lines of each Indic file and an English doc held out of
training. Prints each table, then one JSON line. The Indic sample is tiny (20 lines per script,
written for the tests): the figures show the direction and size of the effect of each
initialisation, not a corpus-level number.
"""

import argparse
import glob
import json
import os
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from maxtrain import cli  # noqa: E402
from maxtrain.checkpoint import Checkpointer  # noqa: E402
from maxtrain.convert import growth_lines  # noqa: E402
from maxtrain.data.tokenizers import train_bpe  # noqa: E402

TEXT = os.path.join(ROOT, "tests", "fixtures", "text")
HELD_DOC = "continued_pretraining.md"


def _lines(name: str) -> list[str]:
    with open(os.path.join(TEXT, name), encoding="utf-8") as f:
        return [x.strip() for x in f if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps of the base model")
    ap.add_argument("--add", type=int, default=200, help="tokens the extension adds")
    args = ap.parse_args()
    docs = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    english = [open(p, encoding="utf-8").read() for p in docs if not p.endswith(HELD_DOC)]
    held_english = [x.strip() for x in open(os.path.join(ROOT, "docs", HELD_DOC), encoding="utf-8")
                    if len(x.strip()) > 40][:40]
    hindi, tamil = _lines("hindi.txt"), _lines("tamil.txt")
    with tempfile.TemporaryDirectory(prefix="vocab-growth-") as work:
        tok = os.path.join(work, "tok", "tokenizer.json")
        train_bpe(english, 512, tok)
        corpus = os.path.join(work, "train.jsonl")
        with open(corpus, "w", encoding="utf-8") as f:
            for doc in english + ["\n".join(hindi[:12])] * 20 + ["\n".join(tamil[:12])] * 20:
                f.write(json.dumps({"text": doc}) + "\n")
        new_lang = os.path.join(work, "new.txt")
        with open(new_lang, "w", encoding="utf-8") as f:
            f.write("\n".join(hindi[:12] + tamil[:12]))
        measure = os.path.join(work, "measure.txt")
        with open(measure, "w", encoding="utf-8") as f:
            f.write("\n".join(hindi[12:] + tamil[12:] + held_english))
        data = os.path.join(work, "data")
        assert cli.main(["prepare", "--input", corpus, "--output", data, "--tokenizer", tok, "--workers", "1"]) == 0
        ck = os.path.join(work, "ck")
        assert cli.main(["train", os.path.join(ROOT, "configs", "tiny.yaml"), f"run_dir={work}/run",
                         "data.kind=tokens", f"data.path={data}", "model.vocab_size=512", f"train.steps={args.steps}",
                         "train.log_every=100", f"checkpoint.dir={ck}", f"checkpoint.every={args.steps}",
                         "reliability.preflight=off"]) == 0
        hf = os.path.join(work, "hf")
        assert cli.main(["convert", "maxtrain-to-hf", ck, hf]) == 0
        ext = os.path.join(work, "ext")
        assert cli.main(["tokenizer", "extend", hf, "--corpus", new_lang, "--add", str(args.add), "--out", ext]) == 0
        results = {}
        for init in ("pieces", "mean", "random"):
            out = os.path.join(work, f"grown-{init}")
            assert cli.main(["convert", "hf-to-maxtrain", hf, out, "--tokenizer", ext, "--grow-init", init,
                             "--measure", measure, "train.dtype=float32"]) == 0
            c = Checkpointer(out)
            try:
                results[init] = c.read_meta(0)["grown_vocab"]["measured"]
            finally:
                c.close()
    for init, measured in results.items():
        print(f"\n--grow-init {init} (base trained {args.steps} steps, {args.add} tokens added):")
        print("\n".join(growth_lines(measured)))
    print(json.dumps({"steps": args.steps, "add": args.add, "measured": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
