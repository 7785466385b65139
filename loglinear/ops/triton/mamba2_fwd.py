"""Forward scan of log-linear Mamba-2: the chunk-level cascade only, one program per (sequence, value head).

Per chunk i (G = chunk-local cumsum of g, Gl = G at the chunk's end), in order:

    record   decays[i, j] = log-decay of level j since it was stored (what chunk i reads it with)
    carry    H_j <- exp(Gl) H_j  (lazy);   H_m <- D_i + sum_{j<=m} H_j,  D_i = K^T (exp(Gl - G) * V)
    record   buckets[i] = H_m (as stored: the value every later reader of level m scales by its decay)

m = ctz(i + 1) (levels.py). The readout (every chunk against its live levels) runs chunk-parallel
afterwards (mamba2_chunk.py) from buckets, decays and the initial states: the sequential chain per chunk
is one deposit GEMM, the amortised O(1) level merge and two stores. The level states never leave the
scan's fp32 buffer except as the final states.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.intra import chunk_gates
from loglinear.ops.triton.levels import flush_levels, level_tile, merge_levels, sequence_range
from loglinear.ops.triton.mamba2_rows import load_tile


@triton.jit
def chunk_deposit(kc, vc, Gc, Gl, PRECISION: tl.constexpr):
    """D = sum_s exp(Gl - G_s) k_s v_s^T = K^T (exp(Gl - G) * V) -> [BK, BV] fp32 (k [C, BK], v [C, BV])."""
    to_end = tl.exp(Gl - Gc)[:, None]
    return tl.dot(tl.trans(kc), (vc.to(tl.float32) * to_end).to(vc.dtype), input_precision=PRECISION)


@triton.jit(do_not_specialize=["H", "G", "J"])
def mamba2_fwd_kernel(
    k, v, g, levels, buckets, decays, bos_ptr, eos_ptr, chunk0_ptr, base_ptr,
    H, G, K, V, J,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr,
    HAS_INIT: tl.constexpr, PRECISION: tl.constexpr,
):
    """k: [tokens, G, K]; v: [tokens, H, V]; g: [tokens, H];
    levels: [N, J, H, K, V] fp32, initial chunk-level states in, final ones out;
    buckets: [NC, H, K, V] (q's dtype) and decays: [NC, H, J] fp32 out, per kernel chunk (mamba2.ChunkTable);
    bos/eos/chunk0/base: [N] (base = the sequence's first kernel chunk).
    Grid (N, H, cdiv(V, BV)): value blocks are independent (block 0 writes decays)."""
    n, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    grp = h // (H // G)
    bos, eos, c0, base = sequence_range(n, bos_ptr, eos_ptr, chunk0_ptr, base_ptr)
    r = tl.arange(0, C)
    kk, jj = tl.arange(0, BK), tl.arange(0, BJ)
    vv = vb * BV + tl.arange(0, BV)
    ptrs, stride, offs, lmask = level_tile(levels, n, h, H, J, K, V, kk, vv)
    decay = tl.zeros([BJ], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    chunk = c0
    for i in range(n_chunks):
        t0 = bos + i * C
        valid = t0 + r < eos
        chunk = c0 + i
        tl.store(decays + ((base + i) * H + h) * J + jj, decay, mask=(jj < J) & ((jj * 0 + vb) == 0))
        Gc, Gl = chunk_gates(g, t0 + r, valid, h, H)
        decay += Gl
        if i < n_chunks - 1:
            kc = load_tile(k, t0, r, valid, grp, G, K, kk)
            deposit = chunk_deposit(kc, load_tile(v, t0, r, valid, h, H, V, vv), Gc, Gl, PRECISION)
            total, decay = merge_levels(ptrs, stride, lmask, deposit, decay, jj, chunk, c0, HAS_INIT, BJ)
            tl.store(buckets + ((base + i) * H + h) * K * V + offs, total.to(buckets.dtype.element_ty), mask=lmask)
    flush_levels(ptrs, stride, lmask, decay, jj, J, chunk, c0, True, HAS_INIT)
