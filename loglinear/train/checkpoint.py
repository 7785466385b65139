"""Checkpoints with exact resume: model, optimizer, scheduler, every RNG and the data position (the step;
the data order is a pure function of the step). Full (unsharded) state dicts, written by rank 0, so a
checkpoint saved by N processes loads in M."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from loglinear.train.parallel import Parallel

__all__ = ["save_checkpoint", "load_checkpoint", "load_model_weights", "CHECKPOINT"]

CHECKPOINT = "checkpoint.pt"


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: str | Path, step: int, model, optimizer, scheduler, par: Parallel) -> None:
    """Write out_dir/checkpoint.pt atomically (every rank must call: gathering the shards is collective)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    if par.is_main:
        path = Path(out_dir) / CHECKPOINT
        tmp = path.with_suffix(".tmp")
        torch.save({"step": step, "model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(),
                    "rng": _rng_state()}, tmp)
        tmp.replace(path)
    if par.distributed:
        dist.barrier()


def load_checkpoint(out_dir: str | Path, model, optimizer, scheduler) -> int:
    """Restore everything saved by save_checkpoint into the (possibly sharded) objects; returns the step."""
    ckpt = torch.load(Path(out_dir) / CHECKPOINT, map_location="cpu", weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(ckpt["scheduler"])
    _set_rng_state(ckpt["rng"])
    return int(ckpt["step"])


def load_model_weights(out_dir: str | Path, model: torch.nn.Module) -> int:
    """Load only the model weights of out_dir/checkpoint.pt (for evaluation); returns the step."""
    ckpt = torch.load(Path(out_dir) / CHECKPOINT, map_location="cpu", weights_only=False)
    model.load_state_dict(ckpt["model"])
    return int(ckpt["step"])
