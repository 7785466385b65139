"""The data-dependent level weights lambda of log-linear attention (spec section 6).

    lambda_t[h, l] = act(Ls[h, l] * (W_lambda x_t)[h, l]),   Ls initialised to 1

for l < max_levels: enough for 2^(max_levels - 1) tokens per sequence. Longer sequences raise
(loglinear.ops.stateful.check_capacity). The activation is recomputed in the backward from the projection's output
(kept in its own dtype, bf16 under autocast), so training keeps one [Ntok, H, max_levels] tensor per layer for it
instead of two fp32 ones (the product and the activation's input). act (LEVEL_ACTIVATIONS):

    "softplus"  softplus(z) >= 0, the paper's (log 2 ~ 0.69 at z = 0); the default
    "sigmoid"   2 sigmoid(z) in (0, 2), exactly 1 at z = 0 in every dtype: with W_lambda = 0 the layer is exactly
                its plain (lambda = 1) linear attention, which is how a converted linear model starts log-linear
                (loglinear.models.convert)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loglinear.inputs import needs_grad
from loglinear.layers.norm import wide

__all__ = ["LevelScales", "LEVEL_ACTIVATIONS"]


def _sigmoid2(z: torch.Tensor) -> torch.Tensor:
    return 2 * torch.sigmoid(z)


def _sigmoid2_slope(z: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    return 2 * s * (1 - s)


# name -> (act, act'): the backward multiplies by the derivative (no autograd inside it, so torch.compile traces it)
LEVEL_ACTIVATIONS = {"softplus": (F.softplus, torch.sigmoid), "sigmoid": (_sigmoid2, _sigmoid2_slope)}


class _Recomputed(torch.autograd.Function):
    """lambda = act(Ls * logits) in at least float32, saving only logits [Ntok, H, L] (in its own dtype) and
    Ls [H, L]: the backward recomputes z = Ls * logits (module docstring)."""

    @staticmethod
    def forward(logits: torch.Tensor, level_scale: torch.Tensor, activation: str) -> torch.Tensor:
        return LEVEL_ACTIVATIONS[activation][0](wide(level_scale) * wide(logits))

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.activation = inputs[2]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        logits, level_scale = ctx.saved_tensors
        wide_logits, wide_scale = wide(logits), wide(level_scale)
        dz = grad * LEVEL_ACTIVATIONS[ctx.activation][1](wide_scale * wide_logits)
        d_logits = (dz * wide_scale).to(logits.dtype) if ctx.needs_input_grad[0] else None
        d_scale = (dz * wide_logits).flatten(0, -3).sum(0).to(level_scale.dtype) if ctx.needs_input_grad[1] else None
        return d_logits, d_scale, None


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
        logits = self.proj(x).reshape(*x.shape[:-1], self.num_heads, self.max_levels)
        if needs_grad(logits, self.level_scale):
            return _Recomputed.apply(logits, self.level_scale, self.activation)
        return _Recomputed.forward(logits, self.level_scale, self.activation)  # no gradient: no autograd node
