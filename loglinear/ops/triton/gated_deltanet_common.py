"""Operand dtype and product precision of the Gated DeltaNet kernels."""

from __future__ import annotations

import torch

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
