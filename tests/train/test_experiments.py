"""benchmarks/experiments/run_experiments.py without launching anything: merging an earlier call's rows, and the LM
report's token column; benchmarks/experiments/lm_seeds.py: log-linear minus base over seeds."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from helpers import load_benchmark
from loglinear.eval.command import lm_report


@pytest.fixture(scope="module")
def exp():
    return load_benchmark("experiments/run_experiments")


def record(arch: str, tokens: int, loss: float) -> dict:
    return {"arch": arch, "params": 1.5e6, "train_seq_len": 512, "train_tokens": tokens, "eval_len": 1024,
            "windows": 2, "val_loss": loss, "ppl": 2.718 ** loss, "loss_by_range": {"0-64": loss + 0.1},
            "per_position_smoothed": {"positions": [0, 32], "loss": [loss, loss]}}


def test_merge_keeps_other_models_rows(exp, tmp_path):
    path = tmp_path / "lm-x.json"
    assert exp.merged([record("mamba2", 10, 3.0)], path) == [record("mamba2", 10, 3.0)]  # no earlier call
    path.write_text(json.dumps([record("transformer", 5, 4.0), record("mamba2", 5, 3.5), record("ll_mamba2", 5, 3.4)]))
    rows = exp.merged([record("mamba2", 10, 3.0), record("gated_deltanet", 10, 3.9)], path)
    assert [(r["arch"], r["train_tokens"]) for r in rows] == [
        ("ll_mamba2", 5), ("mamba2", 10), ("gated_deltanet", 10), ("transformer", 5)]


def test_lm_report_says_when_token_counts_differ(tmp_path):
    same = lm_report([record("mamba2", 4_000_000, 3.0), record("ll_mamba2", 4_000_000, 2.9)], tmp_path / "a", "t")
    assert "the same tokens each" in same and "| 4.0M |" in same
    mixed = lm_report([record("mamba2", 4_000_000, 3.0), record("transformer", 9_000_000, 3.2)], tmp_path / "b", "t")
    assert "NOT the same tokens each" in mixed and "| 9.0M |" in mixed
    assert json.loads((tmp_path / "b.json").read_text())[1]["train_tokens"] == 9_000_000


@pytest.fixture(scope="module")
def seeds_script():
    return load_benchmark("experiments/lm_seeds")


def write_seed(path, losses: dict[str, float], tokens: int = 10):
    path.write_text(json.dumps([record(arch, tokens, loss) for arch, loss in losses.items()]))
    return path


def test_lm_seeds_differences_per_seed_and_mean(seeds_script, tmp_path, monkeypatch):
    a = write_seed(tmp_path / "s0.json", {"ll_mamba2": 2.9, "mamba2": 3.0, "transformer": 3.5})
    b = write_seed(tmp_path / "s1.json", {"mamba2": 3.2, "ll_mamba2": 3.25, "transformer": 3.4})
    monkeypatch.setattr(sys, "argv", ["lm_seeds", str(a), str(b), "--out", str(tmp_path / "out")])
    seeds_script.main()
    md = (tmp_path / "out.md").read_text()
    assert "| LL Mamba-2 | 3.075 | 2.900 | 3.250 |" in md and "| Transformer | 3.450 | 3.500 | 3.400 |" in md
    assert "| LL Mamba-2 - Mamba-2 | seed file 0 | -0.100 | -0.100 |" in md
    assert "| LL Mamba-2 - Mamba-2 | seed file 1 | 0.050 | 0.050 |" in md
    assert "| LL Mamba-2 - Mamba-2 | mean | -0.025 | -0.025 |" in md
    assert "Gated DeltaNet" not in md  # a pair missing from the files is left out
    assert "range of one model's validation loss: 0.350 nats" in md
    assert (tmp_path / "out.png").stat().st_size > 0


def test_lm_seeds_refuses_different_token_budgets(seeds_script, tmp_path):
    a = write_seed(tmp_path / "s0.json", {"ll_mamba2": 2.9, "mamba2": 3.0})
    b = write_seed(tmp_path / "s1.json", {"ll_mamba2": 2.9, "mamba2": 3.0}, tokens=20)
    with pytest.raises(ValueError, match="train_tokens"):
        seeds_script.by_arch([a, b])


def test_lm_seeds_log_bins_average_within_bins(seeds_script):
    x = np.arange(1, 101, dtype=float)
    centers, means = seeds_script.log_bins(x, 2 * x, per_decade=1)
    assert np.allclose(means, 2 * centers) and len(centers) == 3  # bins [1, 10), [10, 100), [100, ...]
    assert centers[0] == pytest.approx(5.0)
