"""MQAR training and the sweep report: a small Transformer learns the task; best-lr / mean-over-seeds summary;
the query-only loss, training segments, early stop, budget stop, GPU slots, the gpu preset."""

import argparse
import json
import time
from dataclasses import replace

import pytest
import torch

from loglinear.train import mqar
from loglinear.train.loop import lm_loss
from loglinear.train.mqar import MQARRun, summarize, train_mqar

TINY = MQARRun("transformer", 16, seed=0, lr=3e-3, seq_len=16, kv_pairs=(2,), vocab_size=32, n_layers=1,
               train_examples=64, test_examples=32, epochs=2, batch_size=32)


def test_transformer_learns_mqar():
    run = MQARRun("transformer", 32, seed=0, lr=3e-3, seq_len=32, kv_pairs=(2,), vocab_size=32,
                  train_examples=1024, test_examples=128, epochs=6, batch_size=32)
    row = train_mqar(run)
    assert row["model"] == "transformer" and row["log_linear"] is False and row["d_model"] == 32
    assert row["accuracy"] > 0.3  # chance: 1 / 16 values


def test_the_row_records_the_precision_that_ran():
    assert train_mqar(replace(TINY, max_steps=1, bf16=True))["bf16"] is False  # a CPU run is fp32


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
    cut = dict(rows[0], lr=3e-2, accuracy=0.9, stopped="budget")  # cut short by the budget: left out
    assert summarize([*rows, cut]) == {("mamba2", 16): 0.5}


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

    def flaky(run, stop_at=None):
        calls.append(run.seed)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return dict(arch=run.arch, d_model=run.d_model, seed=run.seed, lr=run.lr, accuracy=0.5)

    monkeypatch.setattr(mqar, "train_mqar", flaky)
    runs = [MQARRun("transformer", 16, seed=s, lr=3e-3) for s in (0, 1)]
    rows = mqar.sweep(runs)
    assert calls == [0, 1, 0]
    assert [(r["seed"], r["accuracy"], r["attempts"]) for r in rows] == [(0, 0.5, 2), (1, 0.5, 1)]


@pytest.mark.parametrize("arch", ["transformer", "ll_gated_deltanet"])
def test_query_loss_equals_the_full_lm_loss(arch):
    from loglinear.data.mqar import mqar_batch, query_targets

    x, y = mqar_batch(4, 32, 3, 64, seed=0)
    model = mqar._build(replace(TINY, arch=arch, seq_len=32, vocab_size=64, chunk_size=8))
    pos, val = query_targets(y, 5)  # padded beyond the 3 queries: ignored
    assert torch.allclose(mqar.query_loss(model, x, pos, val), lm_loss(model, x, y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["gla", "ll_gla", "mamba2", "ll_gated_deltanet"])
def test_every_recurrent_model_has_the_short_convolution(arch):
    """Zoology's recipe: GLA's config has no short convolution by default; MQAR gives every recurrent model one."""
    model = mqar._build(replace(TINY, arch=arch, seq_len=32, vocab_size=64, chunk_size=8))
    assert model.config.conv_kernel == mqar.SHORT_CONV
    assert all(block.mixer.conv.kernel_size == (mqar.SHORT_CONV,) for block in model.model.layers)


def test_train_mix_keeps_each_batch_at_one_length():
    segments = ((16, 2, 40), (32, 4, 40), (32, 8, 24))
    pools = mqar.make_pools(segments, 64, seed=0)
    assert [p[0].shape for p in pools] == [(40, 16), (64, 32)] and pools[1][1].shape == (64, 8)
    run = replace(TINY, train_mix=segments, batch_size=16, epochs=3)
    assert mqar.train_segments(run) == segments and mqar.total_steps(run, pools) == 3 * (2 + 4)
    stream = mqar.batch_stream(pools, 16, torch.Generator().manual_seed(0))
    lengths = [next(stream)[0].shape[1] for _ in range(12)]
    assert sorted(lengths) == [16] * 4 + [32] * 8  # two epochs: 2 + 4 batches each
    assert mqar.train_segments(TINY) == ((16, 2, 64),)
    row = train_mqar(replace(run, max_steps=4))
    assert row["steps"] == 4 and "2" in row["accuracy_by_kv"]


def test_early_stop_at_the_first_good_enough_evaluation():
    row = train_mqar(replace(TINY, epochs=4, eval_every=2, early_stop=0.0))
    assert (row["steps"], row["stopped"], row["evals"][0][0]) == (2, "early_stop", 2)
    row = train_mqar(replace(TINY, epochs=4, eval_every=2, early_stop=1.01))
    assert (row["steps"], row["stopped"], [e[0] for e in row["evals"]]) == (8, None, [2, 4, 6])


def test_a_run_stops_training_at_its_stop_time():
    row = train_mqar(replace(TINY, epochs=4), stop_at=time.time())
    assert (row["steps"], row["stopped"]) == (1, "budget") and 0.0 <= row["accuracy"] <= 1.0


def test_slots_spread_over_the_gpus():
    assert [mqar.slot_device("cuda", i, 2) for i in range(5)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert mqar.slot_device("cuda:1", 4, 2) == "cuda:1" and mqar.slot_device("cpu", 3, 2) == "cpu"
    assert mqar.slot_device("cuda", 3, 0) == "cuda"


@pytest.mark.slow
def test_sweep_in_worker_slots_with_a_budget():
    runs = [replace(TINY, seed=s, epochs=1) for s in (0, 1, 2)]
    rows = mqar.sweep(runs, workers=2, threads=1, budget=120)
    assert [r["seed"] for r in rows] == [0, 1, 2] and all("accuracy" in r for r in rows)
    assert mqar.sweep(runs, workers=2, threads=1, budget=-1) == []  # nothing starts after the budget


def test_gpu_preset_then_overrides():
    parser = argparse.ArgumentParser()
    mqar.add_arguments(parser)
    args = parser.parse_args(["--preset", "gpu", "--seeds", "3", "--device", "cpu", "--train-mix", "64:4:100"])
    run = mqar.base_run(args)
    assert (run.seq_len, run.kv_pairs, run.batch_size, run.vocab_size, run.early_stop) == (
        256, (4, 8, 16, 32, 64), 256, 8192, 0.99)
    assert run.eval_every > 0 and run.max_steps > 0 and run.device == "cpu" and run.train_mix == ((64, 4, 100),)
    assert args.seeds == [3] and args.widths == [16, 32, 64]
    zoology = mqar.base_run(parser.parse_args(["--preset", "gpu"])).train_mix  # Zoology's mixture unless overridden
    assert zoology == ((64, 4, 100000), (128, 8, 20000), (256, 16, 20000), (256, 32, 20000), (256, 64, 20000))
    default = parser.parse_args([])
    assert mqar.base_run(default) == MQARRun("transformer", 0, 0, 0.0, device=default.device)


def test_merge_keeps_the_earlier_rows_this_call_does_not_redo(tmp_path):
    earlier = [dict(arch="transformer", d_model=16, seed=s, lr=3e-3, accuracy=0.5) for s in (0, 1)]
    (tmp_path / "m.json").write_text(json.dumps(earlier))
    runs = [replace(TINY, seed=1), replace(TINY, seed=2)]
    assert mqar.kept_rows(tmp_path / "m.json", runs) == earlier[:1]
    assert mqar.kept_rows(tmp_path / "none.json", runs) == []


@pytest.mark.parametrize("options, message", [
    (["--seq-len", "-4"], "seq_len must be a positive int"),
    (["--seq-len", "15"], "seq_len must be even"),
    (["--kv-pairs", "9"], "num_kv_pairs must be in [1, seq_len / 4]"),
    (["--train-mix", "16:2:0"], "train_mix examples (16:2) must be a positive int"),
    (["--widths", "0"], "width must be a positive int"),
    (["--lrs", "nan"], "lr must be a finite number in (0, inf]"),
    (["--warmup", "1.5"], "warmup must be a finite number in [0, 1]"),
    (["--chunk-size", "6"], "chunk_size must be a power of two"),
    (["--device", "gpu0"], "device must be a torch device such as cpu or cuda:0"),
])
def test_a_setting_that_fails_every_run_stops_the_command(tmp_path, capsys, options, message):
    """Before any run: one line on stderr and exit status 2 (the CLI), no results written."""
    from loglinear.cli import main

    out = tmp_path / "m"
    assert main(["mqar", "--archs", "transformer", "--seq-len", "16", "--vocab-size", "32", "--device", "cpu",
                 *options, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.with_suffix(".json").exists()


def test_a_failed_run_sets_the_exit_status(tmp_path, monkeypatch, capsys):
    """A run that fails inside the sweep is a row of the results, and the command exits 1."""
    def failing(run, stop_at=None):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(mqar, "train_mqar", failing)
    parser = argparse.ArgumentParser()
    mqar.add_arguments(parser)
    args = parser.parse_args(["--archs", "transformer", "--widths", "16", "--seq-len", "16", "--vocab-size", "32",
                              "--device", "cpu", "--workers", "1", "--out", str(tmp_path / "m")])
    assert mqar.run(args) == 1
    assert "1 of 1 runs failed" in capsys.readouterr().err
    assert "out of memory" in (tmp_path / "m.md").read_text()
