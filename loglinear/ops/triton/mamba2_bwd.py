"""Backward scan of log-linear Mamba-2: the transposed chunk-level cascade, one program per (sequence, value head).

mamba2_chunk.py has written dq and dlambda in full and the in-chunk terms of dk (block 0) and dv; this
scan walks the chunks in reverse carrying the level gradients dH and adds the deposit terms. Per chunk
(G the chunk-local cumsum, Gl = G at the chunk's end):

    deposit  dD_i = dH_m (transposed merge),  dK += exp(Gl - G) * (V dD^T),  dV += exp(Gl - G) * (K dD)
    reads    dH_m += dB_i: the gradient of the level merged after chunk i from all its readers, summed
             chunk-parallel (mamba2_chunk.mamba2_level_grad_kernel); only reads of the initial state
             (HAS_INIT) are added here: dH_j += Q^T (scale * lambda_j * exp(G) * dO)

It may split V over programs (fp32; see mamba2._splits): dK's deposit part and k.dk are sums over the
value blocks, written per block and added by the caller in a fixed order; block 0 adds them to the
in-chunk terms, the other blocks start from 0. k.dk feeds the gate's gradient (mamba2_chunk.py derives
dG_t = q_t.dq_t - k_t.dk_t). No atomics: every output element has one writer at a time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.common import SCAN_RUNTIME_ARGS, load_column
from loglinear.ops.triton.intra import chunk_gates
from loglinear.ops.triton.levels import (
    accumulate_level, flush_levels, level_source, level_tile, sequence_range, split_levels,
)
from loglinear.ops.triton.mamba2_rows import load_qk_tiles, load_tile, store_tile


@triton.jit
def block_zero_rows(valid, t, block):
    """valid [C] for the split block 0 (it adds to the in-chunk terms), all False for the others."""
    return valid & ((t * 0 + block) == 0)


@triton.jit(do_not_specialize=SCAN_RUNTIME_ARGS)
def mamba2_bwd_dkv_kernel(
    q, k, v, g, lam, do, dk, dv, kdk, d_levels, d_buckets, bos_ptr, eos_ptr, chunk0_ptr, base_ptr, scale, tokens,
    H, G, K, V, L, J,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BVS: tl.constexpr,
    BJ: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (N, H, cdiv(V, BVS)). dk, kdk: [NV, tokens, H, K] / [NV, tokens, H] fp32 partial sums over
    V blocks (per value head; dk[0] holds the in-chunk terms on entry); dv: [tokens, H, V], in-chunk
    terms in, totals out; d_levels: [N, J, H, K, V] fp32: the final chunk-level states' gradient in,
    the initial ones' out; d_buckets: [NC, H, K, V] fp32, dB per kernel chunk; base: [N] each sequence's first."""
    n, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    grp = h // (H // G)
    bos, eos, c0, base = sequence_range(n, bos_ptr, eos_ptr, chunk0_ptr, base_ptr)
    r = tl.arange(0, C)
    kk, jj = tl.arange(0, BK), tl.arange(0, BJ)
    vs = vb * BVS + tl.arange(0, BVS)
    ptrs, stride, offs, lmask = level_tile(d_levels, n, h, H, J, K, V, kk, vs)
    dk += vb.to(tl.int64) * tokens * H * K
    kdk += vb.to(tl.int64) * tokens * H
    decay = tl.zeros([BJ], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    for back in range(n_chunks):
        i = n_chunks - 1 - back
        t0 = bos + i * C
        t = t0 + r
        valid = t < eos
        chunk = c0 + i
        qc, kc = load_qk_tiles(q, k, t0, r, valid, grp, G, K, kk)
        dobl = load_tile(do, t0, r, valid, h, H, V, vs)
        Gc, Gl = chunk_gates(g, t, valid, h, H)
        acc_k = load_tile(dk, t0, r, block_zero_rows(valid, t, vb), h, H, K, kk)
        acc_v = load_tile(dv, t0, r, valid, h, H, V, vs)
        if i < n_chunks - 1:
            reads = tl.load(d_buckets + ((base + i) * H + h) * K * V + offs, mask=lmask, other=0.0)
            d_deposit, decay = split_levels(ptrs, stride, lmask, decay, jj, chunk, reads, BJ)
            to_end = tl.exp(Gl - Gc)[:, None]
            vbl = load_tile(v, t0, r, valid, h, H, V, vs)
            d_deposit = d_deposit.to(vbl.dtype)
            acc_k += to_end * tl.dot(vbl, tl.trans(d_deposit), input_precision=PRECISION)
            acc_v += to_end * tl.dot(kc, d_deposit, input_precision=PRECISION)
        store_tile(dk, acc_k, t0, r, valid, h, H, K, kk)
        store_tile(dv, acc_v, t0, r, valid, h, H, V, vs)
        tl.store(kdk + t * H + h, tl.sum(acc_k * kc.to(tl.float32), 1), mask=valid)
        decay += Gl
        if HAS_INIT:
            do_scaled = dobl.to(tl.float32) * (scale * tl.exp(Gc))[:, None]
            for j in range(J):
                kind, _ = level_source(chunk, c0, j, HAS_INIT)
                if kind == 2:
                    lam_j = load_column(lam, t, valid, h, H, L, LOG_C + 1 + j)
                    update = tl.dot(tl.trans(qc), (do_scaled * lam_j[:, None]).to(dobl.dtype),
                                    input_precision=PRECISION)
                    decay = accumulate_level(ptrs, stride, j, lmask, decay, jj, update)
    if HAS_INIT:
        flush_levels(ptrs, stride, lmask, decay, jj, J, c0, c0, False, HAS_INIT)
