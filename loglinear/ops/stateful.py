"""Attention with a state in and out, log-linear or plain: the sequence-mixing call of a mixer layer.

    log-linear (level_scales given): the op with lambda = level_scales; the state keeps
        ceil(log2 T) + 1 level states per sequence.
    plain (level_scales None): lambda = 1, which is exactly the variant's linear attention (Mamba-2, Gated
        DeltaNet, ...): the op's plain call (loglinear.ops.api), with the state kept as ONE level, so a plain
        model pays no log T memory; single-token steps run the plain recurrence (loglinear.ops.decode).

Eager calls run ``fenwick_attention`` directly (native autograd); under torch.compile the mixers call the
``loglinear::fenwick_attention`` custom op (loglinear.ops.custom_ops), so the attention is one graph node.
Arguments are plain tensors, lists and scalars (the variant by name, its gates as a list in the variant's
order) so that both share one signature.
"""

from __future__ import annotations

import torch

from loglinear.ops.api import attention
from loglinear.state import FenwickState
from loglinear.variants import get

__all__ = ["fenwick_attention", "check_capacity", "max_tokens"]


def max_tokens(max_levels: int) -> int:
    """Tokens per sequence that ``max_levels`` levels cover: levels_needed(n) = ceil(log2 n) + 1 <= max_levels."""
    return 1 << (max_levels - 1)


def check_capacity(end: int, max_levels: int) -> None:
    """Raise when a sequence reaches ``end`` tokens, beyond what ``max_levels`` levels cover."""
    if end > max_tokens(max_levels):
        raise ValueError(
            f"a sequence reached {end} tokens, but max_levels = {max_levels} covers at most "
            f"{max_tokens(max_levels)} (2^{max_levels - 1}) tokens; raise max_levels in the config"
        )


def _lengths(batch: int, length: int, cu_seqlens: torch.Tensor | None) -> list[int]:
    if cu_seqlens is None:
        return [length] * batch
    bounds = cu_seqlens.tolist()
    return [b - a for a, b in zip(bounds, bounds[1:])]


def fenwick_attention(
    variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: list[torch.Tensor],
    level_scales: torch.Tensor | None, levels: torch.Tensor | None, positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, scale: float, chunk_size: int, max_levels: int, output_state: bool,
    l2norm_qk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of N sequences continuing from a state.

    variant: a registered variant's name; q, k: [B, T, G, K]; v: [B, T, H, V]; gates: the variant's per-token
    inputs [B, T, H] (per channel: [B, T, H, K]) in the order of variant.gates; level_scales:
    [B, T, H, max_levels] (log-linear) or None (plain); levels: [N, L, H, K, V] or None (a fresh start); positions:
    [N] int64 CPU (tokens already seen) or None; cu_seqlens: [N + 1] or None (then B = 1). Returns o: [B, T, H, V]
    and, if output_state, the new levels [N, L', H, K, V] (L' = 1 for plain) and positions [N] (empty tensors
    otherwise).
    """
    spec = get(variant)
    gate_dict = dict(zip(spec.gate_names, gates, strict=True))
    if level_scales is not None:  # a plain state has no levels to run out of
        lengths = _lengths(q.shape[0], q.shape[1], cu_seqlens)
        starts = positions.tolist() if positions is not None else [0] * len(lengths)
        check_capacity(max(p + n for p, n in zip(starts, lengths)), max_levels)
    state = FenwickState(levels, positions) if levels is not None else None
    o, new_state = attention(
        spec, q, k, v, gate_dict, level_scales, scale=scale, initial_state=state, output_final_state=output_state,
        cu_seqlens=cu_seqlens, use_qk_l2norm=l2norm_qk, chunk_size=chunk_size,
    )
    if not output_state:
        return o, v.new_empty(0), torch.empty(0, dtype=torch.int64)
    return o, new_state.levels, new_state.positions
