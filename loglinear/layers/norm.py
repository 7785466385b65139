"""RMSNorm and the gated RMSNorm of the Mamba-2 / Gated DeltaNet outputs (computed in float32 or wider)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from loglinear.inputs import check_in_range

__all__ = ["RMSNorm", "GatedRMSNorm", "wide"]


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in at least float32 (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim.  x: [*, D]."""

    def __init__(self, dim: int, eps: float = 1e-5):
        check_in_range("norm_eps", eps, 0, math.inf, low_closed=False)
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normalized(self, x32: torch.Tensor) -> torch.Tensor:
        """x32 / sqrt(mean(x32^2) + eps) over the last dim, without the weight.  x32: [*, D'] (any D')."""
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(wide(x)) * wide(self.weight)).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """Gated RMSNorm over groups of ``dim`` channels.  x, gate: [*, n * dim]; weight: [dim].

    norm_before_gate=False (Mamba-2):  y = RMSNorm(x * silu(gate))
    norm_before_gate=True  (GDN):      y = RMSNorm(x) * silu(gate)

    groups > 1: each of ``groups`` equal parts of the ``dim`` channels has its own mean square (Mamba-2 with q/k
    groups in mamba_ssm and transformers: one part per group), the weight still spans all ``dim``.
    """

    def __init__(self, dim: int, eps: float = 1e-5, norm_before_gate: bool = False, groups: int = 1):
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or dim % groups:
            raise ValueError(f"groups must be a positive int dividing dim = {dim}, got {groups!r}")
        super().__init__(dim, eps)
        self.norm_before_gate, self.groups = norm_before_gate, groups

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        shape, dim, part = x.shape, self.weight.shape[0], self.weight.shape[0] // self.groups
        x32, gate32 = wide(x).reshape(*shape[:-1], -1, part), F.silu(wide(gate)).reshape(*shape[:-1], -1, part)
        if not self.norm_before_gate:
            x32 = x32 * gate32
        y = self.normalized(x32)
        if self.norm_before_gate:
            y = y * gate32
        y = y.reshape(*shape[:-1], -1, dim) * wide(self.weight)
        return y.reshape(shape).to(x.dtype)
