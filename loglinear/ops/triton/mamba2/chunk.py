"""Chunk-parallel part of log-linear Mamba-2: one program per (kernel chunk, value head).

The chunks of all sequences are listed in one table (backend.ChunkTable): chunk p covers tokens
[starts[p], starts[p] + C) clipped to [lows[p], ends[p]) (its sequence's first token and end), belongs to sequence
seqs[p] and has the absolute chunk index chunks[p]; rows outside read as 0 (g = 0: zero tokens, the identity) and
are not written. A sequence that starts inside a chunk starts its first kernel chunk at that chunk's start: the
rows before its first token are masked front padding (starts[p] may be before the sequence, or negative). With G the
chunk-local inclusive cumsum of g and Gl its value at the chunk's end:

    deposit (mamba2_deposit_kernel, before the forward scan)   D = K^T (exp(Gl - G) * V)
    in-chunk (levels 0..c, shared/intra.py)   O = (Q K^T * Gamma * Lambda) V
    readout (chunk levels j, live)     O += diag(exp(G)) sum_j diag(lambda_j * exp(decay_j)) Q B_j
    o = scale * O                      (mamba2_chunk_fwd_kernel, after the forward scan)

B_j is the value of level j as stored (the bucket the forward scan recorded after the merge that
assigned it, or the initial state; levels.level_source) and decay_j its log-decay since then (recorded
by the scan for this chunk). The readout loops walk the levels a chunk reads as one branch-free list
(levels.read_levels: the buckets, and the initial levels that are not all zeros), so their loads are pipelined.

The backward runs in two kernels around the reverse scan. mamba2_chunk_bwd_dq_kernel (before it):
dlambda for every level and dQ in full,

    dQ = dS K + diag(scale * exp(G)) sum_j lambda_j exp(decay_j) dO B_j^T,   dS = dA * Gamma * Lambda
    dlambda_t[l <= c] = sum_{s: level(t,s) = l} (dA * P)_ts
    dlambda_t[c+1+j] = scale exp(G_t + decay_j) q_t . (dO B_j^T)_t

and mamba2_chunk_bwd_dkv_kernel (after it, with the deposits' gradients dD_i from the scan):

    dK = dS^T Q + diag(exp(Gl - G)) V dD^T,   dV = scale * A^T dO + diag(exp(Gl - G)) K dD

Both recompute the in-chunk [C, C] blocks (P, dA, Lambda; two extra C x C x K/V GEMMs) instead of
passing them, so each fits 4 warps (shared/launch.py: registers and spills of each).

The gate's gradient needs no per-chunk term. Let Gs be the sequence's inclusive cumsum of g (G is it
minus its value before the chunk). Every factor the kernels apply telescopes into a difference of Gs:
the in-chunk block uses exp(G_t - G_s) = exp(Gs_t - Gs_s); the readout of key s (deposited in chunk e,
read by query t in chunk i through level j) uses exp(G_t) * exp(decay_j) * exp(Gl_e - G_s), and decay_j
sums the chunk totals between, so the product is exp(Gs_t - Gs_s) too; only the final states carry
exp(Gs_end - Gs_s). Hence the loss depends on Gs_u only through q_u e^{Gs_u}, k_u e^{-Gs_u} and, at
u = end, the final states' factor, so o(q e^d, k e^-d, Gs - d) = o for any per-token d and

    dGs_u = q_u . dq_u - k_u . dk_u  (+ sum(dS_final * S_final) at the last token),
    dg_u  = sum_{t >= u} dGs_t                                        (g_u enters every Gs_t, t >= u)

with dq, dk the full gradients of the value head (in-chunk + chunk levels). With a scalar gate both dot products
come term by term, without the head's dq or dk: q_t . dq_t = sum_l lambda_t[l] dlambda_t[l] (each term of dQ is
one of dlambda's, weighted), i.e. the row sums of dA * P * Lambda plus lambda_j times each chunk level's column,
and k_s . dk_s = the column sums of the same dA * P * Lambda (so the in-chunk terms cancel in the sums as the exact
ones do) plus the deposit's v_s . dv_s. So the kernels may sum a group's heads of dq / dk as they form them
(shared.launch.heads_per_program); a per-channel gate's terms q * dq, k * dk need the head's own (one head per
program). The dq kernel stores q.dq, the dk/dv kernel turns each chunk's rows into dGs (the final states' term on
the sequence's last row) and stores the chunk's total; mamba2_gate_later_kernel sums the totals of each sequence's
later chunks (a [chunks, H] suffix sum instead of a [tokens, H] one) and mamba2_gate_grad_kernel adds them to the
sums over each chunk's later rows.

The readout's gradient with respect to the merged levels is also chunk-parallel: the level m merged
after chunk e (m = ctz(e + 1)) is read, as bucket, by exactly the chunks e+1 .. e+2^m (those of the
sequence), so

    dB_e = sum_{i = e+1 .. e+2^m} exp(decay_{i,m}) Q_i^T (scale * lambda_i[c+1+m] * exp(G_i) * dO_i)

(mamba2_level_grad_kernel, one program per (chunk e, head) looping over its readers, pipelined; the
chunks with m >= 5, the longest loops, launch first, highest m first, the others in position order:
backend.ChunkTable's grad_order); the reverse scan (bwd.py) turns
them into the deposits' gradients dD. The initial levels' gradients from their readers are the same sums:
level j of a sequence starting at chunk c0 is read, as initial state, by the chunks c0 .. ((c0 >> j) + 1) 2^j - 1
(levels.level_source kind 2), with exp(decay_j) its decay since c0 (mamba2_initial_grad_kernel, the readers cut
into segments whose sums the backend adds).

PLAIN (plain Mamba-2 / SSD: lambda = 1, one chunk level, shared/levels.py): the same kernels with lambda's
loads and dlambda compiled out; chunk i reads the state after chunk i - 1 (or the initial state), the last
chunk deposits too (into the final state), and each state has one reader.

PER_CHANNEL (GLA, spec section 6b: g [tokens, H, K], a log-decay per key channel; Mamba-2 is its case of equal
channels): every exp(G) above becomes a per-channel factor on the key side of a product, so it moves from the
rows of the output to the columns of q or k:

    deposit    D = (K * exp(Gl - G))^T V
    readout    O += sum_j lambda_j (Q * exp(G) * exp(decay_j)) B_j          (decay_j [K]: decays [NC, H, J, K])
    in-chunk   P[t, s] = sum_k q_t[k] exp(G_t[k] - G_s[k]) k_s[k]

and the in-chunk block is not one product of q and k: two kernels over 16-row sub-chunks (shared/intra_channel.py)
write P [tokens, H, C] and, in the backward, the in-chunk dQ and dK [tokens, H, K] (q's dtype, summed in fp32); the
forward and the dq and dk / dv kernels read P (the dq kernel forms dlambda's in-chunk columns from it as with a
scalar gate), the dq and dk / dv kernels add the in-chunk dQ / dK.
The kernels read G itself (fp32 [tokens, H, K], written once per call by intra_channel.channel_cumsum_kernel; no
kernel forms a [C, K] cumsum), and the per-channel factors are applied where they are cheapest: the forward
forms Q * exp(G) once per chunk; the dq kernel multiplies the sum over levels by exp(G) once and writes
Q * exp(G) (q_dec, q's dtype) for the level gradient, whose readers then load one [C, K] tile and scale the
product's rows by exp(decay) (no exponential of a tile). The gate's gradient is the same telescoping per
channel: dGs_u[k] = q_u[k] dq_u[k] - k_u[k] dk_u[k] (+ the final states' row k), so the gate terms are q * dq and
k * dk [C, K] instead of row sums (gate_term). The per-channel gate reaches the kernels unfloored: G is the cumsum
of max(g, floor) (intra_channel.channel_cumsum_kernel), and mamba2_gate_grad_kernel reads g to give 0 where
g <= floor (loglinear.ops.finite), in the chunks whose G reaches the floor.
"""
from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.shared.common import heads_fastest
from loglinear.ops.triton.shared.intra import (
    FLOOR, chunk_gates, intra_levels, intra_output, intra_score_grads, intra_scores, level_weights, store_level_sums,
)
from loglinear.ops.triton.shared.intra_channel import channel_gates
from loglinear.ops.triton.shared.levels import (
    block_merged, level_read, level_source, merge_target, nth_level, read_levels, row_decay, sequence_range,
    store_total,
)
from loglinear.ops.triton.shared.tiles import level_column, load_tile, rows_within, store_column, store_tile

CHUNK_RUNTIME_ARGS = ["H", "G", "L", "J"]
FP32_DOT = "tf32x3"  # the products of fp32 calls (shared.rules.dot_precision)


@triton.jit
def chunk_rows(p, starts, lows, ends, C: tl.constexpr):
    """Kernel chunk p: its first token t0 (int64), r = arange(C), the token indices t = t0 + r and whether each
    is a token of its sequence, lows[p] <= t < ends[p] (rows before lows[p]: masked front padding)."""
    r = tl.arange(0, C)
    t0 = tl.load(starts + p).to(tl.int64)
    return t0, r, t0 + r, rows_within(r, t0, tl.load(lows + p).to(tl.int64), tl.load(ends + p).to(tl.int64))


@triton.jit
def chunk_position(p, seqs, chunks, chunk0):
    """Kernel chunk p: (sequence n, absolute chunk index, the sequence's first absolute chunk c0)."""
    n = tl.load(seqs + p)
    return n, tl.load(chunks + p).to(tl.int64), tl.load(chunk0 + n).to(tl.int64)


@triton.jit
def gates(g, t, valid, h, H, K, kk, PER_CHANNEL: tl.constexpr):
    """The chunk's gates, fp32: G the chunk-local inclusive cumsum and Gl its total; [C] and a scalar from
    g [tokens, H], or with PER_CHANNEL [C, BK] and [BK] read from g = G itself ([tokens, H, K] fp32, the
    per-channel cumsum that intra_channel.channel_cumsum_kernel writes once per call)."""
    if PER_CHANNEL:
        G, Gl = channel_gates(g, t, valid, h, H, K, kk)
    else:
        G, Gl = chunk_gates(g, t, valid, h, H)
    return G, Gl


@triton.jit
def read_level(buckets, h0, decays, p, n, h, H, J, K, V, chunk, c0, j, kk, offs, mask, HAS_INIT: tl.constexpr,
               PLAIN: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """Level j as kernel chunk p (of sequence n) reads it, before its decay: from its bucket in buckets
    [NC, H, K, V] (the merge levels.level_source points to) or from the initial states h0 [N, J, H, K, V]
    (level_source kind 2; in the operand dtype, as the readouts round every level) -> [BK, BV] in buckets' dtype;
    and exp(decay_j) (level_decay)."""
    kind, back = level_source(chunk, c0, j, HAS_INIT, PLAIN)
    source = buckets + ((p - back) * H + h) * K * V
    if HAS_INIT:
        source = tl.where(kind == 2, h0 + ((n * J + j) * H + h) * K * V, source)
    state = tl.load(source + offs, mask=mask, other=0.0)
    return state, level_decay(decays, p, h, H, J, K, j, kk, PLAIN, PER_CHANNEL)


@triton.jit
def level_decay(decays, p, h, H, J, K, j, kk, PLAIN: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """exp(decay of level j since stored), as chunk p reads it: a scalar from decays [NC, H, J], or [BK] from
    decays [NC, H, J, K] with PER_CHANNEL; 1 when PLAIN (no decays)."""
    if PER_CHANNEL:
        if PLAIN:
            factor = tl.full(kk.shape, 1.0, tl.float32)
        else:
            factor = tl.exp(tl.load(decays + ((p * H + h) * J + j) * K + kk, mask=kk < K, other=0.0))
    else:
        if PLAIN:
            factor = 1.0
        else:
            factor = tl.exp(tl.load(decays + (p * H + h) * J + j))
    return factor


@triton.jit
def readout(qc, q_dec, state, to_now, lam, t, valid, h, H, L, level, PRECISION: tl.constexpr, PLAIN: tl.constexpr,
            PER_CHANNEL: tl.constexpr):
    """One level's readout lambda_level * (Q * exp(decay)) B, unscaled by exp(G) except with PER_CHANNEL, where
    q_dec = Q * exp(G) [C, BK] fp32 and to_now [BK] scale the columns of q -> [C, BV] fp32."""
    lam_j = level_column(lam, t, valid, h, H, L, level, PLAIN)
    if PER_CHANNEL:
        q_read = (q_dec * to_now[None, :]).to(qc.dtype)
    else:
        q_read = qc
        lam_j *= to_now
    return lam_j[:, None] * tl.dot(q_read, state.to(qc.dtype), input_precision=PRECISION)


@triton.jit
def readout_grad(doc, q_read, state, to_now, row_scale, lam, dlam, t, valid, h, H, L, level,
                 PRECISION: tl.constexpr, PLAIN: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """One level's share of dQ, lambda_level * f * (dO B^T), dlambda's column ``level`` = rowsum(q_read * f *
    (dO B^T)) (stored; not when PLAIN) and the share's q . dQ term, lambda_level * that column [C] (a scalar gate;
    0 with PER_CHANNEL), from the product dO B^T [C, BK] fp32 (``d_read``). A scalar gate: f = row_scale *
    exp(decay) [C] (row_scale = scale * exp(G)), a row factor applied to the column's row sums and, with lambda, to
    the share (one multiply-add per element into the caller's sum), never to the [C, BK] product; q_read = Q.
    PER_CHANNEL: f = exp(decay) [BK] on the product's columns (the caller applies scale * exp(G) to the sum over
    levels), q_read = Q * scale * exp(G) in q's dtype (so dlambda is the same; held through the loop over levels, in
    q's dtype the kernel spills less). -> ([C, BK] fp32, [C] fp32)"""
    d_read = tl.dot(doc, tl.trans(state.to(doc.dtype)), input_precision=PRECISION)
    if PER_CHANNEL:
        d_read *= to_now[None, :]
        rows = 1.0
    else:
        rows = row_scale * to_now
    lam_j = level_column(lam, t, valid, h, H, L, level, PLAIN)
    column = tl.zeros(lam_j.shape, dtype=tl.float32)
    term = tl.zeros(lam_j.shape, dtype=tl.float32)  # a per-channel gate's q * dQ comes from dQ itself
    if not PLAIN or not PER_CHANNEL:
        column = tl.sum(d_read * q_read.to(tl.float32), 1) * rows
    if not PLAIN:
        store_column(dlam, column, t, valid, h, H, L, level)
    if not PER_CHANNEL:
        term = lam_j * column
    return (lam_j * rows)[:, None] * d_read, term


@triton.jit
def chunk_deposit(kc, vc, Gc, Gl, PRECISION: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """D = sum_s exp(Gl - G_s) k_s v_s^T -> [BK, BV] fp32 (k [C, BK], v [C, BV]): K^T (exp(Gl - G) * V), or with
    PER_CHANNEL (Gl [BK], G [C, BK]) (K * exp(Gl - G))^T V."""
    if PER_CHANNEL:
        k_end = (kc.to(tl.float32) * tl.exp(Gl[None, :] - Gc)).to(kc.dtype)
        v_end = vc
    else:
        k_end = kc
        v_end = (vc.to(tl.float32) * tl.exp(Gl - Gc)[:, None]).to(vc.dtype)
    return tl.dot(tl.trans(k_end), v_end, input_precision=PRECISION)


@triton.jit
def gate_term(d_x, xc, PER_CHANNEL: tl.constexpr):
    """A complete gradient's share of dGs: x . dx per row ([C]) of dx [C, BK] fp32 and x [C, BK], or with
    PER_CHANNEL x * dx ([C, BK])."""
    term = d_x * xc.to(tl.float32)
    if not PER_CHANNEL:
        term = tl.sum(term, 1)
    return term


@triton.jit
def load_gate_rows(ptr, t0, r, t, valid, h, H, K, kk, PER_CHANNEL: tl.constexpr):
    """The chunk's rows of ptr [tokens, H] fp32 -> [C], or of ptr [tokens, H, K] with PER_CHANNEL -> [C, BK]."""
    if PER_CHANNEL:
        x = load_tile(ptr, t0, r, valid, h, H, K, kk)
    else:
        x = tl.load(ptr + t * H + h, mask=valid, other=0.0)
    return x


@triton.jit
def store_gate_rows(ptr, x, t0, r, t, valid, h, H, K, kk, PER_CHANNEL: tl.constexpr):
    """x ([C], or [C, BK] with PER_CHANNEL) into the chunk's rows of ptr [tokens, H(, K)] fp32."""
    if PER_CHANNEL:
        store_tile(ptr, x, t0, r, valid, h, H, K, kk)
    else:
        tl.store(ptr + t * H + h, x, mask=valid)


@triton.jit
def chunk_gate_grads(d_gate, totals, final_terms, k_dk, t0, r, t, valid, last, p, n, h, H, K, kk,
                     PER_CHANNEL: tl.constexpr):
    """d_gate [tokens, H] ([tokens, H, K] with PER_CHANNEL) fp32 holds q.dq on the chunk's rows (the dq kernel's):
    store x = q.dq - k.dk (k_dk: head h's k.dk [C], or k * dk [C, BK] with PER_CHANNEL; + final_terms[n]
    [N, H(, K)], the final states' term, on the sequence's last row ``last``) back into d_gate's rows and the
    chunk's sum of x into totals [NC, H(, K)] fp32 (row p)."""
    on_last = (t == last) & valid
    x = load_gate_rows(d_gate, t0, r, t, valid, h, H, K, kk, PER_CHANNEL) - k_dk
    if PER_CHANNEL:
        term = tl.load(final_terms + (n * H + h) * K + kk, mask=kk < K, other=0.0)
        x += tl.where(on_last[:, None], term[None, :], 0.0)
        tl.store(totals + (p * H + h) * K + kk, tl.sum(x, 0), mask=kk < K)
    else:
        x += tl.where(on_last, tl.load(final_terms + n * H + h), 0.0)
        tl.store(totals + p * H + h, tl.sum(x, 0))
    store_gate_rows(d_gate, x, t0, r, t, valid, h, H, K, kk, PER_CHANNEL)


@triton.jit(do_not_specialize=["H"])
def mamba2_gate_grad_kernel(
    d_gate, later, g, cum, dg, starts, lows, ends,
    H, K,
    C: tl.constexpr, BK: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """The gate's gradient on the rows of every kernel chunk p: dg_u = sum_{rows t >= u of p} x_t + later[p], with
    x = d_gate [tokens, H] ([tokens, H, K] with PER_CHANNEL) fp32, dGs per row (chunk_gate_grads), and later
    [NC, H(, K)] fp32 the sums over the later chunks of p's sequence; dg: d_gate's shape, in its own dtype. The
    kernels ran on max(g, FLOOR) with g the raw gate: dg_u is 0 where g_u <= FLOOR (the floor's gradient). A scalar
    g [tokens, H] is read on every row; a per-channel g [tokens, H, K] only in a chunk whose total Gl = sum of
    max(g, FLOOR) (cum [tokens, H, K] fp32: G, its last row) is <= FLOOR on some channel, as it is whenever a g of
    the chunk is (every term is <= 0, and rounding keeps the fp32 partial sums monotone): a gate that stays above
    the floor costs no read of it (cum is not read for a scalar gate). Grid (NC * H,) (heads_fastest)."""
    ci, h = heads_fastest(H)
    t0, r, t, valid = chunk_rows(ci, starts, lows, ends, C)
    kk = tl.arange(0, BK)
    x = tl.cumsum(load_gate_rows(d_gate, t0, r, t, valid, h, H, K, kk, PER_CHANNEL), 0, reverse=True)
    row = ci * H + h
    if PER_CHANNEL:
        x += tl.load(later + row * K + kk, mask=kk < K, other=0.0)[None, :]
        if tl.min(channel_gates(cum, t, valid, h, H, K, kk)[1], 0) <= FLOOR:
            x = tl.where(load_tile(g, t0, r, valid, h, H, K, kk).to(tl.float32) <= FLOOR, 0.0, x)
    else:
        x += tl.load(later + row)
        x = tl.where(load_gate_rows(g, t0, r, t, valid, h, H, K, kk, False).to(tl.float32) <= FLOOR, 0.0, x)
    store_gate_rows(dg, x, t0, r, t, valid, h, H, K, kk, PER_CHANNEL)


@triton.jit(do_not_specialize=["H", "K", "N", "NC"])
def mamba2_gate_later_kernel(totals, later, base_ptr, H, K, N, NC, R: tl.constexpr, BK: tl.constexpr):
    """later[p] = the sum of totals[p'] over the chunks p' after p in p's sequence (0 for its last chunk), summed in
    fp64, stored fp32; totals, later: [NC, H] ([NC, H, K] with a per-channel gate; K = 1 for a scalar one) fp32,
    base_ptr: [N] int32 each sequence's first chunk (the chunk table's base). The sequence's chunks go in blocks of
    R from its end, one [R, BK] load each: a block's sums are its reverse cumsum plus the carry, the total of the
    blocks after it. Grid (N, H)."""
    n, h = tl.program_id(0), tl.program_id(1)
    first = tl.load(base_ptr + n)
    end = tl.where(n + 1 < N, tl.load(base_ptr + n + 1, mask=n + 1 < N, other=0), NC)
    rr, kk = tl.arange(0, R), tl.arange(0, BK)
    carry = tl.zeros([BK], dtype=tl.float64)
    for b in range(0, tl.cdiv(end - first, R)):
        p = end - (b + 1) * R + rr
        ok = (p >= first)[:, None] & (kk < K)[None, :]
        offs = (p.to(tl.int64) * H + h)[:, None] * K + kk[None, :]
        x = tl.load(totals + offs, mask=ok, other=0.0).to(tl.float64)
        tl.store(later + offs, (tl.cumsum(x, 0, reverse=True) - x + carry[None, :]).to(tl.float32), mask=ok)
        carry += tl.sum(x, 0)


@triton.jit(do_not_specialize=["H", "G"])
def mamba2_deposit_kernel(
    k, v, g, buckets, totals, starts, lows, ends, seqs, chunks, chunk0,
    H, G, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BB: tl.constexpr, HAS_INIT: tl.constexpr,
    PRECISION: tl.constexpr, PLAIN: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """What the forward scan merges, in buckets [NC, H, K, V], and every chunk's gate total for the scans
    (levels.store_total). Kernel chunk p holds D_p (chunk_deposit; nothing for a sequence's last chunk, which deposits
    nothing, except PLAIN: into the final state), except in the blocks of 2^BB chunks whose merges below level BB this
    kernel does (levels.block_merged; BB = 0: none, every chunk its own deposit, as the plain scan takes them):
    there the block's first chunk walks the block with the running sum A <- exp(Gl) A + D (A = the decayed sum of the
    block's deposits so far) and chunk p of the block (u = p - its first chunk) holds

        D_p  (u even: merge target 0, the bucket itself),    A_p  (u odd: u = 1 is the bucket of level 1, u = 3 the
                                                                   block's sum, which the scan merges with levels >= 2)

    (one running sum serves blocks of up to four chunks: levels.block_merged takes BB <= 2). The forward scan merges
    the slots and overwrites them with the merged levels (PLAIN: its running state).
    k: [tokens, G, K]; v: [tokens, H, V]; g: [tokens, H] (G [tokens, H, K] fp32 with PER_CHANNEL, gates()); buckets:
    [NC, H, K, V]; totals: [NC, H] ([NC, H, K]) fp32; seqs, chunks: [NC], chunk0: [N] (the chunk table).
    Grid (NC * H, cdiv(K, BK)): program (p * H + h, b) does rows b BK .. b BK + BK - 1 of the states (heads_fastest;
    the programs of a merged block's other chunks return at once)."""
    ci, h = heads_fastest(H)
    kb = tl.program_id(1)
    end = tl.load(ends + ci).to(tl.int64)
    _, chunk, c0 = chunk_position(ci, seqs, chunks, chunk0)
    merged = block_merged(chunk, c0, chunk + tl.cdiv(end - tl.load(starts + ci), C) - 1, BB, HAS_INIT)
    walk = tl.where(merged, tl.where((chunk & ((1 << BB) - 1)) == 0, 1 << BB, 0), 1)
    kk, vv = kb * BK + tl.arange(0, BK), tl.arange(0, BV)
    offs, mask = kk[:, None] * V + vv[None, :], (kk[:, None] < K) & (vv[None, :] < V)
    running = tl.zeros([BK, BV], dtype=tl.float32)
    for u in range(walk):
        t0, r, t, valid = chunk_rows(ci + u, starts, lows, ends, C)
        Gc, Gl = gates(g, t, valid, h, H, K, kk, PER_CHANNEL)
        store_total(totals, ci + u, h, H, K, kk, kb == 0, Gl, PER_CHANNEL)
        deposit = chunk_deposit(load_tile(k, t0, r, valid, h // (H // G), G, K, kk),
                                load_tile(v, t0, r, valid, h, H, V, vv), Gc, Gl, PRECISION, PER_CHANNEL)
        running = row_decay(Gl, PER_CHANNEL) * running + deposit
        if PLAIN or t0 + C < end:
            tl.store(buckets + ((ci + u) * H + h) * K * V + offs,
                     tl.where(u % 2 == 1, running, deposit).to(buckets.dtype.element_ty), mask=mask)


@triton.jit
def intra_block(qc, kc, vc, doc, acc, scores, lam, t0, r, t, valid, h, H, L, Gc, scale,
                C: tl.constexpr, LOG_C: tl.constexpr, PRECISION: tl.constexpr, PLAIN: tl.constexpr,
                PER_CHANNEL: tl.constexpr, DQ: tl.constexpr, DK: tl.constexpr):
    """The in-chunk block: the raw scores P (Q K^T * Gamma), Lambda and, with DQ or DK (the backward; doc = dO;
    dA = scale * dO V^T), dA * P (dlambda's in-chunk summand), [C, C] fp32 each; and acc [C, BK] fp32 plus the
    in-chunk dQ = (dA * Gamma * Lambda) K or dK = (dA * Gamma * Lambda)^T Q (accumulated in the product: a kernel
    summing heads holds no second [C, BK] tile). Without DQ / DK, dA * P is 0 and acc comes back as it is.
    Recomputed in each kernel instead of passed (two C x C x K/V GEMMs), so each fits 4 warps (at K = 128, V = 64 in
    bf16 with a scalar gate the dk / dv kernel spills 232 B summing 48 heads per program; shared/launch.py has the
    per-channel numbers).
    PER_CHANNEL: P is read from scores [tokens, H, C] (intra_channel.channel_scores_kernel's), dA is formed with DQ
    only (for dlambda's in-chunk columns) and acc comes back as it is (the intra_channel kernels give the in-chunk
    dQ / dK, which the caller reads)."""
    causal = r[:, None] >= r[None, :]
    weights = level_weights(lam, t, valid, h, H, L, intra_levels(r, r, LOG_C), causal, LOG_C, PLAIN)
    d_a = tl.zeros([C, C], dtype=tl.float32)
    if PER_CHANNEL:
        p = load_tile(scores, t0, r, valid, h, H, C, r).to(tl.float32)
        if DQ:
            d_a = intra_score_grads(doc, vc, causal, scale, PRECISION)
    else:
        if DQ or DK:
            d_a = intra_score_grads(doc, vc, causal, scale, PRECISION)
        p, gamma = intra_scores(qc, kc, Gc, causal, PRECISION)
        d_s = (d_a * gamma * weights).to(qc.dtype)
        if DQ:
            acc = tl.dot(d_s, kc, acc, input_precision=PRECISION)
        if DK:
            acc = tl.dot(tl.trans(d_s), qc, acc, input_precision=PRECISION)
    return p, weights, d_a * p, acc


@triton.jit(do_not_specialize=CHUNK_RUNTIME_ARGS)
def mamba2_chunk_fwd_kernel(
    q, k, v, g, lam, o, h0, h0_held, buckets, decays, scores, starts, lows, ends, seqs, chunks, chunk0, scale,
    H, G, K, V, L, J,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr,
    HAS_INIT: tl.constexpr, PRECISION: tl.constexpr, PLAIN: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """q, k: [tokens, G, K]; v, o: [tokens, H, V]; g: [tokens, H] (G [tokens, H, K] fp32 with PER_CHANNEL, gates();
    the in-chunk scores P then come in scores [tokens, H, C] (q's dtype) from intra_channel.channel_scores_kernel, else
    scores is not read); lam: [tokens, H, L] (not read when PLAIN); h0: [N, J, H, K, V] (q's dtype),
    h0_held: [N, J] int8, 0 where a level of h0 is all zeros (not read: it adds nothing); buckets: [NC, H, K, V],
    decays: [NC, H, J] ([NC, H, J, K]) fp32 (the forward scan's); starts, lows, ends, seqs, chunks: [NC] int32 (the
    chunk table), chunk0: [N].  Grid (NC * H,) (heads_fastest)."""
    ci, h = heads_fastest(H)
    t0, r, t, valid = chunk_rows(ci, starts, lows, ends, C)
    n, chunk, c0 = chunk_position(ci, seqs, chunks, chunk0)
    kk, vv, jj = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BJ)
    offs = kk[:, None] * V + vv[None, :]
    lmask = (kk[:, None] < K) & (vv[None, :] < V)
    qc, kc = load_tile(q, t0, r, valid, h // (H // G), G, K, kk), load_tile(k, t0, r, valid, h // (H // G), G, K, kk)
    vc = load_tile(v, t0, r, valid, h, H, V, vv)
    Gc, _ = gates(g, t, valid, h, H, K, kk, PER_CHANNEL)
    q_dec = Gc  # per channel: the readouts' queries Q * exp(G); a scalar gate scales the rows after the loops
    if PER_CHANNEL:
        q_dec = qc.to(tl.float32) * tl.exp(Gc)
    read = tl.zeros([C, BV], dtype=tl.float32)
    live, rank, count = read_levels(chunk, c0, n, jj, J, h0_held, HAS_INIT, PLAIN)
    for i in range(count):
        j = nth_level(live, rank, jj, i)
        state, to_now = read_level(buckets, h0, decays, ci, n, h, H, J, K, V, chunk, c0, j, kk, offs, lmask, HAS_INIT,
                                   PLAIN, PER_CHANNEL)
        read += readout(qc, q_dec, state, to_now, lam, t, valid, h, H, L, LOG_C + 1 + j, PRECISION, PLAIN,
                        PER_CHANNEL)
    if not PER_CHANNEL:
        read *= tl.exp(Gc)[:, None]
    p, _, _, _ = intra_block(qc, kc, vc, vc, read, scores, lam, t0, r, t, valid, h, H, L, Gc, scale, C, LOG_C,
                             PRECISION, PLAIN, PER_CHANNEL, False, False)
    acc = intra_output(p, vc, lam, t, valid, h, H, L, intra_levels(r, r, LOG_C), r[:, None] >= r[None, :], LOG_C,
                       PRECISION, PLAIN)
    store_tile(o, (acc + read) * scale, t0, r, valid, h, H, V, vv)


@triton.jit
def read_columns(ll, chunk, c0, n, J, held, LOG_C: tl.constexpr, HAS_INIT: tl.constexpr):
    """Which of the lambda columns ll (token levels) are chunk levels that chunk ``chunk`` (of sequence n) reads
    (levels.level_read; held: the initial levels' flags)."""
    return (ll > LOG_C) & level_read(chunk, c0, n, tl.maximum(ll - (LOG_C + 1), 0), J, held, HAS_INIT, False)


@triton.jit
def head_tiles(q, k, v, do, g, t0, r, t, valid, h, H, G, K, V, kk, vv, PER_CHANNEL: tl.constexpr):
    """What the backward chunk kernels read of value head h: q, k [C, BK] (h's group), v, dO [C, BV] and the gates
    (G, Gl: gates()). Called inside their loops over heads, the loads depend on h: no tile is held across heads."""
    grp = h // (H // G)
    qc, kc = load_tile(q, t0, r, valid, grp, G, K, kk), load_tile(k, t0, r, valid, grp, G, K, kk)
    Gc, Gl = gates(g, t, valid, h, H, K, kk, PER_CHANNEL)
    return qc, kc, load_tile(v, t0, r, valid, h, H, V, vv), load_tile(do, t0, r, valid, h, H, V, vv), Gc, Gl


@triton.jit(do_not_specialize=CHUNK_RUNTIME_ARGS)
def mamba2_chunk_bwd_dq_kernel(
    q, k, v, g, lam, do, h0, h0_held, buckets, decays, scores, dq_in, starts, lows, ends, seqs, chunks, chunk0, scale,
    dq, dlam, qdq, q_dec,
    H, G, K, V, L, J,
    HP: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BL: tl.constexpr,
    BJ: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr, PLAIN: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    """dQ (in-chunk + readout) summed over HP value heads of one q/k group, and per head dlambda (every level; not
    when PLAIN) and q.dQ, complete:

        dQ_h = dS K + diag(scale * exp(G)) sum_j lambda_j exp(decay_j) dO B_j^T
        q.dQ_h = rowsum(dA * P * Lambda) + sum_j lambda_j dlambda_j      (dlambda_j: the chunk level's column)

    (the second line is q.dQ_h term by term, so the heads' dQ are summed as they are formed and no head's dQ is
    held; per channel: exp(G) and exp(decay_j) scale dO B_j^T's columns, exp(G) once for the sum over levels, the
    in-chunk dQ comes from dq_in, the gate term is q * dQ_h and HP must be 1). Inputs as the forward, do:
    [tokens, H, V]. Out: dq: [tokens, H / HP, K], program u's sum over the heads u HP .. u HP + HP - 1 (fp32, or
    q's dtype when it is one head or the whole group); dlam: [tokens, H, L] (lam's dtype), qdq: [tokens, H]
    ([tokens, H, K] with PER_CHANNEL) fp32, the gate gradient's q term (for the dk / dv kernel); with PER_CHANNEL
    q_dec = Q * exp(G) [tokens, H, K] (q's dtype, per value head), the level gradient's queries (not written for a
    scalar gate). Grid (NC * H / HP,) (heads_fastest over H / HP)."""
    ci, u = heads_fastest(H // HP)
    t0, r, t, valid = chunk_rows(ci, starts, lows, ends, C)
    n, chunk, c0 = chunk_position(ci, seqs, chunks, chunk0)
    kk, vv, ll, jj = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BL), tl.arange(0, BJ)
    live, rank, count = read_levels(chunk, c0, n, jj, J, h0_held, HAS_INIT, PLAIN)
    d_q = tl.zeros([C, BK], dtype=tl.float32)
    for e in tl.range(HP, disable_licm=True):  # no tile of the loop body lives across heads
        h = u * HP + e
        qc, kc, vc, doc, Gc, _ = head_tiles(q, k, v, do, g, t0, r, t, valid, h, H, G, K, V, kk, vv, PER_CHANNEL)
        p, weights, d_ap, d_q = intra_block(qc, kc, vc, doc, d_q, scores, lam, t0, r, t, valid, h, H, L, Gc, scale,
                                            C, LOG_C, PRECISION, PLAIN, PER_CHANNEL, True, False)
        q_dq = tl.sum(d_ap * weights, 1)  # a scalar gate's in-chunk q . dQ
        if not PLAIN:  # in-chunk columns and zeros; the columns of the live chunk levels are the loop's (one writer)
            skip = read_columns(ll, chunk, c0, n, J, h0_held, LOG_C, HAS_INIT)
            store_level_sums(dlam, d_ap, t, valid, h, H, L, LOG_C)
            zeros = tl.zeros([C, BL], dtype=tl.float32)
            store_tile(dlam, zeros, t0, r, valid, h, H, L, tl.where(skip | (ll <= LOG_C), L, ll))
        row_scale = scale * tl.exp(Gc)
        offs = kk[:, None] * V + vv[None, :]
        lmask = (kk[:, None] < K) & (vv[None, :] < V)
        q_read = qc
        if PER_CHANNEL:  # the sum over levels gets its factor scale * exp(G) after the loops
            q_read = qc.to(tl.float32) * tl.exp(Gc)
            store_tile(q_dec, q_read, t0, r, valid, h, H, K, kk)
            q_read = (q_read * scale).to(qc.dtype)
        for i in range(count):
            j = nth_level(live, rank, jj, i)
            state, to_now = read_level(buckets, h0, decays, ci, n, h, H, J, K, V, chunk, c0, j, kk, offs, lmask,
                                       HAS_INIT, PLAIN, PER_CHANNEL)
            share, term = readout_grad(doc, q_read, state, to_now, row_scale, lam, dlam, t, valid, h, H, L,
                                       LOG_C + 1 + j, PRECISION, PLAIN, PER_CHANNEL)
            d_q += share
            q_dq += term
        if PER_CHANNEL:  # HP = 1: d_q is this head's; the levels' factor, then the in-chunk dQ (both read again
            # rather than held through the loops)
            d_q = d_q * scale * tl.exp(gates(g, t, valid, h, H, K, kk, PER_CHANNEL)[0])
            d_q += load_tile(dq_in, t0, r, valid, h, H, K, kk)
            qc = load_tile(q, t0, r, valid, h // (H // G), G, K, kk)
            store_tile(qdq, gate_term(d_q, qc, PER_CHANNEL), t0, r, valid, h, H, K, kk)
        else:
            tl.store(qdq + t * H + h, q_dq, mask=valid)
    store_tile(dq, d_q, t0, r, valid, u, H // HP, K, kk)


@triton.jit(do_not_specialize=CHUNK_RUNTIME_ARGS)
def mamba2_chunk_bwd_dkv_kernel(
    q, k, v, g, lam, do, d_deposits, scores, dk_in, starts, lows, ends, seqs, eos_ptr, final_terms, scale,
    dk, dv, d_gate, totals,
    H, G, K, V, L,
    HP: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr, PLAIN: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """dK summed over HP value heads of one q/k group, and per head dV, complete:

        dK_h = dS^T Q + diag(exp(Gl - G)) V dD^T,   dV = scale * A^T dO + diag(exp(Gl - G)) K dD

    (per channel: exp(Gl - G) [C, K] scales V dD^T and K elementwise; HP must be 1), dD = d_deposits [NC, H, K, V]
    (q's dtype; the backward scan's; not read for a sequence's last chunk, which deposits nothing), and the gate
    gradient's chunk part (chunk_gate_grads: d_gate in/out, totals out; seqs: [NC] the chunk table's, eos: [N] the
    sequences' ends, final_terms: [N, H(, K)] fp32) from k.dK_h formed term by term, so that no head's dK is held:

        k.dK_h = colsum(dA * P * Lambda) + rowsum(V * diag(exp(Gl - G)) K dD)

    (the in-chunk sum is the dq kernel's q.dQ terms by column, so the two cancel in the gate's sums as the exact
    ones do; the deposit's is its v.dV; per channel k * dK_h). Out: dk: [tokens, H / HP, K] as the dq
    kernel's dq, dv: [tokens, H, V] (v's dtype). Grid (NC * H / HP,) (heads_fastest over H / HP)."""
    ci, u = heads_fastest(H // HP)
    t0, r, t, valid = chunk_rows(ci, starts, lows, ends, C)
    kk, vv = tl.arange(0, BK), tl.arange(0, BV)
    deposits = PLAIN or t0 + C < tl.load(ends + ci)
    n = tl.load(seqs + ci)
    last = tl.load(eos_ptr + n).to(tl.int64) - 1
    d_k = tl.zeros([C, BK], dtype=tl.float32)
    for e in tl.range(HP, disable_licm=True):  # no tile of the loop body lives across heads
        h = u * HP + e
        qc, kc, vc, doc, Gc, Gl = head_tiles(q, k, v, do, g, t0, r, t, valid, h, H, G, K, V, kk, vv, PER_CHANNEL)
        p, weights, d_ap, d_k = intra_block(qc, kc, vc, doc, d_k, scores, lam, t0, r, t, valid, h, H, L, Gc, scale,
                                            C, LOG_C, PRECISION, PLAIN, PER_CHANNEL, False, True)
        k_dk = tl.sum(d_ap * weights, 0)  # a scalar gate's in-chunk k . dK: the dq kernel's q . dQ terms by column
        d_v = tl.dot(tl.trans((p * weights).to(doc.dtype)), doc, input_precision=PRECISION) * scale
        if deposits:
            offs = kk[:, None] * V + vv[None, :]
            d_d = tl.load(d_deposits + (ci * H + h) * K * V + offs,
                          mask=(kk[:, None] < K) & (vv[None, :] < V), other=0.0).to(vc.dtype)
            if PER_CHANNEL:
                to_end = tl.exp(Gl[None, :] - Gc)
                d_v += tl.dot((kc.to(tl.float32) * to_end).to(kc.dtype), d_d, input_precision=PRECISION)
            else:
                to_end = tl.exp(Gl - Gc)[:, None]
                d_v_end = to_end * tl.dot(kc, d_d, input_precision=PRECISION)
                k_dk += gate_term(d_v_end, vc, PER_CHANNEL)  # the deposit's k . dK = v . dV
                d_v += d_v_end
            d_k += to_end * tl.dot(vc, tl.trans(d_d), input_precision=PRECISION)
        store_tile(dv, d_v, t0, r, valid, h, H, V, vv)
        if PER_CHANNEL:  # HP = 1: d_k is this head's
            d_k += load_tile(dk_in, t0, r, valid, h, H, K, kk)
            k_dk = gate_term(d_k, kc, PER_CHANNEL)
        chunk_gate_grads(d_gate, totals, final_terms, k_dk, t0, r, t, valid, last, ci, n, h, H, K, kk, PER_CHANNEL)
    store_tile(dk, d_k, t0, r, valid, u, H // HP, K, kk)


@triton.jit
def reader_grads(q, g, lam, do, decays, row0, first, low, lo, hi, end, h, H, G, K, V, L, J, j, scale, r, kk, vv,
                 C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 PRECISION: tl.constexpr, PLAIN: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """The gradient of one stored level j from its readers d = lo .. hi - 1, the chunks at kernel rows row0 + d
    (tokens first + d C, clipped to [low, end): the sequence's first token and its end):
    sum_d exp(decay_{row0+d, j}) Q_d^T (scale * lambda_d[c+1+j] * exp(G_d) * dO_d), pipelined over d. PER_CHANNEL:
    q = Q * exp(G) [tokens, H, K] per value head (the dq kernel's q_dec; g is not read) and
    sum_d diag(exp(decay_{row0+d, j})) q_d^T (scale * lambda * dO_d), the decay [BK] scaling the product's rows.
    -> [BK, BV] fp32."""
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    for d in range(lo, hi):
        t0 = first + d * C
        valid = rows_within(r, t0, low, end)
        doc = load_tile(do, t0, r, valid, h, H, V, vv)
        to_now = level_decay(decays, (row0 + d).to(tl.int64), h, H, J, K, j, kk, PLAIN, PER_CHANNEL)
        w = level_column(lam, t0 + r, valid, h, H, L, LOG_C + 1 + j, PLAIN) * scale
        if PER_CHANNEL:
            q_read = load_tile(q, t0, r, valid, h, H, K, kk)
        else:
            q_read = load_tile(q, t0, r, valid, h // (H // G), G, K, kk)
            w *= tl.exp(gates(g, t0 + r, valid, h, H, K, kk, PER_CHANNEL)[0]) * to_now
        prod = tl.dot(tl.trans(q_read), (doc.to(tl.float32) * w[:, None]).to(doc.dtype), input_precision=PRECISION)
        if PER_CHANNEL:
            prod *= to_now[:, None]
        acc += prod
    return acc


@triton.jit(do_not_specialize=CHUNK_RUNTIME_ARGS)
def mamba2_level_grad_kernel(
    q, g, lam, do, decays, starts, lows, ends, chunks, order, d_buckets, scale,
    H, G, K, V, L, J,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr,
    PRECISION: tl.constexpr, PLAIN: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """d_buckets: [NC, H, K, V] out (q's dtype, summed in fp32), dB of the level merged after each kernel chunk
    (0 when nothing reads it); order: [NC] int32, the kernel chunks in launch order (backend.ChunkTable's
    grad_order: the longest reader loops first, then position order); other arguments as
    mamba2_chunk_bwd_dq_kernel, but with PER_CHANNEL q = its q_dec [tokens, H, K] (reader_grads).
    Grid (NC * H,): program i * H + h does head h of chunk order[i] (heads vary fastest)."""
    h, p = tl.program_id(0) % H, tl.load(order + tl.program_id(0) // H)
    r, kk, vv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    first = tl.load(starts + p).to(tl.int64)
    end = tl.load(ends + p).to(tl.int64)
    m = merge_target(tl.load(chunks + p).to(tl.int64), tl.arange(0, BJ), BJ, PLAIN)
    readers = tl.minimum(1 << m, tl.cdiv(end - first, C) - 1)
    acc = reader_grads(q, g, lam, do, decays, p, first, tl.load(lows + p), 1, readers + 1, end, h, H, G, K, V, L, J, m,
                       scale, r, kk, vv, C, LOG_C, BK, BV, PRECISION, PLAIN, PER_CHANNEL)
    offs = kk[:, None] * V + vv[None, :]
    tl.store(d_buckets + (p.to(tl.int64) * H + h) * K * V + offs, acc.to(d_buckets.dtype.element_ty),
             mask=(kk[:, None] < K) & (vv[None, :] < V))


@triton.jit(do_not_specialize=CHUNK_RUNTIME_ARGS + ["N", "S", "J0"])
def mamba2_initial_grad_kernel(
    q, g, lam, do, decays, bos_ptr, eos_ptr, chunk0_ptr, base_ptr, lows, d_init, scale,
    N, S, J0, H, G, K, V, L, J,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr, PLAIN: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """The gradients of the initial levels J0 .. J-1 from their readers, in S segments: d_init [S, N, J - J0, H, K, V]
    fp32 out, segment s of the readers of level j of sequence n (the chunks c0 .. ((c0 >> j) + 1) 2^j - 1 of the
    sequence, cut into S equal runs; 0 where a run is empty; a level that the carry past an aligned start cleared
    gets its readers' terms too, which the caller drops). PLAIN: one level, read by the sequence's first chunk.
    Other arguments as the scans (bos, eos, chunk0, base [N]) and mamba2_level_grad_kernel (lows: the chunk
    table's, which gives the sequence's first token at its first chunk, base). Grid
    (S * N * (J - J0) * H,): program i * H + h (heads_fastest)."""
    pid, h = heads_fastest(H)
    JR = J - J0
    s, n, j = pid // (N * JR), (pid // JR) % N, J0 + pid % JR
    bos, eos, c0, base = sequence_range(n, bos_ptr, eos_ptr, chunk0_ptr, base_ptr)
    readers = tl.minimum((((c0 >> j) + 1) << j) - c0, tl.cdiv(eos - bos, C))
    run = tl.cdiv(readers, S)
    lo = tl.minimum(s * run, readers)
    r, kk, vv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    acc = reader_grads(q, g, lam, do, decays, base, bos, tl.load(lows + base), lo, tl.minimum(lo + run, readers), eos,
                       h, H, G, K, V, L, J, j, scale, r, kk, vv, C, LOG_C, BK, BV, PRECISION, PLAIN, PER_CHANNEL)
    offs = kk[:, None] * V + vv[None, :]
    tl.store(d_init + ((pid.to(tl.int64) * H + h) * K * V) + offs, acc, mask=(kk[:, None] < K) & (vv[None, :] < V))


@triton.jit(do_not_specialize=["J0", "J", "H"])
def mamba2_initial_reads_kernel(levels, h0, h0_held, J0, J, H, K, V, CONVERT: tl.constexpr, BLOCK: tl.constexpr):
    """What the chunk kernels read of the initial levels, in one pass over them: levels [N, J, H, K, V] fp32 ->
    h0 (CONVERT: the levels J0 .. J-1 in h0's dtype, the operands'; below J0 not written, never read) and h0_held
    [N, J] int8 (zeroed by the caller), set to 1 for each level J0 .. J-1 that has an element x != 0 (NaN
    included), the chunk kernels' flag to read it:

        h0_held[n, j] = any_e (levels[n, j, e] != 0)

    Grid (N * (J - J0), cdiv(H K V, BLOCK)): program (i, b) takes elements b BLOCK .. of level J0 + i % (J - J0) of
    sequence i // (J - J0); the programs of a level that find a nonzero element all store the same 1."""
    i, b = tl.program_id(0), tl.program_id(1)
    level = (i // (J - J0)) * J + J0 + i % (J - J0)
    E = H * K * V
    offs = b * BLOCK + tl.arange(0, BLOCK)
    inside = offs < E
    x = tl.load(levels + level.to(tl.int64) * E + offs, mask=inside, other=0.0)
    if CONVERT:
        tl.store(h0 + level.to(tl.int64) * E + offs, x.to(h0.dtype.element_ty), mask=inside)
    if tl.max((x != 0).to(tl.int32), axis=0) > 0:
        tl.store(h0_held + level, 1)
