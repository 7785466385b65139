"""Portable chunkwise backend (any device, autograd): the Fenwick chunk scan over a variant's chunk form
(loglinear.variants: Mamba2Form, GatedDeltaNetForm)."""

from loglinear.ops.torch_chunk.scan import chunk_scan

__all__ = ["chunk_scan"]
