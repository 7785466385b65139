"""The per-variant numeric rules of the kernels, in one place: operand dtype, tl.dot precision, kernel chunk.

Product precision (``dot_precision``, the input_precision of every tl.dot):

  * bf16 / fp16 operands: "tf32" for both variants (the products of 16-bit operands accumulate in fp32
    anyway; the value only matters for fp32 operands).
  * fp32 operands, Mamba-2: "ieee", exact fp32 products (no tf32).
  * fp32 operands, Gated DeltaNet: "tf32x3" (3xTF32: fp32-level error on tensor cores). Its chunk-local
    kernels chain dependent [C, C] products (the unit-lower triangular inverse, unit_lower_inverse) where
    tf32 would lose the inverse's accuracy, and with "ieee" these kernels' compile takes minutes.

Kernel chunk (``kernel_chunk_size``): >= 16 (tl.dot tiles) for both; at most 64 for Mamba-2; for Gated
DeltaNet at most 64 for bf16/fp16 operands, 32 for fp32 (16 when K > 128), so that the scan's [C, K] tiles
fit the sm_90 shared memory (checked by compiling for sm_90 with triton 3.6). The op's result does not
depend on the kernel chunk.
"""

from __future__ import annotations

from typing import Literal

import torch

from loglinear.ops.triton.shared.common import interpreting

Variant = Literal["mamba2", "gated_deltanet"]
FP32_PRECISION: dict[str, str] = {"mamba2": "ieee", "gated_deltanet": "tf32x3"}


def dot_dtype(dtype: torch.dtype) -> torch.dtype:
    """Operand dtype of the Gated DeltaNet kernels' products: bf16/fp16 stay, everything else runs in fp32.
    (Triton 3.9's interpreter multiplies bf16 operands as raw bits, so it gets fp32 operands.)"""
    low = (torch.float16,) if interpreting() else (torch.bfloat16, torch.float16)
    return dtype if dtype in low else torch.float32


def dot_precision(dtype: torch.dtype, variant: Variant) -> str:
    """tl.dot input_precision for operands of ``dtype`` in ``variant``'s kernels (module docstring)."""
    return FP32_PRECISION[variant] if dtype == torch.float32 else "tf32"


def kernel_chunk_size(chunk_size: int, variant: Variant, dtype: torch.dtype | None = None, K: int = 0) -> int:
    """The kernels' chunk for the op's chunk_size (module docstring); dtype (the caller's dtype, through
    dot_dtype) and K matter for Gated DeltaNet only."""
    if variant == "mamba2":
        cap = 64
    else:
        cap = 64 if dot_dtype(dtype) != torch.float32 else (32 if K <= 128 else 16)
    return min(max(chunk_size, 16), cap)
