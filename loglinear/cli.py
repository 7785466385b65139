"""The ``loglinear`` command (also ``python -m loglinear``): one subcommand per module, each exposing
``add_arguments`` and ``run``.

Every option's default is shown in ``--help``. A user error (a ValueError or TypeError naming the bad value,
a missing file) ends the command with one line on stderr and exit status 2, a training run that diverged (a
non-finite loss) with one line and status 1; LOGLINEAR_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import NoReturn

from loglinear import __version__
from loglinear.inputs import check_device

# name -> (module, one-line help). A module defines add_arguments(parser) and run(args) -> int | None.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("loglinear.eval.demo", "check both variants in all three forms and show how the decoding state grows"),
    "mqar": ("loglinear.train.mqar", "multi-query associative recall sweep: log-linear vs linear vs Transformer"),
    "train": ("loglinear.train.command", "train a language model on real text (one process or torchrun + FSDP2)"),
    "eval": ("loglinear.eval.command",
             "validation perplexity, per-position loss, needle-in-a-haystack and lm-eval tasks of trained runs"),
    "convert": ("loglinear.models.convert",
                "convert a transformers Mamba2ForCausalLM checkpoint into a plain (linear) loglinear Mamba-2 model"),
}
# the packages of the `train` extra a command needs, checked before it starts (not after a sweep)
NEEDS = {"mqar": ("transformers", "matplotlib"), "train": ("transformers", "tokenizers", "safetensors"),
         "eval": ("transformers", "tokenizers", "matplotlib"), "convert": ("transformers", "safetensors")}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, also for options without a help text (a None default is explained by the
    option's help, not printed)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        if action.help is None and action.default is not argparse.SUPPRESS and action.option_strings:
            return "(default: %(default)s)"
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.default not in (None, argparse.SUPPRESS) and action.option_strings:
            action.help = self._get_help_string(action)
        return super()._format_action(action)


def refuse(prog: str, message: str) -> NoReturn:
    """A command-line value that cannot work, for the benchmark scripts as for the commands: one line on stderr
    (``<prog>: <message>``), exit status 2, before anything runs or is written."""
    print(f"{prog}: {message}", file=sys.stderr)
    sys.exit(2)


def check_script_options(prog: str, at_least: dict[str, tuple[int | list[int], int]],
                         device: str | None = None) -> None:
    """A benchmark script's options: every value of each option in ``at_least`` ({option: (value or values,
    least)}) >= its least, and ``device`` (if given) one this machine has; else refuse(prog, ...) naming the
    option."""
    for option, (values, least) in at_least.items():
        values = values if isinstance(values, list) else [values]
        if any(v < least for v in values):
            refuse(prog, f"{option} must be >= {least}, got {' '.join(map(str, values))}")
    if device is None:
        return
    try:
        check_device("--device", device)
    except ValueError as e:
        refuse(prog, str(e))


def _given_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the options given on the command line (not left at their defaults)."""
    actions = parser._option_string_actions
    return {actions[arg.split("=")[0]].dest for arg in argv if arg.split("=")[0] in actions}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="loglinear", formatter_class=_HelpFormatter,
                                     description="Log-linear attention: demos, experiments, training.")
    parser.add_argument("--version", action="version", version=f"loglinear {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = {name: sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter,
                                    allow_abbrev=False)
               for name, (_, text) in COMMANDS.items()}
    # import only the chosen command's module: `loglinear demo` needs none of the training extras
    chosen = next((arg for arg in argv if arg in COMMANDS), None)
    missing = [name for name in NEEDS.get(chosen, ()) if importlib.util.find_spec(name) is None]
    if missing and not {"-h", "--help"} & set(argv):
        print(f"loglinear {chosen}: error: needs {', '.join(missing)}: pip install \"loglinear[train]\"",
              file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[chosen][0]) if chosen else None
    if module is not None:
        module.add_arguments(parsers[chosen])
    args = parser.parse_args(argv)
    args.given = _given_options(parsers[chosen], argv) if chosen else set()
    try:
        return int(module.run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as e:
        if os.environ.get("LOGLINEAR_DEBUG"):
            raise
        print(f"loglinear {chosen}: error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    except FloatingPointError as e:  # a run that diverged: not a usage error, but one line all the same
        if os.environ.get("LOGLINEAR_DEBUG"):
            raise
        print(f"loglinear {chosen}: {e}".splitlines()[0], file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
