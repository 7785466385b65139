"""Log-linear Mamba-2: a scalar decay per head and token (spec sections 1-4, 6).

    A_t = exp(g_t) I,  P_{t,s} = exp(G_t - G_s) I  (G = cumsum g),  k~_t = k_t
    o_t = scale * sum_{s<=t} lambda_t[level(t, s)] * exp(G_t - G_s) * (q_t . k_s) * v_s
"""

from __future__ import annotations

import torch

from loglinear.fenwick import bit_length
from loglinear.variants.base import Gate, Gates, Variant, by_chunk, decay_matrix, decays, key_value_buckets

__all__ = ["MAMBA2", "Mamba2Form", "suffix_sum", "level_sums"]


def suffix_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """sum_{u >= t} x[u] along dim, same shape as x.

    Scanned with dim innermost: torch's CUDA scan over an outer dimension runs sequentially along it, parallel only
    over the other dimensions (on an H200: 18 ms for the Mamba-2 gate gradient at 32K tokens, 41 ms of a 128K
    context-parallel step)."""
    return x.movedim(dim, -1).flip(-1).contiguous().cumsum(-1).flip(-1).movedim(-1, dim)


class Mamba2Form:
    """The torch chunk form (see loglinear.ops.torch_chunk.scan for what a form provides).

    q, k: [b, H, N, C, K]; v: [b, H, N, C, V]; g: [b, H, N, C] (padding tokens: k = v = g = 0)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor):
        G, gamma, to_end = decays(g)
        self.v = v
        self.intra = torch.einsum("bhntk,bhnsk->bhnts", q, k) * gamma
        self.qt = torch.exp(G)[..., None] * q
        self.kt = to_end[..., None] * k  # exp(G_last - G_s) k_s
        self.chunk_decay = torch.exp(G[..., -1])  # [b, H, N]
        self.deposit = torch.einsum("bhnck,bhncv->bhnkv", self.kt, v)
        self._decay_at = by_chunk(self.chunk_decay)

    def transition(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self._decay_at[i][:, :, None, None] * h

    def bucket_states(self, i: int, masks: torch.Tensor) -> torch.Tensor:
        return key_value_buckets(self.kt[:, :, i], self.v[:, :, i], masks)


def transfer_matrix(q: torch.Tensor, k: torch.Tensor, gates: Gates) -> torch.Tensor:
    """C[b, h, t, s] = exp(G_t - G_s) (q_t . k_s) for s <= t.   q, k: [B, T, H, K]; g: [B, T, H] -> [B, H, T, T]."""
    return torch.einsum("bthk,bshk->bhts", q, k) * decay_matrix(gates["g"])


def transition(S: torch.Tensor, k: torch.Tensor, gates: Gates) -> torch.Tensor:
    """S <- exp(g_t) S on every level.   S: [N, L, H, K, V]; g: [N, H]."""
    return torch.exp(gates["g"])[:, None, :, None, None] * S


def deposit_key(k: torch.Tensor, gates: Gates) -> torch.Tensor:
    """k~_t = k_t.   k: [N, H, K]."""
    return k


def shard_transition(k: torch.Tensor, gates: Gates, chunk_size: int) -> torch.Tensor:
    """A_{T-1} ... A_0 = exp(sum_t g_t).   g: [B, T, H] -> [B, H, 1, 1] (k: [B, T, G, K] unused)."""
    return torch.exp(gates["g"].sum(1))[..., None, None]


def level_sums(kw: torch.Tensor, v: torch.Tensor, position: int, num_levels: int) -> torch.Tensor:
    """sum_{s : level(e, s) = l} kw_s v_s^T per level l, for the last query e = position + T - 1 of a shard whose
    first token is at ``position``: its keys grouped by level are contiguous, aligned ranges, so L GEMMs.
    kw: [R, T, H, K] (keys already decayed to the shard's end); v: [R, T, H, V] -> [R, num_levels, H, K, V]."""
    R, T, H, K = kw.shape
    last = position + T - 1
    lev = bit_length(last ^ (position + torch.arange(T)))  # non-increasing along the shard
    values, counts = torch.unique_consecutive(lev, return_counts=True)
    zero = kw.new_zeros(R, H, K, v.shape[-1])
    levels = [zero] * num_levels
    for level, kws, vs in zip(values.tolist(), kw.split(counts.tolist(), 1), v.split(counts.tolist(), 1)):
        levels[level] = torch.einsum("rthk,rthv->rhkv", kws, vs)
    return torch.stack(levels, dim=1)


def local_state(k: torch.Tensor, v: torch.Tensor, gates: Gates, position: int, num_levels: int) -> torch.Tensor:
    """The state a shard leaves when entered with zeros, in closed form: only the final state is needed, and for a
    scalar decay it is a sum over the shard's keys grouped by their level for the last query e = end - 1
    (contiguous, aligned ranges of keys):

        local[l] = sum_{s : level(e, s) = l} exp(g_{s+1} + ... + g_e) k_s v_s^T

    O(T K V) in L GEMMs (level_sums). The decay exponent is a reverse cumulative sum, exact near the end of the
    shard where the weights matter (no difference of two long prefix sums).
    k: [R, T, H, K] (expanded to the value heads); v: [R, T, H, V]; g: [R, T, H] -> [R, num_levels, H, K, V].
    """
    g = gates["g"]
    kw = k * torch.exp(suffix_sum(g, 1) - g)[..., None]  # sum_{u > s} g_u
    return level_sums(kw, v, position, num_levels)


def sample_gates(B: int, T: int, H: int, K: int, *, dtype: torch.dtype = torch.float32,
                 generator: torch.Generator | None = None) -> Gates:
    """Random valid gates: g in [-0.45, -0.05] (K unused).  -> {"g": [B, T, H]}."""
    return {"g": -0.05 - 0.4 * torch.rand(B, T, H, dtype=dtype, generator=generator)}


MAMBA2 = Variant(
    name="mamba2", title="Mamba-2", gates=(Gate("g", "log-decay <= 0", log_decay=True),), form=Mamba2Form,
    transfer_matrix=transfer_matrix, transition=transition, deposit_key=deposit_key,
    shard_transition=shard_transition, matrix_transition=False, sample_gates=sample_gates, local_state=local_state,
)
