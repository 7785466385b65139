"""Which tokens of a [B, T] batch are real, and how they group into sequences.

A mixer runs its token-wise work (projections, convolution, norms) on a flat list of real tokens and its
sequence-mixing work (the op) either on the dense batch or, when there is padding or packing, on those
tokens packed into one row with ``cu_seqlens``. A padded or packed batch therefore gives exactly the
outputs and states of running every sequence on its own.

    dense   no attention_mask zeros, no cu_seqlens: N = B sequences of T tokens, op on [B, T, ...]
    packed  padding (attention_mask [B, T], any side) or cu_seqlens [N + 1] (B = 1): op on [1, Ntok, ...]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loglinear.inputs import check_cu_seqlens

__all__ = ["TokenLayout"]


@dataclass
class TokenLayout:
    """Real tokens of a [B, T] batch grouped into N sequences.

    index:      [Ntok] positions of the real tokens in the flattened [B * T] batch (None: all, dense)
    cu_seqlens: [M + 1] int64 boundaries of the M sequences with tokens in the packed list (None: dense)
    seq_id:     [Ntok] sequence of every token;  pos: [Ntok] its offset inside this call's part of it
    lengths:    the N sequence lengths of this call (host ints; a padded row may have none in this call,
                e.g. a chunk of a left-padded prompt: its state passes through)
    active:     [M] the sequences with tokens, when some have none (None: all)
    """

    batch: int
    length: int
    index: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    seq_id: torch.Tensor
    pos: torch.Tensor
    lengths: list[int]
    active: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @classmethod
    def build(
        cls, batch: int, length: int, attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None, device: torch.device | str | None = None,
    ) -> "TokenLayout":
        """Layout of a [batch, length] input.  attention_mask: [B, T] (1 = real token; only its last
        ``length`` columns are read, as generate() passes the whole history); cu_seqlens: [N + 1], B = 1."""
        if cu_seqlens is not None:
            return cls._from_cu_seqlens(batch, length, cu_seqlens, device)
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < length:
                raise ValueError(
                    f"attention_mask must be [B, >= T] = [{batch}, >= {length}], got {tuple(attention_mask.shape)}"
                )
            given = attention_mask[:, -length:].to(device=device)
            mask = given != 0
            binary = (given == 0) | (given == 1)  # an additive mask (0 keep, -inf pad) would read inverted
            some, every, valid = torch.stack([mask.any(), mask.all(), binary.all()]).tolist()  # one host read
            if not valid:
                raise ValueError(f"attention_mask must hold 0 (padding) and 1 (real token) only, "
                                 f"got {given[~binary][0].item()}")
            if not some:
                raise ValueError(f"attention_mask {tuple(attention_mask.shape)} marks no real token "
                                 f"among the last T = {length}")
            if not every:
                return cls._from_mask(batch, length, mask)
        seq_id = torch.arange(batch, device=device).repeat_interleave(length)
        pos = torch.arange(length, device=device).repeat(batch)
        return cls(batch, length, None, None, seq_id, pos, [length] * batch)

    @classmethod
    def _from_mask(cls, batch: int, length: int, mask: torch.Tensor) -> "TokenLayout":
        lengths = mask.sum(1).tolist()
        index = mask.reshape(-1).nonzero().squeeze(1)
        seq_id = index // length
        starts = torch.tensor([0] + lengths, device=mask.device).cumsum(0)
        pos = torch.arange(index.numel(), device=mask.device) - starts[seq_id]
        if min(lengths) > 0:
            return cls(batch, length, index, starts, seq_id, pos, lengths)
        active = [b for b, n in enumerate(lengths) if n > 0]
        cu = torch.tensor([0] + [lengths[b] for b in active], device=mask.device).cumsum(0)
        return cls(batch, length, index, cu, seq_id, pos, lengths, torch.tensor(active, dtype=torch.int64))

    @classmethod
    def _from_cu_seqlens(cls, batch: int, length: int, cu_seqlens: torch.Tensor, device) -> "TokenLayout":
        bounds = check_cu_seqlens(cu_seqlens, batch, length)
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        seq_id = torch.arange(len(lengths), device=device).repeat_interleave(torch.tensor(lengths, device=device))
        pos = torch.arange(length, device=device) - cu[seq_id]
        return cls(batch, length, None, cu, seq_id, pos, lengths)

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, *] -> [Ntok, *] real tokens."""
        flat = x.reshape(self.batch * self.length, *x.shape[2:])
        return flat if self.index is None else flat.index_select(0, self.index)

    def unflatten(self, y: torch.Tensor) -> torch.Tensor:
        """[Ntok, *] -> [B, T, *], zeros at padding."""
        if self.index is None:
            return y.reshape(self.batch, self.length, *y.shape[1:])
        out = y.new_zeros(self.batch * self.length, *y.shape[1:])
        return out.index_copy(0, self.index, y).reshape(self.batch, self.length, *y.shape[1:])

    def op_view(self, y: torch.Tensor) -> torch.Tensor:
        """[Ntok, *] -> the op's layout: [B, T, *] dense, [1, Ntok, *] packed."""
        return y.unsqueeze(0) if self.packed else y.reshape(self.batch, self.length, *y.shape[1:])

    def from_op_view(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of op_view: -> [Ntok, *]."""
        return y.reshape(-1, *y.shape[2:])
