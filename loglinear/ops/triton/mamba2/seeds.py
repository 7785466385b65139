"""States inside a chunk on the Mamba-2 / GLA kernels: what a seeded sequence's first kernel chunk reads of its
state's in-chunk buckets, put right in torch, and where those buckets go in a final state.

A sequence whose state is at a position p inside a chunk (or at 0) runs its kernel chunks from the start of p's
chunk c0, the rows before p masked (backend.py). Its state's in-chunk levels 0..c are summed into chunk level
m0 = ctz(c0 + 1) of h0 (torch_chunk.chunk_levels_from), the level chunk c0's cascade merges them into, so the
kernels carry them on exactly; in chunk c0 itself they read that sum at level c + 1 + m0, where query t should read
level m of the state at

    read(t, m) = max(m, ctz(p) + 1, bit_length(t XOR p))       (ctz(p) + 1: 0 for p = 0)

(the carry past p, adding the levels below ctz(p) + 1 into that level, is never formed: level m lands in bucket
max(m, ctz(p) + 1), read at fenwick.incoming_levels of it). SeedReads adds the difference to o for the call's tokens
t of those chunks:

    o_t += scale sum_m (lam_t[read(t, m)] - lam_t[c + 1 + m0]) (exp(G_t) q_t)^T S_m

(S_m the state's level m, G_t the cumsum of the floored gate from the chunk's start; a lam level at or past the
call's L reads 0, as in the kernels). A sequence that ends in chunk c0 still holds the buckets as chunk level m0,
decayed to its last token e: first_levels moves them to the in-chunk levels e reads them at, read(e, m).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loglinear.fenwick import chunk_bits, ctz
from loglinear.inputs import expand_groups
from loglinear.ops.finite import LOG_DECAY_FLOOR, floor_log_decay
from loglinear.ops.torch_chunk import route_buckets
from loglinear.ops.triton.shared.common import group_sum
from loglinear.tables import cached_table, device_table, table_cache

__all__ = ["Seeds", "FirstChunks", "first_chunks", "SeedReads", "first_levels"]

FLOOR = LOG_DECAY_FLOOR[torch.float32]


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
    held [R, C] bool (the sequence's tokens), taken [n] int64 (their places in the flattened [R * C]), reads [n]
    int64 (those tokens) and select [R, C, L, M] fp32: select[r, t, l, m] = [l = read(t, m)] - [l = c + 1 + m0] at
    the held rows (levels < L only; 0 elsewhere), so that lam_t select_t = the weights of the module docstring."""

    tokens: tuple[tuple[int, ...], ...]
    held: torch.Tensor
    taken: torch.Tensor
    reads: torch.Tensor
    select: torch.Tensor


def _select(position: int, front: int, stop: int, C: int, L: int) -> list[list[list[float]]]:
    """One sequence's select [C][L][M] (FirstChunks): held rows front <= t < stop of the chunk of ``position``."""
    c, c0 = chunk_bits(C), position // C
    target, kernel = ctz(position) + 1 if position else 0, c + 1 + ctz(c0 + 1)
    rows = []
    for t in range(C):
        reads = [max(m, target, ((c0 * C + t) ^ position).bit_length()) for m in range(c + 1)]
        held = front <= t < stop
        rows.append([[float(held and lev == r < L) - float(held and lev == kernel < L) for r in reads]
                     for lev in range(L)])
    return rows


@table_cache()
def first_chunks(starts: tuple[int, ...], ends: tuple[int, ...], positions: tuple[int, ...], C: int, L: int,
                 device: torch.device) -> FirstChunks:
    """FirstChunks of the sequences [starts[i] + positions[i] mod C, ends[i]) of the call's tokens (starts[i]: the
    chunk start before the sequence's first token) continuing states at ``positions``, with L lam levels. Cached per
    layout (read-only; normal tensors)."""
    fronts = [p % C for p in positions]
    tokens = tuple(tuple(max(min(a + s, b - 1), a + r) for s in range(C)) for a, b, r in zip(starts, ends, fronts))
    held = [[r <= s < b - a for s in range(C)] for a, b, r in zip(starts, ends, fronts)]
    taken = [i * C + s for i, h in enumerate(held) for s in range(C) if h[s]]
    select = [_select(p, r, b - a, C, L) for a, b, r, p in zip(starts, ends, fronts, positions)]
    with torch.inference_mode(False):
        return FirstChunks(tokens, device_table(held, torch.bool, device), device_table(taken, torch.int64, device),
                           device_table([tokens[i // C][i % C] for i in taken], torch.int64, device),
                           device_table(select, torch.float32, device))


def _decays(floored: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """exp(G) [R, C, H] (per channel [R, C, H, K]) of the floored gate [R, C, H(, K)] fp32, G its cumsum from the
    chunk's start over the held rows (0 at the masked ones)."""
    held = held.view(*held.shape, *(1,) * (floored.dim() - 2))
    return torch.exp(torch.where(held, floored, 0.0).cumsum(1))


def _per_key(decay: torch.Tensor) -> torch.Tensor:
    """A decay [R, C, H] or per channel [R, C, H, K] as a factor of [R, C, H, K] tensors."""
    return decay if decay.dim() == 4 else decay[..., None]


class SeedReads(torch.autograd.Function):
    """(q, g, lam, levels, chunks, scale) -> the terms the module docstring adds to o, [n, H, V] fp32 at
    chunks.reads: q [R, C, G, K], g [R, C, H] or per channel [R, C, H, K] (unfloored), lam [R, C, H, L] at
    chunks.tokens; levels [R, M, H, K, V] fp32 (Seeds.levels). One batch of ops each way, whatever R: with the
    decayed queries qt = exp(G) q, the weights w = lam select [R, C, H, M] and the reads P_m = qt^T S_m [R, C, H, M, V],
    terms = scale sum_m w_m P_m; backward, with dT = scale dterms and U_m = w_m dT:
        dw_m = dT . P_m,  dS_m = sum_t qt_t U_m,t^T,  dqt = sum_m U_m S_m^T,  dlam = dw select^T,
        dq = group sum of exp(G) dqt,  dg_s = sum_{t >= s} dG_t with dG = exp(G) (dqt . q) (per channel: by key),
    dg 0 at the masked rows and where g <= FLOOR."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, g: torch.Tensor, lam: torch.Tensor, levels: torch.Tensor, chunks: FirstChunks,
                scale: float) -> torch.Tensor:
        H = lam.shape[2]
        qe = expand_groups(q.float(), H)
        decay = _decays(floor_log_decay(g.float()), chunks.held)  # no autograd in here: a clamp
        qt = qe * _per_key(decay)
        w = lam.float() @ chunks.select
        P = torch.einsum("rthk,rmhkv->rthmv", qt, levels)
        terms = torch.einsum("rthm,rthmv->rthv", w, P) * scale
        ctx.save_for_backward(q, g, lam, levels, qe, decay, qt, w, P)
        ctx.chunks, ctx.scale = chunks, scale
        return terms.flatten(0, 1).index_select(0, chunks.taken)

    @staticmethod
    def backward(ctx, d_terms: torch.Tensor) -> tuple:
        q, g, lam, levels, qe, decay, qt, w, P = ctx.saved_tensors
        chunks = ctx.chunks
        (R, C, H), V = lam.shape[:3], levels.shape[-1]
        dT = d_terms.new_zeros((R * C, H, V), dtype=torch.float32)
        dT = dT.index_copy_(0, chunks.taken, d_terms.float()).view(R, C, H, V) * ctx.scale
        d_w = torch.einsum("rthv,rthmv->rthm", dT, P)
        U = w[..., None] * dT[:, :, :, None]
        d_qt = torch.einsum("rthmv,rmhkv->rthk", U, levels)
        d_levels = torch.einsum("rthk,rthmv->rmhkv", qt, U)
        d_lam = d_w @ chunks.select.transpose(-1, -2)
        d_q = group_sum(d_qt * _per_key(decay), q.shape[2], 2)
        d_decay = d_qt * qe if decay.dim() == 4 else (d_qt * qe).sum(-1)
        d_g = (d_decay * decay).flip(1).cumsum(1).flip(1)
        d_g = torch.ops.aten.threshold_backward(d_g, g.float(), FLOOR)
        d_g = torch.where(chunks.held.view(R, C, *(1,) * (g.dim() - 2)), d_g, 0.0)
        return d_q.to(q.dtype), d_g.to(g.dtype), d_lam.to(lam.dtype), d_levels, None, None


def first_levels(seeds: Seeds, g: torch.Tensor, chunks: FirstChunks, width: int, C: int
                 ) -> tuple[list[int], torch.Tensor] | None:
    """For the seeded sequences that end in their first chunk, what the final levels need besides the kernels':
    their buckets, which the kernels carried as chunk level m0, decayed to the last token e (exp(G_e), g [R, C, H(,
    K)] at chunks.tokens), moved to the in-chunk levels e reads them at (read(e, m), route_buckets) -> (those
    sequences' indices among the call's sequences, the change [R', width, H, K, V]), or None when every seeded
    sequence goes on."""
    c = chunk_bits(C)
    ending = [i for i, (p, e) in enumerate(zip(seeds.positions, seeds.ends)) if e <= (p // C + 1) * C]
    if not ending:
        return None
    device = seeds.levels.device
    decay = _decays(floor_log_decay(g.float()), chunks.held)
    e = cached_table(tuple((i, (seeds.ends[i] - 1) % C) for i in ending), torch.int64, device)
    at = decay[e[:, 0], e[:, 1]]  # [R', H] or [R', H, K]
    moved = seeds.levels.index_select(0, e[:, 0]) * at.view(at.shape[0], 1, at.shape[1], -1, 1)  # rows K scaled
    positions = [seeds.positions[i] for i in ending]
    floors = tuple(max(((seeds.ends[i] - 1) ^ p).bit_length(), ctz(p) + 1 if p else 0)
                   for i, p in zip(ending, positions))
    m0 = cached_table(tuple(tuple(j == c + 1 + ctz(p // C + 1) for j in range(width)) for p in positions),
                      torch.float32, device)
    routed = route_buckets(moved, floors)
    change = torch.nn.functional.pad(routed, (0, 0, 0, 0, 0, 0, 0, width - routed.shape[1]))
    return [seeds.rows[i] for i in ending], change - m0[:, :, None, None, None] * moved.sum(1, True)
