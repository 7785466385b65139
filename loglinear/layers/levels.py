"""The data-dependent level weights lambda of log-linear attention (spec section 6).

    lambda_t[h, l] = act(Ls[h, l] * (W_lambda x_t)[h, l]),   Ls initialised to 1

for l < max_levels: enough for 2^(max_levels - 1) tokens per sequence. Longer sequences raise
(loglinear.ops.stateful.check_capacity). act (LEVEL_ACTIVATIONS):

    "softplus"  softplus(z) >= 0, the paper's (log 2 ~ 0.69 at z = 0); the default
    "sigmoid"   2 sigmoid(z) in (0, 2), exactly 1 at z = 0 in every dtype: with W_lambda = 0 the layer is exactly
                its plain (lambda = 1) linear attention, which is how a converted linear model starts log-linear
                (loglinear.models.convert)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loglinear.layers.norm import wide

__all__ = ["LevelScales", "LEVEL_ACTIVATIONS"]

LEVEL_ACTIVATIONS = {"softplus": F.softplus, "sigmoid": lambda z: 2 * torch.sigmoid(z)}


class LevelScales(nn.Module):
    """x: [Ntok, D] -> lambda: [Ntok, H, max_levels] (float32 or wider)."""

    def __init__(self, hidden_size: int, num_heads: int, max_levels: int, activation: str = "softplus"):
        super().__init__()
        if max_levels < 1:
            raise ValueError(f"max_levels must be >= 1, got {max_levels}")
        if activation not in LEVEL_ACTIVATIONS:
            raise ValueError(f"level_activation must be one of {sorted(LEVEL_ACTIVATIONS)}, got {activation!r}")
        self.num_heads, self.max_levels, self.activation = num_heads, max_levels, activation
        self.proj = nn.Linear(hidden_size, num_heads * max_levels, bias=False)
        self.level_scale = nn.Parameter(torch.ones(num_heads, max_levels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = wide(self.proj(x)).reshape(*x.shape[:-1], self.num_heads, self.max_levels)
        return LEVEL_ACTIVATIONS[self.activation](wide(self.level_scale) * logits)
