"""Exact references for log-linear Gated DeltaNet.

Transition A_t = exp(g_t) (I - beta_t k_t k_t^T) (symmetric), P_{t,s} = A_t ... A_{s+1}, P_{t,t} = I:

    o_t = scale * sum_{s<=t} lambda_t[level(t,s)] * beta_s * (q_t^T P_{t,s} k_s) * v_s
"""

from __future__ import annotations

import torch

from loglinear.reference import common


def transfer_matrix(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """C[b, h, t, s] = beta_s q_t^T P_{t,s} k_s for s <= t.   q, k: [B, T, H, K]; g, beta: [B, T, H] -> [B, H, T, T].

    Sweeps s from T-1 down to 0 keeping R[t] = q_t^T P_{t,s} for every t >= s, then R <- R A_s.
    """
    B, T, H, K = q.shape
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, K]
    rows = torch.arange(T, device=q.device)
    R = torch.zeros_like(qh)
    cols = []
    for s in reversed(range(T)):
        R = torch.where((rows == s)[None, None, :, None], qh, R)
        ks = kh[:, :, s]  # [B, H, K]
        bs = beta[:, s][..., None]  # [B, H, 1]
        col = bs * torch.einsum("bhtk,bhk->bht", R, ks) * (rows >= s)
        cols.append(col)
        Rk = torch.einsum("bhtk,bhk->bht", R, ks)
        R = torch.exp(g[:, s])[..., None, None] * (R - bs[..., None] * Rk[..., None] * ks[:, :, None, :])
    return torch.stack(cols[::-1], dim=-1)


def transition(S: torch.Tensor, g: torch.Tensor, k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """S <- exp(g_t) (S - beta_t k_t (k_t^T S)) on every level (rank-1).   S: [B, L, H, K, V]; k: [B, H, K]."""
    kS = torch.einsum("bhk,blhkv->blhv", k, S)
    upd = torch.einsum("bh,bhk,blhv->blhkv", beta, k, kS)
    return torch.exp(g)[:, None, :, None, None] * (S - upd)


def materialized(q, k, v, g, beta, level_scales, scale):
    """Quadratic form.  Inputs expanded to heads (see common); returns o: [B, T, H, V]."""
    return common.materialized(transfer_matrix(q, k, g, beta), v, level_scales, scale)


def recurrent(q, k, v, g, beta, level_scales, scale, levels=None, positions=None):
    """Token-by-token cascade (decoding semantics); returns (o, levels, positions)."""
    return common.recurrent(q, k, v, g, beta, level_scales, scale, transition, levels, positions)
