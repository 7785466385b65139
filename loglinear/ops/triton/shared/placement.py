"""Packed sequences laid out again with zero tokens around them, for kernels that need each sequence to start at a
chunk boundary (zero tokens in front) or all sequences as rows of one length (zero tokens behind). A zero token
(q = k = v = 0, every gate 0) is the identity transition: it deposits nothing and its outputs are dropped."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loglinear.tables import device_table, table_cache

__all__ = ["Placement", "placement", "place"]


@dataclass(frozen=True)
class Placement:
    """Where each slot of the new layout takes its token: slots [S] int64, the packed token (a zero token's names
    one of its sequence's); held [S] bool, whether the slot holds one; tokens [total] int64, each packed token's
    slot."""

    slots: torch.Tensor
    held: torch.Tensor
    tokens: torch.Tensor


@table_cache()
def placement(bounds: tuple[int, ...], fronts: tuple[int, ...], width: int | None, device: torch.device
              ) -> Placement:
    """Sequence n (tokens bounds[n] .. bounds[n + 1] - 1) after fronts[n] zero tokens, and (width: a row length)
    zero tokens behind it up to width slots, or none (width None). Cached per layout (read-only; normal tensors
    even when first built under inference mode)."""
    slots: list[int] = []
    held: list[bool] = []
    tokens: list[int] = []
    for a, b, r in zip(bounds, bounds[1:], fronts):
        back = 0 if width is None else width - r - (b - a)
        tokens += range(len(slots) + r, len(slots) + r + b - a)
        slots += [a] * r + list(range(a, b)) + [b - 1] * back
        held += [False] * r + [True] * (b - a) + [False] * back
    with torch.inference_mode(False):
        return Placement(device_table(slots, torch.int64, device), device_table(held, torch.bool, device),
                         device_table(tokens, torch.int64, device))


def place(x: torch.Tensor, at: Placement) -> torch.Tensor:
    """x [tokens, *] in the new layout: [S, *], zero in the slots that hold no token (one gather, one autograd
    node: the zero tokens' gradients go nowhere)."""
    return torch.where(at.held.view(-1, *(1,) * (x.dim() - 1)), x.index_select(0, at.slots), 0)
