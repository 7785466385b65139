"""benchmarks/run_experiments.py without launching anything: merging an earlier call's rows, and the LM
report's token column."""

from __future__ import annotations

import json

import pytest

from helpers import load_benchmark
from loglinear.eval.command import lm_report


@pytest.fixture(scope="module")
def exp():
    return load_benchmark("run_experiments")


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
