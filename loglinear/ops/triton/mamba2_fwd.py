"""Forward of log-linear Mamba-2: one fused kernel, one program per (sequence, value head).

Per chunk i (C tokens, G = chunk-local cumsum of g, Gl = G at the chunk's end):

    intra    O  = (Q K^T * Gamma * Lambda) V                                      levels 0..c
             (INTRA: in the scan, v1.2; otherwise read from oi, mamba2_intra.py computed it)
    readout  O += sum_{live j} (lambda[:, c+1+j] * exp(G) * Q) H_j               one GEMM of depth (#live)*K
    carry    H_j <- exp(Gl) H_j  (lazy);   H_m <- D_i + sum_{j<=m} H_j,  D_i = (exp(Gl - G) * K)^T V
    o = scale * O

The level states never leave the scan's fp32 buffer except as the final states (levels.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.common import SCAN_RUNTIME_ARGS, load_chunk_qk, load_column, load_rows, store_rows
from loglinear.ops.triton.intra import chunk_gates, intra_levels, intra_output
from loglinear.ops.triton.levels import flush_levels, level_live, load_level, merge_levels


@triton.jit(do_not_specialize=SCAN_RUNTIME_ARGS)
def mamba2_fwd_kernel(
    q, k, v, g, lam, o, oi, levels, bos_ptr, eos_ptr, chunk0_ptr, scale,
    H, G, K, V, L, J,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr,
    HAS_INIT: tl.constexpr, INTRA: tl.constexpr, PRECISION: tl.constexpr,
):
    """q, k: [tokens, G, K]; v, o: [tokens, H, V]; g: [tokens, H]; lam: [tokens, H, L];
    oi: [tokens, H, V] fp32 in-chunk outputs (read unless INTRA);
    levels: [N, J, H, K, V] fp32, initial chunk-level states in, final ones out; bos/eos/chunk0: [N].
    Grid (N, H, cdiv(V, BV)): value blocks are independent (with INTRA each recomputes the C x C scores)."""
    n, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    grp = h // (H // G)
    bos = tl.load(bos_ptr + n).to(tl.int64)
    eos = tl.load(eos_ptr + n).to(tl.int64)
    c0 = tl.load(chunk0_ptr + n).to(tl.int64)
    r = tl.arange(0, C)
    kk, jj = tl.arange(0, BK), tl.arange(0, BJ)
    vv = vb * BV + tl.arange(0, BV)
    lev = intra_levels(r, LOG_C)
    causal = r[:, None] >= r[None, :]
    stride = H * K * V
    ptrs = levels + (n * J * H + h) * K * V + kk[:, None] * V + vv[None, :]
    lmask = (kk[:, None] < K) & (vv[None, :] < V)
    decay = tl.zeros([BJ], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    chunk = c0
    for i in range(n_chunks):
        t = bos + i * C + r
        valid = t < eos
        chunk = c0 + i
        qc, kc = load_chunk_qk(q, k, t, valid, grp, G, K, kk, BK)
        vc = load_rows(v, t, valid, h, H, V, vv, BV)
        Gc, Gl = chunk_gates(g, t, valid, h, H)
        if INTRA:
            acc = intra_output(qc, kc, vc, Gc, lam, t, valid, h, H, L, lev, causal, LOG_C, PRECISION)
        else:
            acc = load_rows(oi, t, valid, h, H, V, vv, BV)
        qt = qc.to(tl.float32) * tl.exp(Gc)[:, None]
        for j in range(J):
            if level_live(chunk, c0, j, HAS_INIT):
                lam_j = load_column(lam, t, valid, h, H, L, LOG_C + 1 + j)
                state = load_level(ptrs, stride, j, lmask, decay, jj)
                acc += tl.dot((qt * lam_j[:, None]).to(qc.dtype), state.to(qc.dtype), input_precision=PRECISION)
        store_rows(o, acc * scale, t, valid, h, H, V, vv)
        decay += Gl
        if i < n_chunks - 1:
            kt = kc.to(tl.float32) * tl.exp(Gl - Gc)[:, None]
            deposit = tl.dot(tl.trans(kt.to(vc.dtype)), vc, input_precision=PRECISION)
            decay = merge_levels(ptrs, stride, lmask, deposit, decay, jj, chunk, c0, HAS_INIT, BJ)
    flush_levels(ptrs, stride, lmask, decay, jj, J, chunk, c0, True, HAS_INIT)
