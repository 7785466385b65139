"""Checkpoints cannot run code and cannot be silently altered: they hold only tensors and plain data (the RNG
states too), load with weights_only=True, and are checked against the SHA-256 recorded beside them. A crafted
pickle payload is refused before anything in it executes; a flipped byte is an error; RNG states round-trip."""

import hashlib
import os
import random

import numpy as np
import pytest
import torch

from loglinear.train.checkpoint import CHECKPOINT, load_checkpoint, load_model_weights, read_checkpoint, save_checkpoint
from loglinear.train.parallel import Parallel


def _objects(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _saved(tmp_path):
    model, optimizer, scheduler = _objects()
    save_checkpoint(tmp_path, 7, model, optimizer, scheduler, Parallel())
    return model


def test_round_trip_of_weights_optimizer_and_every_rng(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    model = _saved(tmp_path)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(30), np.random.seed(40), torch.manual_seed(50)
    fresh, optimizer, scheduler = _objects(seed=1)
    assert load_checkpoint(tmp_path, fresh, optimizer, scheduler) == 7
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert torch.equal(fresh.weight, model.weight) and scheduler.last_epoch == 1
    assert load_model_weights(tmp_path, torch.nn.Linear(3, 2)) == 7


class _Payload:
    """Unpickling this calls os.mkdir(marker): what a crafted checkpoint would do with arbitrary code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_crafted_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / CHECKPOINT
    torch.save({"step": 1, "model": _Payload(str(marker))}, path)
    (tmp_path / (CHECKPOINT + ".sha256")).write_text(hashlib.sha256(path.read_bytes()).hexdigest())  # a matching digest
    with pytest.raises(ValueError, match="refusing to unpickle"):
        load_model_weights(tmp_path, torch.nn.Linear(3, 2))
    assert not marker.exists(), "the payload ran"


def test_a_flipped_byte_is_detected(tmp_path):
    _saved(tmp_path)
    path = tmp_path / CHECKPOINT
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its recorded SHA-256"):
        read_checkpoint(path)


def test_a_checkpoint_without_digest_is_refused(tmp_path):
    _saved(tmp_path)
    (tmp_path / (CHECKPOINT + ".sha256")).unlink()
    with pytest.raises(ValueError, match="no recorded SHA-256"):
        read_checkpoint(tmp_path / CHECKPOINT)
    with pytest.raises(ValueError, match="no checkpoint at"):
        read_checkpoint(tmp_path / "missing.pt")
