"""Exact references for log-linear Mamba-2 (scalar decay; beta = 1, P_{t,s} = exp(G_t - G_s) I).

    o_t = scale * sum_{s<=t} lambda_t[level(t,s)] * exp(G_t - G_s) * (q_t . k_s) * v_s
"""

from __future__ import annotations

import torch

from loglinear.reference import common


def transfer_matrix(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """C[b, h, t, s] = exp(G_t - G_s) (q_t . k_s) for s <= t.   q, k: [B, T, H, K]; g: [B, T, H] -> [B, H, T, T]."""
    G = torch.cumsum(g, dim=1).transpose(1, 2)  # [B, H, T]
    diff = G[..., :, None] - G[..., None, :]
    causal = torch.ones(diff.shape[-2:], dtype=torch.bool, device=g.device).tril()
    decay = torch.exp(torch.where(causal, diff, torch.full_like(diff, -torch.inf)))
    return torch.einsum("bthk,bshk->bhts", q, k) * decay


def transition(S: torch.Tensor, g: torch.Tensor, k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """S <- exp(g_t) S on every level.   S: [B, L, H, K, V]; g: [B, H]."""
    return S * torch.exp(g)[:, None, :, None, None]


def materialized(q, k, v, g, level_scales, scale):
    """Quadratic form.  Inputs expanded to heads (see common); returns o: [B, T, H, V]."""
    return common.materialized(transfer_matrix(q, k, g), v, level_scales, scale)


def recurrent(q, k, v, g, level_scales, scale, levels=None, positions=None):
    """Token-by-token cascade (decoding semantics); returns (o, levels, positions)."""
    beta = torch.ones_like(g)
    return common.recurrent(q, k, v, g, beta, level_scales, scale, transition, levels, positions)
