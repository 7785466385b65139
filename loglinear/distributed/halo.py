"""The last tokens of the previous shard (a halo), for token-local operators that look back, such as the
causal short convolution of the mixers (kernel W needs the previous W-1 inputs).

    forward:  rank r sends x[:, -width:] to rank r+1 and receives rank r-1's (zeros on rank 0)
    backward: the halo's gradient goes back to rank r-1 and is added to its last `width` tokens
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from loglinear.distributed.comm import exchange

__all__ = ["previous_tokens"]


class _PreviousTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        halo = x.new_zeros(x.shape[0], width, *x.shape[2:])
        sends = [(x[:, x.shape[1] - width :], rank + 1)] if rank + 1 < world else []
        with record_function("cp/halo_forward"):
            exchange(sends, [(halo, rank - 1)] if rank > 0 else [], group)
        ctx.width, ctx.group, ctx.shape = width, group, x.shape
        return halo

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        tail = grad.new_zeros(grad.shape)
        with record_function("cp/halo_backward"):
            exchange([(grad, rank - 1)] if rank > 0 else [], [(tail, rank + 1)] if rank + 1 < world else [], ctx.group)
        dx = grad.new_zeros(ctx.shape)
        dx[:, ctx.shape[1] - ctx.width :] = tail
        return dx, None, None


def previous_tokens(x: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The last ``width`` tokens of the previous rank's shard.  x: [B, T_r, *] (T_r >= width) -> [B, width, *],
    zeros on the group's first rank. Differentiable; every rank must call it (and backpropagate) together."""
    if x.shape[1] < width:
        raise ValueError(
            f"a context-parallel shard must hold at least {width} tokens for the halo, got x {tuple(x.shape)} [B, T, *]"
        )
    return _PreviousTokens.apply(x, width, group)
