"""Evaluation: per-position loss, NIAH scoring alignment (oracle / anti-oracle models), smoothing,
and `loglinear eval` end to end on a tiny trained run."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loglinear.cli import main as cli_main
from loglinear.data.text import PackedTokens
from loglinear.data.tokenizer import ByteTokenizer
from loglinear.eval.lm import evaluate_lm
from loglinear.eval.niah import evaluate_niah, niah_accuracy
from loglinear.report import smooth
from loglinear.train.loop import TrainConfig, lm_loss, train

TOK = ByteTokenizer()
HAY = np.frombuffer(("for i in range(10):\n    print(i)\n" * 300).encode(), dtype=np.uint8).astype(np.uint16)


class Shifted(torch.nn.Module):
    """Predicts input_ids[t + shift] at position t (shift 1: a perfect next-token oracle)."""

    def __init__(self, vocab: int, shift: int):
        super().__init__()
        self.vocab, self.shift = vocab, shift

    def forward(self, input_ids, use_cache=False):
        target = torch.roll(input_ids, -self.shift, dims=1)
        return SimpleNamespace(logits=20.0 * torch.nn.functional.one_hot(target, self.vocab).float())


@pytest.mark.parametrize("keys", [1, 3])
def test_niah_scoring_is_aligned(keys):
    kw = dict(length=400, depth=0.5, num_keys=keys, samples=6, seed=0, device="cpu", batch_size=4)
    assert niah_accuracy(Shifted(257, 1), HAY, TOK, **kw) == 1.0
    assert niah_accuracy(Shifted(257, 0), HAY, TOK, **kw) == 0.0
    assert niah_accuracy(Shifted(257, 2), HAY, TOK, **kw) == 0.0
    rows = evaluate_niah(Shifted(257, 1), HAY, TOK, lengths=[300, 500], depths=[0.0, 1.0], keys=[keys],
                         samples=2, seed=0, device="cpu")
    assert [(r["length"], r["depth"]) for r in rows] == [(300, 0.0), (300, 1.0), (500, 0.0), (500, 1.0)]
    assert all(r["accuracy"] == 1.0 for r in rows)


def test_per_position_loss_matches_lm_loss(tmp_path):
    path = tmp_path / "v.bin"
    np.random.default_rng(0).integers(0, 50, 1000).astype(np.uint16).tofile(path)
    val = PackedTokens(path, 64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    model.forward = lambda input_ids, use_cache=False, m=model: SimpleNamespace(logits=m[1](m[0](input_ids)))
    res = evaluate_lm(model, val, num_windows=6, batch_size=4, device="cpu")
    idx = torch.linspace(0, val.num_windows - 1, 6).long()
    x, y = val.batch(idx)
    per = lm_loss(model, x, y, reduction="none").detach()
    assert res.per_position.shape == (64,) and res.windows == 6
    np.testing.assert_allclose(res.per_position, per.mean(0).double().numpy(), rtol=1e-6)
    assert res.val_loss == pytest.approx(float(per.mean()), rel=1e-6)
    oracle = evaluate_lm(Shifted(50, 1), val, num_windows=6, batch_size=4, device="cpu")
    assert oracle.per_position[:-1].max() < 1e-6 < oracle.per_position[-1]  # the last target is not x[t+1]


def test_smooth():
    np.testing.assert_allclose(smooth(np.full(10, 3.0), 4), 3.0)
    ramp = np.arange(20.0)
    assert smooth(ramp, 5).shape == (20,)
    np.testing.assert_allclose(smooth(ramp, 5)[2:-2], ramp[2:-2])
    np.testing.assert_allclose(smooth(ramp, 1), ramp)


def test_eval_command_end_to_end(tiny_data, tmp_path):
    run = tmp_path / "run"
    train(TrainConfig(arch="transformer", d_model=32, n_layers=1, n_heads=2, data_dir=str(tiny_data),
                      tokenizer="bytes", seq_len=64, steps=3, global_batch=2, warmup=1, out_dir=str(run),
                      progress=False, device="cpu"))
    out = tmp_path / "eval"
    assert cli_main(["eval", str(run), "--eval-len", "128", "--windows", "2", "--niah-lengths", "100", "--niah-depths",
                     "0", "1", "--niah-keys", "1", "2", "--niah-samples", "2", "--device", "cpu", "--out", str(out),
                     "--smooth", "8", "--tag", "test"]) == 0
    lm = json.loads((out / "lm-test.json").read_text())
    assert lm[0]["arch"] == "transformer" and lm[0]["eval_len"] == 128 and lm[0]["train_seq_len"] == 64
    assert set(lm[0]["loss_by_range"]) == {"0-64", "64-128"} and 0 < lm[0]["val_loss"] < 10
    niah = json.loads((out / "niah-test.json").read_text())
    assert len(niah) == 4 and {r["keys"] for r in niah} == {1, 2}
    for name in ("lm-test", "niah-test"):
        assert (out / f"{name}.png").stat().st_size > 1000 and (out / f"{name}.md").read_text().startswith("#")


def test_eval_defaults_come_from_the_run(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    train(TrainConfig(arch="mamba2", d_model=16, n_layers=1, data_dir=str(tiny_data), tokenizer="bytes", seq_len=256,
                      steps=2, global_batch=2, warmup=1, out_dir=str(run), progress=False, device="cpu"))
    assert cli_main(["eval", str(run), "--windows", "1", "--niah-depths", "0", "--niah-keys", "1", "--niah-samples",
                     "1", "--device", "cpu", "--tag", "t"]) == 0
    niah = json.loads((run / "eval" / "niah-t.json").read_text())  # results beside the run, not in a shared folder
    assert sorted({r["length"] for r in niah}) == [128, 256, 512, 1024]  # 1/4 .. 4 x the training length (>= 128)
    assert json.loads((run / "eval" / "lm-t.json").read_text())[0]["eval_len"] == 256
    assert cli_main(["eval", str(run), "--windows", "1", "--niah-lengths", "--device", "cpu", "--tag", "u"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"wrote {run / 'eval'}/lm-u.*")  # no NIAH, none claimed


def test_eval_options_that_cannot_work_are_refused_before_any_run(tiny_data, tmp_path, capsys, monkeypatch):
    """One line on stderr naming the option, status 2, before a model is loaded (the run folder need only hold its
    config: the check comes first)."""
    run = tmp_path / "run"
    train(TrainConfig(arch="transformer", d_model=16, n_layers=1, n_heads=2, data_dir=str(tiny_data),
                      tokenizer="bytes", seq_len=64, steps=1, global_batch=2, warmup=1, out_dir=str(run),
                      progress=False, device="cpu"))
    import loglinear.eval.command as command

    capsys.readouterr()  # the training's own output
    monkeypatch.setattr(command, "evaluate_run", lambda *a: pytest.fail("a run was evaluated"))
    for option, value, message in [("--windows", "0", "--windows must be a positive int, got 0"),
                                   ("--batch-size", "-1", "--batch-size must be a positive int, got -1"),
                                   ("--smooth", "0", "--smooth must be a positive int, got 0"),
                                   ("--eval-len", "0", "--eval-len must be a positive int, got 0"),
                                   ("--niah-samples", "0", "--niah-samples must be a positive int, got 0"),
                                   ("--niah-keys", "0", "--niah-keys must be a positive int, got 0"),
                                   ("--niah-lengths", "-8", "--niah-lengths must be a positive int, got -8"),
                                   ("--niah-depths", "1.5", "--niah-depths must be a finite number in [0, 1], got 1.5"),
                                   ("--seed", "-1", "--seed must be an int >= 0, got -1"),
                                   ("--device", "gpu0", "--device must be a torch device such as cpu or cuda:0"),
                                   ("--niah-lengths", "10", "--niah-lengths 10 with 1 keys does not fit")]:
        assert cli_main(["eval", str(run), "--out", str(tmp_path / "eval"), option, value]) == 2, option
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"loglinear eval: error: {message}"), err
