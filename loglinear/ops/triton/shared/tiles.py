"""The one token-tile loader and its store, and the per-level column load / store of lambda (1 on the
plain path).

Every kernel moves a chunk of C consecutive rows of a row-major [rows, HEADS, D] tensor through
``load_tile`` / ``store_tile``: the op's layouts ([tokens, H|G, D], a dense batch flattened) and the
per-head stage tensors ([BH, Tp, D]: HEADS = 1, head = 0, t0 = bh Tp + n C). Rows are addressed from the
chunk's first row t0 (int64 scalar; before the sequence's first token, even negative, for masked front padding)
plus int32 in-chunk offsets r * HEADS * D + col (r < C): the 2D offset tensors stay 32-bit (int64 offsets per
element cost registers: on sm_90 / triton 3.6 this took the Mamba-2 in-chunk backward from 255 registers + 120 B
of spills to 243 registers and the in-chunk forward from 137 to 122, docs/kernels.md). Requires
C * HEADS * D < 2^31.
Rows without ``valid`` and columns >= D read as 0 and are not written.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rows_within(r, t0, lo, end):
    """Which rows t0 + r of a chunk (r: int32 in-chunk offsets in [0, 2^30), t0: int64 scalar) are tokens
    lo <= t0 + r < end: the bounds are taken relative to t0 as scalars (clamped to [0, 2^30]), so the rows compare
    in 32 bits (two int64 compares per row cost more instructions in the readers' loops)."""
    return (r >= tl.minimum(tl.maximum(lo - t0, 0), 1 << 30).to(tl.int32)) & \
        (r < tl.minimum(tl.maximum(end - t0, 0), 1 << 30).to(tl.int32))


@triton.jit
def tile_offsets(ptr, t0, r, head, HEADS, D, cols):
    """Pointers to x[t0 + r, head, cols] -> [C, len(cols)]."""
    return ptr + (t0 * HEADS + head) * D + (r * (HEADS * D))[:, None] + cols[None, :]


@triton.jit
def load_tile(ptr, t0, r, valid, head, HEADS, D, cols):
    """x[t0 + r, head, cols] -> [C, len(cols)] in x's dtype (0 for rows without valid and columns >= D)."""
    return tl.load(tile_offsets(ptr, t0, r, head, HEADS, D, cols), mask=valid[:, None] & (cols[None, :] < D),
                   other=0.0)


@triton.jit
def store_tile(ptr, x, t0, r, valid, head, HEADS, D, cols):
    """x[t0 + r, head, cols] = x in ptr's dtype (rows with valid, columns < D)."""
    tl.store(tile_offsets(ptr, t0, r, head, HEADS, D, cols), x.to(ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < D))


@triton.jit
def load_row(ptr, t, lo, end, head, HEADS, D, cols):
    """x[t, head, cols] of a [rows, HEADS, D] tensor for one row t (int64 scalar) -> [len(cols)] in x's dtype (0
    unless lo <= t < end, and for columns >= D)."""
    at = cols * 0 + t
    return tl.load(ptr + (t * HEADS + head) * D + cols, mask=(cols < D) & (at >= lo) & (at < end), other=0.0)


@triton.jit
def load_column(ptr, t, valid, head, HEADS, L, level):
    """lambda[t, head, level] of a [tokens, HEADS, L] tensor -> [C] fp32 (0 for level >= L or invalid rows).

    Per-level loads measured faster than one [C, L] tile plus register column picks (docs/kernels.md)."""
    ok = valid & ((t * 0 + level) < L)
    return tl.load(ptr + (t * HEADS + head) * L + level, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def level_column(lam, t, valid, head, HEADS, L, level, PLAIN: tl.constexpr):
    """lambda_t[level] as load_column, or 1 for every row when PLAIN (lam is not read) -> [C] fp32."""
    if PLAIN:
        return tl.full(t.shape, 1.0, tl.float32)
    return load_column(lam, t, valid, head, HEADS, L, level)


@triton.jit
def store_column(ptr, x, t, valid, head, HEADS, L, level):
    """x[t, head, level] = x [C] of a [tokens, HEADS, L] tensor (rows with valid, level < L)."""
    ok = valid & ((t * 0 + level) < L)
    tl.store(ptr + (t * HEADS + head) * L + level, x.to(ptr.dtype.element_ty), mask=ok)
