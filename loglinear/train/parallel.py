"""The training loop's parallel setup, kept in one place: data parallel over torchrun's processes with
FSDP2 (`fully_shard` on every block, then the root). One process: no process group, the model as is.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; the backend is nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Parallel", "setup_parallel", "parallelize", "all_reduce_mean", "teardown"]


@dataclass
class Parallel:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup_parallel(device: str | None = None) -> Parallel:
    """Read torchrun's environment, pick the device (cuda:LOCAL_RANK if available) and init the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world)
    return Parallel(rank, world, dev)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks: the elements of the largest ModuleList (HF decoders keep them in `.layers`)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def parallelize(model: torch.nn.Module, par: Parallel) -> torch.nn.Module:
    """Move to the device; with several processes shard every block and the root with FSDP2."""
    model = model.to(par.device)
    if par.distributed:
        from torch.distributed.fsdp import fully_shard

        for block in _blocks(model):
            fully_shard(block)
        fully_shard(model)
    return model


def all_reduce_mean(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """The mean of a scalar tensor over processes (itself with one process)."""
    if par.distributed:
        x = x.detach().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= par.world_size
    return x


def teardown(par: Parallel) -> None:
    if par.distributed and dist.is_initialized():
        dist.destroy_process_group()
