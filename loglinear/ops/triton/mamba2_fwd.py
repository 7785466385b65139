"""Forward scan of log-linear Mamba-2 (the chunk levels): one program per (sequence, value head).

mamba2_intra.py has written the in-chunk outputs O_intra. Per chunk i (C tokens, G = chunk-local
cumsum of g, Gl = G at the chunk's end):

    readout  O = O_intra + sum_{live j} diag(lambda[:, c+1+j] * exp(G)) (Q H_j)     one GEMM per live level
    carry    H_j <- exp(Gl) H_j  (lazy);   H_m <- D_i + sum_{j<=m} H_j,  D_i = K^T (exp(Gl - G) * V)
    o = scale * O

The per-token factors lambda_j * exp(G) scale the rows of the readout's result and exp(Gl - G) the
(smaller) V operand of the deposit, so q and k enter the GEMMs as loaded (no scaled [C, K] copies).
The level states never leave the scan's fp32 buffer except as the final states (levels.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.common import SCAN_RUNTIME_ARGS, load_column
from loglinear.ops.triton.intra import chunk_gates
from loglinear.ops.triton.levels import flush_levels, level_live, load_level, merge_levels
from loglinear.ops.triton.mamba2_rows import load_qk_tiles, load_tile, store_tile


@triton.jit
def chunk_deposit(kc, vc, Gc, Gl, PRECISION: tl.constexpr):
    """D = sum_s exp(Gl - G_s) k_s v_s^T = K^T (exp(Gl - G) * V) -> [BK, BV] fp32 (k [C, BK], v [C, BV])."""
    to_end = tl.exp(Gl - Gc)[:, None]
    return tl.dot(tl.trans(kc), (vc.to(tl.float32) * to_end).to(vc.dtype), input_precision=PRECISION)


@triton.jit(do_not_specialize=SCAN_RUNTIME_ARGS)
def mamba2_fwd_kernel(
    q, k, v, g, lam, o, oi, levels, bos_ptr, eos_ptr, chunk0_ptr, scale,
    H, G, K, V, L, J,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr,
    HAS_INIT: tl.constexpr, PRECISION: tl.constexpr,
):
    """q, k: [tokens, G, K]; v, o: [tokens, H, V]; g: [tokens, H]; lam: [tokens, H, L];
    oi: [tokens, H, V] fp32 in-chunk outputs (unscaled);
    levels: [N, J, H, K, V] fp32, initial chunk-level states in, final ones out; bos/eos/chunk0: [N].
    Grid (N, H, cdiv(V, BV)): value blocks are independent."""
    n, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    grp = h // (H // G)
    bos = tl.load(bos_ptr + n).to(tl.int64)
    eos = tl.load(eos_ptr + n).to(tl.int64)
    c0 = tl.load(chunk0_ptr + n).to(tl.int64)
    r = tl.arange(0, C)
    kk, jj = tl.arange(0, BK), tl.arange(0, BJ)
    vv = vb * BV + tl.arange(0, BV)
    stride = H * K * V
    ptrs = levels + (n * J * H + h) * K * V + kk[:, None] * V + vv[None, :]
    lmask = (kk[:, None] < K) & (vv[None, :] < V)
    decay = tl.zeros([BJ], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    chunk = c0
    for i in range(n_chunks):
        t0 = bos + i * C
        t = t0 + r
        valid = t < eos
        chunk = c0 + i
        qc, kc = load_qk_tiles(q, k, t0, r, valid, grp, G, K, kk)
        Gc, Gl = chunk_gates(g, t, valid, h, H)
        read = tl.zeros([C, BV], dtype=tl.float32)
        for j in range(J):
            if level_live(chunk, c0, j, HAS_INIT):
                lam_j = load_column(lam, t, valid, h, H, L, LOG_C + 1 + j)
                state = load_level(ptrs, stride, j, lmask, decay, jj).to(qc.dtype)
                read += lam_j[:, None] * tl.dot(qc, state, input_precision=PRECISION)
        acc = load_tile(oi, t0, r, valid, h, H, V, vv) + read * tl.exp(Gc)[:, None]
        store_tile(o, acc * scale, t0, r, valid, h, H, V, vv)
        decay += Gl
        if i < n_chunks - 1:
            deposit = chunk_deposit(kc, load_tile(v, t0, r, valid, h, H, V, vv), Gc, Gl, PRECISION)
            decay = merge_levels(ptrs, stride, lmask, deposit, decay, jj, chunk, c0, HAS_INIT, BJ)
    flush_levels(ptrs, stride, lmask, decay, jj, J, chunk, c0, True, HAS_INIT)
