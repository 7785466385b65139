"""States inside a chunk on the Mamba-2 / GLA kernels: what a seeded sequence's first kernel chunk reads of its
state's in-chunk buckets, put right by two small kernels, and where those buckets go in a final state.

A sequence whose state is at a position p inside a chunk (or at 0) runs its kernel chunks from the start of p's
chunk c0, the rows before p masked (backend.py). Its state's in-chunk levels 0..c are summed into chunk level
m0 = ctz(c0 + 1) of h0 (torch_chunk.chunk_levels_from), the level chunk c0's cascade merges them into, so the
kernels carry them on exactly; in chunk c0 itself they read that sum at level c + 1 + m0, where the row t of the
chunk (token c0 C + t) should read level m of the state at

    read(t, m) = max(m, ctz(p) + 1, bit_length(t XOR (p mod C)))       (ctz(p) + 1: 0 for p = 0)

(bit_length((c0 C + t) XOR p): the chunk's bits cancel; the carry past p, adding the levels below ctz(p) + 1 into
that level, is never formed: level m lands in bucket max(m, ctz(p) + 1), read at fenwick.incoming_levels of it).
SeedReads adds the difference to o, one program per (seeded sequence, value head), for the rows t of its first
chunk that are tokens of the call (p mod C <= t < its end):

    w_t,m = lam_t[read(t, m)] - lam_t[c + 1 + m0]        (a lam level at or past the call's L reads 0, as in the
                                                           kernels)
    o_t += scale sum_m w_t,m (exp(G_t) q_t)^T S_m        (S_m the state's level m, G_t the cumsum of the floored
                                                           gate from the chunk's start: per key with GLA's gate)

and its backward, with dT = scale dO and U_m = w_m dT:

    dw_m = rowsum(dT * (qt S_m)),  dS_m = qt^T U_m,  dqt = sum_m U_m S_m^T,  dlam_t[l] = sum_m dw_t,m ([l = read(t, m)]
    - [l = c + 1 + m0]),  dq = exp(G) dqt,  dg_s = sum_{t >= s} exp(G_t) (dqt_t . q_t) (per key: elementwise),

dg 0 where g <= FLOOR (the floor's gradient). A sequence that ends in chunk c0 still holds the buckets as chunk level
m0, decayed to its last token e: first_levels moves them to the in-chunk levels e reads them at, read(e, m).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loglinear.fenwick import bucket_floor, carry_level, chunk_bits, chunk_level_to_token_level, ctz
from loglinear.ops.finite import LOG_DECAY_FLOOR, floor_log_decay
from loglinear.ops.torch_chunk import route_buckets
from loglinear.ops.triton.mamba2.chunk import FP32_DOT
from loglinear.ops.triton.shared.common import alloc, group_sum, heads_fastest, next_pow2
from loglinear.ops.triton.shared.intra import FLOOR as GATE_FLOOR, bit_levels
from loglinear.ops.triton.shared.launch import launch_options
from loglinear.ops.triton.shared.rules import dot_precision
from loglinear.tables import cached_table, device_table, table_cache

__all__ = ["Seeds", "FirstChunks", "first_chunks", "SeedReads", "first_levels"]

FLOOR = LOG_DECAY_FLOOR[torch.float32]
ROW_FIELDS = tl.constexpr(5)  # FirstChunks.layout's columns


@dataclass
class Seeds:
    """The seeded sequences of a call: their indices among the call's sequences, positions and ends (absolute), and
    levels [R, c+1, H, K, V] fp32, each one's in-chunk levels of the state (as the state holds them, zero-padded)."""

    rows: list[int]
    positions: list[int]
    ends: list[int]
    levels: torch.Tensor


@dataclass(frozen=True)
class FirstChunks:
    """The first kernel chunks of the seeded sequences: tokens [R][C] of the call (host; clamped to the sequence),
    held [R, C] bool (the sequence's tokens: front <= t < stop) and layout [R, ROW_FIELDS] int64, per chunk the
    call's token at its first row (negative before the call's first token), front = p mod C, stop, the level
    ctz(p) + 1 (0 for p = 0) below which no bucket is read, and the kernels' level c + 1 + m0."""

    tokens: tuple[tuple[int, ...], ...]
    held: torch.Tensor
    layout: torch.Tensor


@table_cache()
def first_chunks(starts: tuple[int, ...], ends: tuple[int, ...], positions: tuple[int, ...], C: int,
                 device: torch.device) -> FirstChunks:
    """FirstChunks of the sequences [starts[i] + positions[i] mod C, ends[i]) of the call's tokens (starts[i]: the
    chunk start before the sequence's first token) continuing states at ``positions``. Cached per layout
    (read-only; normal tensors)."""
    fronts = [p % C for p in positions]
    tokens = tuple(tuple(max(min(a + s, b - 1), a + r) for s in range(C)) for a, b, r in zip(starts, ends, fronts))
    held = [[r <= s < b - a for s in range(C)] for a, b, r in zip(starts, ends, fronts)]
    layout = [(a, r, b - a, carry_level(p), chunk_level_to_token_level(ctz(p // C + 1), C))
              for a, b, r, p in zip(starts, ends, fronts, positions)]
    with torch.inference_mode(False):
        return FirstChunks(tokens, device_table(held, torch.bool, device), device_table(layout, torch.int64, device))


@triton.jit
def seed_rows(layout, at, r, C: tl.constexpr, LOG_C: tl.constexpr):
    """Seeded chunk r (FirstChunks.layout, at: [R, C] int64 its rows' indices into the gathered rows): (its first
    row's token (int64), the held rows [C], their indices into the gathered rows [C] int64, bit_length(t XOR front)
    [C], the floor ctz(p) + 1 of the levels read, the kernels' level c + 1 + m0)."""
    t = tl.arange(0, C)
    row = layout + r * ROW_FIELDS
    front, stop = tl.load(row + 1).to(tl.int32), tl.load(row + 2).to(tl.int32)
    held = (t >= front) & (t < stop)
    return (tl.load(row), held, tl.load(at + r * C + t, mask=held, other=0), bit_levels(t ^ front, LOG_C),
            tl.load(row + 3).to(tl.int32), tl.load(row + 4).to(tl.int32))


@triton.jit
def seed_gates(g, idx, held, h, H, K, kk, PER_CHANNEL: tl.constexpr):
    """(exp(G) fp32 [C] or per channel [C, BK], the raw gate rows in fp32): G the cumsum of max(g, FLOOR) over the
    chunk's rows, 0 at the rows not held; g [n, H] or [n, H, K] the gathered rows (unfloored)."""
    if PER_CHANNEL:
        ok = held[:, None] & (kk[None, :] < K)
        raw = tl.load(g + (idx[:, None] * H + h) * K + kk[None, :], mask=ok, other=0.0).to(tl.float32)
        floored = tl.where(ok, tl.maximum(raw, GATE_FLOOR), 0.0)
    else:
        raw = tl.load(g + idx * H + h, mask=held, other=0.0).to(tl.float32)
        floored = tl.where(held, tl.maximum(raw, GATE_FLOOR), 0.0)
    return tl.exp(tl.cumsum(floored, 0)), raw


@triton.jit
def seed_weight(lam_rows, ll, lev, target, kernel, m):
    """(w_t,m = lam_t[read(t, m)] - lam_t[kernel] [C] fp32 from the rows' lam [C, BL] (0 at levels >= L), read(t, m)
    [C] int32)."""
    read = tl.maximum(tl.maximum(lev, target), m)
    picked = tl.sum(tl.where(ll[None, :] == read[:, None], lam_rows, 0.0), 1)
    return picked - tl.sum(tl.where(ll[None, :] == kernel, lam_rows, 0.0), 1), read


@triton.jit
def seed_inputs(q, g, lam, idx, held, h, H, G, K, L, kk, ll, PER_CHANNEL: tl.constexpr):
    """What both kernels read at the held rows: q [C, BK] (h's group), exp(G) (seed_gates), the raw gate and lam
    [C, BL], fp32; qt = exp(G) q in q's dtype (the products' operand dtype, as the chunk kernels': 16-bit operands,
    fp32 sums)."""
    grp = h // (H // G)
    qc = tl.load(q + (idx[:, None] * G + grp) * K + kk[None, :], mask=held[:, None] & (kk[None, :] < K),
                 other=0.0).to(tl.float32)
    decay, raw = seed_gates(g, idx, held, h, H, K, kk, PER_CHANNEL)
    lam_rows = tl.load(lam + (idx[:, None] * H + h) * L + ll[None, :], mask=held[:, None] & (ll[None, :] < L),
                       other=0.0).to(tl.float32)
    qt = qc * decay if PER_CHANNEL else qc * decay[:, None]
    return qc, decay, raw, lam_rows, qt.to(q.dtype.element_ty)


@triton.jit
def level_offsets(r, m, h, H, K, V, kk, vv, M: tl.constexpr):
    """Offsets [BK, BV] (int64) of level m of seeded chunk r, head h, in levels [R, M, H, K, V]."""
    return (((r * M + m) * H + h) * K + kk[:, None]).to(tl.int64) * V + vv[None, :]


@triton.jit(do_not_specialize=["H", "G", "L"])
def seed_reads_kernel(
    o, q, g, lam, levels, layout, at, scale,
    H, G, K, V, L,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BL: tl.constexpr,
    PRECISION: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """o_t += scale sum_m w_t,m qt_t^T S_m (module docstring) on the held rows of seeded chunk r, head h; o:
    [tokens, H, V] (read and written in its dtype, the sum in fp32), q [n, G, K], g [n, H(, K)], lam [n, H, L]: the
    gathered rows; levels [R, M, H, K, V] fp32 (M = LOG_C + 1). Grid (R * H,) (heads_fastest)."""
    r, h = heads_fastest(H)
    kk, vv, ll = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BL)
    t0, held, idx, lev, target, kernel = seed_rows(layout, at, r, C, LOG_C)
    qc, decay, raw, lam_rows, qt = seed_inputs(q, g, lam, idx, held, h, H, G, K, L, kk, ll, PER_CHANNEL)
    smask = (kk[:, None] < K) & (vv[None, :] < V)
    acc = tl.zeros([C, BV], dtype=tl.float32)
    for m in range(LOG_C + 1):
        state = tl.load(levels + level_offsets(r, m, h, H, K, V, kk, vv, LOG_C + 1), mask=smask, other=0.0)
        state = state.to(qt.dtype)
        w, read = seed_weight(lam_rows, ll, lev, target, kernel, m)
        acc += w[:, None] * tl.dot(qt, state, input_precision=PRECISION)
    rows = o + ((t0 + tl.arange(0, C)) * H + h)[:, None] * V + vv[None, :]
    ok = held[:, None] & (vv[None, :] < V)
    tl.store(rows, (tl.load(rows, mask=ok, other=0.0).to(tl.float32) + scale * acc).to(o.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["H", "G", "L"])
def seed_reads_bwd_kernel(
    d_o, q, g, lam, levels, layout, at, scale,
    dq, dg, dlam, d_levels,
    H, G, K, V, L, stride_t, stride_h, stride_v,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BL: tl.constexpr,
    PRECISION: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """seed_reads_kernel's gradients (module docstring) on the held rows of seeded chunk r, head h: dq [n, H, K]
    (per value head), dg [n, H(, K)], dlam [n, H, L] at the gathered rows (the rows not held are not written);
    d_levels [R, M, H, K, V] fp32. d_o: [tokens, H, V] with strides stride_t, stride_h, stride_v (o.sum()'s
    gradient is an expanded scalar: read as it is, not copied). Grid (R * H,) (heads_fastest)."""
    r, h = heads_fastest(H)
    kk, vv, ll = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BL)
    t0, held, idx, lev, target, kernel = seed_rows(layout, at, r, C, LOG_C)
    qc, decay, raw, lam_rows, qt = seed_inputs(q, g, lam, idx, held, h, H, G, K, L, kk, ll, PER_CHANNEL)
    ok = held[:, None] & (vv[None, :] < V)
    rows = d_o + (t0 + tl.arange(0, C))[:, None] * stride_t + h * stride_h + vv[None, :] * stride_v
    d_t = scale * tl.load(rows, mask=ok, other=0.0).to(tl.float32)
    smask = (kk[:, None] < K) & (vv[None, :] < V)
    d_qt = tl.zeros([C, BK], dtype=tl.float32)
    d_lam = tl.zeros([C, BL], dtype=tl.float32)
    for m in range(LOG_C + 1):
        offs = level_offsets(r, m, h, H, K, V, kk, vv, LOG_C + 1)
        state = tl.load(levels + offs, mask=smask, other=0.0).to(qt.dtype)
        w, read = seed_weight(lam_rows, ll, lev, target, kernel, m)
        d_w = tl.sum(d_t * tl.dot(qt, state, input_precision=PRECISION), 1)
        d_lam += tl.where(ll[None, :] == read[:, None], d_w[:, None], 0.0) - tl.where(ll[None, :] == kernel,
                                                                                     d_w[:, None], 0.0)
        u = (w[:, None] * d_t).to(qt.dtype)
        d_qt += tl.dot(u, tl.trans(state), input_precision=PRECISION)
        tl.store(d_levels + offs, tl.dot(tl.trans(qt), u, input_precision=PRECISION), mask=smask)
    kmask = held[:, None] & (kk[None, :] < K)
    if PER_CHANNEL:
        d_q = decay * d_qt
        d_gate = tl.cumsum(d_q * qc, 0, reverse=True)
        d_gate = tl.where(raw <= GATE_FLOOR, 0.0, d_gate)
        tl.store(dg + (idx[:, None] * H + h) * K + kk[None, :], d_gate.to(dg.dtype.element_ty), mask=kmask)
    else:
        d_q = decay[:, None] * d_qt
        d_gate = tl.cumsum(tl.sum(d_q * qc, 1), 0, reverse=True)
        d_gate = tl.where(raw <= GATE_FLOOR, 0.0, d_gate)
        tl.store(dg + idx * H + h, d_gate.to(dg.dtype.element_ty), mask=held)
    tl.store(dq + (idx[:, None] * H + h) * K + kk[None, :], d_q.to(dq.dtype.element_ty), mask=kmask)
    tl.store(dlam + (idx[:, None] * H + h) * L + ll[None, :], d_lam.to(dlam.dtype.element_ty),
             mask=held[:, None] & (ll[None, :] < L))


class SeedReads(torch.autograd.Function):
    """(o, q, g, lam, levels, chunks, at, scale) -> o with the seeded first chunks' reads added (module docstring),
    in place. o: [tokens, H, V] (the kernels' output, not saved by their Function); q [n, G, K], g [n, H] or per
    channel [n, H, K] (unfloored), lam [n, H, L]: the call's gathered rows (backend._Rows), at: [R, C] int64 the
    seeded chunks' rows among them (unique on the held rows); levels [R, M, H, K, V] fp32 (Seeds.levels). One kernel
    each way, whatever R; the gradients of q, g, lam come at the gathered rows (0 at the rows no chunk holds)."""

    @staticmethod
    def forward(ctx, o: torch.Tensor, q: torch.Tensor, g: torch.Tensor, lam: torch.Tensor, levels: torch.Tensor,
                chunks: FirstChunks, at: torch.Tensor, scale: float) -> torch.Tensor:
        levels = levels.contiguous()
        _launch(seed_reads_kernel, (o, q, g, lam, levels, chunks.layout, at, scale), q, o, lam, g.dim() == 3)
        ctx.mark_dirty(o)
        ctx.save_for_backward(q, g, lam, levels, at)
        ctx.chunks, ctx.scale = chunks, scale
        return o

    @staticmethod
    def backward(ctx, d_o: torch.Tensor) -> tuple:
        q, g, lam, levels, at = ctx.saved_tensors
        H, G = lam.shape[1], q.shape[1]
        per_head = torch.zeros((q.shape[0], H, q.shape[2]), dtype=q.dtype if G == H else torch.float32,
                               device=q.device)
        dg, dlam, d_levels = torch.zeros_like(g), torch.zeros_like(lam), alloc(tuple(levels.shape), torch.float32,
                                                                               levels.device)
        tensors = (d_o, q, g, lam, levels, ctx.chunks.layout, at, ctx.scale, per_head, dg, dlam, d_levels)
        strides = dict(zip(("stride_t", "stride_h", "stride_v"), d_o.stride()))
        _launch(seed_reads_bwd_kernel, tensors, q, d_o, lam, g.dim() == 3, **strides)
        return d_o, group_sum(per_head, G, 1).to(q.dtype), dg, dlam, d_levels, None, None, None


def _launch(kernel, tensors: tuple, q: torch.Tensor, o: torch.Tensor, lam: torch.Tensor, per_channel: bool,
            **extra: int) -> None:
    """Launch a seeds kernel, one program per (seeded chunk, value head): kernel(*tensors, sizes, **extra), with
    tensors[6] = at [R, C]; q [n, G, K], lam [n, H, L] the gathered rows, o [tokens, H, V] the output or its
    gradient."""
    R, C = tensors[6].shape
    H, V = o.shape[1], o.shape[2]
    kernel[(R * H,)](*tensors, H=H, G=q.shape[1], K=q.shape[2], V=V, L=lam.shape[-1], **extra, C=C,
                     LOG_C=chunk_bits(C), BK=next_pow2(q.shape[2]), BV=next_pow2(V), BL=next_pow2(lam.shape[-1]),
                     PRECISION=dot_precision(q.dtype, FP32_DOT), PER_CHANNEL=per_channel,
                     **launch_options(kernel))


def _decays(floored: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """exp(G) [R, C, H] (per channel [R, C, H, K]) of the floored gate [R, C, H(, K)] fp32, G its cumsum from the
    chunk's start over the held rows (0 at the masked ones)."""
    held = held.view(*held.shape, *(1,) * (floored.dim() - 2))
    return torch.exp(torch.where(held, floored, 0.0).cumsum(1))


def first_levels(seeds: Seeds, g: torch.Tensor, chunks: FirstChunks, width: int, C: int
                 ) -> tuple[list[int], torch.Tensor] | None:
    """For the seeded sequences that end in their first chunk, what the final levels need besides the kernels':
    their buckets, which the kernels carried as chunk level m0, decayed to the last token e (exp(G_e), g [R, C, H(,
    K)] at chunks.tokens), moved to the in-chunk levels e reads them at (read(e, m), route_buckets) -> (those
    sequences' indices among the call's sequences, the change [R', width, H, K, V]), or None when every seeded
    sequence goes on."""
    ending = [i for i, (p, e) in enumerate(zip(seeds.positions, seeds.ends)) if e <= (p // C + 1) * C]
    if not ending:
        return None
    device = seeds.levels.device
    decay = _decays(floor_log_decay(g.float()), chunks.held)
    e = cached_table(tuple((i, (seeds.ends[i] - 1) % C) for i in ending), torch.int64, device)
    at = decay[e[:, 0], e[:, 1]]  # [R', H] or [R', H, K]
    moved = seeds.levels.index_select(0, e[:, 0]) * at.view(at.shape[0], 1, at.shape[1], -1, 1)  # rows K scaled
    positions = [seeds.positions[i] for i in ending]
    floors = tuple(bucket_floor(seeds.ends[i] - 1, p) for i, p in zip(ending, positions))
    kernel = [chunk_level_to_token_level(ctz(p // C + 1), C) for p in positions]
    m0 = cached_table(tuple(tuple(j == k for j in range(width)) for k in kernel), torch.float32, device)
    routed = route_buckets(moved, floors)
    change = torch.nn.functional.pad(routed, (0, 0, 0, 0, 0, 0, 0, width - routed.shape[1]))
    return [seeds.rows[i] for i in ending], change - m0[:, :, None, None, None] * moved.sum(1, True)
