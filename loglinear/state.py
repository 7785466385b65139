"""The Fenwick state: per-level linear-attention states of every sequence, and their positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loglinear.fenwick import levels_needed

__all__ = ["FenwickState", "LevelsView"]


class LevelsView:
    """Read-only facts of anything holding ``levels: [N, L, H, K, V]`` and ``positions: [N]``."""

    levels: torch.Tensor
    positions: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return self.levels.shape[0]

    @property
    def num_levels(self) -> int:
        return self.levels.shape[1]

    @property
    def max_position(self) -> int:
        return int(self.positions.max()) if self.positions.numel() else 0


@dataclass
class FenwickState(LevelsView):
    """Recurrent state of log-linear attention after ``positions[n]`` tokens of sequence n.

    levels:    [N, L, H, K, V] float32 (float64 when the op ran in float64). ``levels[n, l]`` is the
               linear-attention state of the level-l bucket of the last query (spec section 4):
               level 0 holds the last token, level l >= 1 the keys s with bit_length(p-1 XOR s) = l.
    positions: [N] int64 on the CPU: tokens consumed so far (the next token's absolute position).

    Passed back as ``initial_state`` it continues the same sequences exactly; gradients flow through
    ``levels``. Memory grows as ceil(log2 T) + 1 level states, never with T.
    """

    levels: torch.Tensor
    positions: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.levels, torch.Tensor) or self.levels.dim() != 5:
            shape = tuple(self.levels.shape) if isinstance(self.levels, torch.Tensor) else type(self.levels)
            raise ValueError(f"FenwickState.levels must be a tensor [N, L, H, K, V], got {shape}")
        if not self.levels.dtype.is_floating_point:
            raise TypeError(f"FenwickState.levels must be floating point, got {self.levels.dtype}")
        raw = torch.as_tensor(self.positions)
        if raw.dtype.is_floating_point or raw.dtype.is_complex or raw.dtype == torch.bool:
            raise TypeError(f"FenwickState.positions must be integers (token counts), got {raw.dtype}")
        positions = raw.to(dtype=torch.int64, device="cpu")
        if positions.shape != (self.levels.shape[0],):
            raise ValueError(
                f"FenwickState.positions must have shape [N] = [{self.levels.shape[0]}], "
                f"got {tuple(positions.shape)}"
            )
        if bool((positions < 0).any()):
            raise ValueError(f"FenwickState.positions must be >= 0, got {positions.tolist()}")
        self.positions = positions

    @classmethod
    def zeros(
        cls, num_sequences: int, num_heads: int, head_k_dim: int, head_v_dim: int,
        *, num_levels: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> "FenwickState":
        """An empty state (position 0) for ``num_sequences`` sequences."""
        sizes = dict(num_sequences=num_sequences, num_heads=num_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                     num_levels=num_levels)
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"FenwickState.zeros: {name} must be a positive int, got {value!r}")
        levels = torch.zeros(num_sequences, num_levels, num_heads, head_k_dim, head_v_dim, dtype=dtype, device=device)
        return cls(levels, torch.zeros(num_sequences, dtype=torch.int64))

    def nbytes(self) -> int:
        """Bytes held by the level states."""
        return self.levels.numel() * self.levels.element_size()

    def with_levels(self, num_levels: int) -> "FenwickState":
        """The same state with its level axis zero-padded to ``num_levels`` (never truncated)."""
        extra = num_levels - self.num_levels
        if extra <= 0:
            return self
        pad = self.levels.new_zeros(self.levels.shape[0], extra, *self.levels.shape[2:])
        return FenwickState(torch.cat([self.levels, pad], dim=1), self.positions)

    def summed(self) -> "FenwickState":
        """The one-level state of plain attention: the level states summed (with lambda = 1 only their sum is
        ever read).  levels [N, 1, H, K, V]."""
        return FenwickState(self.levels.sum(1, keepdim=True), self.positions)

    def select(self, index: torch.Tensor | list[int]) -> "FenwickState":
        """Sequences ``index`` of this state (beam search reordering, batch slicing)."""
        idx = torch.as_tensor(index, dtype=torch.int64)
        return FenwickState(self.levels.index_select(0, idx.to(self.levels.device)), self.positions[idx])

    def detach(self) -> "FenwickState":
        return FenwickState(self.levels.detach(), self.positions.clone())

    def to(self, *args, **kwargs) -> "FenwickState":
        return FenwickState(self.levels.to(*args, **kwargs), self.positions)

    @staticmethod
    def num_levels_for(position: int) -> int:
        """Level slots a state at ``position`` (> 0) tokens needs: ceil(log2 position) + 1."""
        return levels_needed(max(position, 1))
