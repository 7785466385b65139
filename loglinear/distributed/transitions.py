"""The whole-shard transition  mat = A_{T-1} ... A_0  of each variant (the linear part of a shard's map).

Mamba-2:        A_t = exp(g_t) I                   ->  mat = exp(sum_t g_t)            [B, H, 1, 1]
Gated DeltaNet: A_t = exp(g_t) (I - beta_t k_t k_t^T)  ->  mat = product, per head     [B, H, K, K]

The delta-rule product is taken in the WY form of the torch chunk path: chunk n's product is
M_n = exp(G_last) I - K~_n^T W~_n (loglinear.ops.torch_chunk.forms), all chunks in one batched GEMM, then
mat = M_{N-1} ... M_0 by pairwise products in ceil(log2 N) steps. O(T K^2 + (T/C) K^3), differentiable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loglinear.inputs import expand_groups, l2norm
from loglinear.ops.torch_chunk import GatedDeltaNetForm

__all__ = ["decay_transition", "delta_rule_transition"]


def decay_transition(g: torch.Tensor) -> torch.Tensor:
    """Mamba-2 shard transition.  g: [B, T, H] -> [B, H, 1, 1] = exp(sum_t g_t)."""
    return torch.exp(g.sum(1))[..., None, None]


def _chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, *] zero-padded at the end to whole chunks -> [B, H, N, C, *]."""
    B, T, H = x.shape[:3]
    pad = -T % chunk_size
    x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
    return x.reshape(B, (T + pad) // chunk_size, chunk_size, H, *x.shape[3:]).movedim(3, 1)


def delta_rule_transition(
    k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, use_qk_l2norm: bool, chunk_size: int,
) -> torch.Tensor:
    """Gated DeltaNet shard transition  A_{T-1} ... A_0.

    k: [B, T, G, K] (as given to the op: GQA groups, normalised here if use_qk_l2norm); g, beta: [B, T, H].
    Returns [B, H, K, K]. Padding tokens (k = g = beta = 0) are identities.
    """
    H = g.shape[2]
    if use_qk_l2norm:
        k = l2norm(k)
    k = expand_groups(k, H)
    kc, gc, bc = _chunks(k, chunk_size), _chunks(g, chunk_size), _chunks(beta, chunk_size)
    form = GatedDeltaNetForm(kc, kc, kc[..., :1], gc, bc)
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    mats = form.chunk_decay[..., None, None] * eye - torch.einsum("bhnck,bhncj->bhnkj", form.kt, form.wt)
    return _ordered_product(mats)


def _ordered_product(mats: torch.Tensor) -> torch.Tensor:
    """M_{N-1} ... M_0 of [B, H, N, K, K] by pairwise products (log-depth) -> [B, H, K, K]."""
    while mats.shape[2] > 1:
        if mats.shape[2] % 2:
            eye = torch.eye(mats.shape[-1], dtype=mats.dtype, device=mats.device)
            mats = torch.cat([mats, eye.expand(*mats.shape[:2], 1, -1, -1)], dim=2)
        mats = mats[:, :, 1::2] @ mats[:, :, 0::2]
    return mats[:, :, 0]
