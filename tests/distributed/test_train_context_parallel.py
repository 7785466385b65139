"""`loglinear train --context-parallel 2` on 4 gloo processes (a 2 x 2 data x context mesh, FSDP2 over all
four) follows the single-process run: same losses and weights up to float32 reduction order."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from helpers import spawn_train
from loglinear.data.text import prepare_corpus
from loglinear.train.checkpoint import CHECKPOINT, read_checkpoint
from loglinear.train.command import add_arguments, config_from_args
from loglinear.train.loop import train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("bisect.py", "heapq.py", "colorsys.py"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, src / name)
    data = tmp_path_factory.mktemp("data")
    prepare_corpus(src, data, tokenizer="bytes", val_fraction=0.25)
    return data


def _config(data: Path, out: Path, *extra: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--arch", "ll_gated_deltanet", "--d-model", "32", "--layers", "2", "--heads", "2", "--tokenizer", "bytes",
        "--data-dir", str(data), "--seq-len", "32", "--steps", "3", "--global-batch", "4", "--warmup", "1",
        "--lr", "3e-3", "--out-dir", str(out), "--log-every", "1", "--eval-batches", "1", "--no-progress",
        "--precision", "fp32", "--device", "cpu", "--model-config", json.dumps({"chunk_size": 8, "max_levels": 8}),
        *extra,
    ])
    return config_from_args(args)


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r] + [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.mark.slow
def test_context_parallel_training_matches_one_process(corpus, tmp_path):
    cfg = _config(corpus, tmp_path / "cp", "--context-parallel", "2")
    assert cfg.context_parallel == 2
    train(_config(corpus, tmp_path / "one"))
    spawn_train(cfg, 4)
    one, cp = _losses(tmp_path / "one"), _losses(tmp_path / "cp")
    assert len(one) == len(cp) == 4
    assert cp == pytest.approx(one, rel=1e-4)
    a = read_checkpoint(tmp_path / "one" / CHECKPOINT)["model"]
    b = read_checkpoint(tmp_path / "cp" / CHECKPOINT)["model"]
    assert a.keys() == b.keys()
    for k in a:  # float32 reduction order moves a few Adam steps (lr 3e-3) by ~1e-5; a wrong shard moves them all
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-4, msg=k)


def test_context_parallel_must_divide(corpus, tmp_path):
    from loglinear.distributed.training import plan_context_parallel

    with pytest.raises(ValueError, match="must be >= 1 and divide the number of processes 3"):
        plan_context_parallel(2, 0, 3, torch.device("cpu"), 32)
    with pytest.raises(ValueError, match="seq_len = 30 must be a multiple of context_parallel = 4"):
        plan_context_parallel(4, 0, 4, torch.device("cpu"), 30)
