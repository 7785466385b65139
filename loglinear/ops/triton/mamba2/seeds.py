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
add_seed_reads adds the difference to the kernels' o, one program per (seeded sequence, value head), for the rows t
of its first chunk that are tokens of the call (p mod C <= t < its end), reading q, g and lam at those tokens:

    w_t,m = lam_t[read(t, m)] - lam_t[c + 1 + m0]        (a lam level at or past the call's L reads 0, as in the
                                                           kernels)
    o_t += scale sum_m w_t,m (exp(G_t) q_t)^T S_m        (S_m the state's level m, G_t the cumsum of the floored
                                                           gate from the chunk's start: per key with GLA's gate)

and seed_read_grads its gradients, with dT = scale dO and U_m = w_m dT:

    dw_m = rowsum(dT * (qt S_m)),  dS_m = qt^T U_m,  dqt = sum_m U_m S_m^T,  dlam_t[l] = sum_m dw_t,m ([l = read(t, m)]
    - [l = c + 1 + m0]),  dq = exp(G) dqt,  dG_t = dq_t . q_t (per key: elementwise),

added in place to the kernels' per-head dq, dlam and q.dq (the gate's term dG_t, whose reverse cumsum over the
sequence, 0 where g <= FLOOR, the kernels' gate gradient forms: the seeded chunk is its sequence's first), so that
the reads cost no buffer, gather or add of their own. Both run inside the kernels' autograd Function
(backend.LevelScanMamba2). A sequence that ends in chunk c0 still holds the buckets as chunk level m0, decayed to its
last token e: first_levels moves them to the in-chunk levels e reads them at, read(e, m).
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
from loglinear.ops.triton.shared.common import alloc, heads_fastest, next_pow2
from loglinear.ops.triton.shared.intra import FLOOR as GATE_FLOOR, bit_levels
from loglinear.ops.triton.shared.launch import launch, launch_options
from loglinear.ops.triton.shared.rules import dot_precision
from loglinear.tables import cached_table, device_table, table_cache

__all__ = ["Seeds", "FirstChunks", "first_chunks", "add_seed_reads", "seed_read_grads", "first_levels"]

FLOOR = LOG_DECAY_FLOOR[torch.float32]
ROW_FIELDS = tl.constexpr(5)  # FirstChunks.layout's columns
# key and value columns per product of fp32 operands: their tf32x3 products stage both operands' split parts in
# shared memory, which over the whole key and value of 128 takes 262 KB in the backward at C = 64 (sm_90 has 227 KB;
# compile_sm90.py)
FP32_BLOCK = 64


def block(dtype: torch.dtype, width: int) -> int:
    """The seeds kernels' key or value block over ``width`` columns: the whole width (padded to a power of two), at
    most FP32_BLOCK for fp32 operands."""
    return min(next_pow2(width), FP32_BLOCK) if dtype == torch.float32 else next_pow2(width)


def kernel_sizes(dtype: torch.dtype, K: int, V: int, C: int) -> dict[str, int]:
    """The seeds kernels' block sizes for operands of ``dtype``, K key and V value columns and chunk C: the key block
    BK and value block BV (block), their numbers NKB and NVB, and BM, the backward's columns of per-level sums (>= the
    c + 1 in-chunk levels)."""
    BK, BV = block(dtype, K), block(dtype, V)
    return dict(BK=BK, NKB=triton.cdiv(K, BK), BV=BV, NVB=triton.cdiv(V, BV), BM=next_pow2(chunk_bits(C) + 1))


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
def seed_rows(layout, r, C: tl.constexpr, LOG_C: tl.constexpr):
    """Seeded chunk r (FirstChunks.layout): (its rows' tokens [C] int64 (first row's token + t; negative before the
    call's first token), the held rows [C], bit_length(t XOR front) [C], the floor ctz(p) + 1 of the levels read, the
    kernels' level c + 1 + m0)."""
    t = tl.arange(0, C)
    row = layout + r * ROW_FIELDS
    front, stop = tl.load(row + 1).to(tl.int32), tl.load(row + 2).to(tl.int32)
    held = (t >= front) & (t < stop)
    return (tl.load(row) + t, held, bit_levels(t ^ front, LOG_C), tl.load(row + 3).to(tl.int32),
            tl.load(row + 4).to(tl.int32))


@triton.jit
def seed_gates(g, idx, held, h, H, K, kk, PER_CHANNEL: tl.constexpr):
    """exp(G) fp32 [C] (per channel [C, BK]): G the cumsum of max(g, FLOOR) over the chunk's rows, 0 at the rows not
    held; g [tokens, H] or [tokens, H, K] (unfloored), idx the rows' tokens."""
    if PER_CHANNEL:
        ok = held[:, None] & (kk[None, :] < K)
        raw = tl.load(g + (idx[:, None] * H + h) * K + kk[None, :], mask=ok, other=0.0).to(tl.float32)
        floored = tl.where(ok, tl.maximum(raw, GATE_FLOOR), 0.0)
    else:
        raw = tl.load(g + idx * H + h, mask=held, other=0.0).to(tl.float32)
        floored = tl.where(held, tl.maximum(raw, GATE_FLOOR), 0.0)
    return tl.exp(tl.cumsum(floored, 0))


@triton.jit
def seed_read(lev, target, m):
    """read(t, m) [C] int32: the level row t reads the state's in-chunk level m at."""
    return tl.maximum(tl.maximum(lev, target), m)


@triton.jit
def seed_weight(lam_rows, ll, lev, target, kernel, m):
    """w_t,m = lam_t[read(t, m)] - lam_t[kernel] [C] fp32 from the rows' lam [C, BL] (0 at levels >= L)."""
    picked = tl.sum(tl.where(ll[None, :] == seed_read(lev, target, m)[:, None], lam_rows, 0.0), 1)
    return picked - tl.sum(tl.where(ll[None, :] == kernel, lam_rows, 0.0), 1)


@triton.jit
def seed_inputs(q, g, lam, idx, held, h, H, G, K, L, kk, ll, PER_CHANNEL: tl.constexpr):
    """What both kernels read at the held rows (tokens idx) for the key columns kk [BK]: q [C, BK] (h's group),
    exp(G) (seed_gates) and lam [C, BL], fp32; qt = exp(G) q in q's dtype (the products' operand dtype, as the chunk
    kernels': 16-bit operands, fp32 sums)."""
    grp = h // (H // G)
    qc = tl.load(q + (idx[:, None] * G + grp) * K + kk[None, :], mask=held[:, None] & (kk[None, :] < K),
                 other=0.0).to(tl.float32)
    decay = seed_gates(g, idx, held, h, H, K, kk, PER_CHANNEL)
    lam_rows = tl.load(lam + (idx[:, None] * H + h) * L + ll[None, :], mask=held[:, None] & (ll[None, :] < L),
                       other=0.0).to(tl.float32)
    qt = qc * decay if PER_CHANNEL else qc * decay[:, None]
    return qc, decay, lam_rows, qt.to(q.dtype.element_ty)


@triton.jit
def level_offsets(r, m, h, H, K, V, kk, vv, M: tl.constexpr):
    """Offsets [BK, BV] (int64) of level m of seeded chunk r, head h, in levels [R, M, H, K, V]."""
    return (((r * M + m) * H + h) * K + kk[:, None]).to(tl.int64) * V + vv[None, :]


@triton.jit
def add_rows(ptrs, x, mask):
    """*ptrs += x where mask (the sum in fp32, stored in the pointers' dtype); each element has one writer."""
    tl.store(ptrs, (tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + x).to(ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["H", "G", "L"])
def seed_reads_kernel(
    o, q, g, lam, levels, layout, scale,
    H, G, K, V, L,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr,
    BL: tl.constexpr, PRECISION: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """o_t += scale sum_m w_t,m qt_t^T S_m (module docstring) on the held rows of seeded chunk r, head h; o:
    [tokens, H, V] (read and written in its dtype, the sum in fp32), q [tokens, G, K], g [tokens, H(, K)], lam
    [tokens, H, L]: the call's; levels [R, M, H, K, V] fp32 (M = LOG_C + 1). The value in NVB blocks of BV columns,
    the key in NKB blocks of BK (block; unrolled). Grid (R * H,) (heads_fastest)."""
    r, h = heads_fastest(H)
    ll = tl.arange(0, BL)
    idx, held, lev, target, kernel = seed_rows(layout, r, C, LOG_C)
    for vb in tl.static_range(NVB):
        vv = vb * BV + tl.arange(0, BV)
        acc = tl.zeros([C, BV], dtype=tl.float32)
        for kb in tl.static_range(NKB):
            kk = kb * BK + tl.arange(0, BK)
            qc, decay, lam_rows, qt = seed_inputs(q, g, lam, idx, held, h, H, G, K, L, kk, ll, PER_CHANNEL)
            smask = (kk[:, None] < K) & (vv[None, :] < V)
            for m in range(LOG_C + 1):
                state = tl.load(levels + level_offsets(r, m, h, H, K, V, kk, vv, LOG_C + 1), mask=smask, other=0.0)
                w = seed_weight(lam_rows, ll, lev, target, kernel, m)
                acc += w[:, None] * tl.dot(qt, state.to(qt.dtype), input_precision=PRECISION)
        add_rows(o + (idx * H + h)[:, None] * V + vv[None, :], scale * acc, held[:, None] & (vv[None, :] < V))


@triton.jit(do_not_specialize=["H", "G", "L"])
def seed_reads_bwd_kernel(
    d_o, q, g, lam, levels, layout, scale,
    dq, qdq, dlam, d_levels,
    H, G, K, V, L,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr,
    BL: tl.constexpr, BM: tl.constexpr, PRECISION: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """seed_reads_kernel's gradients (module docstring) on the held rows of seeded chunk r, head h, added in place:
    dq [tokens, H, K] (per value head, q's dtype), the gate's term q.dq [tokens, H(, K)] fp32 and dlam [tokens, H, L];
    written: d_levels [R, M, H, K, V] fp32. d_o: [tokens, H, V] contiguous. The key in NKB blocks of BK columns, each
    block's dq, q.dq and d_levels from its own products, summed over the value's NVB blocks of BV columns (block;
    unrolled); dw_m [C, BM] summed over both before dlam is formed. Grid (R * H,) (heads_fastest)."""
    r, h = heads_fastest(H)
    ll, mm = tl.arange(0, BL), tl.arange(0, BM)
    idx, held, lev, target, kernel = seed_rows(layout, r, C, LOG_C)
    d_w = tl.zeros([C, BM], dtype=tl.float32)
    gate_term = tl.zeros([C], dtype=tl.float32)  # q.dq of a scalar gate, summed over the key blocks
    for kb in tl.static_range(NKB):
        kk = kb * BK + tl.arange(0, BK)
        qc, decay, lam_rows, qt = seed_inputs(q, g, lam, idx, held, h, H, G, K, L, kk, ll, PER_CHANNEL)
        d_qt = tl.zeros([C, BK], dtype=tl.float32)
        for vb in tl.static_range(NVB):
            vv = vb * BV + tl.arange(0, BV)
            ok = held[:, None] & (vv[None, :] < V)
            d_t = scale * tl.load(d_o + (idx * H + h)[:, None] * V + vv[None, :], mask=ok, other=0.0).to(tl.float32)
            smask = (kk[:, None] < K) & (vv[None, :] < V)
            for m in range(LOG_C + 1):
                offs = level_offsets(r, m, h, H, K, V, kk, vv, LOG_C + 1)
                state = tl.load(levels + offs, mask=smask, other=0.0).to(qt.dtype)
                w = seed_weight(lam_rows, ll, lev, target, kernel, m)
                part = tl.sum(d_t * tl.dot(qt, state, input_precision=PRECISION), 1)
                d_w += tl.where(mm[None, :] == m, part[:, None], 0.0)
                u = (w[:, None] * d_t).to(qt.dtype)
                d_qt += tl.dot(u, tl.trans(state), input_precision=PRECISION)
                tl.store(d_levels + offs, tl.dot(tl.trans(qt), u, input_precision=PRECISION), mask=smask)
        kmask = held[:, None] & (kk[None, :] < K)
        if PER_CHANNEL:
            d_q = decay * d_qt
            add_rows(qdq + (idx[:, None] * H + h) * K + kk[None, :], d_q * qc, kmask)
        else:
            d_q = decay[:, None] * d_qt
            gate_term += tl.sum(d_q * qc, 1)
        add_rows(dq + (idx[:, None] * H + h) * K + kk[None, :], d_q, kmask)
    if not PER_CHANNEL:
        add_rows(qdq + idx * H + h, gate_term, held)
    d_lam = tl.zeros([C, BL], dtype=tl.float32)
    for m in range(LOG_C + 1):
        d_wm = tl.sum(tl.where(mm[None, :] == m, d_w, 0.0), 1)[:, None]
        d_lam += tl.where(ll[None, :] == seed_read(lev, target, m)[:, None], d_wm, 0.0) - tl.where(
            ll[None, :] == kernel, d_wm, 0.0)
    add_rows(dlam + (idx[:, None] * H + h) * L + ll[None, :], d_lam, held[:, None] & (ll[None, :] < L))


def add_seed_reads(o: torch.Tensor, q: torch.Tensor, g: torch.Tensor, lam: torch.Tensor, levels: torch.Tensor,
                   chunks: FirstChunks, scale: float) -> None:
    """o += the seeded first chunks' reads (module docstring), in place, one kernel whatever the number of seeded
    sequences R. o: [tokens, H, V] (the kernels' output); q [tokens, G, K], g [tokens, H] or per channel
    [tokens, H, K] (unfloored), lam [tokens, H, L]: the call's; levels [R, c+1, H, K, V] fp32 contiguous
    (Seeds.levels)."""
    _launch(seed_reads_kernel, (o, q, g, lam, levels, chunks.layout, scale), q, o, lam, g.dim() == 3, chunks)


def seed_read_grads(d_o: torch.Tensor, q: torch.Tensor, g: torch.Tensor, lam: torch.Tensor, levels: torch.Tensor,
                    chunks: FirstChunks, scale: float, dq: torch.Tensor, qdq: torch.Tensor,
                    dlam: torch.Tensor) -> torch.Tensor:
    """add_seed_reads' gradients from d_o [tokens, H, V] (contiguous): added in place to the kernels' per-head dq
    [tokens, H, K] (q's dtype), q.dq [tokens, H(, K)] fp32 (the gate's term) and dlam [tokens, H, L] at the held
    rows; returns the levels' gradient [R, c+1, H, K, V] fp32. Inputs as add_seed_reads'."""
    d_levels = alloc(tuple(levels.shape), torch.float32, levels.device)
    tensors = (d_o, q, g, lam, levels, chunks.layout, scale, dq, qdq, dlam, d_levels)
    _launch(seed_reads_bwd_kernel, tensors, q, d_o, lam, g.dim() == 3, chunks)
    return d_levels


def _launch(kernel, tensors: tuple, q: torch.Tensor, o: torch.Tensor, lam: torch.Tensor, per_channel: bool,
            chunks: FirstChunks) -> None:
    """Launch a seeds kernel, one program per (seeded chunk, value head): kernel(*tensors, sizes); q [tokens, G, K],
    lam [tokens, H, L], o [tokens, H, V] the output or its gradient."""
    R, C = chunks.held.shape
    H, V = o.shape[1], o.shape[2]
    sizes = {n: x for n, x in kernel_sizes(q.dtype, q.shape[2], V, C).items() if n in kernel.arg_names}
    launch(kernel, (R * H,), *tensors, H=H, G=q.shape[1], K=q.shape[2], V=V, L=lam.shape[-1], C=C, LOG_C=chunk_bits(C),
           BL=next_pow2(lam.shape[-1]), **sizes, PRECISION=dot_precision(q.dtype, FP32_DOT), PER_CHANNEL=per_channel,
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
