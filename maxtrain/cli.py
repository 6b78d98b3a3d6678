"""The `maxtrain` command."""

from __future__ import annotations

import argparse
import logging
import sys

from maxtrain.config import ConfigError

USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # same one-line contract as config errors
        self.exit(USER_ERROR, f"maxtrain: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="maxtrain", description="JAX/XLA trainer for large language models")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train from a YAML config with KEY=VALUE overrides")
    t.add_argument("config", help="YAML config path, e.g. configs/tiny.yaml")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.fsdp=4 train.steps=100")
    return p


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    for noisy in ("absl", "jax"):  # e.g. jax's INFO line about a missing TPU backend
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging()
    try:
        if args.command == "train":
            from maxtrain.config import load_config
            from maxtrain.train import train

            train(load_config(args.config, args.overrides))
    except ConfigError as e:
        print(f"maxtrain: error: {e}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print("maxtrain: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
