"""The chunk-level Fenwick cascade, carried through one scan over chunks (spec sections 4-5).

Chunk-level j (token level c + 1 + j) holds whole chunks. Going from chunk i to i + 1 (absolute chunk
indices), all levels are decayed by the chunk's transition, and with m = ctz(i + 1):

    H_m <- deposit_i + sum_{j <= m} H_j,      H_j <- 0 for j < m          (binary-counter merge)

Chunk i reads every *live* level (its bucket): level j is live at chunk i iff bit j of i is set, or an
initial state was given and no merge above j has happened since the start chunk c0:

    live_j(i) = bit_j(i)  or  (HAS_INIT and i >> (j+1) == c0 >> (j+1))

so dead levels are never loaded. Level states are stored in an fp32 buffer [N, J, H, K, V] (one
[K, V] tile per level, ``ptrs`` = the tile's pointers for level 0, ``stride`` = H*K*V between levels). An element a
thread stores there may be loaded back by another thread of the program (the compiler picks each tile's layout), so
the scans put a barrier (tl.debug_barrier) between one chunk's level stores and the next chunk's loads.
Decays are applied lazily: ``decay[j]`` is the log-decay accumulated since level j was stored, so a chunk
touches only the levels it reads or merges (amortised O(1) merges per chunk). With a scalar gate (Mamba-2) it
is a vector [BJ], one log-decay per level; with a per-channel gate (GLA, PER_CHANNEL) a tile [BJ, BKS], one per
level and state row (the transition diag(exp(g)) scales row k of every K x V state by its own decay).

The backward walks the chunks in reverse with the transposed cascade on the level gradients dH:
split (dH_j <- dH_m for j < m; the deposit's gradient is dH_m; stored once, in level m: split_holder), decay, then
add the reads' gradients.

PLAIN (a constexpr of the helpers the chunk kernels share with the plain path) is the one-level case, plain
linear attention (lambda = 1 throughout): a single chunk level, the running state, into which every chunk's
deposit (the last one's too) merges (m = 0); chunk i reads the value stored after chunk i - 1, or the initial
state at the sequence's first chunk. The scans run it as their own loop with the state in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.shared.common import pick

BLOCK_LEVELS = 2  # the chunk levels merged inside the deposit kernel's blocks of 2^BLOCK_LEVELS chunks (block_merged)


@triton.jit
def sequence_range(n, bos_ptr, eos_ptr, chunk0_ptr, base_ptr):
    """Sequence n of a scan: its first and end token, first absolute chunk and first kernel chunk (int64)."""
    return (tl.load(bos_ptr + n).to(tl.int64), tl.load(eos_ptr + n).to(tl.int64),
            tl.load(chunk0_ptr + n).to(tl.int64), tl.load(base_ptr + n).to(tl.int64))


@triton.jit
def level_tile(levels, n, h, H, J, K, V, kk, vv):
    """Tile (kk, vv) of sequence n's head-h states in levels: [N, J, H, K, V] fp32 -> (ptrs of level 0
    [BK, BV], stride between levels, in-state offsets [BK, BV], mask [BK, BV])."""
    offs = kk[:, None] * V + vv[None, :]
    lmask = (kk[:, None] < K) & (vv[None, :] < V)
    return levels + (n * J * H + h) * K * V + offs, H * K * V, offs, lmask


@triton.jit
def chunk_inputs(tiles, totals, slot, row, t0, r, bos, eos, h, H, offs, mask, kk, K, need, PLAIN: tl.constexpr,
                 PER_CHANNEL: tl.constexpr):
    """What a scan step needs from memory for the chunk at t0 (kernel chunk ``row``) of the sequence [bos, eos): its
    tile in ``slot`` of a per-chunk buffer (the deposit / its gradient: [BKS, BV] fp32; 0 for the sequence's last
    chunk, which deposits nothing unless PLAIN, outside the sequence, and where ``need`` is false: a step that merges
    no tile) and its gate total from totals (store_total; 0 outside): a scalar, or with PER_CHANNEL [BKS] for the
    state rows kk. Loaded one chunk ahead by the scans, off their dependent chain (the reverse scan's next chunk is
    before bos at the sequence's start): nothing is reduced here, so no instruction waits for these loads before the
    chunk is scanned."""
    first = offs * 0 + t0  # the chunk's first token as a tile: the interpreter masks with tensors only
    inside = (first >= bos) & (first < eos) if PLAIN else (first >= bos) & (first + r.shape[0] < eos)
    tile = tl.load(tiles + slot + offs, mask=mask & inside & need, other=0.0)
    if PER_CHANNEL:
        at = kk * 0 + t0
        total = tl.load(totals + (row * H + h) * K + kk, mask=(kk < K) & (at >= bos) & (at < eos), other=0.0)
    else:
        total = tl.load(totals + row * H + h, mask=(t0 >= bos) & (t0 < eos), other=0.0)
    return tile.to(tl.float32), total


@triton.jit
def store_total(totals, row, h, H, K, kk, first, total, PER_CHANNEL: tl.constexpr):
    """Record kernel chunk ``row``'s gate total for the scans (chunk_inputs): totals [NC, H] fp32, written where
    ``first`` (one program of those that computed it), or [NC, H, K] with PER_CHANNEL (total [BK]: the rows kk)."""
    if PER_CHANNEL:
        tl.store(totals + (row * H + h) * K + kk, total, mask=kk < K)
    else:
        tl.store(totals + row * H + h, total, mask=first)


@triton.jit
def no_decays(BJ: tl.constexpr, BKS: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """The lazy log-decays of fresh levels: zeros [BJ], or [BJ, BKS] with PER_CHANNEL."""
    if PER_CHANNEL:
        decay = tl.zeros([BJ, BKS], dtype=tl.float32)
    else:
        decay = tl.zeros([BJ], dtype=tl.float32)
    return decay


@triton.jit
def add_decay(decay, total, PER_CHANNEL: tl.constexpr):
    """Every level decays by a chunk's gate total (a scalar, or [BKS] per state row)."""
    if PER_CHANNEL:
        decay += total[None, :]
    else:
        decay += total
    return decay


@triton.jit
def clear_decays(decay, jj, m, PER_CHANNEL: tl.constexpr):
    """decay with levels 0..m reset to 0 (they were just stored)."""
    if PER_CHANNEL:
        decay = tl.where(jj[:, None] <= m, 0.0, decay)
    else:
        decay = tl.where(jj <= m, 0.0, decay)
    return decay


@triton.jit
def row_decay(total, PER_CHANNEL: tl.constexpr):
    """exp(total) of a chunk's gate total as a factor of a [BKS, BV] state tile: a scalar, or [BKS, 1]."""
    factor = tl.exp(total)
    if PER_CHANNEL:
        factor = factor[:, None]
    return factor


@triton.jit
def store_decays(decays, row, J, K, decay, jj, kk, kb, PER_CHANNEL: tl.constexpr):
    """Record the lazy decays for chunk row ``row``: decays [rows, J] fp32 (written by the first row block kb = 0),
    or [rows, J, K] with PER_CHANNEL (each block its state rows kk)."""
    if PER_CHANNEL:
        tl.store(decays + (row * J + jj[:, None]) * K + kk[None, :], decay,
                 mask=(jj[:, None] < J) & (kk[None, :] < K))
    else:
        tl.store(decays + row * J + jj, decay, mask=(jj < J) & ((jj * 0 + kb) == 0))


@triton.jit
def level_live(chunk, c0, j, HAS_INIT: tl.constexpr, PLAIN: tl.constexpr):
    """Is chunk-level j non-empty (or carrying an initial state) when chunk ``chunk`` reads?"""
    if PLAIN:
        live = (chunk > c0) | HAS_INIT
    else:
        live = ((chunk >> j) & 1) == 1
        if HAS_INIT:
            live = live | ((chunk >> (j + 1)) == (c0 >> (j + 1)))
    return live


@triton.jit
def block_merged(chunk, c0, last, BB: tl.constexpr, HAS_INIT: tl.constexpr):
    """Are the chunk levels below BB merged inside chunk ``chunk``'s block (the aligned 2^BB chunks around it) by
    the deposit kernel (chunk.mamba2_deposit_kernel), so that the forward scan merges only the levels >= BB, after
    the block's last chunk? All blocks of a sequence are except its last (``last``: the sequence's last chunk, which
    deposits nothing) and, with HAS_INIT, its first (which starts from the initial levels): those two go through the
    scan chunk by chunk. Without HAS_INIT a sequence starts at chunk 0, so its blocks are whole. BB <= 2: the deposit
    kernel merges a block with one running sum, and the reverse scan transposes that sum in registers."""
    tl.static_assert(BB <= 2, "one running sum merges blocks of up to four chunks")
    block = chunk >> BB
    merged = block != (last >> BB)
    if HAS_INIT:
        merged = merged & (block != (c0 >> BB))
    return merged


@triton.jit
def merges_tiles(chunk, c0, last, jj, BB: tl.constexpr, BJ: tl.constexpr, HAS_INIT: tl.constexpr):
    """Does a scan step at chunk ``chunk`` (the merge after it, or its transposed split) touch level tiles? Yes where
    the deposit kernel did not merge the chunk's block (block_merged), and after a merged block's last chunk (merge
    target >= BB), where the forward slot holds the block's sum; at the other chunks the forward scan only records
    decays and the reverse scan carries the block's gradient in registers. -> (touches tiles, lowest level to
    merge)."""
    merged = block_merged(chunk, c0, last, BB, HAS_INIT)
    return tl.where(merged, merge_target(chunk, jj, BJ, False) >= BB, True), tl.where(merged, BB, 0)


@triton.jit
def merge_target(chunk, jj, BJ: tl.constexpr, PLAIN: tl.constexpr):
    """m = ctz(chunk + 1) (0 when PLAIN): after chunk ``chunk``, levels 0..m merge into level m
    (jj = arange(BJ))."""
    if PLAIN:
        return tl.min(jj * 0, 0)
    return tl.min(tl.where((((chunk + 1) >> jj) & 1) == 1, jj, BJ), 0)


@triton.jit
def load_level(ptrs, stride, j, mask, decay, jj, PER_CHANNEL: tl.constexpr):
    """The current value of level j: exp(decay[j]) * stored (row by row with PER_CHANNEL).   -> [BK, BV] fp32."""
    if PER_CHANNEL:
        factor = tl.exp(tl.sum(tl.where(jj[:, None] == j, decay, 0.0), 0))[:, None]
    else:
        factor = tl.exp(pick(decay, jj, j))
    return factor * tl.load(ptrs + j * stride, mask=mask, other=0.0)


@triton.jit
def level_source(chunk, c0, j, HAS_INIT: tl.constexpr, PLAIN: tl.constexpr):
    """Where the value of level j that chunk ``chunk`` reads was stored: (kind, back) with kind 1 = by the
    merge after chunk ``chunk - back`` (>= c0), 2 = the initial state (level j not assigned since c0),
    0 = level j is dead.

    Merges into j happen after the chunks e with e + 1 = 2^j mod 2^(j+1) and clears at multiples of
    2^(j+1); so a live level j holds the merge after e = (chunk >> j << j) - 1 (chunk with bit j cleared
    and bits 0..j-1 set) when bit j of chunk is set, else (or when e < c0) the initial state. PLAIN: the
    merge after chunk - 1, or the initial state at c0."""
    if PLAIN:
        e = chunk - 1 + j * 0
        assigned = e >= c0
    else:
        e = ((chunk >> j) << j) - 1
        assigned = (((chunk >> j) & 1) == 1) & (e >= c0)
    kind = tl.where(assigned, 1, tl.where(level_live(chunk, c0, j, HAS_INIT, PLAIN), 2, 0))
    return kind, chunk - e


@triton.jit
def level_read(chunk, c0, n, j, J, held, HAS_INIT: tl.constexpr, PLAIN: tl.constexpr):
    """Does chunk ``chunk`` (of sequence n) read level j (any shape)? Yes for a level stored by a merge
    (level_source kind 1) and, with HAS_INIT, for an initial level (kind 2) that is not all zeros (held [N, J] int8,
    0 where sequence n's initial level j is all zeros: it adds nothing); never for j >= J."""
    kind, _ = level_source(chunk, c0, j, HAS_INIT, PLAIN)
    read = kind == 1
    if HAS_INIT:
        read = read | ((kind == 2) & (tl.load(held + n * J + j, mask=j < J, other=0) != 0))
    return read & (j < J)


@triton.jit
def read_levels(chunk, c0, n, jj, J, held, HAS_INIT: tl.constexpr, PLAIN: tl.constexpr):
    """The levels that chunk ``chunk`` reads (level_read), as a list to loop over without branches (so the loop's
    loads can be pipelined): (live [BJ] bool, rank [BJ] int32 of each live level among them, how many),
    jj = arange(BJ). The list's i-th level: nth_level."""
    live = level_read(chunk, c0, n, jj, J, held, HAS_INIT, PLAIN)
    return live, tl.cumsum(live.to(tl.int32), 0) - 1, tl.sum(live.to(tl.int32), 0)


@triton.jit
def nth_level(live, rank, jj, i):
    """The i-th level of a read_levels list (scalar)."""
    return tl.sum(tl.where(live & (rank == i), jj, 0), 0)


@triton.jit
def merge_levels(ptrs, stride, mask, deposit, decay, jj, chunk, c0, lo, HAS_INIT: tl.constexpr, BJ: tl.constexpr,
                 PER_CHANNEL: tl.constexpr):
    """Forward merge after chunk ``chunk`` (already decayed): H_m = deposit + sum_{lo<=j<=m, live} H_j (lo > 0: the
    levels below lo are in ``deposit`` already, block_merged). Returns (H_m, decay)."""
    m = merge_target(chunk, jj, BJ, False)
    total = deposit
    for j in range(lo, m + 1):
        if level_live(chunk, c0, j, HAS_INIT, False):
            total += load_level(ptrs, stride, j, mask, decay, jj, PER_CHANNEL)
    tl.store(ptrs + m * stride, total, mask=mask)
    return total, clear_decays(decay, jj, m, PER_CHANNEL)


@triton.jit
def flush_levels(ptrs, stride, mask, decay, jj, J, chunk, c0, HAS_INIT: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """Write every level's current value back, dead levels as 0: the forward scan's final states."""
    for j in range(J):
        value = load_level(ptrs, stride, j, mask, decay, jj, PER_CHANNEL)
        value = tl.where(level_live(chunk, c0, j, HAS_INIT, False), value, 0.0)
        tl.store(ptrs + j * stride, value, mask=mask)


@triton.jit
def split_holder(x, j, last, jj, BJ: tl.constexpr):
    """Where the reverse scan keeps level j's gradient once the splits after chunks x..last are done (split_levels
    stores each split's value once, in its target m, though it stands for levels 0..m): the level of the split
    that last assigned j, a = the first chunk >= x with ctz(a + 1) >= j, which is level ctz(a + 1); level j itself
    when a > last (no split assigned it: the final states' gradient). No later split can have overwritten that
    level: a split into it between x and a would also have assigned j. Its lazy decay equals level j's (that split
    cleared both, and none has since)."""
    a = (((x >> j) + 1) << j) - 1
    return tl.where(a <= last, merge_target(a, jj, BJ, False), j)


@triton.jit
def split_levels(ptrs, stride, mask, decay, jj, chunk, last, reads, BJ: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """Transposed merge after chunk ``chunk`` (the reverse scan's splits run after chunks last, last - 1, ...):
    dH_m += reads (the gradient of the merged value from its readers, when the scan does not accumulate them
    itself; else 0), then dH_j <- dH_m for j <= m, stored once, in level m (split_holder finds it).
    Returns (d deposit = dH_m, decay)."""
    m = merge_target(chunk, jj, BJ, False)
    d_deposit = load_level(ptrs, stride, split_holder(chunk + 1, m, last, jj, BJ), mask, decay, jj, PER_CHANNEL)
    d_deposit += reads
    tl.store(ptrs + m * stride, d_deposit, mask=mask)
    return d_deposit, clear_decays(decay, jj, m, PER_CHANNEL)


@triton.jit
def flush_splits(ptrs, stride, mask, decay, jj, J, c0, last, BJ: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """flush_levels after the reverse scan's splits (c0..last): level j's current value from its split_holder,
    levels in increasing order (a level's holder is at or above it, so no level is overwritten before it is read;
    a barrier between levels, as between scan steps)."""
    for j in range(J):
        value = load_level(ptrs, stride, split_holder(c0, j, last, jj, BJ), mask, decay, jj, PER_CHANNEL)
        tl.store(ptrs + j * stride, value, mask=mask)
        tl.debug_barrier()
