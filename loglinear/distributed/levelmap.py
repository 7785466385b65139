"""Affine maps between the Fenwick states at shard boundaries (the algebra of the cross-rank scan).

A shard of tokens p0 .. p1-1 maps the state entering it (at position p0) to the state leaving it
(at position p1). Every token applies its transition to all levels and the binary-counter carries only
add levels together, so the map is affine in the incoming levels:

    out = mat . route_d(in) + local

    route_d(x)[l] = sum_{m <= d} x[m]   if l == d      (levels below d merge into d)
                    x[l]                if l >  d
                    0                   if l <  d
    d = bit_length((p1 - 1) XOR (p0 - 1))              (the highest carry between the two positions)

mat is the product of the shard's transitions: a scalar decay exp(sum g) per head for Mamba-2
([R, H, 1, 1]), the K x K product A_{p1-1} ... A_{p0} of delta-rule transitions per head for Gated
DeltaNet ([R, H, K, K]). mat and route commute (one acts on K, the other on levels), routes compose by
max(d_a, d_b), so the maps form a monoid and the boundary states are a prefix scan.

The backward pass scans the adjoint maps  x -> mat^T . route_d^T(x) + grad,  route_d^T(x)[l] = x[max(l, d)].

States are [R, L, H, K, V] (R rows: the batch, or the one sequence carried across a varlen shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LevelMap", "route", "route_adjoint", "apply_mat", "compose", "mat_grad"]


def route(x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """route_d: levels 0..d merge into level d.  x: [R, L, H, K, V]; depth: [R] int64 -> [R, L, H, K, V]."""
    lev = torch.arange(x.shape[1], device=x.device)[None, :]
    d = depth.to(x.device)[:, None]
    as_x = lambda m: m.to(x.dtype)[:, :, None, None, None]  # noqa: E731
    merged = (x * as_x(lev <= d)).sum(1, keepdim=True)
    return x * as_x(lev > d) + merged * as_x(lev == d)


def route_adjoint(x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """route_d^T: level l reads level max(l, d).  x: [R, L, H, K, V]; depth: [R] int64 -> [R, L, H, K, V]."""
    lev = torch.arange(x.shape[1], device=x.device)[None, :]
    src = torch.maximum(lev, depth.to(x.device)[:, None])  # [R, L]
    return torch.gather(x, 1, src[:, :, None, None, None].expand_as(x))


def apply_mat(mat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """mat . x on every level.  mat: [R, H, K, K] or [R, H, 1, 1] (scalar); x: [R, L, H, K, V]."""
    if mat.shape[-1] == 1:
        return mat[:, None] * x
    return mat[:, None] @ x


@dataclass
class LevelMap:
    """x -> mat . route(x, depth) + offset (route_adjoint when scanning adjoints); mat None: constant map.

    offset: [R, L, H, K, V]; mat: [R, H, K, K], [R, H, 1, 1] or None; depth: [R] int64 (CPU).
    """

    offset: torch.Tensor
    mat: torch.Tensor | None
    depth: torch.Tensor

    def linear(self, x: torch.Tensor, adjoint: bool) -> torch.Tensor:
        """The linear part applied to x: [R, L, H, K, V] (zero for a constant map)."""
        if self.mat is None:
            return torch.zeros_like(x)
        return apply_mat(self.mat, (route_adjoint if adjoint else route)(x, self.depth))


def compose(b: LevelMap, a: LevelMap, adjoint: bool) -> LevelMap:
    """b after a:  x -> b(a(x)).  Constant if either is constant."""
    if b.mat is None:
        return b
    offset = b.linear(a.offset, adjoint) + b.offset
    mat = None if a.mat is None else b.mat @ a.mat
    return LevelMap(offset, mat, torch.maximum(a.depth, b.depth))


def mat_grad(grad_out: torch.Tensor, routed_in: torch.Tensor, scalar: bool) -> torch.Tensor:
    """d mat of  out = mat . routed_in:  sum over levels and V of grad_out routed_in^T.

    grad_out, routed_in: [R, L, H, K, V] -> [R, H, K, K], or [R, H, 1, 1] for a scalar mat.
    """
    if scalar:
        return torch.einsum("rlhkv,rlhkv->rh", grad_out, routed_in)[..., None, None]
    return torch.einsum("rlhiv,rlhjv->rhij", grad_out, routed_in)
