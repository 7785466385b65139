"""Backward scan of log-linear Mamba-2: the transposed chunk-level cascade only, one program per
(sequence, value head, block of K rows of the level states).

The scan walks the chunks in reverse carrying the level gradients dH. Per chunk i (Gl = the chunk's gate
total), with m = ctz(i + 1) the level merged after it (shared/levels.py):

    split    dD_i = dH_m + dB_i,   dH_j <- dD_i for j <= m      (transposed merge)
    decay    dH_j <- exp(Gl) dH_j (lazy)
    reads    only reads of the initial state (HAS_INIT): dH_j += Q^T (scale * lambda_j * exp(G) * dO)

dB_i, the gradient of the level merged after chunk i from all its readers, comes summed chunk-parallel
(chunk.mamba2_level_grad_kernel) in d_buckets; the scan overwrites it with dD_i, the gradient of
chunk i's deposit D_i = K^T (exp(Gl - G) * V). The deposit's terms in dK and dV are chunk-parallel again
(chunk.mamba2_chunk_bwd_dkv_kernel). Without initial states the chain per chunk is one level
load, the split's stores and dD's store (dB and the gate total are loaded a chunk ahead): no GEMM, so the
state tile is cut into blocks of K rows (contiguous in the [K, V] states) over many programs. No atomics:
every output element has one writer.

PLAIN (one chunk level, lambda = 1; see fwd.py): the split is dD_i = dS + dB_i, dS <- dD_i for every chunk,
the last one too (its dB is 0, its deposit is merged into the final state), and only the sequence's first
chunk reads the initial state.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.shared.common import SCAN_RUNTIME_ARGS
from loglinear.ops.triton.shared.intra import chunk_gates
from loglinear.ops.triton.shared.levels import (
    accumulate_level, chunk_inputs, flush_levels, level_source, level_tile, sequence_range, split_levels,
)
from loglinear.ops.triton.shared.tiles import level_column, load_tile


@triton.jit
def initial_read_grads(q, g, do, lam, ptrs, stride, lmask, decay, jj, t0, r, eos, grp, h, G, H, K, V, L, J,
                       chunk, c0, scale, kk, vv, LOG_C: tl.constexpr, PRECISION: tl.constexpr, PLAIN: tl.constexpr):
    """dH_j += Q^T (scale * lambda_j * exp(G) * dO) for every level j that the chunk at t0 reads from the
    initial state (kind 2); Q's rows kk, dO's columns vv.  Returns decay."""
    t = t0 + r
    valid = t < eos
    Gc = chunk_gates(g, t, valid, h, H)[0]
    qc = load_tile(q, t0, r, valid, grp, G, K, kk)
    dobl = load_tile(do, t0, r, valid, h, H, V, vv)
    do_scaled = dobl.to(tl.float32) * (scale * tl.exp(Gc))[:, None]
    for j in range(J):
        kind, _ = level_source(chunk, c0, j, True, PLAIN)
        if kind == 2:
            lam_j = level_column(lam, t, valid, h, H, L, LOG_C + 1 + j, PLAIN)
            update = tl.dot(tl.trans(qc), (do_scaled * lam_j[:, None]).to(dobl.dtype), input_precision=PRECISION)
            decay = accumulate_level(ptrs, stride, j, lmask, decay, jj, update)
    return decay


@triton.jit(do_not_specialize=SCAN_RUNTIME_ARGS)
def mamba2_bwd_scan_kernel(
    q, g, lam, do, d_levels, d_buckets, bos_ptr, eos_ptr, chunk0_ptr, base_ptr, scale,
    H, G, K, V, L, J,
    C: tl.constexpr, LOG_C: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    BJ: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr, PLAIN: tl.constexpr,
):
    """Grid (N, H, cdiv(K, BKS)). d_levels: [N, J, H, K, V] fp32, the final chunk-level states' gradient in,
    the initial ones' out (HAS_INIT); d_buckets: [NC, H, K, V] (q's dtype), dB per kernel chunk in, dD out (every
    chunk but each sequence's last); base: [N] each sequence's first kernel chunk."""
    n, h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, c0, base = sequence_range(n, bos_ptr, eos_ptr, chunk0_ptr, base_ptr)
    r = tl.arange(0, C)
    kk, vv, jj = kb * BKS + tl.arange(0, BKS), tl.arange(0, BV), tl.arange(0, BJ)
    ptrs, stride, offs, lmask = level_tile(d_levels, n, h, H, J, K, V, kk, vv)
    decay = tl.zeros([BJ], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    slot = ((base + n_chunks - 1) * H + h) * K * V
    reads, Gl = chunk_inputs(d_buckets, g, slot, bos + (n_chunks - 1) * C, r, bos, eos, h, H, offs, lmask, PLAIN)
    for back in range(n_chunks):
        i = n_chunks - 1 - back
        t0 = bos + i * C
        next_reads, next_Gl = chunk_inputs(d_buckets, g, slot - H * K * V, t0 - C, r, bos, eos, h, H, offs, lmask,
                                           PLAIN)
        if PLAIN or i < n_chunks - 1:
            d_deposit, decay = split_levels(ptrs, stride, lmask, decay, jj, c0 + i, reads, BJ, PLAIN)
            tl.store(d_buckets + slot + offs, d_deposit.to(d_buckets.dtype.element_ty), mask=lmask)
        decay += Gl
        if HAS_INIT:
            decay = initial_read_grads(q, g, do, lam, ptrs, stride, lmask, decay, jj, t0, r, eos, h // (H // G), h, G,
                                       H, K, V, L, J, c0 + i, c0, scale, kk, vv, LOG_C, PRECISION, PLAIN)
        reads, Gl, slot = next_reads, next_Gl, slot - H * K * V
    if HAS_INIT:
        flush_levels(ptrs, stride, lmask, decay, jj, J, c0, c0, False, HAS_INIT, PLAIN)
