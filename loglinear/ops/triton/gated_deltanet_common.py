"""Operand dtype, product precision and the token geometry shared by the Gated DeltaNet kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loglinear.ops.triton.common import interpreting


def dot_dtype(dtype: torch.dtype) -> torch.dtype:
    """Operand dtype of the kernels' products: bf16/fp16 stay, everything else runs in fp32.
    (Triton 3.9's interpreter multiplies bf16 operands as raw bits, so it gets fp32 operands.)"""
    low = (torch.float16,) if interpreting() else (torch.bfloat16, torch.float16)
    return dtype if dtype in low else torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input_precision: fp32 operands use 3xTF32 (fp32-level error on tensor cores; "ieee" makes
    these kernels' compile take minutes), bf16/fp16 products accumulate in fp32 anyway."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


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
    """Chunk n of head bh (bh = batch row * H + head): flat token indices row * T + t [C] (int64),
    valid [C] (0 <= t < T), and the head."""
    t = n * C + tl.arange(0, C) - front
    return (bh // H) * T + t, (t >= 0) & (t < T), bh % H


@triton.jit
def load_tokens(ptr, tok, valid, head, HEADS, D, col0, BD: tl.constexpr, dt: tl.constexpr):
    """x[tok, head, col0 : col0 + BD] of a contiguous [tokens, HEADS, D] tensor in dtype dt -> [C, BD] (0 outside)."""
    cols = col0 + tl.arange(0, BD)
    offs = (tok * HEADS + head)[:, None] * D + cols[None, :]
    return tl.load(ptr + offs, mask=valid[:, None] & (cols[None, :] < D), other=0.0).to(dt)


@triton.jit
def store_tokens(ptr, x, tok, valid, head, HEADS, D, col0, BD: tl.constexpr):
    """x[tok, head, col0 : col0 + BD] = x (valid rows, columns < D), in ptr's dtype."""
    cols = col0 + tl.arange(0, BD)
    offs = (tok * HEADS + head)[:, None] * D + cols[None, :]
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < D))
