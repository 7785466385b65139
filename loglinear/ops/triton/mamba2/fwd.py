"""Forward scan of log-linear Mamba-2: the chunk-level cascade only, one program per (sequence, value head,
block of K rows of the level states).

Per chunk i (Gl = the chunk's gate total), in order:

    record   decays[i, j] = log-decay of level j since it was stored (what chunk i reads it with)
    carry    H_j <- exp(Gl) H_j  (lazy);   H_m <- D_i + sum_{j<=m} H_j
    record   buckets[i] = H_m (as stored: the value every later reader of level m scales by its decay)

m = ctz(i + 1) (shared/levels.py). With PER_CHANNEL (GLA) the gate total Gl is one per state row and
so are the lazy decays and the recorded ones ([NC, H, J, K]). The deposits D_i = K^T (exp(Gl - G) * V)
come chunk-parallel beforehand in the same buffer (chunk.mamba2_deposit_kernel), with every chunk's gate total
Gl (levels.store_total): the scan reads slot i and overwrites it with the bucket. Inside the aligned blocks of
2^BB chunks (BB = levels.BLOCK_LEVELS) the deposit kernel has done the merges below level BB already: in such a block
(every block of a sequence but its last and, with an initial state, its first: levels.block_merged) slot i holds
the bucket itself where m < BB, and after the block's last chunk the block's decayed sum, so the scan merges tiles
only there (levels BB..m), and at the block's other chunks only records decays and clears the merged levels' ones.
The readout (every chunk against
its live levels) runs chunk-parallel afterwards (chunk.py) from buckets, decays and the initial states. The
sequential chain per chunk is the amortised O(1) level merge (sum over chunks of the levels merged = 2 NT) and two
stores, no GEMM, so the state tile is cut into blocks of K rows (contiguous in the [K, V] states) over many
programs; the next chunk's deposit and gate total are loaded one chunk ahead. The level states never leave the
scan's fp32 buffer except as the final states.

PLAIN (plain Mamba-2 / SSD, lambda = 1): one chunk level, the running state S, kept in registers; every chunk,
the last one too, merges S <- exp(Gl) S + D_i, and buckets[i] = S is what chunk i + 1 reads (no decays: a
bucket is read right after it is stored). Its deposits come from the deposit kernel too (every chunk's, no merged
blocks), so its chain has no GEMM either and runs in blocks of rows. Forming them in the scan instead (a [K, C] x
[C, V] product per chunk) needs whole 16-bit state tiles (split ones hit a triton 3.6 miscompile), one program per
sequence and head: slower or the same at every shape timed, 2.4x at fla's GLA head shape (docs/kernels.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.shared.levels import (
    add_decay, chunk_inputs, clear_decays, flush_levels, level_tile, merge_levels, merge_target, merges_tiles,
    no_decays, row_decay, sequence_range, store_decays,
)


@triton.jit
def plain_chain(buckets, totals, ptrs, lmask, bos, eos, base, h, H, K, V, offs, r, kk, C: tl.constexpr,
                PER_CHANNEL: tl.constexpr):
    """PLAIN: S <- exp(Gl) S + D_i for every chunk i, in registers from the initial state at ptrs (zeros without
    one), the deposits and gate totals read a chunk ahead (levels.chunk_inputs); buckets[i] = S over its deposit
    (what chunk i + 1 reads); the final S back to ptrs."""
    state = tl.load(ptrs, mask=lmask, other=0.0)
    slot = (base * H + h) * K * V
    deposit, Gl = chunk_inputs(buckets, totals, slot, base, bos, r, bos, eos, h, H, offs, lmask, kk, K, True, True,
                               PER_CHANNEL)
    for i in range(tl.cdiv(eos - bos, C)):
        next_deposit, next_Gl = chunk_inputs(buckets, totals, slot + H * K * V, base + i + 1, bos + (i + 1) * C, r,
                                             bos, eos, h, H, offs, lmask, kk, K, True, True, PER_CHANNEL)
        state = row_decay(Gl, PER_CHANNEL) * state + deposit
        tl.store(buckets + slot + offs, state.to(buckets.dtype.element_ty), mask=lmask)
        deposit, Gl, slot = next_deposit, next_Gl, slot + H * K * V
    tl.store(ptrs, state, mask=lmask)


@triton.jit
def fenwick_chain(totals, ptrs, stride, lmask, buckets, decays, bos, eos, c0, base, h, H, K, V, J, kb, offs, r, jj, kk,
                  C: tl.constexpr, BJ: tl.constexpr, BKS: tl.constexpr, BB: tl.constexpr, HAS_INIT: tl.constexpr,
                  PER_CHANNEL: tl.constexpr):
    """The chunk-level cascade (module docstring) on the level states at ptrs (stride between levels); the levels
    below BB of the blocks the deposit kernel merged are not touched (merges_tiles)."""
    decay = no_decays(BJ, BKS, PER_CHANNEL)
    n_chunks = tl.cdiv(eos - bos, C)
    last = c0 + n_chunks - 1
    deposit, Gl = chunk_inputs(buckets, totals, (base * H + h) * K * V, base, bos, r, bos, eos, h, H, offs, lmask, kk,
                               K, merges_tiles(c0, c0, last, jj, BB, BJ, HAS_INIT)[0], False, PER_CHANNEL)
    chunk = c0
    for i in range(n_chunks):
        chunk = c0 + i
        slot = ((base + i) * H + h) * K * V
        next_deposit, next_Gl = chunk_inputs(buckets, totals, slot + H * K * V, base + i + 1, bos + (i + 1) * C, r,
                                             bos, eos, h, H, offs, lmask, kk, K,
                                             merges_tiles(chunk + 1, c0, last, jj, BB, BJ, HAS_INIT)[0], False,
                                             PER_CHANNEL)
        store_decays(decays, (base + i) * H + h, J, K, decay, jj, kk, kb, PER_CHANNEL)
        decay = add_decay(decay, Gl, PER_CHANNEL)
        if i < n_chunks - 1:
            tiles, lo = merges_tiles(chunk, c0, last, jj, BB, BJ, HAS_INIT)
            if tiles:
                total, decay = merge_levels(ptrs, stride, lmask, deposit, decay, jj, chunk, c0, lo, HAS_INIT, BJ,
                                            PER_CHANNEL)
                tl.store(buckets + slot + offs, total.to(buckets.dtype.element_ty), mask=lmask)
                tl.debug_barrier()  # levels' stores before the next chunk's loads (shared/levels.py)
            else:
                decay = clear_decays(decay, jj, merge_target(chunk, jj, BJ, False), PER_CHANNEL)
        deposit, Gl = next_deposit, next_Gl
    tl.debug_barrier()
    flush_levels(ptrs, stride, lmask, decay, jj, J, chunk, c0, HAS_INIT, PER_CHANNEL)


@triton.jit(do_not_specialize=["H", "J"])
def mamba2_fwd_kernel(
    levels, buckets, decays, totals, bos_ptr, eos_ptr, chunk0_ptr, base_ptr,
    H, K, V, J,
    C: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr, BB: tl.constexpr, HAS_INIT: tl.constexpr,
    PLAIN: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """levels: [N, J, H, K, V] fp32, initial chunk-level states in, final ones out; buckets: [NC, H, K, V] (q's
    dtype), the deposits in (the deposit kernel's), the merged levels out (every chunk but each sequence's last;
    PLAIN: every chunk's state after it);
    decays: [NC, H, J] ([NC, H, J, K]) fp32 out, per kernel chunk (backend.ChunkTable; not when PLAIN);
    totals: [NC, H] ([NC, H, K]) fp32 in, the chunks' gate totals (the deposit kernel's, levels.store_total);
    bos/eos/chunk0/base: [N] (base = the sequence's first kernel chunk).  Grid (N, H, cdiv(K, BKS)): row blocks
    are independent."""
    n, h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, c0, base = sequence_range(n, bos_ptr, eos_ptr, chunk0_ptr, base_ptr)
    r = tl.arange(0, C)
    kk, vv, jj = kb * BKS + tl.arange(0, BKS), tl.arange(0, BV), tl.arange(0, BJ)
    ptrs, stride, offs, lmask = level_tile(levels, n, h, H, J, K, V, kk, vv)
    if PLAIN:
        plain_chain(buckets, totals, ptrs, lmask, bos, eos, base, h, H, K, V, offs, r, kk, C, PER_CHANNEL)
    else:
        fenwick_chain(totals, ptrs, stride, lmask, buckets, decays, bos, eos, c0, base, h, H, K, V, J, kb, offs, r, jj,
                      kk, C, BJ, BKS, BB, HAS_INIT, PER_CHANNEL)
