"""Portable chunkwise backend (any device, autograd): the Fenwick chunk scan over a variant's chunk form
(loglinear.variants: Mamba2Form, GatedDeltaNetForm)."""

from loglinear.ops.torch_chunk.scan import (
    carry_past, chunk_levels_from, chunk_scan, chunked, final_levels, level_scales_at, pad_time, route_buckets,
)

__all__ = ["chunk_scan", "carry_past", "chunk_levels_from", "chunked", "final_levels", "level_scales_at", "pad_time",
           "route_buckets"]
