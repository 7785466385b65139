"""The exact state entering every shard: an exclusive prefix scan of boundary maps across ranks.

Rank r's shard maps the state entering it to the state leaving it: E_r(x) = mat_r . route_r(x) + local_r
(levelmap). The state entering shard r is (E_{r-1} o ... o E_0)(0) (E_0 is constant: sequences start
on rank 0). Hillis-Steele over ceil(log2 P) rounds: in round s = 1, 2, 4, ... each rank sends its
inclusive aggregate (the composite of the maps of ranks r-s+1..r) to rank r+s and composes the one
from rank r-s into both its exclusive and inclusive aggregates. A message is one [R, L, H, K, V] level
state, plus the [R, H, K, K] (GDN) or [R, H, 1, 1] (Mamba-2) transition when the composite is not
constant.

Backward: with g_r = dloss/d(state entering r), the adjoint of the state leaving r is
a_r = g_{r+1} + E_{r+1}^T(a_{r+1}),  E^T(x) = mat^T . route^T(x), a_{P-1} = 0: the same scan in reverse
rank order over the adjoint maps x -> E_r^T(x) + g_r. Then d local_r = a_r and
d mat_r = sum_levels a_r route_r(in_r)^T.

The last rank's map is read by no one (its state leaves the sequence; a_{P-1} = 0), so its local and mat
may be placeholders (zeros, None); the shard's inputs, passed as anchors, keep the scan in the autograd
graph on every rank alike, so its backward, a collective, runs everywhere. Profiler scopes: cp/scan_forward,
cp/scan_backward, cp/mat_grad.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from loglinear.distributed.comm import exchange
from loglinear.distributed.layout import ShardLayout
from loglinear.distributed.levelmap import LevelMap, compose, mat_grad, route

__all__ = ["exclusive_scan", "incoming_states"]


def _expected(layout: ShardLayout, ranks: list[int], resets: list[bool], offset: torch.Tensor, mat_shape) -> LevelMap:
    """Receive buffers for the composite of ``ranks``' maps (its structure is known from the layout)."""
    constant = any(resets[r] for r in ranks)
    depth = torch.stack([layout.depths[r] for r in ranks]).amax(0)
    mat = None if constant else offset.new_empty(mat_shape)
    return LevelMap(torch.empty_like(offset), mat, depth)


def _tensors(m: LevelMap) -> list[torch.Tensor]:
    return [m.offset] + ([m.mat] if m.mat is not None else [])


def exclusive_scan(
    own: LevelMap, layout: ShardLayout, resets: list[bool], mat_shape: tuple[int, ...],
    group: dist.ProcessGroup, *, reverse: bool, adjoint: bool,
) -> torch.Tensor:
    """The offset of the composite of the maps of all ranks before this one (after it, if reverse).

    own: this rank's map; resets: which ranks' maps are constant (scan position 0 must be).
    Returns [R, L, H, K, V] (zeros at scan position 0).
    """
    world = layout.world
    order = (lambda p: world - 1 - p) if reverse else (lambda p: p)  # noqa: E731  (an involution)
    pos = order(layout.rank)
    inclusive, exclusive = own, None
    step = 1
    while step < world:
        sends, received = [], None
        if pos + step < world:
            sends = [(t, order(pos + step)) for t in _tensors(inclusive)]
        if pos - step >= 0:
            ranks = [order(p) for p in range(max(0, pos - 2 * step + 1), pos - step + 1)]
            received = _expected(layout, ranks, resets, own.offset, mat_shape)
        exchange(sends, [(t, order(pos - step)) for t in _tensors(received)] if received else [], group)
        if received is not None:
            exclusive = received if exclusive is None else compose(exclusive, received, adjoint)
            if pos + 2 * step < world:  # sent in a later round
                inclusive = compose(inclusive, received, adjoint)
        step *= 2
    return torch.zeros_like(own.offset) if exclusive is None else exclusive.offset


class _IncomingStates(torch.autograd.Function):
    """local, mat -> the state entering this rank's shard (zeros where its first sequence starts fresh).
    The anchors only put the scan into the autograd graph (no gradient)."""

    @staticmethod
    def forward(ctx, local, mat, mat_shape, layout: ShardLayout, group, *anchors):
        own = LevelMap(local, None if layout.reset else mat, layout.depth)
        with record_function("cp/scan_forward"):
            incoming = exclusive_scan(own, layout, layout.resets, mat_shape, group, reverse=False, adjoint=False)
        if not layout.carries:
            incoming = torch.zeros_like(local)
        ctx.save_for_backward(incoming, mat)
        ctx.mat_shape, ctx.layout, ctx.group, ctx.num_anchors = mat_shape, layout, group, len(anchors)
        return incoming

    @staticmethod
    def backward(ctx, grad):
        incoming, mat = ctx.saved_tensors
        layout: ShardLayout = ctx.layout
        last = layout.world - 1
        resets = [reset or r == last for r, reset in enumerate(layout.resets)]
        grad = grad if layout.carries else torch.zeros_like(incoming)
        own = LevelMap(grad, None if resets[layout.rank] else mat.mT, layout.depth)
        with record_function("cp/scan_backward"):
            adj = exclusive_scan(own, layout, resets, ctx.mat_shape, ctx.group, reverse=True, adjoint=True)
        d_mat = None
        if mat is not None and ctx.needs_input_grad[1]:
            with record_function("cp/mat_grad"):
                d_mat = mat_grad(adj, route(incoming, layout.depth), scalar=mat.shape[-1] == 1)
        return adj, d_mat, None, None, None, *([None] * ctx.num_anchors)


def incoming_states(
    local: torch.Tensor, mat: torch.Tensor | None, mat_shape: tuple[int, ...], layout: ShardLayout,
    group: dist.ProcessGroup, anchors: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """The exact state entering this rank's shard, differentiable across ranks.

    local: [R, L, H, K, V] the state leaving this shard when it is entered with zeros (any values on the
    last rank: no one reads it); mat: this shard's transition [R, H, K, K] / [R, H, 1, 1], None when the
    layout resets here (or on the last rank); mat_shape: the transition's shape on every rank; anchors: the
    shard's inputs, the same kinds on every rank (the result requires grad where any of them, local or mat
    does). Returns [R, L, H, K, V] (zeros where the shard's first sequence starts at its first token).
    Every rank must call it, and backpropagate through its result, together.
    """
    return _IncomingStates.apply(local, mat, tuple(mat_shape), layout, group, *anchors)
