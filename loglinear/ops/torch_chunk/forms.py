"""Per-chunk algebra of each variant: what the shared Fenwick chunk scan needs from a variant.

Tensors are chunked: q, k: [b, H, N, C, K]; v: [b, H, N, C, V]; g, beta: [b, H, N, C] (N chunks of C
tokens, padding tokens have k = v = g = beta = 0, so their transition is the identity). Within a chunk,
G is the local inclusive cumsum of g and Gamma[t, s] = exp(G_t - G_s) for s <= t.

A form provides
    intra:  [b, H, N, C, C]  beta_s q_t^T P_{t,s} k_s inside the chunk (before the level mask)
    qt:     [b, H, N, C, K]  readout queries:  q_t^T P_{t, chunk start - 1} h  ==  (qt_t) h
    transition(i, h):        the chunk's whole transition applied to states h: [b, H, K, X]
    bucket_states(i, masks): state at the chunk's end of the tokens selected by masks [M, C] -> [b, M, H, K, V]
    deposit:                 [b, H, N, K, V]  the chunk's own state at its end (all tokens)
"""

from __future__ import annotations

import torch


def suffix_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """sum_{u >= t} x[u] along dim, same shape as x.

    Scanned with dim innermost: torch's CUDA scan over an outer dimension runs sequentially along it, parallel only
    over the other dimensions (on an H200: 18 ms for the Mamba-2 gate gradient at 32K tokens, 41 ms of a 128K
    context-parallel step)."""
    return x.movedim(dim, -1).flip(-1).contiguous().cumsum(-1).flip(-1).movedim(-1, dim)


def _decays(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """G: local cumsum [b,H,N,C]; Gamma: [b,H,N,C,C] (0 above the diagonal); to_end: exp(G_last - G_s) [b,H,N,C]."""
    G = torch.cumsum(g, dim=-1)
    diff = G[..., :, None] - G[..., None, :]
    causal = torch.ones(diff.shape[-2:], dtype=torch.bool, device=g.device).tril()
    gamma = torch.exp(torch.where(causal, diff, torch.full_like(diff, -torch.inf)))
    to_end = torch.exp(G[..., -1:] - G)
    return G, gamma, to_end


class Mamba2Form:
    """Scalar decay: P_{t,s} = exp(G_t - G_s) I, beta = 1."""

    def __init__(self, q, k, v, g, beta):
        G, gamma, to_end = _decays(g)
        self.v = v
        self.intra = torch.einsum("bhntk,bhnsk->bhnts", q, k) * gamma
        self.qt = torch.exp(G)[..., None] * q
        self.kt = to_end[..., None] * k  # exp(G_last - G_s) k_s
        self.chunk_decay = torch.exp(G[..., -1])  # [b, H, N]
        self.deposit = torch.einsum("bhnck,bhncv->bhnkv", self.kt, v)

    def transition(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self.chunk_decay[:, :, i, None, None] * h

    def bucket_states(self, i: int, masks: torch.Tensor) -> torch.Tensor:
        return torch.einsum("mc,bhck,bhcv->bmhkv", masks, self.kt[:, :, i], self.v[:, :, i])


class GatedDeltaNetForm:
    """Delta rule with gates, WY/UT form inside chunks (spec section 5).

    T_g = (I + strict_lower(diag(beta) (Gamma * K K^T)))^-1   (the gated UT inverse, a unit-lower solve)
    u   = T_g (beta * V)               pseudo-values
    W~  = T_g (beta * exp(G) * K)      = exp(G) * w,  w = T (beta * K)
    intra = (tril(Q K^T) * Gamma) T_g diag(beta)
    qt  = exp(G) * Q - (tril(Q K^T) * Gamma) W~
    transition: h <- exp(G_last) h - K~^T (W~ h),   K~ = exp(G_last - G) * K
    state of selected tokens at the chunk end: K~^T T_g (beta * V * mask)
    """

    def __init__(self, q, k, v, g, beta):
        G, gamma, to_end = _decays(g)
        C = q.shape[-2]
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        kk = torch.einsum("bhntk,bhnsk->bhnts", k, k) * gamma
        lower = torch.tril(beta[..., :, None] * kk, diagonal=-1)
        self.Tg = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
        self.bv = beta[..., None] * v
        u = self.Tg @ self.bv
        self.wt = self.Tg @ ((beta * torch.exp(G))[..., None] * k)
        qk = torch.einsum("bhntk,bhnsk->bhnts", q, k) * gamma
        self.intra = (qk @ self.Tg) * beta[..., None, :]
        self.qt = torch.exp(G)[..., None] * q - qk @ self.wt
        self.kt = to_end[..., None] * k
        self.chunk_decay = torch.exp(G[..., -1])
        self.deposit = torch.einsum("bhnck,bhncv->bhnkv", self.kt, u)

    def transition(self, i: int, h: torch.Tensor) -> torch.Tensor:
        wh = torch.einsum("bhck,bhkx->bhcx", self.wt[:, :, i], h)
        return self.chunk_decay[:, :, i, None, None] * h - torch.einsum("bhck,bhcx->bhkx", self.kt[:, :, i], wh)

    def bucket_states(self, i: int, masks: torch.Tensor) -> torch.Tensor:
        u = torch.einsum("bhcs,ms,bhsv->bmhcv", self.Tg[:, :, i], masks, self.bv[:, :, i])
        return torch.einsum("bhck,bmhcv->bmhkv", self.kt[:, :, i], u)
