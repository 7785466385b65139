"""The ``loglinear`` command: one subcommand per module, each exposing ``add_arguments`` and ``run``."""

from __future__ import annotations

import argparse
import importlib

# name -> (module, one-line help). A module defines add_arguments(parser) and run(args) -> int | None.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("loglinear.eval.demo", "check both variants in all three forms and show how the decoding state grows"),
    "mqar": ("loglinear.train.mqar", "multi-query associative recall sweep: log-linear vs linear vs Transformer"),
    "train": ("loglinear.train.command", "train a language model on real text (one process or torchrun + FSDP2)"),
    "eval": ("loglinear.eval.command", "validation perplexity, per-position loss and needle-in-a-haystack of trained runs"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loglinear", description="Log-linear attention: demos, experiments, training.")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        modules[name] = mod
        mod.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
