"""Log-linear Gated DeltaNet: a gated delta rule per head (spec sections 1-5, 6).

    A_t = exp(g_t) (I - beta_t k_t k_t^T),  P_{t,s} = A_t ... A_{s+1},  k~_t = beta_t k_t
    o_t = scale * sum_{s<=t} lambda_t[level(t, s)] * beta_s * (q_t^T P_{t,s} k_s) * v_s
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loglinear.inputs import expand_groups
from loglinear.variants.base import Gate, Gates, Variant, by_chunk, decays

__all__ = ["GATED_DELTANET", "GatedDeltaNetForm"]


class GatedDeltaNetForm:
    """The torch chunk form: the delta rule with gates, WY/UT form inside chunks (spec section 5).

    q, k: [b, H, N, C, K]; v: [b, H, N, C, V]; g, beta: [b, H, N, C] (padding tokens: k = v = g = beta = 0).

    T_g = (I + strict_lower(diag(beta) (Gamma * K K^T)))^-1   (the gated UT inverse, a unit-lower solve)
    u   = T_g (beta * V)               pseudo-values
    W~  = T_g (beta * exp(G) * K)      = exp(G) * w,  w = T (beta * K)
    intra = (tril(Q K^T) * Gamma) T_g diag(beta)
    qt  = exp(G) * Q - (tril(Q K^T) * Gamma) W~
    transition: h <- exp(G_last) h - K~^T (W~ h),   K~ = exp(G_last - G) * K
    state of selected tokens at the chunk end: K~^T T_g (beta * V * mask)
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
        G, gamma, to_end = decays(g)
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
        self._at = list(zip(by_chunk(self.chunk_decay), by_chunk(self.wt), by_chunk(self.kt)))

    def transition(self, i: int, h: torch.Tensor) -> torch.Tensor:
        decay, wt, kt = self._at[i]
        wh = torch.einsum("bhck,bhkx->bhcx", wt, h)
        return decay[:, :, None, None] * h - torch.einsum("bhck,bhcx->bhkx", kt, wh)

    def bucket_states(self, i: int, masks: torch.Tensor) -> torch.Tensor:
        u = torch.einsum("bhcs,ms,bhsv->bmhcv", self.Tg[:, :, i], masks, self.bv[:, :, i])
        return torch.einsum("bhck,bmhcv->bmhkv", self.kt[:, :, i], u)

    def chunk_products(self) -> torch.Tensor:
        """Each chunk's whole transition as a matrix, M_n = exp(G_last) I - K~_n^T W~_n.  -> [b, H, N, K, K]."""
        eye = torch.eye(self.kt.shape[-1], dtype=self.kt.dtype, device=self.kt.device)
        return self.chunk_decay[..., None, None] * eye - torch.einsum("bhnck,bhncj->bhnkj", self.kt, self.wt)


def transfer_matrix(q: torch.Tensor, k: torch.Tensor, gates: Gates) -> torch.Tensor:
    """C[b, h, t, s] = beta_s q_t^T P_{t,s} k_s for s <= t.   q, k: [B, T, H, K]; g, beta: [B, T, H] -> [B, H, T, T].

    Sweeps s from T-1 down to 0 keeping R[t] = q_t^T P_{t,s} for every t >= s, then R <- R A_s.
    """
    g, beta = gates["g"], gates["beta"]
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


def transition(S: torch.Tensor, k: torch.Tensor, gates: Gates) -> torch.Tensor:
    """S <- exp(g_t) (S - beta_t k_t (k_t^T S)) on every level: rank-1, O(K V) per level.
    S: [N, L, H, K, V]; k: [N, H, K]; g, beta: [N, H]."""
    kk = k[:, None, :, :, None]  # [N, 1, H, K, 1]
    kS = (kk * S).sum(3, keepdim=True)  # [N, L, H, 1, V]
    decay = torch.exp(gates["g"])[:, None, :, None, None]
    return decay * (S - gates["beta"][:, None, :, None, None] * kk * kS)


def deposit_key(k: torch.Tensor, gates: Gates) -> torch.Tensor:
    """k~_t = beta_t k_t.   k: [N, H, K]; beta: [N, H]."""
    return gates["beta"][..., None] * k


def _chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, *] zero-padded at the end to whole chunks -> [B, H, N, C, *]."""
    B, T, H = x.shape[:3]
    pad = -T % chunk_size
    x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
    return x.reshape(B, (T + pad) // chunk_size, chunk_size, H, *x.shape[3:]).movedim(3, 1)


def _ordered_product(mats: torch.Tensor) -> torch.Tensor:
    """M_{N-1} ... M_0 of [B, H, N, K, K] by pairwise products (log-depth) -> [B, H, K, K]."""
    while mats.shape[2] > 1:
        if mats.shape[2] % 2:
            eye = torch.eye(mats.shape[-1], dtype=mats.dtype, device=mats.device)
            mats = torch.cat([mats, eye.expand(*mats.shape[:2], 1, -1, -1)], dim=2)
        mats = mats[:, :, 1::2] @ mats[:, :, 0::2]
    return mats[:, :, 0]


def shard_transition(k: torch.Tensor, gates: Gates, chunk_size: int) -> torch.Tensor:
    """A_{T-1} ... A_0 of a shard, in the WY form of the chunk path: each chunk's product M_n in one batched GEMM,
    then M_{N-1} ... M_0 by pairwise products in ceil(log2 N) steps. O(T K^2 + (T/C) K^3), differentiable.
    k: [B, T, G, K] (normalised if the op normalises); g, beta: [B, T, H] -> [B, H, K, K]. Padding tokens
    (k = g = beta = 0) are identities."""
    k = expand_groups(k, gates["g"].shape[2])
    kc, gc, bc = _chunks(k, chunk_size), _chunks(gates["g"], chunk_size), _chunks(gates["beta"], chunk_size)
    return _ordered_product(GatedDeltaNetForm(kc, kc, kc[..., :1], gc, bc).chunk_products())


def sample_gates(B: int, T: int, H: int, K: int, *, dtype: torch.dtype = torch.float32,
                 generator: torch.Generator | None = None) -> Gates:
    """Random valid gates: g in [-0.45, -0.05], beta in [0.05, 0.95] (K unused).  -> {"g", "beta": [B, T, H]}."""
    return {"g": -0.05 - 0.4 * torch.rand(B, T, H, dtype=dtype, generator=generator),
            "beta": 0.05 + 0.9 * torch.rand(B, T, H, dtype=dtype, generator=generator)}


GATED_DELTANET = Variant(
    name="gated_deltanet", title="Gated DeltaNet",
    gates=(Gate("g", "log-decay <= 0", log_decay=True), Gate("beta", "in (0, 1)")),
    form=GatedDeltaNetForm, transfer_matrix=transfer_matrix, transition=transition, deposit_key=deposit_key,
    shard_transition=shard_transition, matrix_transition=True, sample_gates=sample_gates, delta_rule=True,
)
