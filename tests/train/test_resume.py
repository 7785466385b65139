"""A resumed run cannot lie: it needs a checkpoint, keeps the saved settings (the command line restores them),
refuses a change of trajectory by name, and a new run never silently replaces an existing one."""

import json

import pytest

from loglinear.cli import main
from loglinear.train.loop import TrainConfig, train


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(arch="mamba2", d_model=16, n_layers=1, data_dir=str(data), tokenizer="bytes", seq_len=16, steps=4,
                global_batch=2, warmup=1, lr=3e-3, out_dir=str(out), eval_batches=1, progress=False, device="cpu")
    return TrainConfig(**base | kw)


def test_resume_needs_a_checkpoint(tiny_data, tmp_path):
    with pytest.raises(ValueError, match="resume: no checkpoint at"):
        train(_cfg(tiny_data, tmp_path), resume=True)


def test_a_run_is_not_replaced_without_overwrite(tiny_data, tmp_path):
    train(_cfg(tiny_data, tmp_path, steps=2))
    with pytest.raises(ValueError, match="already holds a run"):
        train(_cfg(tiny_data, tmp_path, steps=2))
    train(_cfg(tiny_data, tmp_path, steps=2), overwrite=True)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps), "the replaced run's metrics were kept"


def test_resume_refuses_a_changed_trajectory_and_allows_more_steps(tiny_data, tmp_path):
    train(_cfg(tiny_data, tmp_path, stop_after=2))
    with pytest.raises(ValueError, match=r"lr: 0.003 -> 0.05; weight_decay: 0.1 -> 0.9"):
        train(_cfg(tiny_data, tmp_path, lr=0.05, weight_decay=0.9), resume=True)
    assert train(_cfg(tiny_data, tmp_path, steps=6), resume=True)["step"] == 6


def test_command_line_resume_restores_the_saved_settings(tiny_data, tmp_path, capsys):
    args = ["train", "--arch", "mamba2", "--d-model", "16", "--layers", "1", "--data-dir", str(tiny_data),
            "--tokenizer", "bytes", "--seq-len", "16", "--steps", "4", "--global-batch", "2", "--warmup", "1",
            "--lr", "0.003", "--eval-batches", "1", "--device", "cpu", "--no-progress", "--out-dir", str(tmp_path)]
    assert main(args + ["--stop-after", "2"]) == 0
    assert "stopped at step 2 of 4" in capsys.readouterr().out
    assert main(["train", "--out-dir", str(tmp_path), "--lr", "0.05", "--resume"]) == 2
    assert "lr: 0.003 -> 0.05" in capsys.readouterr().err
    assert main(["train", "--out-dir", str(tmp_path), "--resume"]) == 0  # nothing repeated
    assert json.loads((tmp_path / "train_config.json").read_text())["d_model"] == 16
    assert main(["train", "--out-dir", str(tmp_path / "new"), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_a_stop_signal_checkpoints_and_resume_continues_exactly(tiny_data, tmp_path, monkeypatch):
    import os
    import signal
    import threading

    from loglinear.train import loop

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers live in the main thread")

    straight = train(_cfg(tiny_data, tmp_path / "a", steps=5))
    real = loop._step_windows

    def interrupted_at_step_2(data, cfg, step, tok):
        if step == 2 and "b" in cfg.out_dir:
            os.kill(os.getpid(), signal.SIGINT)  # arrives during the step: it finishes, then the run stops
        return real(data, cfg, step, tok)

    monkeypatch.setattr(loop, "_step_windows", interrupted_at_step_2)
    first = train(_cfg(tiny_data, tmp_path / "b", steps=5))
    assert first["interrupted"] and first["step"] == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    second = train(_cfg(tiny_data, tmp_path / "b", steps=5), resume=True)
    assert first["losses"] + second["losses"] == straight["losses"]
