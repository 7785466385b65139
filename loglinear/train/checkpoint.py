"""Checkpoints with exact resume: model, optimizer, scheduler, every RNG and the data position (the step;
the data order is a pure function of the step). Full (unsharded) state dicts, written by rank 0, so a
checkpoint saved by N processes loads in M.

A checkpoint is a file a user may have received, so loading it can never run code: it holds only tensors,
numbers, strings and plain containers (the RNG states are stored as tensors), and it is read with
``torch.load(weights_only=True)``, which refuses anything else. Its SHA-256, written beside it at save
(checkpoint.pt.sha256), is checked before it is read: a flipped byte is an error, not a silently different model.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from loglinear.train.parallel import Parallel

__all__ = ["save_checkpoint", "load_checkpoint", "load_model_weights", "read_checkpoint", "CHECKPOINT"]

CHECKPOINT = "checkpoint.pt"
DIGEST_SUFFIX = ".sha256"


def _rng_state() -> dict:
    """Every RNG's state as tensors (python: version, 625 words, cached gauss; numpy: MT19937 words, position,
    cached gaussian)."""
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "words": torch.tensor(words, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["words"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state(("MT19937", nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"],
                         nps["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint at ``path``, checked against its recorded SHA-256 and loaded with weights_only=True.
    ValueError if the digest is missing or differs, or if the file holds anything but tensors and plain data."""
    path = Path(path)
    digest = _digest_path(path)
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}")
    if not digest.is_file():
        raise ValueError(f"{path} has no recorded SHA-256 ({digest.name}): it was not written by this version of "
                         "loglinear's save_checkpoint, so it is not loaded")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest.read_text().split()[0]:
        raise ValueError(f"{path} does not match its recorded SHA-256 ({digest.name}): the file is corrupted or was "
                         "altered")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds objects other than tensors and plain data; refusing to unpickle it (that "
                         f"could run code): {str(e).splitlines()[0]}") from None


def save_checkpoint(out_dir: str | Path, step: int, model, optimizer, scheduler, par: Parallel) -> dict | None:
    """Write out_dir/checkpoint.pt atomically (every rank must call: gathering the shards is collective).
    Returns the full model state dict on the main process (None elsewhere)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    if par.is_main:
        path = Path(out_dir) / CHECKPOINT
        buffer = io.BytesIO()
        torch.save({"step": step, "model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(),
                    "rng": _rng_state()}, buffer)
        data = buffer.getvalue()
        for target, content in ((path, data), (_digest_path(path), f"{hashlib.sha256(data).hexdigest()}  {path.name}\n"
                                                                    .encode())):
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_bytes(content)
            tmp.replace(target)
    if par.distributed:
        dist.barrier()
    return model_sd if par.is_main else None


def load_checkpoint(out_dir: str | Path, model, optimizer, scheduler) -> int:
    """Restore everything saved by save_checkpoint into the (possibly sharded) objects; returns the step."""
    ckpt = read_checkpoint(Path(out_dir) / CHECKPOINT)
    set_state_dict(model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(ckpt["scheduler"])
    _set_rng_state(ckpt["rng"])
    return int(ckpt["step"])


def load_model_weights(out_dir: str | Path, model: torch.nn.Module) -> int:
    """Load only the model weights of out_dir/checkpoint.pt (for evaluation); returns the step."""
    ckpt = read_checkpoint(Path(out_dir) / CHECKPOINT)
    model.load_state_dict(ckpt["model"])
    return int(ckpt["step"])
