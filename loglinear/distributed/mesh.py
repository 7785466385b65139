"""Process layout helpers: the 2-D (data parallel x context parallel) mesh and sequence sharding of a batch.

Ranks are laid out dp-major: the cp ranks of one data-parallel replica are consecutive (on one node,
where the per-layer scan messages are cheapest). Every cp group sees the same batch, each rank its
contiguous slice of the sequence; parameters and gradients are shared over all dp x cp ranks (FSDP2 over
the whole world averages gradients over both dims, which is the gradient of the mean loss when every
shard holds the same number of target tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["shard_bounds", "shard_sequence", "context_parallel_mesh"]


def shard_bounds(length: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous near-even split of ``length`` tokens over ``world`` ranks (the first ``length % world``
    ranks get one more): this rank's [start, end)."""
    if not 0 <= rank < world or length < world:
        raise ValueError(f"cannot split length {length} over {world} ranks (rank {rank}): every rank needs >= 1 token")
    base, extra = divmod(length, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (the sequence axis: [B, T, ...] -> [B, T_r, ...])."""
    group = group if group is not None else dist.group.WORLD
    start, end = shard_bounds(x.shape[dim], dist.get_world_size(group), dist.get_rank(group))
    return x.narrow(dim, start, end - start)


def context_parallel_mesh(context_parallel: int, device_type: str = "cuda"):
    """A 2-D DeviceMesh ("dp", "cp") over the whole world: world = dp * context_parallel, cp innermost.

    mesh["cp"].get_group() is this rank's context-parallel group, mesh["dp"] its data-parallel one."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if context_parallel < 1 or world % context_parallel:
        raise ValueError(f"context_parallel = {context_parallel} must divide the world size {world}")
    return init_device_mesh(device_type, (world // context_parallel, context_parallel), mesh_dim_names=("dp", "cp"))
