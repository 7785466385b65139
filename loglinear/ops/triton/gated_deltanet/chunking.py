"""The token geometry of the Gated DeltaNet kernels: rows that share a start position, cut into aligned chunks;
and their numbers for the shared numeric rules (loglinear.ops.triton.shared.rules)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loglinear.ops.triton.shared.rules import dot_dtype

FP32_DOT = "tf32x3"  # fp32 products: the chunk-local kernels chain dependent [C, C] products (the inverse)
FillChunks = Callable[[int, int], None]  # fill(i0, i1): a stage's outputs for the chunks i0 .. i1 - 1 of every row


def chunk_cap(dtype: torch.dtype, K: int) -> int:
    """The largest kernel chunk whose scan tiles [C, K] fit sm_90's shared memory: 64 for bf16/fp16 operands,
    32 for fp32 (16 when K > 128)."""
    return 64 if dot_dtype(dtype) != torch.float32 else (32 if K <= 128 else 16)


@dataclass(frozen=True)
class Chunking:
    """Rows b of T tokens that start at the same absolute position, cut into N aligned chunks of C tokens:
    chunk n holds tokens n C - front .. (n + 1) C - front - 1 (those outside 0..T-1 are zero padding).
    The kernels read the op's layouts ([b, T, G|H, D]) directly and write per-head [b H, N C, D] tensors."""

    b: int
    T: int
    H: int
    front: int
    C: int

    @property
    def N(self) -> int:
        return -(-(self.front + self.T) // self.C)

    @property
    def Tp(self) -> int:
        return self.N * self.C

    @property
    def BH(self) -> int:
        return self.b * self.H


@triton.jit
def chunk_tokens(n, bh, T, front, H, C: tl.constexpr):
    """Chunk n of head bh (bh = batch row * H + head) on the flat token axis of the op's tensors: its first
    token t0 = row * T + n C - front (int64 scalar; before the row's start for front padding), r = arange(C),
    valid [C] (the chunk's tokens t0 + r inside 0..T-1 of the row), and the head (for shared.tiles)."""
    r = tl.arange(0, C)
    t = n * C + r - front
    return (bh // H) * T + n * C - front, r, (t >= 0) & (t < T), bh % H
