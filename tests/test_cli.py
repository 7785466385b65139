"""The command line: --version, python -m loglinear, every option described and its default shown in --help,
user errors as one line and status 2."""

import argparse
import importlib
import re
import subprocess
import sys

import pytest

from loglinear import __version__
from loglinear.cli import COMMANDS, main


def test_version_and_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "loglinear", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"loglinear {__version__}"


def test_help_shows_every_default(capsys):
    try:
        main(["train", "--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert re.search(r"--d-model D_MODEL\s+model width \(hidden size\) \(default: 256\)", out), out
    assert re.search(r"--steps STEPS\s+optimizer steps of the whole run \(default: 300\)", out), out
    assert "(default: None)" not in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_a_help_text(command):
    parser = argparse.ArgumentParser(prog=f"loglinear {command}")
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    options = [action for action in parser._actions if action.option_strings and action.dest != "help"]
    assert options
    bare = [action.option_strings[-1] for action in options if not (action.help or "").strip()]
    assert not bare, f"loglinear {command}: options without a help text: {', '.join(bare)}"


def test_user_error_is_one_line_with_status_2(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "no-run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loglinear eval: error:") and "config.json" in err and len(err.splitlines()) == 1


def test_a_missing_extra_is_named_before_anything_runs(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["mqar", "--widths", "8"]) == 2
    assert capsys.readouterr().err.strip() == 'loglinear mqar: error: needs matplotlib: pip install "loglinear[train]"'


def test_training_values_that_cannot_work_are_refused(tmp_path, capsys):
    for option, value, message in [("--seq-len", "0", "seq_len must be a positive int, got 0"),
                                   ("--steps", "-5", "steps must be a positive int, got -5"),
                                   ("--lr", "nan", "lr must be a finite number in (0, inf], got nan"),
                                   ("--device", "gpu0", "device must be a torch device such as cpu or cuda:0, got "
                                                        "'gpu0'"),
                                   ("--profile-step", "0", "profile_step must be a step in [1, steps = 300], got 0")]:
        assert main(["train", "--out-dir", str(tmp_path), option, value]) == 2
        assert capsys.readouterr().err.strip() == f"loglinear train: error: {message}"
    assert main(["train", "--out-dir", str(tmp_path), "--tokenizer", "bytes", "--vocab-size", "100"]) == 2
    assert capsys.readouterr().err.strip() == ("loglinear train: error: --vocab-size sets the BPE tokenizer's "
                                               "vocabulary; --tokenizer bytes has 257 tokens")
    assert not any(tmp_path.iterdir()), "nothing is written for a refused run"


def test_a_cuda_device_this_machine_lacks_is_refused(monkeypatch):
    """check_device: a CUDA device past the machine's GPUs (none here: CUDA reported unavailable) is a ValueError
    naming the option, not a crash inside torch."""
    import torch

    from loglinear.inputs import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=r"--device is 'cuda.*', but this machine has 0 CUDA device\(s\)"):
            check_device("--device", device)
    assert check_device("--device", "cpu") == torch.device("cpu")


def test_demo_runs_and_refuses_sizes_that_cannot_work(capsys):
    """`loglinear demo` at small sizes: every variant's three forms agree (exit 0); a size that cannot work is one
    line naming the option, exit 2."""
    small = ["--seq-len", "40", "--heads", "2", "--key-dim", "4", "--value-dim", "3", "--chunk-size", "8",
             "--table-key-dim", "8", "--table-value-dim", "4"]
    assert main(["demo", *small]) == 0
    assert "-> all three forms agree" in capsys.readouterr().out
    for option in ("--seq-len", "--heads", "--value-dim", "--table-value-dim"):
        assert main(["demo", *small, option, "-1"]) == 2
        assert capsys.readouterr().err.strip() == f"loglinear demo: error: {option} must be a positive int, got -1"
