"""The training loop: it learns, resumes exactly, and 2 FSDP2 processes (gloo) match one process."""

import json

import pytest
import torch

from helpers import spawn_train
from loglinear.models.convert import convert
from loglinear.train.checkpoint import CHECKPOINT, read_checkpoint
from loglinear.train.loop import TrainConfig, cosine_schedule, train


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(arch="transformer", d_model=32, n_layers=2, n_heads=2, data_dir=str(data), tokenizer="bytes",
                seq_len=32, steps=6, global_batch=4, warmup=2, lr=3e-3, out_dir=str(out), log_every=1,
                eval_batches=2, progress=False, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def _weights(out) -> dict[str, torch.Tensor]:
    return read_checkpoint(out / CHECKPOINT)["model"]


def _logged_losses(out) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_cosine_schedule_shape():
    lrs = [cosine_schedule(s, 10, 100, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_loss_decreases_and_logs(tiny_data, tmp_path):
    res = train(_cfg(tiny_data, tmp_path, steps=25, needle_rate=0.5, needle_keys=1, seq_len=96))
    assert res["losses"][-1] < res["losses"][0] - 0.3
    assert res["val_loss"] is not None and res["val_loss"] < 5.0
    assert len(_logged_losses(tmp_path)) == 25
    assert json.loads((tmp_path / "train_config.json").read_text())["arch"] == "transformer"


def test_resume_is_exact(tiny_data, tmp_path):
    straight = train(_cfg(tiny_data, tmp_path / "a"))
    first = train(_cfg(tiny_data, tmp_path / "b", stop_after=3))
    second = train(_cfg(tiny_data, tmp_path / "b"), resume=True)
    assert first["step"] == 3 and second["step"] == 6
    assert first["losses"] + second["losses"] == straight["losses"]
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_max_seconds_ends_the_run_with_a_checkpoint_and_validation(tiny_data, tmp_path):
    res = train(_cfg(tiny_data, tmp_path, steps=50, max_seconds=0.0))
    assert res["timed_out"] and res["step"] == 1 and res["val_loss"] is not None
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and rows[-1]["stopped"] == "max_seconds=0.0"
    assert read_checkpoint(tmp_path / CHECKPOINT)["step"] == 1


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(tiny_data, tmp_path, monkeypatch, capsys):
    """A diverged step (NaN loss) ends the run with FloatingPointError (CLI: one line, status 1): no NaN weights are
    saved or exported, metrics.jsonl says where it stopped."""
    import loglinear.train.loop as loop
    from loglinear.cli import main

    real, calls = loop._train_step, []

    def diverging(*args):
        calls.append(1)
        loss = real(*args)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(loop, "_train_step", diverging)
    with pytest.raises(FloatingPointError, match="the training loss is nan at step 3: the run diverged"):
        train(_cfg(tiny_data, tmp_path / "a", save_every=2))
    assert read_checkpoint(tmp_path / "a" / CHECKPOINT)["step"] == 2
    assert not (tmp_path / "a" / "model.safetensors").exists()
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and rows[-1]["stopped"] == "non-finite loss"
    calls.clear()
    assert main(["train", "--arch", "transformer", "--d-model", "32", "--layers", "1", "--data-dir", str(tiny_data),
                 "--tokenizer", "bytes", "--seq-len", "32", "--steps", "4", "--global-batch", "2", "--warmup", "1",
                 "--device", "cpu", "--no-progress", "--out-dir", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("loglinear train: the training loss is nan at step 3"), err


def test_micro_batches_match_full_batch(tiny_data, tmp_path):
    full = train(_cfg(tiny_data, tmp_path / "full", steps=3))
    micro = train(_cfg(tiny_data, tmp_path / "micro", steps=3, micro_batch=1))
    assert micro["losses"] == pytest.approx(full["losses"], rel=1e-5)


def test_a_plain_run_continues_as_log_linear_from_where_it_stopped(tiny_data, tmp_path):
    """A plain Mamba-2 run, made log-linear by `loglinear convert --log-linear` (lambda starts at exactly 1), starts a
    new run with --init: its first loss is the plain model's on the same batch, far below a fresh start."""
    first = train(_cfg(tiny_data, tmp_path / "plain", arch="mamba2", steps=20, lr=1e-2))
    convert(tmp_path / "plain", tmp_path / "ll", log_linear=True)
    sigmoid = {"level_activation": "sigmoid"}
    as_plain = train(_cfg(tiny_data, tmp_path / "a", arch="mamba2", steps=1, init=str(tmp_path / "plain")))
    as_ll = train(_cfg(tiny_data, tmp_path / "b", arch="ll_mamba2", steps=1, init=str(tmp_path / "ll"),
                       model_overrides=sigmoid))
    assert as_ll["losses"][0] == pytest.approx(as_plain["losses"][0], abs=1e-5)
    assert as_ll["losses"][0] < first["losses"][0] - 0.5
    with pytest.raises(ValueError, match="init: .* do not fit the model of these options .*level_scales"):
        train(_cfg(tiny_data, tmp_path / "c", arch="mamba2", steps=1, init=str(tmp_path / "ll")))


def test_activation_checkpointing_keeps_fewer_activations_and_the_same_result(tiny_data, tmp_path):
    def run(name: str, **kw) -> tuple[dict, int]:
        saved = []  # bytes autograd keeps for the backward
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            res = train(_cfg(tiny_data, tmp_path / name, arch="ll_mamba2", steps=2, **kw))
        return res, sum(saved)

    plain, kept = run("plain")
    again, kept_checkpointed = run("ckpt", activation_checkpointing=True)
    assert kept_checkpointed < 0.2 * kept
    assert again["losses"] == plain["losses"]
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "ckpt")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["transformer", "ll_gated_deltanet"])
def test_fsdp2_two_processes_match_one(tiny_data, tmp_path, arch):
    one = train(_cfg(tiny_data, tmp_path / "one", steps=4, arch=arch))
    spawn_train(_cfg(tiny_data, tmp_path / "two", steps=4, arch=arch), 2)
    assert _logged_losses(tmp_path / "two") == pytest.approx(one["losses"], rel=1e-5)
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
