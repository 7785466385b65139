"""Context parallelism inside a data-parallel trainer: the (dp, cp) split of the world and of a batch.

World = dp x cp ranks (cp innermost: mesh.context_parallel_mesh). The cp ranks of one data-parallel
replica take the same windows and each its contiguous slice of the sequence; parameters are sharded and
gradients averaged over all ranks (FSDP2 over the world), which equals the gradient of the global mean
loss when every rank holds the same number of target tokens (seq_len divisible by cp, no ignored targets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from loglinear.distributed.mesh import context_parallel_mesh, shard_bounds

__all__ = ["ContextParallelPlan", "plan_context_parallel"]


@dataclass
class ContextParallelPlan:
    """This rank's place in the (dp, cp) layout.

    size, rank:            the context-parallel group (ranks sharing one sequence) and this rank in it
    group:                 its process group (None when size == 1)
    data_rank, data_size:  the data-parallel replica this rank belongs to, and how many there are
    """

    size: int
    rank: int
    group: dist.ProcessGroup | None
    data_rank: int
    data_size: int

    def shard(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's contiguous slice of each [B, T, ...] along T (unchanged when size == 1)."""
        if self.size == 1:
            return xs
        start, end = shard_bounds(xs[0].shape[1], self.size, self.rank)
        return tuple(x[:, start:end] for x in xs)


def plan_context_parallel(size: int, rank: int, world: int, device: torch.device, seq_len: int) -> ContextParallelPlan:
    """The (dp, cp) plan for ``size``-way context parallelism over ``world`` ranks (mesh built when size > 1)."""
    if size < 1 or world % size:
        raise ValueError(f"context_parallel = {size} must be >= 1 and divide the number of processes {world}")
    if seq_len % size:
        raise ValueError(f"seq_len = {seq_len} must be a multiple of context_parallel = {size} (equal shards)")
    if size == 1:
        return ContextParallelPlan(1, 0, None, rank, world)
    mesh = context_parallel_mesh(size, device.type)
    return ContextParallelPlan(
        size, mesh["cp"].get_local_rank(), mesh["cp"].get_group(), mesh["dp"].get_local_rank(), world // size
    )
