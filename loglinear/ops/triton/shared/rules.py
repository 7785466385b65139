"""The kernels' numeric rules, in one place: operand dtype, tl.dot precision, kernel chunk. Each variant's kernel
folder states its own numbers (mamba2/backend.py, gated_deltanet/chunking.py) and the rule applies them:

  * ``dot_precision(dtype, fp32)``: the input_precision of every tl.dot. "tf32" for bf16 / fp16 operands (their
    products accumulate in fp32 anyway; the value only matters for fp32 operands), the variant's ``fp32`` choice
    for fp32 operands ("tf32x3" for both variants: three TF32 tensor-core products of the operands' split parts,
    fp32-level error, which Gated DeltaNet's chained [C, C] products need; "ieee", exact products on CUDA cores,
    compiles for minutes and ran Mamba-2 16x slower, docs/kernels.md).
  * ``kernel_chunk_size(chunk_size, cap)``: >= 16 (tl.dot tiles) and <= the variant's cap, the largest chunk
    whose tiles fit sm_90's shared memory (checked by compiling for sm_90 with triton 3.6). The op's result does
    not depend on the kernel chunk.
"""

from __future__ import annotations

import torch

from loglinear.ops.triton.shared.common import interpreting



def dot_dtype(dtype: torch.dtype) -> torch.dtype:
    """Operand dtype of the Gated DeltaNet kernels' products: bf16/fp16 stay, everything else runs in fp32.
    (Triton 3.9's interpreter multiplies bf16 operands as raw bits, so it gets fp32 operands.)"""
    low = (torch.float16,) if interpreting() else (torch.bfloat16, torch.float16)
    return dtype if dtype in low else torch.float32


def dot_precision(dtype: torch.dtype, fp32: str) -> str:
    """tl.dot input_precision for operands of ``dtype``: ``fp32`` (the variant's choice) for fp32, else "tf32"."""
    return fp32 if dtype == torch.float32 else "tf32"


def kernel_chunk_size(chunk_size: int, cap: int) -> int:
    """The kernels' chunk for the op's chunk_size: at least 16 (tl.dot tiles), at most the variant's ``cap``."""
    return min(max(chunk_size, 16), cap)
