"""Causal depthwise short convolution over sequences, with a state for decoding.

    y_t[c] = bias[c] + sum_{j=0}^{W-1} w[c, W-1-j] * x_{t-j}[c]

where x_{t-j} for t-j before the start of this call comes from the state (the sequence's last W-1 inputs,
zeros for a fresh sequence). Tokens are the flat real tokens of a TokenLayout, so sequences never see
each other (padding, packing).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from loglinear.layers.sequence import TokenLayout
from loglinear.tables import device_table

__all__ = ["ShortConvolution"]


class ShortConvolution(nn.Conv1d):
    """Depthwise causal conv of kernel W on [Ntok, C] tokens; state: [N, W-1, C] (oldest input first)."""

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=bias)

    def step(
        self, x: torch.Tensor, layout: TokenLayout, state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [Ntok, C]; state: [N, W-1, C] or None -> (y: [Ntok, C], new state [N, W-1, C])."""
        W, C, N = self.kernel_size[0], x.shape[1], layout.num_sequences
        if state is None:
            state = x.new_zeros(N, W - 1, C)
        elif state.shape != (N, W - 1, C):
            raise ValueError(f"conv state must be [N, W-1, C] = [{N}, {W - 1}, {C}], got {tuple(state.shape)}")
        weight = self.weight[:, 0, :].to(x.dtype)  # [C, W]
        y = x.new_zeros(x.shape) if self.bias is None else self.bias.to(x.dtype).expand_as(x)
        if layout.index is None and not layout.packed:  # dense: every sequence is a row of T tokens
            T = layout.length
            window = torch.cat([state.to(x.dtype), x.reshape(N, T, C)], dim=1)  # [N, W-1+T, C]
            for i in range(W):
                y = y + window[:, i : i + T].reshape(N * T, C) * weight[:, i]
            return y, window[:, T:]
        source = torch.cat([state.to(x.dtype).reshape(N * (W - 1), C), x], dim=0)
        token = torch.arange(x.shape[0], device=x.device)
        for lag in range(W):
            rows = self._rows(layout.seq_id, layout.pos - lag, token - lag, N * (W - 1), W)
            y = y + source.index_select(0, rows) * weight[:, W - 1 - lag]
        return y, self._last_inputs(source, layout, W)

    @staticmethod
    def _rows(seq: torch.Tensor, rel: torch.Tensor, token: torch.Tensor, n_state: int, W: int) -> torch.Tensor:
        """Row of ``source`` holding the input at relative time ``rel`` of sequence ``seq``
        (token index if rel >= 0)."""
        return torch.where(rel >= 0, n_state + token, seq * (W - 1) + (W - 1) + rel)

    def _last_inputs(self, source: torch.Tensor, layout: TokenLayout, W: int) -> torch.Tensor:
        """The last W-1 inputs of every sequence: [N, W-1, C]."""
        N = layout.num_sequences
        device = source.device
        lengths = device_table(layout.lengths, torch.int64, device)
        starts = torch.cumsum(lengths, 0) - lengths
        rel = lengths[:, None] - (W - 1) + torch.arange(W - 1, device=device)[None, :]  # [N, W-1]
        seq = torch.arange(N, device=device)[:, None].expand_as(rel)
        rows = self._rows(seq, rel, starts[:, None] + rel, N * (W - 1), W)
        return source.index_select(0, rows.reshape(-1)).reshape(N, W - 1, source.shape[1])
