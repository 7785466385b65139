"""The ``loglinear`` command: one subcommand per module, each exposing ``add_arguments`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). A module defines add_arguments(parser) and run(args) -> int | None.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("loglinear.eval.demo", "check both variants in all three forms and show how the decoding state grows"),
    "mqar": ("loglinear.train.mqar", "multi-query associative recall sweep: log-linear vs linear vs Transformer"),
    "train": ("loglinear.train.command", "train a language model on real text (one process or torchrun + FSDP2)"),
    "eval": ("loglinear.eval.command",
             "validation perplexity, per-position loss and needle-in-a-haystack of trained runs"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="loglinear",
                                     description="Log-linear attention: demos, experiments, training.")
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = {name: sub.add_parser(name, help=text, description=text) for name, (_, text) in COMMANDS.items()}
    # import only the chosen command's module: `loglinear demo` needs none of the training extras
    chosen = next((arg for arg in argv if arg in COMMANDS), None)
    module = importlib.import_module(COMMANDS[chosen][0]) if chosen else None
    if module is not None:
        module.add_arguments(parsers[chosen])
    args = parser.parse_args(argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
