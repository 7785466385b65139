"""Portable chunkwise backend (any device, autograd): the Fenwick chunk scan over per-variant forms."""

from loglinear.ops.torch_chunk.forms import GatedDeltaNetForm, Mamba2Form, suffix_sum
from loglinear.ops.torch_chunk.scan import carry_past, chunk_scan, chunked, final_levels, level_scales_at, pad_time

__all__ = [
    "chunk_scan", "Mamba2Form", "GatedDeltaNetForm", "suffix_sum", "carry_past", "chunked", "final_levels",
    "level_scales_at", "pad_time",
]
