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

from loglinear.layers.norm import wide

__all__ = ["LevelScales", "LEVEL_ACTIVATIONS"]

LEVEL_ACTIVATIONS = {"softplus": F.softplus, "sigmoid": lambda z: 2 * torch.sigmoid(z)}


def _level_weights(logits: torch.Tensor, level_scale: torch.Tensor, activation: str) -> torch.Tensor:
    """act(Ls * logits) in at least float32.  logits: [Ntok, H, L]; level_scale: [H, L]."""
    return LEVEL_ACTIVATIONS[activation](wide(level_scale) * wide(logits))


class _Recomputed(torch.autograd.Function):
    """_level_weights saving only its inputs; the backward recomputes it (module docstring)."""

    @staticmethod
    def forward(logits: torch.Tensor, level_scale: torch.Tensor, activation: str) -> torch.Tensor:
        return _level_weights(logits, level_scale, activation)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.activation = inputs[2]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        need = ctx.needs_input_grad[:2]
        create = torch.is_grad_enabled()  # a double backward: the gradients stay functions of the saved inputs
        inputs = [x if create else x.detach().requires_grad_(n) for x, n in zip(ctx.saved_tensors, need)]
        with torch.enable_grad():
            out = _level_weights(*inputs, ctx.activation)
            grads = iter(torch.autograd.grad(out, [x for x, n in zip(inputs, need) if n], grad, create_graph=create))
        return (*(next(grads) if n else None for n in need), None)


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
        if torch.is_grad_enabled() and (logits.requires_grad or self.level_scale.requires_grad):
            return _Recomputed.apply(logits, self.level_scale, self.activation)
        return _level_weights(logits, self.level_scale, self.activation)
