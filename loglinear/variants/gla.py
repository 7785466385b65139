"""Log-linear Gated Linear Attention (GLA): a decay per head, token and key channel (spec section 6b).

    A_t = diag(exp(g_t)),  P_{t,s} = diag(exp(G_t - G_s))  (G = cumsum_t g, per channel),  k~_t = k_t
    o_t = scale * sum_{s<=t} lambda_t[level(t, s)] * sum_k q_t[k] exp(G_t[k] - G_s[k]) k_s[k] * v_s

g[..., k] equal for every k is log-linear Mamba-2 exactly; lambda = 1 is GLA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loglinear.variants.base import Gate, Gates, Variant, by_chunk, key_value_buckets
from loglinear.variants.mamba2 import level_sums, suffix_sum

__all__ = ["GLA", "GLAForm", "intra_chunk_scores", "sub_chunk_size"]


def sub_chunk_size(C: int) -> int:
    """The sub-chunk length S of the in-chunk scores: about sqrt(C), a power of two dividing C = 2^c."""
    return 1 << (C.bit_length() // 2)


def _decayed(diff: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp(diff) where keep, exactly 0 elsewhere (the exponent masked before exp: no overflow, no NaN gradient)."""
    return torch.exp(torch.where(keep, diff, torch.full_like(diff, -torch.inf)))


def intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """A[t, s] = sum_k q_t[k] exp(G_t[k] - G_s[k]) k_s[k] for s <= t inside each chunk, 0 above the diagonal.

    q, k, G: [..., C, K] (G the local inclusive cumsum of the log-decays) -> [..., C, C]. Every exponent is <= 0, so
    nothing overflows whatever the decays (exp(G_t - G_s) is never split into exp(G_t) exp(-G_s) across the
    chunk). The chunk is cut into sub-chunks of S tokens (sub_chunk_size):
      diagonal sub-blocks  the decays exp(G_t - G_s) themselves, [.., C/S, S, S, K]
      below them           for query sub-chunk i and key sub-chunk j < i, exp(G_t - G_s) is the product of three
                           factors <= 1: exp(G_t - G_b) on q (G_b the cumsum before sub-chunk i), exp(G_e - G_s) on
                           k (G_e the cumsum at the end of sub-chunk j) and exp(G_b - G_e) [.., C/S, C/S, K] between
                           them; one product over K per pair of sub-chunks
    so the intermediates hold O(C (S + C/S) K) per chunk instead of the C^2 K of a direct [C, C, K] product, and
    the exponentials O(C S K).
    """
    *batch, C, K = q.shape
    S = sub_chunk_size(C)
    n = C // S
    qs, ks, Gs = (x.reshape(*batch, n, S, K) for x in (q, k, G))
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()[..., None]  # [S, S, 1]
    gamma = _decayed(Gs[..., :, None, :] - Gs[..., None, :, :], causal)  # [.., n, S, S, K]
    diagonal = torch.einsum("...itk,...itsk,...isk->...its", qs, gamma, ks)  # [.., n, S, S]
    last = Gs[..., :, -1, :]  # G_e of each sub-chunk: [.., n, K]
    before = torch.cat([torch.zeros_like(last[..., :1, :]), last[..., :-1, :]], dim=-2)  # G_b: [.., n, K]
    q_ref = qs * torch.exp(Gs - before[..., None, :])  # [.., n, S, K]
    k_end = ks * torch.exp(last[..., None, :] - Gs)  # [.., n, S, K]
    earlier = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)[..., None]  # j < i: [n, n, 1]
    between = _decayed(before[..., :, None, :] - last[..., None, :, :], earlier)  # [.., n, n, K]
    below = torch.einsum("...itk,...ijk,...jsk->...itjs", q_ref, between, k_end)  # [.., n, S, n, S]
    eye = torch.eye(n, dtype=q.dtype, device=q.device)[:, None, :, None]  # [n, 1, n, 1]
    scores = below + diagonal[..., None, :] * eye
    return scores.reshape(*batch, C, C)


class GLAForm:
    """The torch chunk form with per-channel decays (see loglinear.ops.torch_chunk.scan for what a form provides).

    q, k: [b, H, N, C, K]; v: [b, H, N, C, V]; g: [b, H, N, C, K] (padding tokens: k = v = g = 0).
    With G the local inclusive cumsum of g per channel:
      intra  intra_chunk_scores(q, k, G)  (stable sub-chunk form)
      qt     q_t * exp(G_t)                       readout queries
      kt     k_s * exp(G_last - G_s)              keys decayed to the chunk's end
      transition: h <- diag(exp(G_last)) h        (rows of the K x X states scaled per channel)
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor):
        G = torch.cumsum(g, dim=-2)
        self.v = v
        self.intra = intra_chunk_scores(q, k, G)
        self.qt = torch.exp(G) * q
        self.kt = torch.exp(G[..., -1:, :] - G) * k
        self.chunk_decay = torch.exp(G[..., -1, :])  # [b, H, N, K]
        self.deposit = torch.einsum("bhnck,bhncv->bhnkv", self.kt, v)
        self._decay_at = by_chunk(self.chunk_decay)

    def transition(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self._decay_at[i][..., None] * h

    def bucket_states(self, i: int, masks: torch.Tensor) -> torch.Tensor:
        return key_value_buckets(self.kt[:, :, i], self.v[:, :, i], masks)


def transfer_matrix(q: torch.Tensor, k: torch.Tensor, gates: Gates) -> torch.Tensor:
    """C[b, h, t, s] = sum_k q_t[k] exp(G_t[k] - G_s[k]) k_s[k] for s <= t (a [B, H, T, T, K] intermediate).
    q, k, g: [B, T, H, K] -> [B, H, T, T]."""
    G = torch.cumsum(gates["g"], dim=1).transpose(1, 2)  # [B, H, T, K]
    T = G.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[..., None]
    gamma = _decayed(G[:, :, :, None, :] - G[:, :, None, :, :], causal)
    return torch.einsum("bthk,bhtsk,bshk->bhts", q, gamma, k)


def transition(S: torch.Tensor, k: torch.Tensor, gates: Gates) -> torch.Tensor:
    """S <- diag(exp(g_t)) S on every level (row k of each K x V state scaled by exp(g_t[k])).
    S: [N, L, H, K, V]; g: [N, H, K]."""
    return torch.exp(gates["g"])[:, None, :, :, None] * S


def deposit_key(k: torch.Tensor, gates: Gates) -> torch.Tensor:
    """k~_t = k_t.   k: [N, H, K]."""
    return k


def shard_transition(k: torch.Tensor, gates: Gates, chunk_size: int) -> torch.Tensor:
    """A_{T-1} ... A_0 = diag(exp(sum_t g_t)), as the K x K matrix the context-parallel scan composes.
    g: [B, T, H, K] -> [B, H, K, K] (k: [B, T, G, K] unused)."""
    return torch.diag_embed(torch.exp(gates["g"].sum(1)))


def local_state(k: torch.Tensor, v: torch.Tensor, gates: Gates, position: int, num_levels: int) -> torch.Tensor:
    """The state a shard leaves when entered with zeros, in closed form (as Mamba-2's, per channel):

        local[l] = sum_{s : level(e, s) = l} diag(exp(g_{s+1} + ... + g_e)) k_s v_s^T     (e = end - 1)

    O(T K V). k, g: [R, T, H, K] (k expanded to the value heads); v: [R, T, H, V] -> [R, num_levels, H, K, V]."""
    g = gates["g"]
    return level_sums(k * torch.exp(suffix_sum(g, 1) - g), v, position, num_levels)


def sample_gates(B: int, T: int, H: int, K: int, *, dtype: torch.dtype = torch.float32,
                 generator: torch.Generator | None = None) -> Gates:
    """Random valid gates: g = logsigmoid(x) / 16 with x ~ N(0, 1) (about -0.003 to -0.2 per token), except on
    about a quarter of the channels of each row and head, which forget fast: g in [-1.5, -0.5] per token (decays
    down to about exp(-24) over 16 tokens).  -> {"g": [B, T, H, K]}."""
    slow = F.logsigmoid(torch.randn(B, T, H, K, dtype=dtype, generator=generator)) / 16
    fast = -0.5 - torch.rand(B, T, H, K, dtype=dtype, generator=generator)
    forgets = torch.rand(B, 1, H, K, generator=generator) < 0.25
    return {"g": torch.where(forgets, fast, slow)}


GLA = Variant(
    name="gla", title="GLA", gates=(Gate("g", "log-decay <= 0 per key channel", log_decay=True, per_channel=True),),
    form=GLAForm, transfer_matrix=transfer_matrix, transition=transition, deposit_key=deposit_key,
    shard_transition=shard_transition, matrix_transition=True, sample_gates=sample_gates, local_state=local_state,
)
