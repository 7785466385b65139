"""Backward scan of log-linear Mamba-2: the transposed chunk-level cascade only, one program per
(sequence, value head, block of K rows of the level states).

The scan walks the chunks in reverse carrying the level gradients dH. Per chunk i (Gl = the chunk's gate
total), with m = ctz(i + 1) the level merged after it (shared/levels.py):

    split    dD_i = dH_m + dB_i,   dH_j <- dD_i for j <= m      (transposed merge; stored once, in level m)
    decay    dH_j <- exp(Gl) dH_j (lazy)

dB_i, the gradient of the level merged after chunk i from all its readers, comes summed chunk-parallel
(chunk.mamba2_level_grad_kernel) in d_buckets; the scan overwrites it with dD_i, the gradient of
chunk i's deposit D_i = K^T (exp(Gl - G) * V). The deposit's terms in dK and dV are chunk-parallel again
(chunk.mamba2_chunk_bwd_dkv_kernel). The chain per chunk is one level load, the split's stores and dD's store
(dB and the gate total are loaded a chunk ahead): no GEMM, so the state tile is cut into blocks of K rows
(contiguous in the [K, V] states) over many programs. No atomics: every output element has one writer.

In the blocks of 2^BB chunks whose merges below level BB the deposit kernel did (levels.block_merged; BB = 2: one
running sum A per block, fwd.py), the splits below BB are the transpose of that sum, so they need no level tiles:
from the split after the block's last chunk (dD = dA, the gradient of the block's sum), walking back,

    A <- exp(Gl_{i+1}) A;   dD_i = A + dB_i;   A <- dD_i where A was the bucket (m = 1: after the second chunk)

in registers (``carry``), and only the split after a block's last chunk (levels BB..m) touches the level states.

An initial state's levels are read, as kind-2 levels, by the first chunks; those reads' gradients are the same
chunk-parallel sums as dB (chunk.mamba2_initial_grad_kernel), which the backend adds to what the scan leaves
in the initial levels: the transposed merges into them, decayed back to the start. So the chain never
multiplies, with or without a state.

PLAIN (one chunk level, lambda = 1; see fwd.py): dD_i = dS + dB_i, dS <- exp(Gl) dD_i for every chunk, the
last one too (its dB is 0: its deposit is merged into the final state), with dS in registers; only the
sequence's first chunk reads the initial state (its term added by the backend as above).

PER_CHANNEL (GLA): the gate totals, and so the lazy decays, are per state row (shared/levels.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.shared.common import SCAN_RUNTIME_ARGS
from loglinear.ops.triton.shared.levels import (
    add_decay, chunk_inputs, clear_decays, flush_splits, level_tile, merge_target, merges_tiles, no_decays, row_decay,
    sequence_range, split_levels,
)


@triton.jit
def plain_chain(totals, ptrs, lmask, d_buckets, bos, eos, base, h, H, K, V, offs, r, kk, C: tl.constexpr,
                HAS_INIT: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """PLAIN, in reverse from the final state's gradient at ptrs: dD_i = dS + dB_i (stored over dB_i),
    dS <- exp(Gl_i) dD_i, in registers; then dS back to ptrs (the initial state's gradient, less its first
    chunk's read: the backend adds it)."""
    d_state = tl.load(ptrs, mask=lmask, other=0.0)
    n_chunks = tl.cdiv(eos - bos, C)
    slot = ((base + n_chunks - 1) * H + h) * K * V
    reads, Gl = chunk_inputs(d_buckets, totals, slot, base + n_chunks - 1, bos + (n_chunks - 1) * C, r, bos, eos, h,
                             H, offs, lmask, kk, K, True, True, PER_CHANNEL)
    for back in range(n_chunks):
        i = n_chunks - 1 - back
        t0 = bos + i * C
        next_reads, next_Gl = chunk_inputs(d_buckets, totals, slot - H * K * V, base + i - 1, t0 - C, r, bos, eos, h,
                                           H, offs, lmask, kk, K, True, True, PER_CHANNEL)
        d_deposit = d_state + reads
        tl.store(d_buckets + slot + offs, d_deposit.to(d_buckets.dtype.element_ty), mask=lmask)
        d_state = row_decay(Gl, PER_CHANNEL) * d_deposit
        reads, Gl, slot = next_reads, next_Gl, slot - H * K * V
    if HAS_INIT:
        tl.store(ptrs, d_state, mask=lmask)


@triton.jit
def fenwick_chain(totals, ptrs, stride, lmask, d_buckets, bos, eos, c0, base, h, H, K, V, J, offs, r, jj, kk,
                  C: tl.constexpr, BJ: tl.constexpr, BKS: tl.constexpr, BB: tl.constexpr, HAS_INIT: tl.constexpr,
                  PER_CHANNEL: tl.constexpr):
    """The transposed cascade (module docstring) on the level gradients at ptrs (stride between levels); inside the
    blocks the deposit kernel merged (levels.merges_tiles) the splits below level BB run in registers."""
    decay = no_decays(BJ, BKS, PER_CHANNEL)
    n_chunks = tl.cdiv(eos - bos, C)
    last = c0 + n_chunks - 2  # the last chunk with a split after it
    slot = ((base + n_chunks - 1) * H + h) * K * V
    reads, Gl = chunk_inputs(d_buckets, totals, slot, base + n_chunks - 1, bos + (n_chunks - 1) * C, r, bos, eos, h,
                             H, offs, lmask, kk, K, True, False, PER_CHANNEL)
    carry = tl.zeros(lmask.shape, dtype=tl.float32)  # a merged block's gradient A (below), at the current chunk's end
    for back in range(n_chunks):
        i = n_chunks - 1 - back
        t0 = bos + i * C
        next_reads, next_Gl = chunk_inputs(d_buckets, totals, slot - H * K * V, base + i - 1, t0 - C, r, bos, eos, h,
                                           H, offs, lmask, kk, K, True, False, PER_CHANNEL)
        if i < n_chunks - 1:
            m = merge_target(c0 + i, jj, BJ, False)
            tiles, _ = merges_tiles(c0 + i, c0, last + 1, jj, BB, BJ, HAS_INIT)  # last + 1: the sequence's last
            if tiles:
                d_deposit, decay = split_levels(ptrs, stride, lmask, decay, jj, c0 + i, last, reads, BJ, PER_CHANNEL)
                tl.debug_barrier()  # levels' stores before the next chunk's loads (shared/levels.py)
            else:
                d_deposit = carry + reads
                decay = clear_decays(decay, jj, m, PER_CHANNEL)
            tl.store(d_buckets + slot + offs, d_deposit.to(d_buckets.dtype.element_ty), mask=lmask)
            carry = tl.where(tiles | (m == 1), d_deposit, carry)
        decay = add_decay(decay, Gl, PER_CHANNEL)
        carry *= row_decay(Gl, PER_CHANNEL)
        reads, Gl, slot = next_reads, next_Gl, slot - H * K * V
    if HAS_INIT:
        tl.debug_barrier()
        flush_splits(ptrs, stride, lmask, decay, jj, J, c0, last, BJ, PER_CHANNEL)


@triton.jit(do_not_specialize=SCAN_RUNTIME_ARGS)
def mamba2_bwd_scan_kernel(
    totals, d_levels, d_buckets, bos_ptr, eos_ptr, chunk0_ptr, base_ptr,
    H, K, V, J,
    C: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr, BB: tl.constexpr, HAS_INIT: tl.constexpr,
    PLAIN: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """Grid (N, H, cdiv(K, BKS)). totals: [NC, H] ([NC, H, K] with PER_CHANNEL) fp32, the chunks' gate totals
    (levels.store_total, written by the forward);
    d_levels: [N, J, H, K, V] fp32, the final chunk-level states' gradient in, the initial ones' out (HAS_INIT;
    less their readers' terms); d_buckets: [NC, H, K, V] (q's dtype), dB per kernel chunk in, dD out (every chunk
    but each sequence's last, every chunk when PLAIN); base: [N] each sequence's first kernel chunk."""
    n, h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, c0, base = sequence_range(n, bos_ptr, eos_ptr, chunk0_ptr, base_ptr)
    r = tl.arange(0, C)
    kk, vv, jj = kb * BKS + tl.arange(0, BKS), tl.arange(0, BV), tl.arange(0, BJ)
    ptrs, stride, offs, lmask = level_tile(d_levels, n, h, H, J, K, V, kk, vv)
    if PLAIN:
        plain_chain(totals, ptrs, lmask, d_buckets, bos, eos, base, h, H, K, V, offs, r, kk, C, HAS_INIT, PER_CHANNEL)
    else:
        fenwick_chain(totals, ptrs, stride, lmask, d_buckets, bos, eos, c0, base, h, H, K, V, J, offs, r, jj, kk, C, BJ,
                      BKS, BB, HAS_INIT, PER_CHANNEL)
