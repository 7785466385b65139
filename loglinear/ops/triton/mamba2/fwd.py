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
bucket is read right after it is stored). With FORMS the deposits are formed in the scan (one [BKS, C] x [C, BV]
product per chunk, a chunk ahead: off the chain), so the call has no deposit kernel and no deposit buffer traffic,
and the scan records the gate totals for the backward scan itself; but in 16-bit the tiles stay whole (one program
per sequence and head), so with few of them the deposit kernel forms the deposits (every chunk's, the last one's
too) and the scan reads them as the log-linear one does, in blocks of rows (backend._plain_forms_deposits).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.mamba2.chunk import chunk_deposit, gates
from loglinear.ops.triton.shared.levels import (
    add_decay, chunk_inputs, clear_decays, flush_levels, level_tile, merge_levels, merge_target, merges_tiles,
    no_decays, row_decay, sequence_range, store_decays, store_total,
)
from loglinear.ops.triton.shared.tiles import load_tile


@triton.jit
def deposit_rows(k, v, g, t0, r, eos, grp, h, G, H, K, V, kk, vv, C: tl.constexpr, PRECISION: tl.constexpr,
                 PER_CHANNEL: tl.constexpr):
    """Rows kk of the chunk at t0's deposit D (chunk.chunk_deposit) -> [BKS, BV] fp32, and its gate total Gl
    (scalar, or [BKS] with PER_CHANNEL; rows past eos read as 0)."""
    valid = t0 + r < eos
    Gc, Gl = gates(g, t0 + r, valid, h, H, K, kk, PER_CHANNEL)
    kc, vc = load_tile(k, t0, r, valid, grp, G, K, kk), load_tile(v, t0, r, valid, h, H, V, vv)
    return chunk_deposit(kc, vc, Gc, Gl, PRECISION, PER_CHANNEL), Gl


@triton.jit
def plain_inputs(k, v, g, buckets, totals, i, bos, eos, base, grp, h, G, H, K, V, offs, lmask, r, kk, vv,
                 C: tl.constexpr, PRECISION: tl.constexpr, PER_CHANNEL: tl.constexpr, FORMS: tl.constexpr):
    """PLAIN: chunk i's deposit (rows kk: [BKS, BV] fp32) and gate total, formed from k, v, g (FORMS: deposit_rows)
    or read from the deposit kernel's slot i of buckets and totals (levels.chunk_inputs); 0 past the sequence."""
    if FORMS:
        deposit, Gl = deposit_rows(k, v, g, bos + i * C, r, eos, grp, h, G, H, K, V, kk, vv, C, PRECISION, PER_CHANNEL)
    else:
        deposit, Gl = chunk_inputs(buckets, totals, ((base + i) * H + h) * K * V, base + i, bos + i * C, r, bos, eos,
                                   h, H, offs, lmask, kk, K, True, True, PER_CHANNEL)
    return deposit, Gl


@triton.jit
def plain_chain(k, v, g, ptrs, lmask, buckets, totals, bos, eos, base, grp, h, G, H, K, V, kb, offs, r, kk, vv,
                C: tl.constexpr, PRECISION: tl.constexpr, PER_CHANNEL: tl.constexpr, FORMS: tl.constexpr):
    """PLAIN: S <- exp(Gl) S + D_i for every chunk i, in registers from the initial state at ptrs (zeros without
    one), the deposits formed here or read (plain_inputs; the next chunk's during the current one's update);
    buckets[i] = S (what chunk i + 1 reads; over its deposit), with FORMS the gate totals for the backward scan (else
    the deposit kernel's); the final S back to ptrs."""
    state = tl.load(ptrs, mask=lmask, other=0.0)
    deposit, Gl = plain_inputs(k, v, g, buckets, totals, 0, bos, eos, base, grp, h, G, H, K, V, offs, lmask, r, kk, vv,
                               C, PRECISION, PER_CHANNEL, FORMS)
    for i in range(tl.cdiv(eos - bos, C)):
        next_deposit, next_Gl = plain_inputs(k, v, g, buckets, totals, i + 1, bos, eos, base, grp, h, G, H, K, V, offs,
                                             lmask, r, kk, vv, C, PRECISION, PER_CHANNEL, FORMS)
        state = row_decay(Gl, PER_CHANNEL) * state + deposit
        if FORMS:
            store_total(totals, base + i, h, H, K, kk, kb == 0, Gl, PER_CHANNEL)
        tl.store(buckets + ((base + i) * H + h) * K * V + offs, state.to(buckets.dtype.element_ty), mask=lmask)
        deposit, Gl = next_deposit, next_Gl
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


@triton.jit(do_not_specialize=["H", "G", "J"])
def mamba2_fwd_kernel(
    k, v, g, levels, buckets, decays, totals, bos_ptr, eos_ptr, chunk0_ptr, base_ptr,
    H, G, K, V, J,
    C: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr, BB: tl.constexpr, HAS_INIT: tl.constexpr,
    PLAIN: tl.constexpr, FORMS: tl.constexpr, PRECISION: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """g: [tokens, H] (G [tokens, H, K] fp32 with PER_CHANNEL, chunk.gates()); levels: [N, J, H, K, V] fp32,
    initial chunk-level states in, final ones out; buckets: [NC, H, K, V] (q's dtype), the deposits in (PLAIN with
    FORMS: formed here from k: [tokens, G, K] and v: [tokens, H, V]), the merged levels out (every chunk but each
    sequence's last; PLAIN: every chunk);
    decays: [NC, H, J] ([NC, H, J, K]) fp32 out, per kernel chunk (backend.ChunkTable; not when PLAIN);
    totals: [NC, H] ([NC, H, K]) fp32, the chunks' gate totals (levels.store_total): in (the deposit kernel's), or
    out when PLAIN with FORMS;
    bos/eos/chunk0/base: [N] (base = the sequence's first kernel chunk).  Grid (N, H, cdiv(K, BKS)): row blocks
    are independent."""
    n, h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, c0, base = sequence_range(n, bos_ptr, eos_ptr, chunk0_ptr, base_ptr)
    r = tl.arange(0, C)
    kk, vv, jj = kb * BKS + tl.arange(0, BKS), tl.arange(0, BV), tl.arange(0, BJ)
    ptrs, stride, offs, lmask = level_tile(levels, n, h, H, J, K, V, kk, vv)
    if PLAIN:
        plain_chain(k, v, g, ptrs, lmask, buckets, totals, bos, eos, base, h // (H // G), h, G, H, K, V, kb, offs, r,
                    kk, vv, C, PRECISION, PER_CHANNEL, FORMS)
    else:
        fenwick_chain(totals, ptrs, stride, lmask, buckets, decays, bos, eos, c0, base, h, H, K, V, J, kb, offs, r, jj,
                      kk, C, BJ, BKS, BB, HAS_INIT, PER_CHANNEL)
