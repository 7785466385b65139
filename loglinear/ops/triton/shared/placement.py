"""Packed sequences laid out again as rows of one length, zero tokens behind each, for kernels that run all
sequences as rows (Gated DeltaNet's padded rows). A zero token (q = k = v = 0, every gate 0) is the identity
transition: it deposits nothing and its outputs are dropped.

Each packed token has one slot, so both directions move every element once: ``place`` scatters the tokens into a
zeroed layout and its backward gathers their gradients back; ``take`` gathers the tokens' outputs and its backward
scatters their gradients into zeros. Neither adds into an element twice (autograd's backward of a gather would: an
index_add, with atomics that are slow in 16 bits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loglinear.tables import device_table, table_cache

__all__ = ["Placement", "placement", "place", "take"]


@dataclass(frozen=True)
class Placement:
    """tokens [total] int64: each packed token's slot in the new layout of ``size`` slots (the other slots hold zero
    tokens)."""

    tokens: torch.Tensor
    size: int


@table_cache()
def placement(bounds: tuple[int, ...], width: int, device: torch.device) -> Placement:
    """Sequence n (tokens bounds[n] .. bounds[n + 1] - 1) as row n of ``width`` slots, zero tokens behind it.
    Cached per layout (read-only; a normal tensor even when first built under inference mode)."""
    tokens = [n * width + s for n, (a, b) in enumerate(zip(bounds, bounds[1:])) for s in range(b - a)]
    with torch.inference_mode(False):
        return Placement(device_table(tokens, torch.int64, device), (len(bounds) - 1) * width)


class _Place(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tokens: torch.Tensor, size: int) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        return x.new_zeros((size, *x.shape[1:])).index_copy_(0, tokens, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (tokens,) = ctx.saved_tensors
        return grad.index_select(0, tokens), None, None


class _Take(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.size = y.shape[0]
        return y.index_select(0, tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (tokens,) = ctx.saved_tensors
        return grad.new_zeros((ctx.size, *grad.shape[1:])).index_copy_(0, tokens, grad), None


def place(x: torch.Tensor, at: Placement) -> torch.Tensor:
    """x [tokens, *] in the new layout: [at.size, *], zero in the slots that hold no token (the zero tokens'
    gradients go nowhere)."""
    return _Place.apply(x, at.tokens, at.size)


def take(y: torch.Tensor, at: Placement) -> torch.Tensor:
    """The tokens of y [at.size, *] (the new layout): [tokens, *]."""
    return _Take.apply(y, at.tokens)
