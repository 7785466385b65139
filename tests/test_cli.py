"""The command line: --version, python -m loglinear, defaults in --help, user errors as one line and status 2."""

import subprocess
import sys

from loglinear import __version__
from loglinear.cli import main


def test_version_and_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "loglinear", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"loglinear {__version__}"


def test_help_shows_every_default(capsys):
    try:
        main(["train", "--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert "--d-model D_MODEL     (default: 256)" in out and "--steps STEPS         (default: 300)" in out
    assert "(default: None)" not in out


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
                                   ("--lr", "nan", "lr must be a finite number in (0, inf], got nan")]:
        assert main(["train", "--out-dir", str(tmp_path), option, value]) == 2
        assert capsys.readouterr().err.strip() == f"loglinear train: error: {message}"
    assert not any(tmp_path.iterdir()), "nothing is written for a refused run"
