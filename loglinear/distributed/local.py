"""The state leaving a shard entered with zeros (the offset of its boundary map), Mamba-2 in closed form.

Only the final state is needed, not the outputs, and for a scalar decay it is a sum over the shard's
keys grouped by their level for the last query  e = end - 1  (contiguous, aligned ranges of keys):

    local[l] = sum_{s : level(e, s) = l} exp(g_{s+1} + ... + g_e) k_s v_s^T

O(T K V) in L GEMMs, against a whole chunked op (intra-chunk outputs included). The decay exponent is a
reverse cumulative sum, exact near the end of the shard where the weights matter (no difference of two
long prefix sums). Gated DeltaNet's state needs the full delta-rule cascade and comes from the op.
"""

from __future__ import annotations

import torch

from loglinear.fenwick import bit_length
from loglinear.ops.torch_chunk import suffix_sum

__all__ = ["decay_local_state"]


def decay_local_state(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, position: int, num_levels: int,
) -> torch.Tensor:
    """Mamba-2 state after tokens position .. position+T-1 from an empty state.

    k: [R, T, H, K] (expanded to the value heads); v: [R, T, H, V]; g: [R, T, H] -> [R, num_levels, H, K, V].
    """
    R, T, H, K = k.shape
    kw = k * torch.exp(suffix_sum(g, 1) - g)[..., None]  # sum_{u > s} g_u
    last = position + T - 1
    lev = bit_length(last ^ (position + torch.arange(T)))  # non-increasing along the shard
    values, counts = torch.unique_consecutive(lev, return_counts=True)
    zero = kw.new_zeros(R, H, K, v.shape[-1])
    levels = [zero] * num_levels
    for level, kws, vs in zip(values.tolist(), kw.split(counts.tolist(), 1), v.split(counts.tolist(), 1)):
        levels[level] = torch.einsum("rthk,rthv->rhkv", kws, vs)
    return torch.stack(levels, dim=1)

