"""MQAR training and the sweep report: a small Transformer learns the task; best-lr / mean-over-seeds summary."""

import argparse
import json

from loglinear.train import mqar
from loglinear.train.mqar import MQARRun, summarize, train_mqar


def test_transformer_learns_mqar():
    run = MQARRun("transformer", 32, seed=0, lr=3e-3, seq_len=32, kv_pairs=(2,), vocab_size=32,
                  train_examples=1024, test_examples=128, epochs=6, batch_size=32)
    row = train_mqar(run)
    assert row["model"] == "transformer" and row["log_linear"] is False and row["d_model"] == 32
    assert row["accuracy"] > 0.3  # chance: 1 / 16 values


def test_on_step_sees_every_optimizer_step_and_its_loss():
    run = MQARRun("transformer", 16, seed=0, lr=3e-3, seq_len=16, kv_pairs=(2,), vocab_size=32, n_layers=1,
                  train_examples=64, test_examples=32, epochs=2, batch_size=32)
    seen = []
    row = train_mqar(run, on_step=lambda step, loss: seen.append((step, float(loss))))
    assert [s for s, _ in seen] == [1, 2, 3, 4] and seen[-1][1] == row["final_loss"]


def test_summary_takes_best_lr_then_mean_over_seeds():
    rows = [dict(arch="mamba2", d_model=16, seed=s, lr=lr, accuracy=a)
            for s, lr, a in [(0, 1e-3, 0.2), (0, 1e-2, 0.6), (1, 1e-3, 0.4), (1, 1e-2, 0.1)]]
    assert summarize(rows) == {("mamba2", 16): 0.5}


def test_command_writes_json_md_png(tmp_path):
    parser = argparse.ArgumentParser()
    mqar.add_arguments(parser)
    args = parser.parse_args([
        "--archs", "transformer", "ll_mamba2", "--widths", "16", "--lrs", "3e-3", "--seq-len", "16", "--kv-pairs",
        "2", "--vocab-size", "32", "--layers", "1", "--train-examples", "64", "--test-examples", "32", "--epochs",
        "1", "--batch-size", "32", "--chunk-size", "8", "--device", "cpu", "--workers", "1",
        "--out", str(tmp_path / "mqar-test"),
    ])
    assert mqar.run(args) == 0
    rows = json.loads((tmp_path / "mqar-test.json").read_text())
    assert [(r["model"], r["log_linear"]) for r in rows] == [("transformer", False), ("mamba2", True)]
    assert all(0.0 <= r["accuracy"] <= 1.0 and {"d_model", "seed", "lr"} <= r.keys() for r in rows)
    assert "LL Mamba-2" in (tmp_path / "mqar-test.md").read_text()
    assert (tmp_path / "mqar-test.png").stat().st_size > 1000


def test_a_failing_run_is_reported_and_the_sweep_goes_on(tmp_path):
    good = MQARRun("transformer", 16, seed=0, lr=3e-3, seq_len=16, kv_pairs=(2,), vocab_size=32, n_layers=1,
                   train_examples=64, test_examples=32, epochs=1, batch_size=32)
    bad = MQARRun("transformer", 16, seed=1, lr=3e-3, seq_len=16, kv_pairs=(9,), vocab_size=32, n_layers=1,
                  train_examples=64, test_examples=32, epochs=1, batch_size=32)  # 4 * 9 > seq_len
    rows = mqar.sweep([bad, good])
    assert len(rows) == 2 and "num_kv_pairs" in rows[1]["error"] and "accuracy" in rows[0]
    assert (rows[0]["attempts"], rows[1]["attempts"]) == (1, 2)  # the failing run was tried again once
    assert list(summarize(rows)) == [("transformer", 16)]
    assert "1 runs failed" in mqar.report(rows, tmp_path / "m", "t")


def test_a_run_that_fails_once_is_tried_again(monkeypatch):
    calls = []

    def flaky(run):
        calls.append(run.seed)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return dict(arch=run.arch, d_model=run.d_model, seed=run.seed, lr=run.lr, accuracy=0.5)

    monkeypatch.setattr(mqar, "train_mqar", flaky)
    runs = [MQARRun("transformer", 16, seed=s, lr=3e-3) for s in (0, 1)]
    rows = mqar.sweep(runs)
    assert calls == [0, 1, 0]
    assert [(r["seed"], r["accuracy"], r["attempts"]) for r in rows] == [(0, 0.5, 2), (1, 0.5, 1)]
