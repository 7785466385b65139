"""The Fenwick delta-rule scan: all chunk-level states of log-linear Gated DeltaNet in one pass.

Per head, chunks i = 0..N-1 of C tokens, J chunk-level states h_j (each [K, V], fp32). Chunk i brings
    qt_i, wt_i, kt_i: [C, K]   readout queries, W~ and K~ of the chunk (spec section 5)
    u_i: [C, V]                pseudo-values;  d_i = exp(G_last) its total decay
    lam_i: [C, J]              lambda of token level c+1+j (0 where a query has no such level)
    m_i                        cascade target ctz(chunk+1) (-1 for the last chunk: no cascade)
and the scan does, for every level j at once (one kernel, one pass over the chunk inputs):

    o_i   = sum_j lam_i[:, j] * (qt_i h_j)                              readout, depth J*K
    g_j   = d_i h_j - kt_i^T (wt_i h_j) = d_i h_j - Wm_i h_j            delta-rule transition, Wm_i = kt_i^T wt_i
    h_j   = 0 (j < m),  g_m + sum_{j<m} g_j + kt_i^T u_i (j = m),  g_j (j > m)     the binary-counter carry
            (the carry as one transition of the summed states: d S - Wm_i S + kt_i^T u_i, S = sum_{j<=m} h_j)

Backward (reverse over chunks, dh_j carried the same way):
    cascade:     dg_j = dh_m (j <= m), dh_j (j > m);   dD = dh_m;  du_i = kt_i dD;  dkt_i += u_i dD^T
    transition:  dh_j = d_i dg_j - Wm_i^T dg_j;  dd_i = sum_j <dg_j, h_j>
                 dkt_i -= sum_j (wt_i h_j) dg_j^T;      dwt_i -= sum_j (kt_i dg_j) h_j^T
    readout:     Y_j = lam_i[:, j] * do_i;  dqt_i += sum_j Y_j h_j^T;  dh_j += qt_i^T Y_j
                 dlam_i[:, j] = rowsum(do_i * (qt_i h_j))

Only live levels are touched: entering chunk i a level holds a (possibly) nonzero state iff a cascade put
keys into it and none has cleared it since (bit j of the chunk index from position 0), or the initial
states seeded it and no cascade has reached it yet (schedule); the others are 0, so half of the level
steps vanish. The kernels:

  _scan_fwd_kernel      sequential over chunks (programs: V blocks x heads): per chunk form Wm_i ([K, K],
                        operand dtype; K <= 128 at 16 bits, 64 at fp32) from the chunk's inputs, then per live
                        level load the state (the next level's one level ahead), transition it (1 GEMM with
                        Wm_i; 2, kt^T (wt h), for wider keys) or add it to the carry's sum (levels <= m: one
                        transition for all of them); the states are updated in place in one fp32 buffer
                        (L2-resident: the snapshots stream past it).
                        With gradients it stores every live incoming state (operand dtype) and leaves the
                        readouts to _scan_readout_kernel (chunk-parallel, reads the snapshots); without,
                        it reads out in the chain, but for fp32 operands and 16-bit keys wider than 128
                        (reads_apart: their snapshots then live in a ring of two segments' buffers).
  _scan_dh_kernel       the backward's sequential chain, reverse: dh_j = d dg_j - Wm^T dg_j + qt^T Y_j
                        (Wm^T = wt^T kt once per chunk, then 2 GEMMs per live level, 1 of them on the chain;
                        wider keys: 3, wt^T (kt dg_j)), stores every live dh (operand dtype).
  _scan_grads_kernel    chunk-parallel: dwt, dkt, du, dd of a chunk from its incoming states and the dh leaving
                        it, through Z = sum_j h_j dg_j^T ([K, K] fp32, K <= 128 at 16 bits, 64 at fp32): 1 GEMM
                        per live level, then dkt = u dD^T - wt Z, dwt = -kt Z^T, dd = trace(Z), du = kt dD
                        (4 per chunk); wider keys: 4 GEMMs per live level.
  _scan_readout_bwd_kernel  chunk-parallel: dqt, dlam of a chunk from its incoming states and do (2 GEMMs per
                        live level; needs no dh, only the scaled do that the dh chain writes as it passes).
On the plain schedule (Schedule.one: one level, every chunk's cascade target) both chains keep that level's
state or gradient in registers across their segment (ONE) instead of storing and reloading it every chunk, and
transition it with two products in the value-correction order (h <- d h + kt^T (u - wt h)), not through Wm: with
one level there is nothing to share Wm's formation with (launch.py: this build's warps and what it measured).
The chunk-parallel kernels walk the chunk's live levels from the live-level list with the next level's
tiles loaded a step ahead; all V in one program: no partial sums, deterministic, no atomics.

Both chains run in segments of SEGMENT chunks (PLAIN_SEGMENT: the plain schedule with snapshots) on a side stream
(shared/streams.py): while a chain walks segment s, the chunk-parallel kernels of segment s - 1 (forward: the
readouts; backward: the grads and readout backward) run on the SMs that the chain's one program per head leaves
idle, and in the forward the producers of the chain's inputs for segment s + 1 too (``produce``: the chunk-local
stage, local.chunk_local_segments; with or without gradients: without, the chain reads out itself and only the
producers run beside it, but for fp32 operands and wide keys on the log-linear schedule, reads_apart). The
backward's dh snapshots exist for two segments at a time (the one the chain writes, the one the grads kernel reads),
and so do a forward's without gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loglinear.ops.triton.gated_deltanet.chunking import FP32_DOT, Chunking, FillChunks, chunk_tokens
from loglinear.ops.triton.shared.common import alloc, next_pow2
from loglinear.ops.triton.shared.launch import launch, launch_options
from loglinear.ops.triton.shared.rules import dot_precision
from loglinear.ops.triton.shared.streams import ChainStreams
from loglinear.ops.triton.shared.tiles import load_tile, store_tile
from loglinear.tables import device_table, table_cache


@triton.jit
def _state_block(C: tl.constexpr, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """A sequential program's value block iv (axis 0) and head row bh (axis 1), the chunk rows rc [C], and
    its tile of a [K, V] state: rk [BK], rv [BV], their masks, offsets hoff and mask hmask [BK, BV]."""
    iv = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    return iv, bh, tl.arange(0, C), rk, rv, mk, mv, rk[:, None] * V + rv[None, :], mk[:, None] & mv[None, :]


@triton.jit
def _chunk_rows(i, Tp, C: tl.constexpr, K, BK: tl.constexpr):
    """A chunk-parallel program's head row bh (axis 1), its key columns rk [BK] and mask, chunk i's first row
    of the [BH, Tp, *] stage tensors and its rows rc = arange(C) from there."""
    bh = tl.program_id(1).to(tl.int64)
    rk = tl.arange(0, BK)
    return bh, rk, rk < K, bh * Tp + i * C, tl.arange(0, C)


@triton.jit
def _ahead(src, j, KV, hoff, hmask, rk, s, count):
    """Level j's [K, BV] fp32 tile of the running states when s < count (the s-th live level), else 0."""
    ahead = (rk * 0 + s) < count
    return tl.load(src + j * KV + hoff, mask=hmask & ahead[:, None], other=0.0, eviction_policy="evict_last")


@triton.jit
def _gram(a, b, PREC: tl.constexpr):
    """a^T b: [C, BK] x [C, BK] -> [BK, BK] in the operand dtype (a chunk's transition matrix, kt^T wt or its
    transpose wt^T kt)."""
    return tl.dot(tl.trans(a), b, input_precision=PREC).to(a.dtype)


@triton.jit
def _transition(h, w, k, u, d, PREC: tl.constexpr):
    """The chunk's delta-rule transition of h [BK, BV] fp32 through two products, d h + k^T (u - w h); w, k:
    [C, BK], u: [C, BV] in the operand dtype; u - w h is rounded to it."""
    x = (u - tl.dot(w, h.to(w.dtype), input_precision=PREC)).to(w.dtype)
    return d * h + tl.dot(tl.trans(k), x, input_precision=PREC)


@triton.jit
def _scan_fwd_kernel(
    qt, wt, kt, u, decay, lam, merge, lev, snap_at, states, snap, o_intra, o,
    N, J, Tp, S, first, T, front, H, scale, i0, i1,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, SNAP: tl.constexpr, TM: tl.constexpr, ONE: tl.constexpr,
):
    """Chunks i0 .. i1-1 of the forward chain.
    qt, wt, kt: [BH, Tp, K]; u: [BH, Tp, V]; decay: [BH, N]; lam: [BH, Tp, J]; merge: [N], snap_at: [N + 1]
    int32 (cascade target, first snapshot slot); lev: the live levels of chunk i at lev[snap_at[i] : snap_at[i + 1]]
    (ascending; one entry past the end); states: [BH, J, K, V] fp32, updated in place (the states entering chunk
    i0; at the end the ones leaving chunk i1 - 1: after the last segment the final states of the live levels);
    snap: [BH, S, K, V] (SNAP: the live states entering each chunk, in level order, chunk i's from slot
    snap_at[i] - first); o_intra: [BH, Tp, V] fp32, the chunk-local outputs; o: [b, T, H, V] (Chunking's tokens)
    = scale (o_intra + the readouts), written here without SNAP; with SNAP the readouts leave the sequential chain
    (_scan_readout_kernel reads the snapshots).

    TM (square_fits: Wm_i fits 32 KB of registers: BK <= 128 for bf16/fp16 operands, <= 64 for fp32): the chunk's
    transition through one matrix, formed (with ku_i) from the chunk's inputs only, off the states' chain,

        Wm_i = kt_i^T wt_i: [BK, BK] (operand dtype);   ku_i = kt_i^T u_i: [BK, BV] fp32
        g_j = d_i h_j - Wm_i h_j  (j > m);              h_m = d_i L - Wm_i L + ku_i,  L = sum_{j <= m} h_j

    (one product per transition on the chain).  Otherwise two: g_j = d_i h_j - kt_i^T (wt_i h_j),
    h_m = d_i L + kt_i^T (u_i - wt_i L).

    ONE (Schedule.one: the plain schedule, one level that every chunk transitions and cascades into): the
    state stays in registers from chunk i0 to i1 - 1 (read before, written after the segment),
    h <- d_i h + kt_i^T (u_i - wt_i h) on every chunk (two products; no Wm); a chunk that enters with the level
    empty (chunk 0 without initial states) transitions zeros and stores no snapshot."""
    iv, bh, rc, rk, rv, mk, mv, hoff, hmask = _state_block(C, K, V, BK, BV)
    KV = K * V
    # in place: level j is read, then written (j > m); the cascade target m is written after every read
    src = states + bh * J * KV
    if ONE:
        h_one = _ahead(src, 0, KV, hoff, hmask, rk, 0, tl.load(snap_at + i0 + 1) - tl.load(snap_at + i0))
    for i in range(i0, i1):
        row0 = bh * Tp + i * C
        rows = row0 + rc
        if not SNAP:
            q_i = load_tile(qt, row0, rc, rc < C, 0, 1, K, rk)
        w_i = load_tile(wt, row0, rc, rc < C, 0, 1, K, rk)
        k_i = load_tile(kt, row0, rc, rc < C, 0, 1, K, rk)
        u_i = load_tile(u, row0, rc, rc < C, 0, 1, V, rv)
        d = tl.load(decay + bh * N + i)
        m = tl.load(merge + i)
        start = tl.load(snap_at + i)
        count = tl.load(snap_at + i + 1) - start
        keep = snap + (bh * S + start - first) * KV
        if not SNAP:
            acc = load_tile(o_intra, row0, rc, rc < C, 0, 1, V, rv)
        if TM and not ONE:  # from the chunk's inputs only: w_i, k_i, u_i are dead after these two
            wm = _gram(k_i, w_i, PREC)
            ku = tl.dot(tl.trans(k_i), u_i, input_precision=PREC)
        if ONE:
            hd = h_one.to(w_i.dtype)
            if SNAP:
                tl.store(keep + hoff, hd.to(snap.dtype.element_ty), mask=hmask & ((rk * 0 + count) > 0)[:, None],
                         eviction_policy="evict_first")
            else:
                acc += tl.load(lam + rows * J)[:, None] * tl.dot(q_i, hd, input_precision=PREC)
            h_one = _transition(h_one, w_i, k_i, u_i, d, PREC)
        else:
            low = tl.zeros([BK, BV], dtype=tl.float32)  # sum of the live states j <= m (they merge into m)
            j = tl.load(lev + start)
            h = _ahead(src, j, KV, hoff, hmask, rk, 0, count)
            for s in range(count):  # the live levels; the next one's state is loaded a level ahead
                j_next = tl.load(lev + start + s + 1)
                h_next = _ahead(src, j_next, KV, hoff, hmask, rk, s + 1, count)
                hd = h.to(w_i.dtype)
                if SNAP:
                    tl.store(keep + s * KV + hoff, hd.to(snap.dtype.element_ty), mask=hmask,
                             eviction_policy="evict_first")
                else:
                    acc += tl.load(lam + rows * J + j)[:, None] * tl.dot(q_i, hd, input_precision=PREC)
                if j <= m:
                    low += h
                else:
                    if TM:
                        g = d * h - tl.dot(wm, hd, input_precision=PREC)
                    else:
                        wh = tl.dot(w_i, hd, input_precision=PREC)
                        g = d * h - tl.dot(tl.trans(k_i), wh.to(w_i.dtype), input_precision=PREC)
                    tl.store(src + j * KV + hoff, g, mask=hmask)
                j = j_next
                h = h_next
            if m >= 0:  # h_m = sum_{j <= m} g_j + kt^T u: one transition for them all
                if TM:
                    tl.store(src + m * KV + hoff, d * low - tl.dot(wm, low.to(w_i.dtype), input_precision=PREC) + ku,
                             mask=hmask)
                else:
                    tl.store(src + m * KV + hoff, _transition(low, w_i, k_i, u_i, d, PREC), mask=hmask)
        if not SNAP:
            tok0, _, valid, head = chunk_tokens(i, bh, T, front, H, C)
            store_tile(o, scale * acc, tok0, rc, valid, head, H, V, rv)
        if not ONE:
            tl.debug_barrier()
    if ONE:
        tl.store(src + hoff, h_one, mask=hmask)


@triton.jit
def _scan_readout_kernel(
    qt, lam, live, snap_at, snap, o_intra, o,
    J, Tp, S, first, T, front, H, scale, i0,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    PREC: tl.constexpr,
):
    """The readouts of chunk i = i0 + program_id(0) of head bh (all in parallel) from the forward's snapshots
    (snap: [BH, S, K, V] from slot ``first``, as _scan_fwd_kernel writes them):
    o = scale (o_intra + sum_j lam[:, j] (qt_i h_j)) over the live levels, written for the real tokens of
    o: [b, T, H, V].  Shapes as _scan_fwd_kernel; V in NV blocks of BV."""
    i = tl.program_id(0) + i0
    bh, rk, mk, row0, rc = _chunk_rows(i, Tp, C, K, BK)
    rows = row0 + rc
    KV = K * V
    q_i = load_tile(qt, row0, rc, rc < C, 0, 1, K, rk)
    alive = tl.load(live + i)
    hsrc = snap + (bh * S + tl.load(snap_at + i) - first) * KV
    tok0, _, valid, head = chunk_tokens(i, bh, T, front, H, C)
    for iv in range(NV):
        rv = iv * BV + tl.arange(0, BV)
        acc = load_tile(o_intra, row0, rc, rc < C, 0, 1, V, rv)
        slot = 0
        for j in range(J):
            if (alive >> j) & 1:
                hd = tl.load(hsrc + slot * KV + rk[:, None] * V + rv[None, :], mask=mk[:, None] & (rv < V)[None, :],
                             other=0.0)
                acc += tl.load(lam + rows * J + j)[:, None] * tl.dot(q_i, hd, input_precision=PREC)
                slot += 1
        store_tile(o, scale * acc, tok0, rc, valid, head, H, V, rv)


@triton.jit
def _scan_dh_kernel(
    qt, wt, kt, decay, lam, merge, lev, snap_at, do, dstates, dsnap, do_intra,
    N, J, Tp, S, T, front, H, scale, i0, i1,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, TM: tl.constexpr, ONE: tl.constexpr,
):
    """Backward, pass 1 (sequential, chunks i1-1 down to i0): the chain dh_j = d_i dg_j - Wm_i^T dg_j + qt_i^T Y_j
    for the live levels only, Wm_i^T = wt_i^T kt_i: [BK, BK] (operand dtype) formed once per chunk (TM, as in
    _scan_fwd_kernel: 2 products per live level, one of them, qt_i^T Y_j, off the chain); otherwise
    d_i dg_j - wt_i^T (kt_i dg_j) + qt_i^T Y_j (3 products; as one product over 2C, [-wt_i^T | qt_i^T]
    [kt_i dg_j; Y_j], it spilled more and ran slower on sm_90).  do: [b, T, H, V] (any float
    dtype); dstates: [BH, J, K, V] fp32, updated in place (dh entering chunk i1, at the end entering chunk i0:
    after the last segment, dh of the initial states of the levels live at chunk 0); dsnap: [BH, S, K, V]
    (operand dtype): dh entering each chunk of the segment at slot snap_at[i] - snap_at[i0] (the host has filled
    chunk i1's); do_intra: [BH, Tp, V] fp32 (scale do, 0 on padding); merge, lev, snap_at as in _scan_fwd_kernel.
    ONE (the plain schedule, as in _scan_fwd_kernel): dh stays in registers over the segment,
    dh <- d_i dh - wt_i^T (kt_i dh) + qt_i^T Y (no Wm^T); a chunk entered with the level empty stores no snapshot
    (its dh, written at the end of the last segment, is the caller's to mask)."""
    iv, bh, rc, rk, rv, mk, mv, hoff, hmask = _state_block(C, K, V, BK, BV)
    KV = K * V
    # in place: dh_m is read first; a live j > m is read, then written; the levels below m were cleared
    # by the cascade (their dh after the chunk is never read)
    src = dstates + bh * J * KV
    base = tl.load(snap_at + i0)
    if ONE:
        dh_one = tl.load(src + hoff, mask=hmask, other=0.0)
    for r in range(i1 - i0):
        i = i1 - 1 - r
        row0 = bh * Tp + i * C
        rows = row0 + rc
        q_i = load_tile(qt, row0, rc, rc < C, 0, 1, K, rk)
        w_i = load_tile(wt, row0, rc, rc < C, 0, 1, K, rk)
        k_i = load_tile(kt, row0, rc, rc < C, 0, 1, K, rk)
        tok0, _, valid, head = chunk_tokens(i, bh, T, front, H, C)
        do_i = scale * load_tile(do, tok0, rc, valid, head, H, V, rv).to(tl.float32)
        store_tile(do_intra, do_i, row0, rc, rc < C, 0, 1, V, rv)
        d = tl.load(decay + bh * N + i)
        m = tl.load(merge + i)
        start = tl.load(snap_at + i)
        count = tl.load(snap_at + i + 1) - start
        keep = dsnap + (bh * S + start - base) * KV
        if TM and not ONE:
            wmt = _gram(w_i, k_i, PREC)
        if ONE:
            dgd = dh_one.to(q_i.dtype)
            y = (tl.load(lam + rows * J)[:, None] * do_i).to(q_i.dtype)
            kdg = tl.dot(k_i, dgd, input_precision=PREC).to(q_i.dtype)
            dh_one = d * dh_one - tl.dot(tl.trans(w_i), kdg, input_precision=PREC)
            dh_one += tl.dot(tl.trans(q_i), y, input_precision=PREC)
            tl.store(keep + hoff, dh_one.to(dsnap.dtype.element_ty), mask=hmask & ((rk * 0 + count) > 0)[:, None],
                     eviction_policy="evict_first")
        else:
            dh_m = tl.load(src + tl.maximum(m, 0) * KV + hoff, mask=hmask, other=0.0)
            dh_m = tl.where(m >= 0, dh_m, 0.0)
            j = tl.load(lev + start)
            dh_j = _ahead(src, j, KV, hoff, hmask, rk, 0, count)
            for s in range(count):  # the live levels; the next one's dh is loaded a level ahead
                j_next = tl.load(lev + start + s + 1)
                dh_next = _ahead(src, j_next, KV, hoff, hmask, rk, s + 1, count)
                dg = tl.where(j <= m, dh_m, dh_j)
                dgd = dg.to(q_i.dtype)
                y = (tl.load(lam + rows * J + j)[:, None] * do_i).to(q_i.dtype)
                if TM:
                    dh = d * dg - tl.dot(wmt, dgd, input_precision=PREC)
                else:
                    kdg = tl.dot(k_i, dgd, input_precision=PREC).to(q_i.dtype)
                    dh = d * dg - tl.dot(tl.trans(w_i), kdg, input_precision=PREC)
                dh += tl.dot(tl.trans(q_i), y, input_precision=PREC)
                tl.store(src + j * KV + hoff, dh, mask=hmask)
                tl.store(keep + s * KV + hoff, dh.to(dsnap.dtype.element_ty), mask=hmask,
                         eviction_policy="evict_first")
                j = j_next
                dh_j = dh_next
            tl.debug_barrier()
    if ONE:
        tl.store(src + hoff, dh_one, mask=hmask)


@triton.jit
def _popcount(x):
    """Set bits of a non-negative int32 (SWAR byte sums)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)


@triton.jit
def _level_step(lev, start, t, steps, rk, mk, V, BV: tl.constexpr, NV: tl.constexpr):
    """Step t of a chunk's walk over its live levels x NV value blocks (level-major; the chunk's live levels
    at lev[start:], steps = their count x NV): live slot s, level j, value block iv, and the offsets hoff and
    mask hmask of a [BK, BV] state tile (nothing past the last step: the walk loads one step ahead)."""
    s = t // NV
    iv = t % NV
    j = tl.load(lev + start + s)  # t = steps reads one entry past the chunk's (lev has a padding entry)
    rv = iv * BV + tl.arange(0, BV)
    hmask = mk[:, None] & (rv < V)[None, :] & ((rk * 0 + t) < steps)[:, None]
    return s, j, iv, rk[:, None] * V + rv[None, :], hmask


@triton.jit
def _grad_tiles(hsrc, gsrc, lev, start, m, after, t, steps, KV, rk, mk, V, BV: tl.constexpr, NV: tl.constexpr):
    """_level_step's tiles for the grads kernel: the state entering the chunk hd and the gradient leaving it dg
    ([BK, BV]; dg of a level j <= m is dh_m, slot 0 after the cascade, of j > m its slot among the next
    chunk's live levels, after: their bitmask), with the level j and value block iv."""
    s, j, iv, hoff, hmask = _level_step(lev, start, t, steps, rk, mk, V, BV, NV)
    gslot = tl.where(j <= m, 0, _popcount(after & ((1 << j) - 1)))
    return j, iv, tl.load(hsrc + s * KV + hoff, mask=hmask, other=0.0), tl.load(gsrc + gslot * KV + hoff, mask=hmask,
                                                                               other=0.0)


@triton.jit
def _scan_readout_bwd_kernel(
    qt, lam, snap_at, lev, snap, do_intra, dqt, dlam,
    J, Tp, S, i0,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    PREC: tl.constexpr,
):
    """Backward of the readouts (chunk i = i0 + program_id(0) of head bh, all in parallel; they do not need dh),
    from the forward's states entering the chunk (snap: [BH, S, K, V]) and do_intra = scale do ([BH, Tp, V] fp32,
    _scan_dh_kernel, which writes a chunk's rows when it passes the chunk):

        Y_j = lam_i[:, j] * do_i;   dqt_i = sum_j Y_j h_j^T;   dlam_i[:, j] = rowsum(do_i * (qt_i h_j))

    over the live levels (walked from lev, the next state tile loaded a step ahead).  Outputs dqt: [BH, Tp, K]
    (operand dtype), dlam: [BH, Tp, J] fp32 (the live levels' columns; the caller zeroes the others)."""
    i = tl.program_id(0) + i0
    bh, rk, mk, row0, rc = _chunk_rows(i, Tp, C, K, BK)
    rows = row0 + rc
    KV = K * V
    q_i = load_tile(qt, row0, rc, rc < C, 0, 1, K, rk)
    start = tl.load(snap_at + i)
    steps = (tl.load(snap_at + i + 1) - start) * NV
    hsrc = snap + (bh * S + start) * KV
    dq_acc = tl.zeros([C, BK], dtype=tl.float32)
    dl = tl.zeros([C], dtype=tl.float32)
    s, j, iv, hoff, hmask = _level_step(lev, start, 0, steps, rk, mk, V, BV, NV)
    hd = tl.load(hsrc + s * KV + hoff, mask=hmask, other=0.0)
    for t in range(steps):
        s_n, j_n, iv_n, hoff, hmask = _level_step(lev, start, t + 1, steps, rk, mk, V, BV, NV)
        hd_n = tl.load(hsrc + s_n * KV + hoff, mask=hmask, other=0.0)
        rv = iv * BV + tl.arange(0, BV)
        do_b = load_tile(do_intra, row0, rc, rc < C, 0, 1, V, rv)
        y = tl.load(lam + rows * J + j)[:, None] * do_b
        dq_acc += tl.dot(y.to(q_i.dtype), tl.trans(hd), input_precision=PREC)
        dl += tl.sum(do_b * tl.dot(q_i, hd, input_precision=PREC), axis=1)
        last = (rows * 0 + iv) == NV - 1  # the level's last value block: its dlam column is complete
        tl.store(dlam + rows * J + j, dl, mask=last)
        dl = tl.where(last, 0.0, dl)
        j, iv, hd = j_n, iv_n, hd_n
    store_tile(dqt, dq_acc, row0, rc, rc < C, 0, 1, K, rk)


@triton.jit
def _value_tile(rk, mk, iv, V, BV: tl.constexpr):
    """Value block iv: its columns rv [BV], and the offsets hoff and mask hmask of a [BK, BV] state tile."""
    rv = iv * BV + tl.arange(0, BV)
    return rv, rk[:, None] * V + rv[None, :], mk[:, None] & (rv < V)[None, :]


@triton.jit
def _cascade_tile(gsrc, m, rk, hoff, hmask):
    """A value block's tile of dh_m, the cascade target's gradient (slot 0; 0 without a cascade: no slot to read
    after the last chunk)."""
    return tl.load(gsrc + hoff, mask=hmask & ((rk * 0 + m) >= 0)[:, None], other=0.0)


@triton.jit
def _low_sum(hsrc, low_count, KV, hoff, hmask, BK: tl.constexpr, BV: tl.constexpr):
    """A value block's tile of L = sum_{j <= m} h_j, the low_count live levels leading the chunk's list (fp32)."""
    low = tl.zeros([BK, BV], dtype=tl.float32)
    for s in range(low_count):
        low += tl.load(hsrc + s * KV + hoff, mask=hmask, other=0.0).to(tl.float32)
    return low


@triton.jit
def _scan_grads_kernel(
    wt, kt, u, merge, live, snap_at, lev, snap, dsnap,
    dwt, dkt, du, dd,
    N, Tp, S, SD, i0,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    PREC: tl.constexpr, TZ: tl.constexpr,
):
    """Backward, pass 2 (chunk i of head bh, all in parallel): the gradients of the chunk's transition inputs
    from the forward's states entering it (snap: [BH, S, K, V]) and the gradients dg_j leaving it (dh entering
    chunk i + 1, dsnap: [BH, SD, K, V] of the segment from chunk i0 (_scan_dh_kernel); level m is its slot 0,
    a live j > m its slot among chunk i + 1's live levels):

        cascade:     dD = dh_m;  du_i = kt_i dD;  dkt_i += u_i dD^T
        transition:  dd_i = sum_j <dg_j, h_j>;  dkt_i -= sum_j (wt_i h_j) dg_j^T;  dwt_i -= sum_j (kt_i dg_j) h_j^T

    where the levels j <= m (dg_j = dh_m) enter through their sum L = sum_{j <= m} h_j.

    TZ (square_fits: Z fits 64 KB of fp32 registers where Wm_i of the chains fits 32 KB: BK <= 128 for bf16/fp16
    operands, <= 64 for fp32): the transition's sums through one [BK, BK] fp32 matrix,

        Z = L dh_m^T + sum_{j > m} h_j dg_j^T;   dkt_i = u_i dh_m^T - wt_i Z;   dwt_i = -kt_i Z^T;   dd_i = trace(Z)

    (per value block one product per live level j > m and one for L, then wt_i Z, kt_i Z^T and the cascade's
    two per value block; no [C, *] intermediates per level, and wt_i, kt_i are loaded after the walk: at bf16
    K = 128 the kernel no longer spills).  Otherwise per level: dd_i = <dh_m, L> + sum_{j > m} <dg_j, h_j>,
    dkt_i = (u_i - wt_i L) dh_m^T - sum_{j > m} (wt_i h_j) dg_j^T, dwt_i = -(kt_i dh_m) L^T - sum_{j > m}
    (kt_i dg_j) h_j^T (4 products per live level j > m, 4 for L and the cascade).

    Outputs: dwt, dkt: [BH, Tp, K], du: [BH, Tp, V] (operand dtype); dd: [BH, N] fp32.  The live levels are
    walked from lev (V in NV blocks of BV per level), the next step's two tiles loaded a step ahead."""
    i = tl.program_id(0) + i0
    bh, rk, mk, row0, rc = _chunk_rows(i, Tp, C, K, BK)
    KV = K * V
    m = tl.load(merge + i)
    after = tl.load(live + i + 1)
    start = tl.load(snap_at + i)
    steps = (tl.load(snap_at + i + 1) - start) * NV
    # the live levels j <= m lead the chunk's list; their dg is dh_m
    low_count = tl.where(m >= 0, _popcount(tl.load(live + i) & ((2 << tl.maximum(m, 0)) - 1)), 0)
    hsrc = snap + (bh * S + start) * KV
    gsrc = dsnap + (bh * SD + tl.load(snap_at + i + 1) - tl.load(snap_at + i0)) * KV
    t0 = low_count * NV
    if TZ:
        dt = wt.dtype.element_ty
        z = tl.zeros([BK, BK], dtype=tl.float32)
        if low_count > 0:
            for iv in range(NV):  # L dh_m^T
                rv, hoff, hmask = _value_tile(rk, mk, iv, V, BV)
                low = _low_sum(hsrc, low_count, KV, hoff, hmask, BK, BV)
                z += tl.dot(low.to(dt), tl.trans(_cascade_tile(gsrc, m, rk, hoff, hmask)), input_precision=PREC)
        _, _, hd, dgd = _grad_tiles(hsrc, gsrc, lev, start, m, after, t0, steps, KV, rk, mk, V, BV, NV)
        for t in range(t0, steps):  # the live levels j > m
            _, _, hd_n, dgd_n = _grad_tiles(hsrc, gsrc, lev, start, m, after, t + 1, steps, KV, rk, mk, V, BV, NV)
            z += tl.dot(hd, tl.trans(dgd), input_precision=PREC)
            hd, dgd = hd_n, dgd_n
        dd_acc = tl.sum(tl.sum(tl.where(rk[:, None] == rk[None, :], z, 0.0), axis=1), axis=0)
        zd = z.to(dt)
        w_i = load_tile(wt, row0, rc, rc < C, 0, 1, K, rk)
        dk_acc = -tl.dot(w_i, zd, input_precision=PREC)
        k_i = load_tile(kt, row0, rc, rc < C, 0, 1, K, rk)
        dw_acc = -tl.dot(k_i, tl.trans(zd), input_precision=PREC)
        for iv in range(NV):  # the cascade: du = kt dh_m;  dkt += u dh_m^T
            rv, hoff, hmask = _value_tile(rk, mk, iv, V, BV)
            dh_m = _cascade_tile(gsrc, m, rk, hoff, hmask)
            store_tile(du, tl.dot(k_i, dh_m, input_precision=PREC), row0, rc, rc < C, 0, 1, V, rv)
            x = load_tile(u, row0, rc, rc < C, 0, 1, V, rv)
            dk_acc += tl.dot(x, tl.trans(dh_m), input_precision=PREC)
    else:
        w_i = load_tile(wt, row0, rc, rc < C, 0, 1, K, rk)
        k_i = load_tile(kt, row0, rc, rc < C, 0, 1, K, rk)
        dw_acc = tl.zeros([C, BK], dtype=tl.float32)
        dk_acc = tl.zeros([C, BK], dtype=tl.float32)
        dd_acc = 0.0
        for iv in range(NV):  # the cascade, with the levels j <= m summed
            rv, hoff, hmask = _value_tile(rk, mk, iv, V, BV)
            dh_m = _cascade_tile(gsrc, m, rk, hoff, hmask)
            kd = tl.dot(k_i, dh_m, input_precision=PREC)
            store_tile(du, kd, row0, rc, rc < C, 0, 1, V, rv)
            x = load_tile(u, row0, rc, rc < C, 0, 1, V, rv).to(tl.float32)
            if low_count > 0:  # dd += <dh_m, L>;  dwt -= (kt dh_m) L^T;  dkt += (u - wt L) dh_m^T
                low = _low_sum(hsrc, low_count, KV, hoff, hmask, BK, BV)
                dd_acc += tl.sum(tl.sum(dh_m.to(tl.float32) * low, axis=1), axis=0)
                dw_acc -= tl.dot(kd.to(w_i.dtype), tl.trans(low.to(w_i.dtype)), input_precision=PREC)
                x -= tl.dot(w_i, low.to(w_i.dtype), input_precision=PREC)
            dk_acc += tl.dot(x.to(w_i.dtype), tl.trans(dh_m), input_precision=PREC)
        _, _, hd, dgd = _grad_tiles(hsrc, gsrc, lev, start, m, after, t0, steps, KV, rk, mk, V, BV, NV)
        for t in range(t0, steps):  # the live levels j > m
            _, _, hd_n, dgd_n = _grad_tiles(hsrc, gsrc, lev, start, m, after, t + 1, steps, KV, rk, mk, V, BV, NV)
            dd_acc += tl.sum(tl.sum(dgd.to(tl.float32) * hd.to(tl.float32), axis=1), axis=0)
            wh = tl.dot(w_i, hd, input_precision=PREC).to(w_i.dtype)
            dk_acc -= tl.dot(wh, tl.trans(dgd), input_precision=PREC)
            kdg = tl.dot(k_i, dgd, input_precision=PREC).to(w_i.dtype)
            dw_acc -= tl.dot(kdg, tl.trans(hd), input_precision=PREC)
            hd, dgd = hd_n, dgd_n
    store_tile(dwt, dw_acc, row0, rc, rc < C, 0, 1, K, rk)
    store_tile(dkt, dk_acc, row0, rc, rc < C, 0, 1, K, rk)
    tl.store(dd + bh * N + i, dd_acc)


# chunks per chain segment (a shorter last segment: less of the readers runs alone after the chain); the plain
# schedule's chains take a fraction of a log-linear chain's time per chunk, and with gradients its calls run
# faster in longer segments (fewer launches and hand-overs); without, the forward keeps SEGMENT, whose second
# segment lets the producers run beside the chain from 8K (docs/kernels.md, "plain Gated DeltaNet")
SEGMENT = 64
PLAIN_SEGMENT = 128


def _segments(N: int, sched: Schedule, snapshots: bool) -> list[tuple[int, int]]:
    """The chains' segments (i0, i1) of N chunks, in order: PLAIN_SEGMENT chunks on the plain schedule with
    snapshots (its dh chain's, or a forward's that reads out apart), else SEGMENT."""
    n = PLAIN_SEGMENT if sched.one and snapshots else SEGMENT
    return [(i0, min(i0 + n, N)) for i0 in range(0, N, n)]


def _blocks(K: int, V: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BK, BV, number of V blocks): K whole (the transition contracts over it); V in blocks of 64 for
    bf16/fp16 operands with K <= 128 (the whole-tile shape that the Mamba-2 kernels found correct on
    triton 3.6; split bf16 [128, 32] tiles miscomputed there), 32 for fp32 (shared memory), 16 for K > 128."""
    BK = next_pow2(K)
    BV = 16 if BK > 128 else (32 if dtype == torch.float32 else 64)
    BV = min(BV, next_pow2(V))
    return BK, BV, triton.cdiv(V, BV)


def square_fits(BK: int, dtype: torch.dtype) -> bool:
    """TM / TZ of the chain and grads kernels: a [BK, BK] matrix of the operand dtype fits 32 KB of registers
    (Wm of the chains; Z, fp32, twice that): BK <= 128 for bf16/fp16 operands, <= 64 for fp32."""
    return BK * BK * dtype.itemsize <= 128 * 128 * 2


@dataclass(frozen=True, eq=False)
class Schedule:
    """What the scan needs to know about its chunks (the same for every head).  merge: [N], live, snap_at:
    [N + 1] int32 on the device (cascade target, live-level bitmask, first snapshot slot; entry N: the final
    states); lev: the live levels, chunk after chunk (chunk i's from snap_at[i]; one padding entry);
    mask: [N + 1, J] bool on the device, the live levels entering each chunk; bits, at: live and snap_at on
    the host; slots: snapshot slots of chunks 0..N-1 per head; one: the plain schedule (one level, every chunk's
    cascade target: the chains' ONE build).  Shared by the calls with the same schedule (see schedule): read only."""

    merge: torch.Tensor
    live: torch.Tensor
    snap_at: torch.Tensor
    lev: torch.Tensor
    mask: torch.Tensor
    bits: tuple[int, ...]
    at: tuple[int, ...]
    slots: int
    one: bool

    def count(self, i: int) -> int:
        """The number of levels live entering chunk i (i = N: the final states)."""
        return self.bits[i].bit_count()

    def level_index(self, i: int) -> torch.Tensor:
        """[count(i)] int32 on the device: the levels live entering chunk i, ascending (their snapshot order)."""
        return self.lev[self.at[i] : self.at[i] + self.count(i)]


@table_cache()
def schedule(merge: tuple[int, ...], J: int, seeds: int, device: torch.device) -> Schedule:
    """Live levels per chunk: a level holds a (possibly) nonzero state entering chunk i iff it is seeded by
    the initial states and no cascade has reached it yet, or a cascade moved keys into it and none has
    cleared it since (for a sequence from position 0: bit j of the chunk index). merge: [N] cascade targets
    (-1 for the last chunk); seeds: bitmask of the levels whose initial states may be nonzero (live at chunk 0;
    0 without initial states). Cached per argument tuple: repeated calls get the same Schedule (no
    host-to-device copy)."""
    live, snap_at, alive, slots = [], [], seeds, 0
    for m in (*merge, -1):
        live.append(alive)
        snap_at.append(slots)
        slots += bin(alive).count("1")
        if m >= 0:  # levels 0..m merge into m
            alive = (alive & ~((2 << m) - 1)) | (1 << m)
    lev = [j for bits in live for j in range(J) if (bits >> j) & 1] + [0]
    mask = [[(bits >> j) & 1 == 1 for j in range(J)] for bits in live]
    as_int = lambda x: device_table(x, torch.int32, device)  # noqa: E731
    return Schedule(as_int(merge), as_int(live), as_int(snap_at), as_int(lev), device_table(mask, torch.bool, device),
                    tuple(live), tuple(snap_at), snap_at[-1], J == 1 and all(m == 0 for m in merge))


def _first_readout(w0: torch.Tensor, qt: torch.Tensor, p0: torch.Tensor, C: int) -> torch.Tensor:
    """The first chunk's readout of incoming in-chunk buckets: sum_m w0[:, t, m] (qt_t p0_m).  w0: [BH, C, M],
    qt: [BH, Tp, K], p0: [BH, M, K, V] fp32 -> [BH, C, V] fp32."""
    return torch.einsum("ntm,ntk,nmkv->ntv", w0, qt[:, :C].float(), p0)


def _add_first_chunk(o: torch.Tensor, x: torch.Tensor, ch: Chunking) -> None:
    """o[:, t] += x at chunk 0's row front + t, for the first chunk's real tokens, in fp32 then o's dtype.
    o: [b, T, H, V]; x: [b H, C, V] fp32."""
    first = min(ch.T, ch.C - ch.front)
    rows = x.view(ch.b, ch.H, ch.C, -1)[:, :, ch.front : ch.front + first].transpose(1, 2)  # [b, first, H, V]
    o[:, :first] = (o[:, :first].float() + rows).to(o.dtype)


def reads_apart(operand: torch.dtype, sched: Schedule, BK: int) -> bool:
    """Does a forward without gradients read out apart from its chain (snapshots and _scan_readout_kernel, as with
    gradients) instead of in it? On the log-linear schedule, for fp32 operands and for key blocks BK whose Wm does
    not fit registers (square_fits: 16-bit keys wider than 128). fp32: their chain that reads out itself spills 1.7
    KB per thread (sm_90, triton 3.6; 0.6 KB when it snapshots), and took 145.9 ms at 32K against 93.8 for the
    training forward (an H100, the paper setting). BK = 256: the chain that reads out itself and transitions with
    two products made illegal memory accesses on an H100 (triton 3.6; K = 192 and 256 at any V, from the second
    chunk on; it passes the interpreter's tests), the one that snapshots runs right. 16-bit ones up to K = 128 read
    out in the chain (10.7 against 11.8 ms), and so does the plain schedule's chain (its state in registers, one
    readout product per chunk)."""
    return not sched.one and (operand == torch.float32 or not square_fits(BK, operand))


def _snapshots(segments: list[tuple[int, int]], sched: Schedule, keep: bool, apart: bool, shape: tuple[int, int, int],
               dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor | None, Callable[[int], tuple[torch.Tensor, int]]]:
    """The forward's snapshot buffers: (what it saves for the backward or None, snapshots(n) -> (segment n's buffer
    [BH, S, K, V], the slot ``first`` that its slot 0 holds: chunk i's snapshots from slot snap_at[i] - first)).
    keep (gradients): one [BH, slots, K, V] buffer for every segment (first = 0); apart without gradients: a ring
    of two buffers of the longest segment's slots, segment n's in buffer n % 2 from its first slot; else one
    unused element. shape: (BH, K, V)."""
    BH, K, V = shape
    if keep:
        whole = alloc((BH, sched.slots, K, V), dtype, device)
        return whole, lambda n: (whole, 0)
    if apart:
        S = max(sched.at[i1] - sched.at[i0] for i0, i1 in segments)
        ring = [alloc((BH, max(S, 1), K, V), dtype, device) for _ in range(2)]
        return None, lambda n: (ring[n % 2], sched.at[segments[n][0]])
    unused = alloc((1, 1, 1, 1), dtype, device)
    return None, lambda n: (unused, 0)


class FenwickDeltaScan(torch.autograd.Function):
    """(o, final states) = scan(qt, wt, kt, u, decay, lam, h0, o_intra, w0, p0, sched, ch, scale, dtype, final,
    produce); see the module docstring.

    qt, wt, kt: [BH, Tp, K] (the dot dtype); u: [BH, Tp, V] (dot dtype); decay: [BH, N] fp32;
    lam: [BH, Tp, J] fp32; h0: [BH, J, K, V] fp32 or None (zeros); o_intra: [BH, Tp, V] fp32;
    w0: [BH, C, M], p0: [BH, M, K, V] fp32 or None: M incoming in-chunk buckets that chunk 0 reads with weights w0
    (o gains scale _first_readout; its gradients stay [BH, C, *]: no full-size copy of o_intra's or qt's);
    sched: schedule(merge, J, seeds), seeds covering every level h0 may hold; ch: the chunking of the op's tokens.
    Returns o: [b, T, H, V] in dtype (scale (o_intra + readouts) of the real tokens) and hN: [BH, J, K, V] fp32
    (None unless final).  Only the live levels of each chunk are touched.  produce(i0, i1), when given, fills qt,
    wt, kt, u, decay and o_intra for the chunks i0 .. i1 - 1 on the current stream: called for each chain segment
    before it (the producers of segment s + 1 then run beside the chain's segment s), with or without gradients.
    """

    @staticmethod
    def forward(ctx, qt, wt, kt, u, decay, lam, h0, o_intra, w0, p0, sched: Schedule, ch: Chunking, scale: float,
                dtype: torch.dtype, final: bool, produce: FillChunks | None):
        BH, Tp, K = qt.shape
        V, N, J = u.shape[-1], decay.shape[1], lam.shape[-1]
        BK, BV, NV = _blocks(K, V, qt.dtype)
        keep = ctx.needs_input_grad[:8] != (False,) * 8
        apart = keep or reads_apart(qt.dtype, sched, BK)
        states = h0.clone() if h0 is not None else alloc((BH, J, K, V), torch.float32, qt.device)
        o = alloc((ch.b, ch.T, ch.H, V), dtype, qt.device)
        prec, fp32 = dot_precision(qt.dtype, FP32_DOT), qt.dtype == torch.float32
        segments = _segments(N, sched, apart)
        snap, snapshots = _snapshots(segments, sched, keep, apart, (BH, K, V), qt.dtype, qt.device)

        def chain(n: int) -> None:
            buf, first = snapshots(n)
            launch(_scan_fwd_kernel, (NV, BH),
                qt, wt, kt, u, decay, lam, sched.merge, sched.lev, sched.snap_at, states, buf, o_intra, o,
                N, J, Tp, buf.shape[1], first, ch.T, ch.front, ch.H, scale, *segments[n],
                K=K, V=V, C=ch.C, BK=BK, BV=BV, PREC=prec, SNAP=apart, TM=square_fits(BK, qt.dtype),
                ONE=sched.one, **launch_options(_scan_fwd_kernel, plain=sched.one, fp32=fp32, block=BK),
            )

        produce = produce or (lambda i0, i1: None)
        # the producers of segment s + 1 and the readouts of segment s - 1 (apart) beside the chain's segment s;
        # otherwise the chain reads out itself. A segment's producers wait for the readouts launched before them,
        # and its chain for its producers: a chain never overwrites a ring snapshot buffer that is still being read.
        streams = ChainStreams(qt.device)

        def start(n: int) -> None:
            produce(*segments[n])
            streams.feed()
            with streams.chain():
                chain(n)

        start(0)
        for n, (i0, i1) in enumerate(segments):
            if n + 1 < len(segments):
                start(n + 1)
            if apart:
                streams.hand_over(upto=n)
                buf, first = snapshots(n)
                launch(_scan_readout_kernel, (i1 - i0, BH),
                    qt, lam, sched.live, sched.snap_at, buf, o_intra, o, J, Tp, buf.shape[1], first, ch.T, ch.front,
                    ch.H, scale, i0, K=K, V=V, C=ch.C, BK=BK, BV=BV, NV=NV, PREC=prec,
                    **launch_options(_scan_readout_kernel, fp32=fp32, block=BK),
                )
        streams.hand_over()
        if w0 is not None:
            _add_first_chunk(o, scale * _first_readout(w0, qt, p0, ch.C), ch)
        ctx.save_for_backward(qt, wt, kt, u, decay, lam, snap, w0, p0)
        ctx.sched, ctx.ch, ctx.scale = sched, ch, scale
        return o, torch.where(sched.mask[N, :, None, None], states, 0.0) if final else None

    @staticmethod
    def backward(ctx, do, dhN):
        qt, wt, kt, u, decay, lam, snap, w0, p0 = ctx.saved_tensors
        sched, ch = ctx.sched, ctx.ch
        BH, Tp, K = qt.shape
        V, N, J = u.shape[-1], decay.shape[1], lam.shape[-1]
        BK, BV, NV = _blocks(K, V, qt.dtype)
        dev, dt, prec = qt.device, qt.dtype, dot_precision(qt.dtype, FP32_DOT)
        fp32 = dt == torch.float32
        nan = lambda *shape, dtype=torch.float32: alloc(shape, dtype, dev)  # noqa: E731
        dstates = torch.zeros(BH, J, K, V, dtype=torch.float32, device=dev) if dhN is None else dhN.clone()
        do_intra = nan(BH, Tp, V)
        do = torch.zeros(ch.b, ch.T, ch.H, V, device=dev) if do is None else do.contiguous()
        dqt, dwt, dkt = [nan(BH, Tp, K, dtype=dt) for _ in range(3)]
        du, dd = nan(BH, Tp, V, dtype=u.dtype), nan(BH, N)
        dlam = torch.zeros(BH, Tp, J, device=dev)  # the readout backward writes the live levels' columns

        def dh_snapshots(i0: int, i1: int) -> torch.Tensor:
            """[BH, slots, K, V]: room for the dh entering chunks i0 .. i1 - 1, then (filled) the dh entering i1."""
            base, tail = sched.at[i0], sched.at[i1]
            dsnap = nan(BH, tail - base + sched.count(i1), K, V, dtype=dt)
            dsnap[:, tail - base :] = dstates.index_select(1, sched.level_index(i1))
            return dsnap

        streams = ChainStreams(dev)
        segments = _segments(N, sched, True)[::-1]  # last first
        with streams.chain():
            dsnap = dh_snapshots(*segments[0])
        for n, (i0, i1) in enumerate(segments):
            with streams.chain():
                launch(_scan_dh_kernel, (NV, BH),
                    qt, wt, kt, decay, lam, sched.merge, sched.lev, sched.snap_at, do, dstates, dsnap, do_intra,
                    N, J, Tp, dsnap.shape[1], ch.T, ch.front, ch.H, ctx.scale, i0, i1,
                    K=K, V=V, C=ch.C, BK=BK, BV=BV, PREC=prec, TM=square_fits(BK, dt),
                    ONE=sched.one, **launch_options(_scan_dh_kernel, plain=sched.one, fp32=fp32, block=BK),
                )
                # the next segment's buffer before the hand-over: the chain's next launch is then ready as
                # soon as the segment's readers below are
                after = dh_snapshots(*segments[n + 1]) if n + 1 < len(segments) else None
            streams.hand_over(dsnap)
            launch(_scan_grads_kernel, (i1 - i0, BH),
                wt, kt, u, sched.merge, sched.live, sched.snap_at, sched.lev, snap, dsnap, dwt, dkt, du, dd,
                N, Tp, sched.slots, dsnap.shape[1], i0, K=K, V=V, C=ch.C, BK=BK, BV=BV, NV=NV, PREC=prec,
                TZ=square_fits(BK, dt), **launch_options(_scan_grads_kernel, fp32=fp32, block=BK),
            )
            launch(_scan_readout_bwd_kernel, (i1 - i0, BH),
                qt, lam, sched.snap_at, sched.lev, snap, do_intra, dqt, dlam, J, Tp, sched.slots, i0,
                K=K, V=V, C=ch.C, BK=BK, BV=BV, NV=NV, PREC=prec,
                **launch_options(_scan_readout_bwd_kernel, fp32=fp32, block=BK),
            )
            dsnap = after
        streams.hand_over()  # dstates: the dh of the initial states
        dh0 = torch.where(sched.mask[0, :, None, None], dstates, 0.0) if ctx.needs_input_grad[6] else None
        dw0 = dp0 = None
        if w0 is not None:  # the first chunk's readout of the incoming buckets: do_intra = scale do
            dx, qt0 = do_intra[:, : ch.C], qt[:, : ch.C].float()
            dqt[:, : ch.C] += torch.einsum("ntm,ntv,nmkv->ntk", w0, dx, p0).to(dqt.dtype)
            dw0 = torch.einsum("ntv,ntk,nmkv->ntm", dx, qt0, p0) if ctx.needs_input_grad[8] else None
            dp0 = torch.einsum("ntm,ntk,ntv->nmkv", w0, qt0, dx) if ctx.needs_input_grad[9] else None
        return dqt, dwt, dkt, du, dd, dlam, dh0, do_intra, dw0, dp0, None, None, None, None, None, None


def fenwick_delta_scan(
    qt, wt, kt, u, decay, lam, h0, o_intra, merge: Sequence[int], ch: Chunking, scale: float, dtype: torch.dtype,
    final: bool = True, seeds: int | None = None, first: tuple[torch.Tensor, torch.Tensor] | None = None,
    produce: FillChunks | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Functional form of FenwickDeltaScan (shapes there; merge: the N cascade targets, -1 last; final: return
    the final states, else None; seeds: bitmask of the levels of h0 that may be nonzero, None: all of them; the
    others must be zeros that nothing differentiates, they are never read and get no gradient; first: (w0, p0),
    incoming in-chunk buckets that chunk 0 reads, or None; produce: produce(i0, i1) fills qt, wt, kt, u, decay and
    o_intra for the chunks i0 .. i1 - 1 (local.chunk_local_segments' launch), called once per chain segment before
    it, or None: they are filled; with produce they must come in the kernels' dtypes and contiguous, as the
    conversions here would copy them unfilled); qt/wt/kt/u keep their (operand) dtype."""
    J = lam.shape[-1]
    if h0 is None:
        seeds = 0
    elif seeds is None:
        seeds = (1 << J) - 1
    elif not 0 <= seeds < 1 << J:
        raise ValueError(f"seeds must be a bitmask of the J = {J} levels, got {seeds}")
    sched = schedule(tuple(merge), J, seeds, qt.device)
    w0, p0 = (None, None) if first is None else (first[0].float().contiguous(), first[1].float().contiguous())
    return FenwickDeltaScan.apply(
        qt.contiguous(), wt.contiguous(), kt.contiguous(), u.contiguous(), decay.float().contiguous(),
        lam.float().contiguous(), None if h0 is None else h0.float().contiguous(), o_intra.contiguous(), w0, p0,
        sched, ch, scale, dtype, final, produce,
    )
