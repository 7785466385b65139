"""The Fenwick chunk scan: chunkwise log-linear attention for any variant form, in plain PyTorch.

Tokens are placed in chunks aligned to *absolute* positions (C = 2^c), so a call that continues a state
at position p0 is front-padded with p0 mod C identity tokens. Then (spec sections 2, 4, 5):

  intra   O += (intra * Lambda) V,  Lambda[t, s] = lambda_t[bit_length(tl XOR sl)]      levels 0..c
  inter   chunk-level buckets H_j (sources in earlier chunks, token level c+1+j) are carried together
          through one scan over chunks -- the binary-counter cascade at chunk granularity:
             read:   O_i += sum_j lambda_t[c+1+j] (qt_i H_j)            (one GEMM of depth L*K)
             update: H_j <- transition_i(H_j) for all j; with m = ctz(chunk+1):
                     H_m <- deposit_i + sum_{j<m} H_j,  H_j <- 0 for j < m
  state   the incoming token-level state is first carried past position p0 (levels 0..ctz(p0) merge
          into ctz(p0)+1); its levels <= c are buckets inside the first chunk, read by query t at level
          max(l, bit_length(t XOR p0)); its levels > c are the chunk buckets H_j. The outgoing state
          splits the last chunk into token-level buckets around the last position.

Time O(T C (K + V) + T K V log(T / C)); memory O(T C + K V log T): no T x T tensor.

What the scan needs from a variant is its chunk form (Variant.form), built on chunked tensors
q, k: [b, H, N, C, K]; v: [b, H, N, C, V]; each gate [b, H, N, C], a per-channel one [b, H, N, C, K] (N chunks of
C tokens; padding tokens have k = v = gates = 0, so their transition is the identity). Within a chunk, G is the
local inclusive cumsum of g and Gamma[t, s] = exp(G_t - G_s) for s <= t. A form provides
    intra:  [b, H, N, C, C]  beta_s q_t^T P_{t,s} k_s inside the chunk (before the level mask)
    qt:     [b, H, N, C, K]  readout queries:  q_t^T P_{t, chunk start - 1} h  ==  (qt_t) h
    transition(i, h):        the chunk's whole transition applied to states h: [b, H, K, X] (its per-chunk
                             tensors taken with variants.base.by_chunk: the scan calls it for every chunk)
    bucket_states(i, masks): state at the chunk's end of the tokens selected by masks [M, C] -> [b, M, H, K, V]
    deposit:                 [b, H, N, K, V]  the chunk's own state at its end (all tokens)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loglinear.fenwick import (
    bucket_floor, chunk_bits, ctz, incoming_levels, intra_chunk_levels, last_query_masks, levels_needed,
)
from loglinear.tables import cached_table, table_cache
from loglinear.variants.base import by_chunk


def pad_time(x: torch.Tensor, front: int, back: int) -> torch.Tensor:
    """Zero-pad dim 1 (time): x [b, T, ...] -> [b, front + T + back, ...]."""
    pad = [0, 0] * (x.dim() - 2) + [front, back]
    return F.pad(x, pad)


def chunked(x: torch.Tensor, C: int) -> torch.Tensor:
    """Cut time into chunks: x [b, T, H, *] (T = N C) -> [b, H, N, C, *] (a view where possible)."""
    b, T, H = x.shape[:3]
    x = x.reshape(b, T // C, C, H, *x.shape[3:])
    return x.movedim(3, 1)


def carry_past(levels: torch.Tensor, position: int) -> torch.Tensor:
    """The cascade's carry for a new token at ``position`` (> 0), widening the level axis if needed:
    levels [b, L, H, K, V] -> [b, max(L, ctz(position) + 2), H, K, V]. Levels 0..ctz(position) add into level
    ctz(position) + 1 and clear (fenwick.carry for one host-side position: slices only, no host-device copy; rows
    at different positions: fenwick.carry_into)."""
    target = ctz(position) + 1
    if levels.shape[1] <= target:
        levels = F.pad(levels, (0, 0, 0, 0, 0, 0, 0, target + 1 - levels.shape[1]))
    merged = levels[:, : target + 1].sum(1, keepdim=True)
    return torch.cat([torch.zeros_like(levels[:, :target]), merged, levels[:, target + 1 :]], 1)


@table_cache()
def _from_tables(through: tuple[int, ...], into: tuple[int, ...], c: int, L: int, J: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """chunk_levels_from's tables: the rows n J + into[n] of the output's [N J] level axis, [N] int64; the chunk
    levels not kept in some rows only (lo <= j < through[n] - c, lo the fewest of all rows, among the first A =
    min(L - c - 1, J)) as rows n J + j of the output and n L + c+1+j of the [N L] state, [n] int64 each (None when
    there are none); and summed [N, S, 1, 1, 1] bool, l <= through[n] (S = min(max(through) + 1, L) levels; None
    when every row sums the same levels)."""
    A, S, lo = max(min(L - c - 1, J), 0), min(max(through) + 1, L), min(through) - c
    rows = cached_table(tuple(n * J + j for n, j in enumerate(into)), torch.int64, device)
    cleared = [(n, j) for n, t in enumerate(through) for j in range(lo, min(t - c, A))]
    if not cleared:
        out_cleared = state_cleared = None
    else:
        out_cleared = cached_table(tuple(n * J + j for n, j in cleared), torch.int64, device)
        state_cleared = cached_table(tuple(n * L + c + 1 + j for n, j in cleared), torch.int64, device)
    if len(set(through)) == 1:
        return rows, out_cleared, state_cleared, None
    summed = cached_table(tuple(tuple(lev <= t for lev in range(S)) for t in through), torch.bool, device)
    return rows, out_cleared, state_cleared, summed.view(*summed.shape, 1, 1, 1)


class _ChunkLevelsFrom(torch.autograd.Function):
    """chunk_levels_from in one step each way: the chunk levels copied (those no row keeps left out, those some rows
    do not keep cleared), the sums added and the in-chunk levels of the rows asked for picked forward, the gradient
    written once backward (a carry by masks, slices and pads copies the whole state several times each way, and
    each output taking its own slice of the state makes autograd add whole-state gradients)."""

    @staticmethod
    def forward(ctx, levels: torch.Tensor, through: tuple[int, ...], into: tuple[int, ...], picked: tuple[int, ...],
                c: int, J: int) -> tuple[torch.Tensor, torch.Tensor]:
        (N, L), rest = levels.shape[:2], levels.shape[2:]
        rows, cleared, _, summed = _from_tables(through, into, c, L, J, levels.device)
        lo = min(through) - c  # chunk levels below lo are kept in no row
        kept = levels[:, c + 1 + lo : c + 1 + J]
        out = F.pad(kept, (0, 0) * len(rest) + (lo, J - lo - kept.shape[1]))  # a new tensor
        if cleared is not None:
            out.view(N * J, -1).index_fill_(0, cleared, 0.0)
        low = levels[:, : min(max(through) + 1, L)]
        if summed is None and len(set(into)) == 1 and into[0] < lo:  # one carry target: its level is still 0
            torch.sum(low, 1, out=out[:, into[0]])
        else:
            sums = (low if summed is None else torch.where(summed, low, 0.0)).sum(1)
            out.view(N * J, -1).index_add_(0, rows, sums.view(N, -1))
        ctx.set_materialize_grads(False)
        ctx.sizes = (through, into, picked, c, L, J)
        if not picked:
            return out, levels.new_empty((0, c + 1, *rest))
        in_chunk = levels[:, : c + 1].index_select(0, cached_table(picked, torch.int64, levels.device))
        return out, F.pad(in_chunk, (0, 0) * len(rest) + (0, c + 1 - in_chunk.shape[1]))

    @staticmethod
    def backward(ctx, d_out: torch.Tensor, d_in_chunk: torch.Tensor) -> tuple:
        through, into, picked, c, L, J = ctx.sizes
        if d_out is None:  # only the in-chunk levels were used
            d_out = d_in_chunk.new_zeros((len(through), J, *d_in_chunk.shape[2:]))
        rows, _, cleared, summed = _from_tables(through, into, c, L, J, d_out.device)
        N, rest, lo = d_out.shape[0], d_out.shape[2:], min(through) - c
        if len(set(through)) == len(set(into)) == 1:  # one row layout: levels 0..through get d_out[:, into]
            S = min(through[0] + 1, L)
            summed_grad = d_out[:, into[0] : into[0] + 1].expand(-1, S, *rest)
            d_levels = torch.cat([summed_grad, d_out[:, lo : lo + L - S]], 1)
        else:
            kept = d_out[:, lo : max(min(L - c - 1, J), lo)]
            front = min(c + 1 + lo, L)
            d_levels = F.pad(kept, (0, 0) * len(rest) + (front, L - front - kept.shape[1]))
            if cleared is not None:
                d_levels.view(N * L, -1).index_fill_(0, cleared, 0.0)
            d_sums = d_out.reshape(N * J, -1).index_select(0, rows).view(N, 1, *rest)
            low = d_levels[:, : min(max(through) + 1, L)]
            low += d_sums if summed is None else torch.where(summed, d_sums, 0.0)
        if d_in_chunk is not None and picked:
            M = min(c + 1, L)
            at = cached_table(tuple(n * L + m for n in picked for m in range(M)), torch.int64, d_out.device)
            d_levels.view(N * L, -1).index_add_(0, at, d_in_chunk[:, :M].reshape(len(picked) * M, -1))
        return d_levels, None, None, None, None, None


def chunk_levels_from(levels: torch.Tensor, through: tuple[int, ...], into: tuple[int, ...], chunk_size: int,
                      J: int, in_chunk: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk levels c+1 .. c+J (c = log2 chunk_size) of states whose levels 0..through[n] are summed into chunk
    level into[n], row n of levels [N, L, H, K, V] (L <= c + 1 + J) -> [N, J, H, K, V]:

        out[n, j] = [c+1+j > through[n]] levels[n, c+1+j] + [j == into[n]] sum_{l <= through[n]} levels[n, l]

    and the in-chunk levels 0..c of the rows ``in_chunk`` as they are, [len(in_chunk), c+1, H, K, V] (zero-padded).
    Two uses: the carry past a chunk-aligned position p (through = into + c + 1 = ctz(p) + 1, the carry's target:
    that chunk level then holds levels 0..target and those below it are 0, no gradient flowing there), and a state
    inside a chunk whose in-chunk buckets are summed into the chunk level a kernel chunk's cascade merges them into
    (through = c: every chunk level kept), those buckets then read on their own (in_chunk). One read of the state
    forward, one write of its gradient backward."""
    c, (N, L) = chunk_bits(chunk_size), levels.shape[:2]
    if len(through) != N or len(into) != N:
        raise ValueError(f"chunk_levels_from takes one through and one into per row of levels ({N}), got "
                         f"{len(through)} and {len(into)}")
    if L > c + 1 + J or any(not c <= t <= c + J for t in through) or any(not 0 <= j < J for j in into):
        raise ValueError(f"chunk_levels_from takes at most c + 1 + J = {c + 1 + J} levels, through in [c, c + J] = "
                         f"[{c}, {c + J}] and into in [0, J) = [0, {J}), got {L} levels, through {through} and "
                         f"into {into}")
    if any(not 0 <= n < N for n in in_chunk):
        raise ValueError(f"chunk_levels_from takes in_chunk rows in [0, {N}), got {in_chunk}")
    return _ChunkLevelsFrom.apply(levels, tuple(through), tuple(into), tuple(in_chunk), c, J)


def level_scales_at(lam: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """lam: [..., C, L]; idx: [C, M] level per (query, slot), or per row [b, 1, C, M] (lam [b, H, C, L])
    -> [..., C, M] (levels >= L read as 0).

    Only padding rows ever ask for a level >= L: validation guarantees L covers every real query."""
    inside = idx < lam.shape[-1]
    picked = torch.gather(lam, -1, torch.where(inside, idx, 0).expand(*lam.shape[:-1], idx.shape[-1]))
    return picked * inside


def route_buckets(moved: torch.Tensor, floors: tuple[int, ...]) -> torch.Tensor:
    """Incoming in-chunk buckets moved to the levels of a later query of their chunk: bucket m of row n to level
    max(m, floors[n]) (floors[n] = bit_length(query XOR the state's position); one floor: every row's).
    moved: [b, M, H, K, V] -> [b, M, H, K, V]."""
    M = moved.shape[1]
    route = cached_table(tuple(tuple(tuple(max(m, f) == d for d in range(M)) for m in range(M)) for f in floors),
                         moved.dtype, moved.device)  # [rows, src, dst]
    return torch.einsum("bsd,bshkv->bdhkv", route.expand(moved.shape[0], M, M), moved)


def chunk_scan(
    form_cls: type, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor],
    lam: torch.Tensor, scale: float, levels: torch.Tensor | None, position: int, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise log-linear attention of rows sharing the start ``position``; form_cls: the variant's chunk form.

    q, k: [b, T, H, K]; v: [b, T, H, V]; gates: {name: [b, T, H] or per channel [b, T, H, K]}; lam: [b, T, H, L];
    levels: [b, Ls, H, K, V] incoming state (or None). Returns o: [b, T, H, V] and the final levels
    [b, max(Ls, levels_needed(position + T)), H, K, V].
    """
    C, c = chunk_size, chunk_bits(chunk_size)
    b, T, H, K = q.shape
    V = v.shape[-1]
    front = position % C
    Tp = -(-(front + T) // C) * C
    back = Tp - front - T
    N, c0 = Tp // C, position // C
    end = position + T  # tokens consumed after the call
    pad = lambda x: chunked(pad_time(x, front, back), C)  # noqa: E731
    qc, kc, vc, lc = pad(q), pad(k), pad(v), pad(lam)
    form = form_cls(qc, kc, vc, **{name: pad(x) for name, x in gates.items()})
    device = q.device
    n_final = max(levels_needed(end), levels.shape[1] if levels is not None else 0)

    # intra-chunk levels 0..c
    lev = intra_chunk_levels(C, device=device)
    lam_intra = level_scales_at(lc, lev)
    o = (form.intra * lam_intra * torch.ones(C, C, dtype=q.dtype, device=device).tril()) @ vc

    # incoming state: carry past p0, split into in-chunk buckets (levels <= c) and chunk buckets
    n_chunk_levels = max((end - 1) // C, 1).bit_length()
    partial = None
    if levels is not None:
        levels = carry_past(levels, position) if position > 0 else levels
        n_chunk_levels = max(n_chunk_levels, levels.shape[1] - c - 1)
        levels = F.pad(levels, (0, 0, 0, 0, 0, 0, 0, max(0, c + 1 + n_chunk_levels - levels.shape[1])))
        partial = levels[:, : c + 1].transpose(1, 2)  # [b, H, c+1, K, V]
        H_levels = list(levels[:, c + 1 :].unbind(1))  # each [b, H, K, V]
    else:
        H_levels = [q.new_zeros(b, H, K, V) for _ in range(n_chunk_levels)]

    outs = []
    intra_outs, queries, lams, deposits = by_chunk(o), by_chunk(form.qt), by_chunk(lc), by_chunk(form.deposit)
    for i in range(N):
        chunk = c0 + i
        oi, qt = intra_outs[i], queries[i]  # [b, H, C, V], [b, H, C, K]
        if i == 0 and partial is not None:
            w = level_scales_at(lams[0], incoming_levels(position, C, device))  # [b, H, C, c+1]
            oi = oi + torch.einsum("bhtm,bhtk,bhmkv->bhtv", w, qt, partial)
        if H_levels:
            stacked = torch.stack(H_levels, dim=2)  # [b, H, J, K, V]
            idx = (c + 1 + torch.arange(len(H_levels), device=device)).expand(C, -1)
            w = level_scales_at(lams[i], idx)  # [b, H, C, J]
            oi = oi + torch.einsum("bhtj,bhtk,bhjkv->bhtv", w, qt, stacked)
        outs.append(oi)
        if H_levels:
            flat = torch.stack(H_levels, dim=3).reshape(b, H, K, -1)
            H_levels = list(form.transition(i, flat).reshape(b, H, K, len(H_levels), V).unbind(3))
        if i == N - 1:
            break
        deposit = deposits[i]
        if i == 0 and partial is not None:
            deposit = deposit + form.transition(i, partial.sum(2))
        m = ctz(chunk + 1)
        merged = deposit + sum(H_levels[:m], torch.zeros_like(deposit))
        H_levels = [torch.zeros_like(deposit)] * m + [merged + H_levels[m]] + H_levels[m + 1 :]

    o = torch.stack(outs, dim=2).movedim(1, 3).reshape(b, Tp, H, V)[:, front : front + T] * scale
    final = final_levels(form, H_levels, partial if N == 1 else None, position, end, c0, N, C, c)
    final = F.pad(final, (0, 0, 0, 0, 0, 0, 0, max(0, n_final - final.shape[1])))[:, :n_final]
    return o, final


def final_levels(form, H_levels, partial, position, end, c0, N, C, c) -> torch.Tensor:
    """Token-level state around the last position end-1: levels 0..c from the last chunk, then the H_j.

    form: the chunked variant form (its chunk N-1 is the last); H_levels: J chunk-level states [b, H, K, V];
    partial: the incoming in-chunk buckets [b, H, c+1, K, V] when the call is one chunk, else None, carried past
    the position or not (bucket m goes to level max(m, fenwick.bucket_floor(last, position))); position, end: the
    call's first and end absolute positions; c0: the absolute index of the form's chunk 0; N chunks of C = 2^c
    tokens.  -> [b, c+1+J, H, K, V] in the form's dtype."""
    device = form.qt.device
    last = end - 1
    e = last - (c0 + N - 1) * C  # the last chunk's buckets for query `last`
    buckets = form.bucket_states(N - 1, last_query_masks(e, C, form.qt.dtype, device))  # [b, c+1, H, K, V]
    if partial is not None:
        b, H, M, K, V = partial.shape
        flat = partial.permute(0, 1, 3, 2, 4).reshape(b, H, K, M * V)
        moved = form.transition(N - 1, flat).reshape(b, H, K, M, V).permute(0, 3, 1, 2, 4)  # [b, M, H, K, V]
        buckets = buckets + route_buckets(moved, (bucket_floor(last, position),))
    if H_levels:
        buckets = torch.cat([buckets, torch.stack(H_levels, dim=1)], dim=1)
    return buckets
