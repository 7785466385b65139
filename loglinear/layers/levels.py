"""The data-dependent level weights lambda of log-linear attention (spec section 6).

    lambda_t[h, l] = softplus(Ls[h, l] * (W_lambda x_t)[h, l]),   Ls initialised to 1 (lambda ~ 0.69)

for l < max_levels: enough for 2^(max_levels - 1) tokens per sequence. Longer sequences raise
(loglinear.ops.stateful.check_capacity).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loglinear.layers.norm import wide

__all__ = ["LevelScales"]


class LevelScales(nn.Module):
    """x: [Ntok, D] -> lambda: [Ntok, H, max_levels] (float32 or wider)."""

    def __init__(self, hidden_size: int, num_heads: int, max_levels: int):
        super().__init__()
        if max_levels < 1:
            raise ValueError(f"max_levels must be >= 1, got {max_levels}")
        self.num_heads, self.max_levels = num_heads, max_levels
        self.proj = nn.Linear(hidden_size, num_heads * max_levels, bias=False)
        self.level_scale = nn.Parameter(torch.ones(num_heads, max_levels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = wide(self.proj(x)).reshape(*x.shape[:-1], self.num_heads, self.max_levels)
        return F.softplus(wide(self.level_scale) * logits)
