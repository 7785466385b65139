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

PLAIN (one chunk level, lambda = 1; see fwd.py): dD_i = dS + dB_i, dS <- exp(Gl) dD_i for every chunk, the
last one too (its dB is 0: its deposit is merged into the final state), with dS in registers; only the
sequence's first chunk reads the initial state.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.shared.common import SCAN_RUNTIME_ARGS
from loglinear.ops.triton.shared.intra import chunk_gates
from loglinear.ops.triton.shared.levels import (
    accumulate_level, chunk_inputs, flush_levels, level_source, level_tile, sequence_range, split_levels,
)
from loglinear.ops.triton.shared.tiles import load_column, load_tile


@triton.jit
def read_operands(q, g, do, t0, r, eos, grp, h, G, H, K, V, kk, vv, scale):
    """The chunk at t0 as a reader of levels: its queries Q (rows kk) [C, BKS] and scale * exp(G) * dO (columns vv)
    [C, BV] fp32 (rows past eos 0)."""
    t = t0 + r
    valid = t < eos
    Gc = chunk_gates(g, t, valid, h, H)[0]
    dobl = load_tile(do, t0, r, valid, h, H, V, vv)
    return load_tile(q, t0, r, valid, grp, G, K, kk), dobl.to(tl.float32) * (scale * tl.exp(Gc))[:, None]


@triton.jit
def initial_read_grads(q, g, lam, do, ptrs, stride, lmask, decay, jj, t0, r, eos, grp, h, G, H, K, V, L, J,
                       chunk, c0, scale, kk, vv, LOG_C: tl.constexpr, PRECISION: tl.constexpr):
    """dH_j += Q^T (scale * lambda_j * exp(G) * dO) for every level j that the chunk at t0 reads from the
    initial state (kind 2); Q's rows kk, dO's columns vv.  Returns decay."""
    qc, do_scaled = read_operands(q, g, do, t0, r, eos, grp, h, G, H, K, V, kk, vv, scale)
    for j in range(J):
        kind, _ = level_source(chunk, c0, j, True, False)
        if kind == 2:
            lam_j = load_column(lam, t0 + r, t0 + r < eos, h, H, L, LOG_C + 1 + j)
            update = tl.dot(tl.trans(qc), (do_scaled * lam_j[:, None]).to(qc.dtype), input_precision=PRECISION)
            decay = accumulate_level(ptrs, stride, j, lmask, decay, jj, update)
    return decay


@triton.jit
def plain_chain(q, g, do, ptrs, lmask, d_buckets, bos, eos, base, grp, h, G, H, K, V, offs, r, kk, vv, scale,
                C: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr):
    """PLAIN, in reverse from the final state's gradient at ptrs: dD_i = dS + dB_i (stored over dB_i),
    dS <- exp(Gl_i) dD_i, in registers; then dS += Q^T (scale exp(G) dO) of the first chunk (it reads the initial
    state) and dS back to ptrs: the initial state's gradient."""
    d_state = tl.load(ptrs, mask=lmask, other=0.0)
    n_chunks = tl.cdiv(eos - bos, C)
    slot = ((base + n_chunks - 1) * H + h) * K * V
    reads, Gl = chunk_inputs(d_buckets, g, slot, bos + (n_chunks - 1) * C, r, bos, eos, h, H, offs, lmask, True)
    for back in range(n_chunks):
        t0 = bos + (n_chunks - 1 - back) * C
        next_reads, next_Gl = chunk_inputs(d_buckets, g, slot - H * K * V, t0 - C, r, bos, eos, h, H, offs, lmask,
                                           True)
        d_deposit = d_state + reads
        tl.store(d_buckets + slot + offs, d_deposit.to(d_buckets.dtype.element_ty), mask=lmask)
        d_state = tl.exp(Gl) * d_deposit
        reads, Gl, slot = next_reads, next_Gl, slot - H * K * V
    if HAS_INIT:
        qc, do_scaled = read_operands(q, g, do, bos, r, eos, grp, h, G, H, K, V, kk, vv, scale)
        d_state += tl.dot(tl.trans(qc), do_scaled.to(qc.dtype), input_precision=PRECISION)
        tl.store(ptrs, d_state, mask=lmask)


@triton.jit
def fenwick_chain(q, g, lam, do, ptrs, stride, lmask, d_buckets, bos, eos, c0, base, grp, h, G, H, K, V, L, J,
                  offs, r, kk, vv, jj, scale, C: tl.constexpr, LOG_C: tl.constexpr, BJ: tl.constexpr,
                  HAS_INIT: tl.constexpr, PRECISION: tl.constexpr):
    """The transposed cascade (module docstring) on the level gradients at ptrs (stride between levels)."""
    decay = tl.zeros([BJ], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    slot = ((base + n_chunks - 1) * H + h) * K * V
    reads, Gl = chunk_inputs(d_buckets, g, slot, bos + (n_chunks - 1) * C, r, bos, eos, h, H, offs, lmask, False)
    for back in range(n_chunks):
        i = n_chunks - 1 - back
        t0 = bos + i * C
        next_reads, next_Gl = chunk_inputs(d_buckets, g, slot - H * K * V, t0 - C, r, bos, eos, h, H, offs, lmask,
                                           False)
        if i < n_chunks - 1:
            d_deposit, decay = split_levels(ptrs, stride, lmask, decay, jj, c0 + i, reads, BJ)
            tl.store(d_buckets + slot + offs, d_deposit.to(d_buckets.dtype.element_ty), mask=lmask)
        decay += Gl
        if HAS_INIT:
            decay = initial_read_grads(q, g, lam, do, ptrs, stride, lmask, decay, jj, t0, r, eos, grp, h, G, H, K, V,
                                       L, J, c0 + i, c0, scale, kk, vv, LOG_C, PRECISION)
        reads, Gl, slot = next_reads, next_Gl, slot - H * K * V
    if HAS_INIT:
        flush_levels(ptrs, stride, lmask, decay, jj, J, c0, c0, False, HAS_INIT)


@triton.jit(do_not_specialize=SCAN_RUNTIME_ARGS)
def mamba2_bwd_scan_kernel(
    q, g, lam, do, d_levels, d_buckets, bos_ptr, eos_ptr, chunk0_ptr, base_ptr, scale,
    H, G, K, V, L, J,
    C: tl.constexpr, LOG_C: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    BJ: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr, PLAIN: tl.constexpr,
):
    """Grid (N, H, cdiv(K, BKS)). d_levels: [N, J, H, K, V] fp32, the final chunk-level states' gradient in,
    the initial ones' out (HAS_INIT); d_buckets: [NC, H, K, V] (q's dtype), dB per kernel chunk in, dD out (every
    chunk but each sequence's last, every chunk when PLAIN); base: [N] each sequence's first kernel chunk."""
    n, h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, c0, base = sequence_range(n, bos_ptr, eos_ptr, chunk0_ptr, base_ptr)
    r = tl.arange(0, C)
    kk, vv, jj = kb * BKS + tl.arange(0, BKS), tl.arange(0, BV), tl.arange(0, BJ)
    ptrs, stride, offs, lmask = level_tile(d_levels, n, h, H, J, K, V, kk, vv)
    if PLAIN:
        plain_chain(q, g, do, ptrs, lmask, d_buckets, bos, eos, base, h // (H // G), h, G, H, K, V, offs, r, kk, vv,
                    scale, C, HAS_INIT, PRECISION)
    else:
        fenwick_chain(q, g, lam, do, ptrs, stride, lmask, d_buckets, bos, eos, c0, base, h // (H // G), h, G, H, K, V,
                      L, J, offs, r, kk, vv, jj, scale, C, LOG_C, BJ, HAS_INIT, PRECISION)
