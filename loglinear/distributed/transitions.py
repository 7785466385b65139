"""The whole-shard transition  mat = A_{T-1} ... A_0  of each variant (the linear part of a shard's map).

Mamba-2:        A_t = exp(g_t) I                   ->  mat = exp(sum_t g_t)            [B, H, 1, 1]
Gated DeltaNet: A_t = exp(g_t) (I - beta_t k_t k_t^T)  ->  mat = product, per head     [B, H, K, K]

The delta-rule product is taken chunk by chunk in the WY form of the torch chunk path (one chunk's
product is exp(G_last) I - K~^T W~, see loglinear.ops.torch_chunk.forms), so it costs O(T K^2 + (T/C) K^3)
and is differentiable by autograd.
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
    B, K = k.shape[0], k.shape[-1]
    mat = torch.eye(K, dtype=k.dtype, device=k.device).expand(B, H, K, K)
    for i in range(kc.shape[2]):
        mat = form.transition(i, mat)
    return mat
