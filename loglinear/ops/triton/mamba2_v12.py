"""TEMPORARY: the v1.2 scans (the in-chunk block computed inside the sequential scans), selected by
mamba2.CHUNK_PARALLEL_INTRA = False until v2 (mamba2_intra.py + the lean scans of mamba2_fwd.py /
mamba2_bwd.py) has been measured on the device; delete this module then.

Forward, per chunk: O = (Q K^T * Gamma * Lambda) V + sum_{live j} (lambda_j * exp(G) * Q) H_j, then
deposit and merge (mamba2_fwd.py). Backward: the dq scan (forward cascade again; intra dQ, dlambda
0..c plus the readout terms) and the dk/dv scan (transposed cascade; intra dK, dV plus the deposit
terms), with the intra block's formulas of intra.py; split K / V blocks as mamba2_bwd.py, the intra
terms added by block 0 only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.common import SCAN_RUNTIME_ARGS, load_chunk_qk, load_column, load_rows, store_rows
from loglinear.ops.triton.intra import (
    chunk_gates, intra_levels, intra_output, intra_score_grads, intra_scores, level_sums, level_weights,
)
from loglinear.ops.triton.levels import (
    accumulate_level, flush_levels, level_live, load_level, merge_levels, split_levels,
)


@triton.jit(do_not_specialize=SCAN_RUNTIME_ARGS)
def mamba2_v12_fwd_kernel(
    q, k, v, g, lam, o, levels, bos_ptr, eos_ptr, chunk0_ptr, scale,
    H, G, K, V, L, J,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr,
    HAS_INIT: tl.constexpr, PRECISION: tl.constexpr,
):
    """q, k: [tokens, G, K]; v, o: [tokens, H, V]; g: [tokens, H]; lam: [tokens, H, L];
    levels: [N, J, H, K, V] fp32, initial chunk-level states in, final ones out; bos/eos/chunk0: [N].
    Grid (N, H, cdiv(V, BV)): value blocks are independent (each recomputes the C x C scores)."""
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
        acc = intra_output(qc, kc, vc, Gc, lam, t, valid, h, H, L, lev, causal, LOG_C, PRECISION)
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
            _, decay = merge_levels(ptrs, stride, lmask, deposit, decay, jj, chunk, c0, HAS_INIT, BJ)
    flush_levels(ptrs, stride, lmask, decay, jj, J, chunk, c0, True, HAS_INIT)


@triton.jit(do_not_specialize=SCAN_RUNTIME_ARGS)
def mamba2_v12_bwd_dq_kernel(
    q, k, v, g, lam, do, dq, dlam, qdq, levels, bos_ptr, eos_ptr, chunk0_ptr, scale, tokens,
    H, G, K, V, L, J,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    BJ: tl.constexpr, BL: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (N, H, cdiv(K, BKS)). dq: [tokens, H, K] fp32 (per value head);
    dlam, qdq: [NK, tokens, H, L] / [NK, tokens, H] fp32 partial sums over K blocks;
    levels: [N, J, H, K, V] fp32 scratch holding the initial chunk-level states (overwritten)."""
    n, h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    grp = h // (H // G)
    bos = tl.load(bos_ptr + n).to(tl.int64)
    eos = tl.load(eos_ptr + n).to(tl.int64)
    c0 = tl.load(chunk0_ptr + n).to(tl.int64)
    r = tl.arange(0, C)
    kk, vv, jj, ll = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BJ), tl.arange(0, BL)
    ks = kb * BKS + tl.arange(0, BKS)
    first = (kb == 0).to(tl.float32)
    lev = intra_levels(r, LOG_C)
    causal = r[:, None] >= r[None, :]
    stride = H * K * V
    ptrs = levels + (n * J * H + h) * K * V + ks[:, None] * V + vv[None, :]
    lmask = (ks[:, None] < K) & (vv[None, :] < V)
    dlam += kb.to(tl.int64) * tokens * H * L
    qdq += kb.to(tl.int64) * tokens * H
    decay = tl.zeros([BJ], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    for i in range(n_chunks):
        t = bos + i * C + r
        valid = t < eos
        chunk = c0 + i
        qs = load_rows(q, t, valid, grp, G, K, ks, BKS)
        kbl = load_rows(k, t, valid, grp, G, K, ks, BKS)
        vc = load_rows(v, t, valid, h, H, V, vv, BV)
        doc = load_rows(do, t, valid, h, H, V, vv, BV)
        Gc, Gl = chunk_gates(g, t, valid, h, H)
        qc, kc = load_chunk_qk(q, k, t, valid, grp, G, K, kk, BK)
        p, gamma = intra_scores(qc, kc, Gc, causal, PRECISION)
        d_a = intra_score_grads(doc, vc, causal, scale, PRECISION)
        d_lam = level_sums(d_a * p * first, lev, ll, LOG_C)
        weights = level_weights(lam, t, valid, h, H, L, lev, causal, LOG_C)
        acc = tl.dot((d_a * gamma * weights).to(kbl.dtype), kbl, input_precision=PRECISION)
        qt = qs.to(tl.float32) * tl.exp(Gc)[:, None]
        d_qt = tl.zeros([C, BKS], dtype=tl.float32)
        for j in range(J):
            if level_live(chunk, c0, j, HAS_INIT):
                lam_j = load_column(lam, t, valid, h, H, L, LOG_C + 1 + j)
                state = load_level(ptrs, stride, j, lmask, decay, jj).to(qs.dtype)
                d_qt += lam_j[:, None] * tl.dot(doc, tl.trans(state), input_precision=PRECISION)
                read = tl.dot(qt.to(qs.dtype), state, input_precision=PRECISION)
                col = tl.sum(read * doc.to(tl.float32), 1) * scale
                d_lam = tl.where(ll[None, :] == LOG_C + 1 + j, col[:, None], d_lam)
        acc += d_qt * (scale * tl.exp(Gc))[:, None]
        store_rows(dq, acc, t, valid, h, H, K, ks)
        store_rows(dlam, d_lam, t, valid, h, H, L, ll)
        tl.store(qdq + t * H + h, tl.sum(acc * qs.to(tl.float32), 1), mask=valid)
        decay += Gl
        if i < n_chunks - 1:
            kt = kbl.to(tl.float32) * tl.exp(Gl - Gc)[:, None]
            deposit = tl.dot(tl.trans(kt.to(vc.dtype)), vc, input_precision=PRECISION)
            _, decay = merge_levels(ptrs, stride, lmask, deposit, decay, jj, chunk, c0, HAS_INIT, BJ)


@triton.jit(do_not_specialize=SCAN_RUNTIME_ARGS)
def mamba2_v12_bwd_dkv_kernel(
    q, k, v, g, lam, do, dk, dv, kdk, d_levels, bos_ptr, eos_ptr, chunk0_ptr, scale, tokens,
    H, G, K, V, L, J,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVS: tl.constexpr,
    BJ: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (N, H, cdiv(V, BVS)). dk, kdk: [NV, tokens, H, K] / [NV, tokens, H] fp32 partial sums over
    V blocks (per value head); dv: [tokens, H, V];
    d_levels: [N, J, H, K, V] fp32: the final chunk-level states' gradient in, the initial ones' out."""
    n, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    grp = h // (H // G)
    bos = tl.load(bos_ptr + n).to(tl.int64)
    eos = tl.load(eos_ptr + n).to(tl.int64)
    c0 = tl.load(chunk0_ptr + n).to(tl.int64)
    r = tl.arange(0, C)
    kk, vv, jj = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BJ)
    vs = vb * BVS + tl.arange(0, BVS)
    first = (vb == 0).to(tl.float32)
    lev = intra_levels(r, LOG_C)
    causal = r[:, None] >= r[None, :]
    stride = H * K * V
    ptrs = d_levels + (n * J * H + h) * K * V + kk[:, None] * V + vs[None, :]
    lmask = (kk[:, None] < K) & (vs[None, :] < V)
    dk += vb.to(tl.int64) * tokens * H * K
    kdk += vb.to(tl.int64) * tokens * H
    decay = tl.zeros([BJ], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    for back in range(n_chunks):
        i = n_chunks - 1 - back
        t = bos + i * C + r
        valid = t < eos
        chunk = c0 + i
        qc, kc = load_chunk_qk(q, k, t, valid, grp, G, K, kk, BK)
        vbl = load_rows(v, t, valid, h, H, V, vs, BVS)
        dobl = load_rows(do, t, valid, h, H, V, vs, BVS)
        Gc, Gl = chunk_gates(g, t, valid, h, H)
        vc = load_rows(v, t, valid, h, H, V, vv, BV)
        doc = load_rows(do, t, valid, h, H, V, vv, BV)
        p, gamma = intra_scores(qc, kc, Gc, causal, PRECISION)
        weights = level_weights(lam, t, valid, h, H, L, lev, causal, LOG_C)
        d_s = intra_score_grads(doc, vc, causal, scale * first, PRECISION) * gamma * weights
        acc_k = tl.dot(tl.trans(d_s.to(qc.dtype)), qc, input_precision=PRECISION)
        acc_v = tl.dot(tl.trans((p * weights).to(dobl.dtype)), dobl, input_precision=PRECISION) * scale
        if i < n_chunks - 1:
            d_deposit, decay = split_levels(ptrs, stride, lmask, decay, jj, chunk, 0.0, BJ)
            to_end = tl.exp(Gl - Gc)[:, None]
            d_deposit = d_deposit.to(vbl.dtype)
            acc_k += to_end * tl.dot(vbl, tl.trans(d_deposit), input_precision=PRECISION)
            acc_v += to_end * tl.dot(kc, d_deposit, input_precision=PRECISION)
        decay += Gl
        qt = qc.to(tl.float32) * (scale * tl.exp(Gc))[:, None]
        for j in range(J):
            if level_live(chunk, c0, j, HAS_INIT):
                lam_j = load_column(lam, t, valid, h, H, L, LOG_C + 1 + j)
                update = tl.dot(tl.trans((qt * lam_j[:, None]).to(dobl.dtype)), dobl, input_precision=PRECISION)
                decay = accumulate_level(ptrs, stride, j, lmask, decay, jj, update)
        store_rows(dk, acc_k, t, valid, h, H, K, kk)
        store_rows(dv, acc_v, t, valid, h, H, V, vs)
        tl.store(kdk + t * H + h, tl.sum(acc_k * kc.to(tl.float32), 1), mask=valid)
    if HAS_INIT:
        flush_levels(ptrs, stride, lmask, decay, jj, J, c0, c0, False, HAS_INIT)
