"""Chunk tiles of [tokens, HEADS, D] tensors addressed from the chunk's first token t0 (int64 scalar) plus
int32 in-chunk offsets r * HEADS * D + col (r < C): the 2D offset tensors stay 32-bit (common.load_rows
builds int64 offsets per element). On sm_90 / triton 3.6 this took the in-chunk backward from 255
registers + 120 B of spills to 243 registers and the in-chunk forward from 137 to 122 (benchmarks/NOTES.md).
Requires C * HEADS * D < 2^31.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_offsets(ptr, t0, r, head, HEADS, D, cols):
    """Pointers to x[t0 + r, head, cols] -> [C, BD]."""
    return ptr + (t0 * HEADS + head) * D + (r * (HEADS * D))[:, None] + cols[None, :]


@triton.jit
def load_tile(ptr, t0, r, valid, head, HEADS, D, cols):
    """x[t0 + r, head, cols] -> [C, len(cols)] (0 for rows without valid and columns >= D)."""
    return tl.load(tile_offsets(ptr, t0, r, head, HEADS, D, cols), mask=valid[:, None] & (cols[None, :] < D),
                   other=0.0)


@triton.jit
def store_tile(ptr, x, t0, r, valid, head, HEADS, D, cols):
    """x[t0 + r, head, cols] = x (rows with valid, columns < D)."""
    tl.store(tile_offsets(ptr, t0, r, head, HEADS, D, cols), x.to(ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < D))


@triton.jit
def load_qk_tiles(q, k, t0, r, valid, grp, G, K, kk):
    """The chunk's q and k rows of group grp from [tokens, G, K] tensors -> [C, len(kk)] each (0 outside)."""
    return load_tile(q, t0, r, valid, grp, G, K, kk), load_tile(k, t0, r, valid, grp, G, K, kk)


@triton.jit
def store_column(ptr, x, t, valid, head, HEADS, L, level):
    """x[t, head, level] = x [C] of a [tokens, HEADS, L] tensor (rows with valid, level < L)."""
    ok = valid & ((t * 0 + level) < L)
    tl.store(ptr + (t * HEADS + head) * L + level, x.to(ptr.dtype.element_ty), mask=ok)
