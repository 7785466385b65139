"""Log-linear Mamba-2 on the fused Triton kernels: the autograd Function and the backend.

Composition (all sequences of a call in one launch per kernel):
  1. flatten the batch to one token axis; sequence n covers tokens [start_n, end_n) and starts at
     absolute position p_n (0, or its initial state's position);
  2. the kernels start every sequence at a chunk boundary. A state at one: after the carry past that aligned
     position every incoming level is a chunk level (token level > c), and those below the carry's target are 0
     (LevelScanPlan.first_level: not read, no gradient). A state inside a chunk (or at position 0): the sequence's
     kernel chunks start at its first token's chunk start, p_n mod C rows before it (LevelScanPlan.bos); the
     kernels mask those rows (ChunkTable.lows: they read as zero tokens, the identity transition, depositing and
     reading nothing, and are not written; no copy of the inputs), its in-chunk buckets are seeded into the chunk
     level its first chunk's cascade merges them into (torch_chunk.chunk_levels_from, one step for every
     sequence's h0), and seeds.py puts right what the kernels read of them in that chunk and the final state of a
     sequence that ends in it (exact, differentiable; one kernel each way for the first chunk's reads, whatever
     the positions);
  3. forward: a chunk-parallel kernel computes every chunk's deposit, a sequential scan merges them
     through the chunk levels (fwd.py: recording each merged level and every chunk's level
     decays; no GEMM, the states cut into K-row blocks), then a chunk-parallel kernel computes the
     in-chunk block and the readout of every chunk (chunk.py). Backward: a chunk kernel gives dq,
     dlambda (complete) and q.dq; a second one each merged level's gradient from its readers; the reverse
     scan (bwd.py) only the transposed cascade, giving every deposit's gradient; a last chunk
     kernel dk and dv (in-chunk + deposit terms) and the gate gradient's chunk parts (q.dq - k.dk per row and
     chunk totals; _gate_grad sums each row's later rows and chunks). The dk / dv kernel (and the plain path's dq
     kernel) sums a q/k group's heads in registers, several heads per program (shared.launch.group_parts); the
     log-linear dq kernel and a per-channel gate's kernels write dq / dk per value head in the operand dtype, summed
     over the group in fp32 here. Memory: the backward drops the buckets after the dq kernel (their only reader
     there; a second backward recomputes them) and the deposits' gradients once read: at most one [NC, H, K, V]
     buffer and one [tokens, H, K] gradient are alive at a time (the peak: dD and dv during the dk / dv kernel;
     docs/kernels.md);
  4. the final state = the last chunk's in-chunk buckets (torch, differentiable) + the scan's chunk levels.

A plain call (level_scales None: plain Mamba-2 / SSD, lambda = 1, a one-level state) runs the same kernels with
PLAIN set: no alignment (a plain state continues at any position), one chunk level (the running state),
every chunk's deposit merged into it, the final state the scan's (shared/levels.py).

GLA (a log-decay per key channel, g [B, T, H, K]) is the same algorithm with the kernels' PER_CHANNEL switch: the
backend serves every variant whose one gate is a log-decay, scalar (Mamba-2) or per channel (GLA), and reads which
from the variant (``Gate.per_channel``).

The log-decay gate arrives as the caller gave it (the backend is registered with Backend.takes_raw_log_decays) and
is floored where it is read, with no pass over it added: a scalar one [B, T, H] (Mamba-2) by the kernels' loads of
g (shared/intra.chunk_gates), checked by the op (loglinear.ops.finite); a per-channel one (GLA), the largest input
of a call, only through G, the cumsum of max(g, FLOOR) (_read_gate), whose last row per chunk tells whether the
chunk's g is finite (_gate_peak, reported to the op's check). The gate gradient is 0 where g <= FLOOR (_gate_grad);
the torch ops' rows (the seeded first chunks, the final state's last chunk) floor their few tokens in torch
(floor_log_decay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
import triton

from loglinear.fenwick import chunk_bits, ctz, last_query_masks, levels_needed, trailing_zeros
from loglinear.inputs import OpInputs, expand_groups, l2norm
from loglinear.ops.finite import floor_log_decay, log_decay_peak
from loglinear.ops.torch_chunk import chunk_levels_from
from loglinear.ops.triton.mamba2.bwd import mamba2_bwd_scan_kernel
from loglinear.ops.triton.mamba2.chunk import (
    FP32_DOT, mamba2_chunk_bwd_dkv_kernel, mamba2_chunk_bwd_dq_kernel, mamba2_chunk_fwd_kernel, mamba2_deposit_kernel,
    mamba2_gate_grad_kernel, mamba2_gate_later_kernel, mamba2_initial_grad_kernel, mamba2_initial_reads_kernel,
    mamba2_level_grad_kernel,
)
from loglinear.ops.triton.mamba2.fwd import mamba2_fwd_kernel
from loglinear.ops.triton.mamba2.seeds import (FirstChunks, Seeds, add_seed_reads, first_chunks, first_levels,
                                              seed_read_grads)
from loglinear.ops.triton.shared.common import MAX_CHUNK_LEVELS, alloc, group_sum, interpreting, next_pow2
from loglinear.ops.triton.shared.heads import min_head_dim, run_padded, run_value_slices
from loglinear.ops.triton.shared.intra_channel import (
    KEY_BLOCK, SUB_CHUNK, channel_cumsum_kernel, channel_dk_kernel, channel_dq_kernel, channel_scores_kernel,
)
from loglinear.ops.triton.shared.launch import group_parts, launch, launch_options
from loglinear.ops.triton.shared.levels import BLOCK_LEVELS
from loglinear.ops.triton.shared.rules import dot_precision, kernel_chunk_size
from loglinear.state import FenwickState
from loglinear.tables import cached_table, device_table, table_cache

__all__ = ["supports", "backend", "LevelScanPlan"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_CHUNK = 64  # the kernels' chunk cap (shared.rules.kernel_chunk_size): tiles fit sm_90's shared memory
MAX_K = 256  # wider keys run on the torch chunk path (supports)
# by operand size, the most elements of a [K, V] state tile (K padded to a power of two) and the most value columns
# the chunk kernels take in one call: 16-bit operands up to K = 256, V = 128 or K = 128, V = 256 (the plain dk / dv
# kernel's [C, V] sums at V = 512 fail ptxas's register allocation), fp32 (tf32x3: split operands, twice the shared
# memory) up to K = V = 128 or K = 256, V = 64 (GLA's plain dq kernel at K = 64, V = 256: 256 KB); wider values run
# in slices (value_slice; sm_90 compiles: benchmarks/profiling/compile_sm90.py)
VALUE_SLICE = {2: (128 * 256, 256), 4: (128 * 128, 128)}
SCAN_ROWS = 16  # K rows per program of the scans
DEPOSIT_ROWS = 128  # K rows per deposit program (its running sum and the deposit: two fp32 tiles; 64 ran slower)
INITIAL_READS_BLOCK = 4096  # elements of the initial levels one program of mamba2_initial_reads_kernel reads
INITIAL_READERS = 32  # reader chunks per program of the initial levels' gradient (fewer: more segments)
INITIAL_GRAD_BYTES = 256 << 20  # at most this much for its segments' partial sums (more readers per program)
GATE_LATER_BLOCK = 16  # chunks per load of the gate gradient's sums over later chunks (mamba2_gate_later_kernel)
LONG_READS = 5  # level-gradient programs of buckets at this level or higher (2^5+ readers) start first (ChunkTable)


@dataclass
class ChunkTable:
    """The kernel chunks of all sequences, int32 [NC] each: first row, first token of the sequence in it (``lows``:
    after the first row in a sequence's first chunk when the sequence starts inside it, the rows before masked), the
    sequence's end, the sequence, the absolute chunk index, ``grad_order``: the level-gradient kernel's launch order,
    and ``last``: each one's last token; ``base`` [N]: each sequence's first row.

    ``grad_order`` puts the chunks whose merged level is LONG_READS or higher first, highest first (the longest
    reader loops start first and do not trail at the end), then the rest in position order, so that programs
    running side by side read the same dO rows while L2 holds them (levels strictly by height: each level's pass
    streamed dO from DRAM again)."""

    starts: torch.Tensor
    lows: torch.Tensor
    ends: torch.Tensor
    seqs: torch.Tensor
    chunks: torch.Tensor
    grad_order: torch.Tensor
    last: torch.Tensor
    base: torch.Tensor


@dataclass
class LevelScanPlan:
    """Where the kernels run: sequence n covers tokens [los[n], eos[n]) of the flat axis; its kernel chunks start at
    bos[n] <= los[n], the start of the absolute chunk chunk0[n] (a sequence whose state is inside a chunk: the rows
    bos[n] .. los[n] - 1 are masked front padding, bos[n] may be negative)."""

    bos: list[int]
    los: list[int]
    eos: list[int]
    chunk0: list[int]
    chunk_size: int
    num_levels: int  # J chunk levels
    has_init: bool
    scale: float
    plain: bool = False
    per_channel: bool = False  # g [tokens, H, K] (GLA), else [tokens, H]
    first_level: int = 0  # chunk levels below it are 0 in every h0 (the carry cleared them): not read, no gradient

    def device_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """bos, eos, chunk0 as int32 [N] tensors on ``device`` (cached, see _tables)."""
        return self._cached_tables(device)[0]

    def chunk_table(self, device: torch.device) -> ChunkTable:
        """Every kernel chunk of every sequence, in sequence order (see ChunkTable; cached, see _tables)."""
        return self._cached_tables(device)[1]

    def _cached_tables(self, device: torch.device) -> tuple[tuple[torch.Tensor, ...], ChunkTable]:
        return _tables(tuple(self.bos), tuple(self.los), tuple(self.eos), tuple(self.chunk0), self.chunk_size, device)


@table_cache()
def _tables(bos: tuple[int, ...], los: tuple[int, ...], eos: tuple[int, ...], chunk0: tuple[int, ...], C: int,
            device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ChunkTable]:
    """The plan's index tensors on ``device``: (bos, eos, chunk0) int32 [N] and the ChunkTable.

    Built on the host and copied once per distinct plan: repeated calls at the same shapes (training, decoding
    prefills, benchmarks) reuse them, so a call does no host-to-device copy and no host tensor work (on the
    H200, a contended host took ~2 ms per call for this table alone)."""
    counts = torch.tensor([triton.cdiv(b - a, C) for a, b in zip(bos, eos)], dtype=torch.long)
    seqs = torch.repeat_interleave(torch.arange(len(bos)), counts)
    base = torch.cumsum(counts, 0) - counts
    local = torch.arange(len(seqs)) - base[seqs]
    starts = torch.tensor(bos, dtype=torch.long)[seqs] + local * C
    chunks = torch.tensor(chunk0, dtype=torch.long)[seqs] + local
    merged = trailing_zeros(chunks + 1)  # the level merged after each chunk
    grad_order = torch.argsort(torch.where(merged >= LONG_READS, merged, -1), descending=True, stable=True)
    N, NC = len(bos), len(seqs)
    ends = torch.tensor(eos, dtype=torch.long)[seqs]
    lows = torch.maximum(starts, torch.tensor(los, dtype=torch.long)[seqs])
    packed = torch.cat([torch.tensor([bos, eos, chunk0], dtype=torch.long).flatten(), starts, lows, ends, seqs, chunks,
                        grad_order, torch.minimum(starts + C, ends) - 1, base])
    packed = device_table(packed, torch.int32, device)
    ranges, rows = packed[: 3 * N].view(3, N), packed[3 * N :]
    return (ranges[0], ranges[1], ranges[2]), ChunkTable(*rows[: 7 * NC].view(7, NC), rows[7 * NC :])


def _blocks(q: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """The whole blocks of K and V (BK, BV)."""
    return next_pow2(q.shape[-1]), next_pow2(v.shape[-1])


def _scan_rows(q: torch.Tensor) -> int:
    """A scan's block of K rows: SCAN_ROWS (no scan multiplies tiles: many small programs over contiguous rows of the
    [K, V] states)."""
    return min(SCAN_ROWS, next_pow2(q.shape[-1]))


def _sizes(plan: LevelScanPlan, q: torch.Tensor, v: torch.Tensor) -> dict:
    """Runtime sizes and constexprs of the chunk kernels (those reading levels also take J = plan.num_levels)."""
    return dict(H=v.shape[1], G=q.shape[1], K=q.shape[-1], V=v.shape[-1], C=plan.chunk_size,
                PRECISION=dot_precision(q.dtype, FP32_DOT), PER_CHANNEL=plan.per_channel)


def _launch(kernel, plan: LevelScanPlan, keys: torch.Tensor, values: torch.Tensor) -> dict[str, int]:
    """The launch config of a Mamba-2 kernel for this plan, its operands keys [tokens, G, K] (q or k: their dtype)
    and values [tokens, H, V] (v or dO) (shared.launch.launch_options: per-channel gates take the kernels'
    ``channel`` config, the plain path their ``plain`` one, fp32 operands their ``fp32`` one; blocks of K or V above
    128 at most two stages)."""
    block = max(_blocks(keys, values))
    return launch_options(kernel, per_channel=plan.per_channel, plain=plan.plain, fp32=keys.dtype == torch.float32,
                          block=block)


def _gate_shape(plan: LevelScanPlan, rows: int, H: int, K: int) -> tuple[int, ...]:
    """Shape of a per-gate tensor of ``rows`` rows: [rows, H], or [rows, H, K] per channel."""
    return (rows, H, K) if plan.per_channel else (rows, H)


def _gate_grad(d_gate: torch.Tensor, totals: torch.Tensor, g: torch.Tensor, gate: torch.Tensor,
               table: ChunkTable, plan: LevelScanPlan) -> torch.Tensor:
    """dg [tokens, H] ([tokens, H, K] per channel) in g's dtype, dg_u = the sum of dGs over u and the later tokens
    of its sequence, from the dk / dv kernel's chunk parts: d_gate (fp32) holds dGs on every kernel row, totals
    [NC, H(, K)] fp32 each chunk's sum. mamba2_gate_grad_kernel gives every row the sum over its chunk's rows from
    it on plus the totals of its sequence's later chunks (mamba2_gate_later_kernel, summed per sequence in fp64);
    0 where the gate g (the call's, unfloored) is <= FLOOR (per channel g is read only in the chunks whose G, gate
    from _read_gate, reaches the floor)."""
    NC, H = totals.shape[:2]
    dg = alloc(tuple(d_gate.shape), g.dtype, d_gate.device)
    if NC:
        K = d_gate.shape[-1] if plan.per_channel else 1
        later, N = alloc(tuple(totals.shape), torch.float32, totals.device), table.base.numel()
        launch(mamba2_gate_later_kernel, (N, H), totals, later, table.base, H=H, K=K, N=N, NC=NC, R=GATE_LATER_BLOCK,
               BK=next_pow2(K), **launch_options(mamba2_gate_later_kernel))
        launch(mamba2_gate_grad_kernel, (NC * H,), d_gate, later, g, gate, dg, table.starts, table.lows, table.ends,
               H=H, K=K, C=plan.chunk_size, BK=next_pow2(K), PER_CHANNEL=plan.per_channel,
               **launch_options(mamba2_gate_grad_kernel))
    return dg


def _group_grad(x: torch.Tensor, groups: int, plan: LevelScanPlan, dtype: torch.dtype) -> torch.Tensor:
    """The kernels' sums over parts of each group x [tokens, S * groups, K] (group_parts) -> [tokens, groups, K] in
    ``dtype``: a group's S parts summed in fp32 (x itself when S = 1)."""
    return group_sum(x, groups, 1).to(dtype)


def _merge_levels(k, v, gate, levels, ranges, table: ChunkTable, plan: LevelScanPlan) -> tuple[torch.Tensor, ...]:
    """The chunks' deposits (merged inside blocks of 2^BLOCK_LEVELS chunks: levels.block_merged; plain: every
    chunk's own), then the chunk-level scan merging them (levels [N, J, H, K, V] fp32: the initial
    states in, the final ones out; gate: what the kernels read of g, _read_gate). -> buckets [NC, H, K, V]
    (k's dtype), decays [NC, H, J] ([NC, H, J, K] per channel) fp32, the chunks' gate totals [NC, H] ([NC, H, K])
    fp32 (levels.store_total: the scans read them instead of the gate)."""
    BK, BV = _blocks(k, v)
    (N, H), NC = (len(plan.bos), v.shape[1]), table.starts.numel()
    buckets = alloc((NC, H, k.shape[-1], v.shape[-1]), k.dtype, k.device)  # deposits, then merged levels
    J = plan.num_levels if not plan.plain else 0  # plain: no decays
    decays = alloc((NC, H, J, k.shape[-1]) if plan.per_channel else (NC, H, J), torch.float32, k.device)
    totals = alloc(_gate_shape(plan, NC, H, k.shape[-1]), torch.float32, k.device)
    if NC:
        rows = min(DEPOSIT_ROWS, BK)
        launch(mamba2_deposit_kernel, (NC * H, triton.cdiv(k.shape[-1], rows)),
            k, v, gate, buckets, totals, table.starts, table.lows, table.ends, table.seqs, table.chunks, ranges[2],
            BK=rows, BV=BV, BB=0 if plan.plain else BLOCK_LEVELS, HAS_INIT=plan.has_init, PLAIN=plan.plain,
            **_sizes(plan, k, v), **_launch(mamba2_deposit_kernel, plan, k, v),
        )
    BKS = _scan_rows(k)
    launch(mamba2_fwd_kernel, (N, H, triton.cdiv(k.shape[-1], BKS)),
        levels, buckets, decays, totals, *ranges, table.base, H=H, K=k.shape[-1], V=v.shape[-1], J=plan.num_levels,
        C=plan.chunk_size, BKS=BKS, BV=BV, BJ=MAX_CHUNK_LEVELS, BB=BLOCK_LEVELS, HAS_INIT=plan.has_init,
        PLAIN=plan.plain, PER_CHANNEL=plan.per_channel, **_launch(mamba2_fwd_kernel, plan, k, v),
    )
    return buckets, decays, totals


@dataclass
class _Saved:
    """What the backward needs besides save_for_backward's tensors: the chunk table, the merged levels
    ``buckets`` [NC, H, K, V] (k's dtype; None once a backward took them), the level decays [NC, H, J] fp32, the
    chunks' gate totals (_merge_levels), what the kernels read of the gate (_read_gate: per channel G [tokens, H, K]
    fp32, else g) and, per channel, the in-chunk scores P [tokens, H, C] in q's dtype (_channel_scores; None once a
    backward took them), and what the chunk kernels read of the initial states (_initial_reads: formed once, read by
    the forward and dq kernels)."""

    table: ChunkTable
    buckets: torch.Tensor | None
    decays: torch.Tensor
    totals: torch.Tensor
    gate: torch.Tensor
    scores: torch.Tensor | None
    initial: tuple[torch.Tensor, torch.Tensor]

    def take_buckets(self, k, v, gate, h0, ranges, plan: LevelScanPlan) -> torch.Tensor:
        """The buckets, no longer held here, so the backward frees them after their only reader (the dq
        kernel). A second backward through the graph (retain_graph=True) recomputes them from h0."""
        buckets, self.buckets = self.buckets, None
        if buckets is None:
            levels = h0.detach().clone(memory_format=torch.contiguous_format)
            buckets = _merge_levels(k, v, gate, levels, ranges, self.table, plan)[0]
        return buckets

    def take_scores(self, q, k, gate, plan: LevelScanPlan) -> torch.Tensor:
        """The in-chunk scores, no longer held here (freed after the backward's last reader); a second backward
        recomputes them."""
        scores, self.scores = self.scores, None
        return _channel_scores(q, k, gate, self.table, plan) if scores is None else scores


def _initial_reads(h0: torch.Tensor, q: torch.Tensor, plan: LevelScanPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """What the chunk kernels read of the initial states h0 [N, J, H, K, V] fp32: h0 in q's dtype (their readouts
    round every level to it, so the same products) and held [N, J] int8, 0 for an all-zero level, which they skip
    (a state a call leaves holds only its position's levels), both from one read of h0
    (mamba2_initial_reads_kernel). Levels below plan.first_level are 0 by construction: held 0 without a read, and
    not converted (never read). Without states: h0 and h0 (never read)."""
    if not plan.has_init:
        return h0, h0
    (N, J, H, K, V), j0 = h0.shape, plan.first_level
    h0 = h0.contiguous()
    held = torch.zeros(N, J, dtype=torch.int8, device=h0.device)
    converted = h0 if h0.dtype == q.dtype else alloc(tuple(h0.shape), q.dtype, h0.device)
    if J > j0:
        launch(mamba2_initial_reads_kernel, (N * (J - j0), triton.cdiv(H * K * V, INITIAL_READS_BLOCK)),
            h0, converted, held, j0, J, H, K, V, CONVERT=converted is not h0, BLOCK=INITIAL_READS_BLOCK,
            **launch_options(mamba2_initial_reads_kernel),
        )
    return converted, held


def _forward(q, k, v, gate, lam, h0, o, levels, ranges, plan: LevelScanPlan) -> _Saved:
    """The deposits and the chunk-level scan (levels in/out), then the chunk kernel writing o (gate: _read_gate's;
    what it reads of h0, _initial_reads, is kept for the backward)."""
    BK, BV = _blocks(q, v)
    table = plan.chunk_table(q.device)
    buckets, decays, totals = _merge_levels(k, v, gate, levels, ranges, table, plan)
    NC, scores = table.starts.numel(), _channel_scores(q, k, gate, table, plan)
    initial = _initial_reads(h0, q, plan)
    if NC:
        launch(mamba2_chunk_fwd_kernel, (NC * v.shape[1],),
            q, k, v, gate, lam, o, *initial, buckets, decays, scores,
            table.starts, table.lows, table.ends, table.seqs, table.chunks, ranges[2], plan.scale, L=lam.shape[-1],
            J=plan.num_levels, LOG_C=chunk_bits(plan.chunk_size), BK=BK, BV=BV, BJ=MAX_CHUNK_LEVELS,
            HAS_INIT=plan.has_init, PLAIN=plan.plain, **_sizes(plan, q, v),
            **_launch(mamba2_chunk_fwd_kernel, plan, q, v),
        )
    return _Saved(table, buckets, decays, totals, gate, scores, initial)


def _read_gate(g, plan: LevelScanPlan, report: Callable[[torch.Tensor], None] | None) -> torch.Tensor:
    """What every kernel reads of the gate: the raw g [tokens, H] itself for a scalar gate (the kernels floor it,
    the op checks it); per channel G [tokens, H, K] fp32, the chunk-local cumsum of max(g, FLOOR)
    (intra_channel.channel_cumsum_kernel), formed once per call (kept for the backward) and read by the scans, the
    chunk kernels, the in-chunk kernels and the gate gradient, and g's peak to ``report`` (OpInputs.report_finite)
    when set (_gate_peak)."""
    if not plan.per_channel:
        return g
    (tokens, H, K), table = g.shape, plan.chunk_table(g.device)
    cum = alloc((tokens, H, K), torch.float32, g.device)
    launch(channel_cumsum_kernel, (table.starts.numel(), H), g, cum, table.starts, table.lows, table.ends, H=H, K=K,
           C=plan.chunk_size, BK=next_pow2(K), **launch_options(channel_cumsum_kernel))
    if report is not None:
        report(_gate_peak(g, cum, table, plan))
    return cum


def _gate_peak(g, cum, table: ChunkTable, plan: LevelScanPlan) -> torch.Tensor:
    """A scalar on g's device that is NaN or +inf when the per-channel gate g [tokens, H, K] holds a NaN or a +inf:
    the largest entry of G (cum) at the last token of each kernel chunk, which is NaN or +inf whenever a g of the
    chunk is (a sum of max(g, FLOOR), NaN kept, no term -inf): [NC, H, K] instead of all of g. (A sum that
    overflows to +inf fails too: the op then reads the inputs again and finds them finite.)"""
    if not table.last.numel():
        return torch.zeros((), dtype=torch.float32, device=g.device)
    return log_decay_peak([cum.index_select(0, table.last)])


def _key_blocks(K: int) -> tuple[int, int]:
    """(BK, KB): the whole block of K and the key channels per block of the in-chunk kernels."""
    BK = next_pow2(K)
    return BK, min(KEY_BLOCK, BK)


def _channel_scores(q, k, gate, table: ChunkTable, plan: LevelScanPlan) -> torch.Tensor:
    """Per-channel gates (gate = G, _read_gate): the in-chunk scores P [tokens, H, C] of every kernel chunk, in
    q's dtype (intra_channel.channel_scores_kernel; computed in fp32, rounded as the products that read them round
    P * Lambda). A scalar gate: gate, which the chunk kernels then do not read."""
    NC = table.starts.numel()
    if not plan.per_channel or not NC:
        return gate
    (tokens, H, K), C = gate.shape, plan.chunk_size
    scores = alloc((tokens, H, C), q.dtype, q.device)
    BK, KB = _key_blocks(K)
    launch(channel_scores_kernel, (NC * (C // SUB_CHUNK), H),
        q, k, gate, scores, table.starts, table.lows, table.ends, H=H, G=q.shape[1], K=K, C=C,
        S=SUB_CHUNK, BK=BK, KB=KB, PRECISION=dot_precision(q.dtype, FP32_DOT), **launch_options(channel_scores_kernel),
    )
    return scores


def _channel_intra_grads(q, k, v, cum, lam, d_o, table: ChunkTable, plan: LevelScanPlan
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel gates (cum = G, _read_gate): the in-chunk dQ and dK [tokens, H, K] in q's dtype (per value head) of
    every kernel chunk (intra_channel.channel_dq_kernel, channel_dk_kernel). A scalar gate: (cum, cum), which the
    chunk kernels then do not read."""
    NC, H, K = table.starts.numel(), v.shape[1], q.shape[-1]
    if not plan.per_channel or not NC:
        return cum, cum
    dq_in, dk_in = (alloc((v.shape[0], H, K), q.dtype, q.device) for _ in range(2))
    C, (BK, KB) = plan.chunk_size, _key_blocks(K)
    sizes = dict(H=H, G=q.shape[1], K=K, V=v.shape[-1], L=lam.shape[-1], C=C, S=SUB_CHUNK, LOG_C=chunk_bits(C),
                 BK=BK, KB=KB, BV=next_pow2(v.shape[-1]), PRECISION=dot_precision(q.dtype, FP32_DOT), PLAIN=plan.plain)
    grid = (NC * (C // SUB_CHUNK) * (BK // KB), H)
    launch(channel_dq_kernel, grid, q, k, v, cum, lam, d_o, dq_in, table.starts, table.lows, table.ends, plan.scale,
           **sizes, **launch_options(channel_dq_kernel))
    launch(channel_dk_kernel, grid, q, k, v, cum, lam, d_o, dk_in, table.starts, table.lows, table.ends, plan.scale,
           **sizes, **launch_options(channel_dk_kernel))
    return dq_in, dk_in


def _chunk_sizes(plan: LevelScanPlan, q: torch.Tensor, v: torch.Tensor, lam: torch.Tensor) -> dict:
    """_sizes plus L, LOG_C and the whole blocks BK, BV: what every backward chunk kernel takes."""
    BK, BV = _blocks(q, v)
    return dict(L=lam.shape[-1], LOG_C=chunk_bits(plan.chunk_size), BK=BK, BV=BV, PLAIN=plan.plain,
                **_sizes(plan, q, v))


def _dq_grads(q, k, v, gate, lam, d_o, ranges, buckets, scores, saved: _Saved, plan: LevelScanPlan) -> tuple:
    """mamba2_chunk_bwd_dq_kernel, the only backward reader of the buckets (per channel after
    _channel_intra_grads, whose dQ it completes). -> dq's parts [tokens, G * S, K] (group_parts: per value head
    with levels or a per-channel gate; _group_grad sums them), dlam [tokens, H, L] (lam's
    dtype; None when plain), q.dq [tokens, H] fp32 (per value head; [tokens, H, K] per channel), the in-chunk
    dK for the dk / dv kernel (per channel; else gate) and the level gradient's queries: per channel
    Q * exp(G) [tokens, H, K] (q's dtype, per value head), else q."""
    (tokens, H), K, L, table = v.shape[:2], q.shape[-1], lam.shape[-1], saved.table
    # per head with a per-channel gate (its gate term), and with levels (shared.launch: measured slower summed)
    HP, dq = group_parts(table.starts.numel(), (tokens,), H, q.shape[1], K, q.dtype, q.device,
                         per_head=plan.per_channel or not plan.plain)
    dlam = alloc(tuple(lam.shape), lam.dtype, q.device) if not plan.plain else gate  # never written when plain
    qdq = alloc(_gate_shape(plan, tokens, H, K), torch.float32, q.device)
    q_dec = alloc((tokens, H, K), q.dtype, q.device) if plan.per_channel else q  # a scalar gate: never written
    dq_in, dk_in = _channel_intra_grads(q, k, v, gate, lam, d_o, table, plan)
    if table.starts.numel():
        launch(mamba2_chunk_bwd_dq_kernel, (table.starts.numel() * H // HP,),
            q, k, v, gate, lam, d_o, *saved.initial, buckets, saved.decays, scores, dq_in,
            table.starts, table.lows, table.ends, table.seqs, table.chunks, ranges[2], plan.scale, dq, dlam, qdq,
            q_dec, HP=HP, BL=next_pow2(L, minimum=32), BJ=MAX_CHUNK_LEVELS, J=plan.num_levels, HAS_INIT=plan.has_init,
            **_chunk_sizes(plan, q, v, lam), **_launch(mamba2_chunk_bwd_dq_kernel, plan, q, v),
        )
    del dq_in
    if plan.plain:
        return dq, None, qdq, dk_in, q_dec
    return dq, dlam, qdq, dk_in, q_dec


def _initial_read_grads(q, readers, gate, lam, d_o, ranges, saved: _Saved, plan: LevelScanPlan) -> torch.Tensor:
    """The initial levels' gradients from their readers (mamba2_initial_grad_kernel; readers: the queries
    _dq_grads gives it): each level's readers cut into S runs of about INITIAL_READERS chunks (fewer, longer runs
    where the partial sums would pass INITIAL_GRAD_BYTES), summed here.
    -> levels plan.first_level .. J-1 [N, J - first_level, H, K, V] fp32 (those below are 0 in h0: no gradient)."""
    (N, H), J, j0, table = (len(plan.bos), d_o.shape[1]), plan.num_levels, plan.first_level, saved.table
    chunks = max(triton.cdiv(b - a, plan.chunk_size) for a, b in zip(plan.bos, plan.eos))
    shape = (N, J - j0, H, q.shape[-1], d_o.shape[-1])
    S = max(1, min(triton.cdiv(chunks, INITIAL_READERS), INITIAL_GRAD_BYTES // (4 * math.prod(shape))))
    d_init = alloc((S, *shape), torch.float32, q.device)
    launch(mamba2_initial_grad_kernel, (S * math.prod(shape[:3]),),
        readers, gate, lam, d_o, saved.decays, *ranges, table.base, table.lows, d_init, plan.scale, N=N, S=S, J0=j0,
        J=J, **_chunk_sizes(plan, q, d_o, lam), **_launch(mamba2_initial_grad_kernel, plan, q, d_o),
    )
    return d_init.sum(0) if S > 1 else d_init[0]


def _deposit_grads(q, readers, gate, lam, d_o, d_levels, ranges, saved: _Saved, plan: LevelScanPlan
                   ) -> torch.Tensor:
    """The merged levels' gradients dB from their readers (mamba2_level_grad_kernel, reading the queries
    ``readers`` that _dq_grads gives), then the reverse scan turning them into the deposits' gradients dD, in
    place (d_levels: the final levels' gradient in, the initial ones' out, with their readers' terms added from
    plan.first_level on).
    -> dD [NC, H, K, V] (q's dtype)."""
    (N, H), table, J = (len(plan.bos), d_o.shape[1]), saved.table, plan.num_levels
    NC, chunk = table.starts.numel(), _chunk_sizes(plan, q, d_o, lam)
    d_buckets = alloc((NC, H, q.shape[-1], d_o.shape[-1]), q.dtype, q.device)
    if NC:
        launch(mamba2_level_grad_kernel, (NC * H,),
            readers, gate, lam, d_o, saved.decays, table.starts, table.lows, table.ends, table.chunks, table.grad_order,
            d_buckets, plan.scale, J=J, BJ=MAX_CHUNK_LEVELS, **chunk,
            **_launch(mamba2_level_grad_kernel, plan, q, d_o),
        )
    BKS = _scan_rows(q)
    launch(mamba2_bwd_scan_kernel, (N, H, triton.cdiv(q.shape[-1], BKS)),
        saved.totals, d_levels, d_buckets, *ranges, table.base, H=H, K=q.shape[-1], V=d_o.shape[-1], J=J,
        C=plan.chunk_size, BKS=BKS, BV=chunk["BV"], BJ=MAX_CHUNK_LEVELS, BB=BLOCK_LEVELS, HAS_INIT=plan.has_init,
        PLAIN=plan.plain, PER_CHANNEL=plan.per_channel,
        **_launch(mamba2_bwd_scan_kernel, plan, q, d_o),
    )
    if plan.has_init and NC:
        d_levels[:, plan.first_level :].add_(_initial_read_grads(q, readers, gate, lam, d_o, ranges, saved, plan))
    return d_buckets


def _dkv_grads(q, k, v, gate, lam, d_o, d_deposits, scores, dk_in, d_gate, final_terms, ranges, table: ChunkTable,
               plan: LevelScanPlan, g: torch.Tensor) -> tuple:
    """mamba2_chunk_bwd_dkv_kernel (in-chunk + deposit terms; per channel it reads the in-chunk dK dk_in and the
    scores) and the gate gradient's chunk parts in d_gate and the chunk totals. -> dk [tokens, G, K] (k's dtype),
    dv [tokens, H, V] (v's dtype), dg [tokens, H] ([tokens, H, K] per channel) in g's dtype (_gate_grad; g: the
    call's gate)."""
    H, K, NC = v.shape[1], k.shape[-1], table.starts.numel()
    HP, dk = group_parts(NC, v.shape[:1], H, k.shape[1], K, k.dtype, k.device, per_head=plan.per_channel)
    dv = alloc(tuple(v.shape), v.dtype, v.device)
    totals = alloc(_gate_shape(plan, NC, H, K), torch.float32, k.device)
    if NC:
        launch(mamba2_chunk_bwd_dkv_kernel, (NC * H // HP,),
            q, k, v, gate, lam, d_o, d_deposits, scores, dk_in, table.starts, table.lows, table.ends, table.seqs,
            ranges[1], final_terms, plan.scale, dk, dv, d_gate, totals, HP=HP, **_chunk_sizes(plan, q, v, lam),
            **_launch(mamba2_chunk_bwd_dkv_kernel, plan, q, v),
        )
    return _group_grad(dk, k.shape[1], plan, k.dtype), dv, _gate_grad(d_gate, totals, g, gate, table, plan)


class LevelScanMamba2(torch.autograd.Function):
    """(q, k, v, g, gate, lam, h0, plan, rows, seeds, first) -> (o, chunk-level final states, and with rows k, v, g
    there) on the kernels.

    q, k: [tokens, G, K]; v: [tokens, H, V]; g: [tokens, H] or [tokens, H, K] per channel, unfloored (the kernels
    floor it); gate: what the kernels read of g (_read_gate; no gradient); lam: [tokens, H, L] (plain:
    not read, no gradient);
    h0: [N, J, H, K, V] fp32 chunk-level initial states (plain: J = 1, the state); rows: [n] int64 unique tokens
    whose k, v, g a final state's torch ops read (_Rows), or None; seeds: the seeded sequences' in-chunk levels
    [R, c+1, H, K, V] fp32 (Seeds.levels) whose reads in their first chunks ``first`` the kernels' o takes
    (seeds.add_seed_reads; its gradients seeds.seed_read_grads, added into the kernels'), or None. Returns o:
    [tokens, H, V] (rows outside the plan's sequences unwritten), the final chunk levels [N, J, H, K, V] fp32 and,
    with rows, k, v and g at those rows (_Rows.NAMES), whose gradients the backward adds into the kernels' there."""

    @staticmethod
    def forward(ctx, q, k, v, g, gate, lam, h0, plan: LevelScanPlan, rows: torch.Tensor | None,
                seeds: torch.Tensor | None = None, first: FirstChunks | None = None):
        ranges = plan.device_tensors(q.device)
        o = alloc(tuple(v.shape), v.dtype, v.device)
        levels = h0.detach().clone(memory_format=torch.contiguous_format)
        ctx.saved = _forward(q, k, v, gate, lam, h0, o, levels, ranges, plan)
        if seeds is not None:
            seeds = seeds.contiguous()
            add_seed_reads(o, q, g, lam, seeds, first, plan.scale)
        ctx.plan, ctx.ranges, ctx.rows, ctx.first = plan, ranges, rows, first
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None, not as zeros
        ctx.save_for_backward(q, k, v, g, lam, h0, levels, seeds)
        if rows is None:
            return o, levels
        return o, levels, *(x.index_select(0, rows) for x in (k, v, g))  # _Rows.NAMES

    @staticmethod
    def backward(ctx, d_o, d_final, *d_rows):
        """Three stages, each freeing its largest input when it returns: the dq kernel (the buckets, whose
        only reader it is) and the seeded first chunks' reads, the deposits' gradients dD, the dk / dv kernel
        (dD)."""
        q, k, v, g, lam, h0, final, seeds = ctx.saved_tensors
        plan, saved, ranges = ctx.plan, ctx.saved, ctx.ranges
        d_o = torch.zeros_like(v) if d_o is None else d_o.to(v.dtype).contiguous()
        gate = saved.gate
        buckets = saved.take_buckets(k, v, gate, h0, ranges, plan)
        scores = saved.take_scores(q, k, gate, plan)
        dq, dlam, qdq, dk_in, readers = _dq_grads(q, k, v, gate, lam, d_o, ranges, buckets, scores, saved, plan)
        del buckets
        d_seeds = None if seeds is None else seed_read_grads(d_o, q, g, lam, seeds, ctx.first, plan.scale, dq, qdq,
                                                             dlam)
        dq = _group_grad(dq, q.shape[1], plan, q.dtype)
        d_levels, final_terms = _final_grads(d_final, final, plan)
        d_deposits = _deposit_grads(q, readers, gate, lam, d_o, d_levels, ranges, saved, plan)
        del readers
        dk, dv, dg = _dkv_grads(q, k, v, gate, lam, d_o, d_deposits, scores, dk_in, qdq, final_terms, ranges,
                                saved.table, plan, g)
        del d_deposits, scores, dk_in, gate
        grads = dict(k=dk, v=dv, g=dg)
        for name, d in zip(_Rows.NAMES, d_rows):
            if d is not None:  # the rows' own gradients, in place: the rows are unique, so each element takes
                grads[name].index_add_(0, ctx.rows, d.to(grads[name].dtype))  # one add (deterministic)
        d_h0 = d_levels if plan.has_init else None
        return dq, dk, dv, dg, None, dlam, d_h0, None, None, d_seeds, None


def _final_grads(d_final: torch.Tensor | None, final: torch.Tensor, plan: LevelScanPlan
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """From the final chunk levels' gradient d_final [N, J, H, K, V] (None: not used, zeros) and the levels final:
    d_levels, the backward scan's levels (a fp32 copy it works in) and the final states' gate term sum(dS * S) over
    levels and values [N, H, K] ([N, H] for a scalar gate) fp32."""
    N, _, H, K, _ = final.shape
    if d_final is None:
        return torch.zeros_like(final), final.new_zeros(_gate_shape(plan, N, H, K))
    d_final = d_final.float()
    terms = (d_final * final).sum((1, 4))
    terms = terms if plan.per_channel else terms.sum(-1)
    return d_final.clone(memory_format=torch.contiguous_format), terms.contiguous()


@table_cache()
def _last_chunks(bos: tuple[int, ...], los: tuple[int, ...], eos: tuple[int, ...], C: int, device: torch.device
                 ) -> tuple[tuple[tuple[int, ...], ...], torch.Tensor, torch.Tensor]:
    """The last kernel chunk of each sequence [lo, b) whose chunks start at a <= lo (aligned): its tokens [R][C]
    (host; clamped to [lo, b - 1]), masks [R, c+1, C] fp32, the in-chunk buckets of its last token
    (fenwick.last_query_masks) on the rows from lo on, and held [R, C] fp32, their sum over the buckets: 1 at the
    tokens of the sequence up to the last. Cached per layout (read-only; normal tensors even when first built under
    inference mode: autograd saves them)."""
    starts = [a + ((b - a - 1) // C) * C for a, b in zip(bos, eos)]
    rows = tuple(tuple(max(min(t + s, b - 1), lo) for s in range(C)) for t, lo, b in zip(starts, los, eos))
    with torch.inference_mode(False):
        masks = last_query_masks(tuple(b - 1 - t for t, b in zip(starts, eos)), C, torch.float32, device)
        if any(lo > t for t, lo in zip(starts, los)):  # a sequence that ends in its first chunk, after masked rows
            inside = [[t + s >= lo for s in range(C)] for t, lo in zip(starts, los)]
            masks = masks * device_table(inside, torch.float32, device)[:, None]
        return rows, masks, masks.sum(1)


def _last_chunk_levels(rows: "_Rows", at: torch.Tensor, masks: torch.Tensor, held: torch.Tensor, H: int
                       ) -> torch.Tensor:
    """In-chunk token levels 0..c of each sequence's state after its token b-1, from the last kernel chunk of each
    sequence (_last_chunks: masks, held; its tokens as rows' indices at [R, C]), all sequences in one batch of ops.

    level l holds sum_{s: bit_length(s XOR e) = l} exp(G_e - G_s) k_s v_s^T (g: [tokens, H], or [tokens, H, K]:
    exp per key channel; G the cumsum of g floored here; rows past e read as g = 0).   -> [R, c+1, H, K, V] fp32."""
    ks = expand_groups(rows.at(rows.k, at).float(), H)  # [R, C, H, K]
    gs = floor_log_decay(rows.at(rows.g, at).float())
    G = (gs * held.view(*held.shape, *(1,) * (gs.dim() - 2))).cumsum(1)
    w = torch.exp(G[:, -1:] - G)  # [R, C, H] or [R, C, H, K]
    return torch.einsum("rls,rshk,rshv->rlhkv", masks, ks * (w if w.dim() == 4 else w[..., None]),
                        rows.at(rows.v, at).float())


def _pad_levels(x: torch.Tensor, n: int, dim: int = 0) -> torch.Tensor:
    """x zero-padded or truncated to n levels along dim (x itself when it has n)."""
    if x.shape[dim] == n:
        return x
    pad = (0, 0) * (x.dim() - 1 - dim) + (0, max(0, n - x.shape[dim]))
    return F.pad(x, pad).narrow(dim, 0, n)


@dataclass
class _Flat:
    """The call on one flat token axis: sequence n covers tokens [bounds[n], bounds[n+1]) from positions[n].

    q, k: [tokens, G, K]; v: [tokens, H, V] (kernel dtype); g: [tokens, H], or [tokens, H, K] per channel, as the
    call gives it (unfloored); lam: [tokens, H, L] (a plain call: g in its place, never read)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    lam: torch.Tensor
    bounds: list[int]
    positions: list[int]


def _kernel_dtype(inp: OpInputs) -> torch.dtype:
    """The kernels' operand dtype: q / k / v's when they agree, else fp32."""
    dtype = inp.q.dtype if inp.q.dtype == inp.k.dtype == inp.v.dtype else torch.float32
    if dtype == torch.bfloat16 and interpreting():
        return torch.float32  # Triton's CPU interpreter (3.9) gets bf16 tl.dot wrong; GPUs run bf16
    return dtype


def _flatten(inp: OpInputs) -> _Flat:
    B, T, G, K = inp.q.shape
    H, V = inp.v.shape[2:]
    dtype = _kernel_dtype(inp)
    g = inp.gates["g"].reshape(B * T, *inp.gates["g"].shape[2:]).contiguous()
    bounds = inp.bounds if inp.bounds is not None else [n * T for n in range(B + 1)]
    state = inp.initial_state
    return _Flat(
        inp.q.to(dtype).reshape(B * T, G, K).contiguous(), inp.k.to(dtype).reshape(B * T, G, K).contiguous(),
        inp.v.to(dtype).reshape(B * T, H, V).contiguous(), g,
        inp.level_scales.reshape(B * T, H, -1).contiguous() if inp.level_scales is not None else g, bounds,
        state.positions.tolist() if state is not None else [0] * (len(bounds) - 1),
    )


@dataclass
class _Rows:
    """Rows of the call's tokens that a final state's torch ops read (the last kernel chunks' k, v, g; the seeded
    first chunks' g, seeds.first_levels): k [n, G, K], v [n, H, V], g [n, H(, K)] at the unique tokens of
    _row_tables. LevelScanMamba2 gathers them as outputs of its own, so their gradients are added into the kernels'
    at those rows in its backward (gathered from the inputs, autograd would write each input's gradient at whole
    size once more, then add the two)."""

    NAMES = ("k", "v", "g")  # what LevelScanMamba2 gathers, in its outputs' order

    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor

    @staticmethod
    def at(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """x's rows at the indices at [R, C] -> [R, C, *]."""
        return x.index_select(0, at.flatten()).view(*at.shape, *x.shape[1:])


@table_cache()
def _row_tables(layouts: tuple[tuple[tuple[int, ...], ...], ...], device: torch.device
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The unique tokens of the row layouts (each [R][C] tokens of the call), [n] int64, and each layout as indices
    into them ([R, C] int64). Cached per layout (read-only; normal tensors)."""
    tokens = sorted({t for layout in layouts for row in layout for t in row})
    index = {t: i for i, t in enumerate(tokens)}
    with torch.inference_mode(False):
        return (device_table(tokens, torch.int64, device),
                tuple(device_table([[index[t] for t in row] for row in layout], torch.int64, device)
                      for layout in layouts))


def _chunk_levels(flat: _Flat, state: FenwickState | None, C: int
                  ) -> tuple[int, torch.Tensor, bool, int, Seeds | None]:
    """J (chunk levels the scans carry), the initial chunk levels h0 [N, J, H, K, V] fp32 at every sequence's
    kernel start (the start of the chunk of its first token), whether any sequence has a state (otherwise h0 is
    zeros and the scans skip it), the first level h0 may hold (plan.first_level: the carry into a target t > c
    clears the chunk levels below t - c - 1) and the seeded sequences (seeds.Seeds: a state inside a chunk or at 0,
    its in-chunk levels summed into chunk level m0 = ctz(c0 + 1) of h0) or None. One chunk_levels_from for all."""
    c, N, positions = chunk_bits(C), len(flat.bounds) - 1, flat.positions
    ends = [p + b - a for a, b, p in zip(flat.bounds, flat.bounds[1:], positions)]
    J = max([1] + [max((e - 1) // C, 1).bit_length() for e in ends])
    H, K, V = flat.v.shape[1], flat.q.shape[2], flat.v.shape[2]
    if state is None:
        return J, flat.v.new_zeros((J, H, K, V), dtype=torch.float32).expand(N, J, H, K, V), False, 0, None
    levels = state.levels.float()
    seeded = [n for n, p in enumerate(positions) if p % C or p == 0]
    # a state at a chunk boundary: the carry past it (target ctz(p) + 1 > c) sums levels 0..target into chunk level
    # target - c - 1; a seeded one: its in-chunk levels 0..c into chunk level m0
    through = tuple(c if n in seeded else ctz(p) + 1 for n, p in enumerate(positions))
    into = tuple(ctz(p // C + 1) if n in seeded else t - c - 1 for n, (p, t) in enumerate(zip(positions, through)))
    J = max([J, levels.shape[1] - c - 1] + [j + 1 for j in into])
    h0, in_chunk = chunk_levels_from(levels, through, into, C, J, in_chunk=tuple(seeded))
    if not seeded:
        return J, h0, True, min(into), None
    return J, h0, True, 0, Seeds(seeded, [positions[n] for n in seeded], [ends[n] for n in seeded], in_chunk)


def _first_chunk_layout(plan: LevelScanPlan, seeds: Seeds) -> FirstChunks:
    """seeds.first_chunks of the seeded sequences (plan.bos: their first kernel chunks' starts)."""
    return first_chunks(tuple(plan.bos[n] for n in seeds.rows), tuple(plan.eos[n] for n in seeds.rows),
                        tuple(seeds.positions), plan.chunk_size, seeds.levels.device)


def _final_state(flat: _Flat, last: torch.Tensor, final: torch.Tensor, n_in: int,
                 first: tuple[list[int], torch.Tensor] | None) -> FenwickState:
    """Per sequence: the last kernel chunk's in-chunk buckets (last [N, c+1, H, K, V], _last_chunk_levels) + the
    scan's chunk levels (final [N, J, H, K, V]), plus ``first``'s change to the rows it names (seeds.first_levels), with
    max(levels_needed(end), n_in) levels as the torch path (the rest zero, up to the widest), in one batch of ops
    whatever their number."""
    ends = [p + b - a for a, b, p in zip(flat.bounds, flat.bounds[1:], flat.positions)]
    keep = [max(levels_needed(e), n_in) for e in ends]
    width = max(keep)
    levels = _pad_levels(torch.cat([last, final], 1), width, dim=1)
    if first is not None:
        rows, change = first
        levels = levels.index_add(0, cached_table(tuple(rows), torch.int64, levels.device),
                                  _pad_levels(change, width, dim=1))
    if min(keep) < width:  # rows that keep fewer levels: zero the rest
        kept = cached_table(tuple(tuple(j < k for j in range(width)) for k in keep), torch.bool, levels.device)
        levels = torch.where(kept[:, :, None, None, None], levels, 0.0)
    return FenwickState(levels.contiguous(), torch.tensor(ends))


def _per_channel(inp: OpInputs) -> bool:
    """Is the variant's log-decay per key channel (GLA) rather than per head (Mamba-2)?"""
    return inp.variant.gates[0].per_channel


def supports(inp: OpInputs) -> bool:
    """Do the kernels take this call? bf16/fp16/fp32 q and v, K <= MAX_K, on CUDA (CPU tensors under the
    interpreter). The dispatcher (loglinear.ops.backends) sends the others (float64, K > 256, CPU without
    TRITON_INTERPRET) to torch."""
    dtypes = inp.q.dtype in SUPPORTED_DTYPES and inp.v.dtype in SUPPORTED_DTYPES
    return dtypes and inp.q.shape[-1] <= MAX_K and (inp.q.device.type == "cuda" or interpreting())


def backend(inp: OpInputs, output_final_state: bool, chunk_size: int,
            use_qk_l2norm: bool = False) -> tuple[torch.Tensor, FenwickState | None]:
    """Backend "triton" of Mamba-2 and GLA (see loglinear.ops.backends) on inputs it supports, their log-decay
    gate as the module docstring says; values wider than value_slice run in slices, heads narrower than
    min_head_dim zero-padded. use_qk_l2norm: q and k are normalised here (in fp32, back to their dtype; the kernels
    read them as given)."""
    if use_qk_l2norm:
        inp = replace(inp, q=l2norm(inp.q.float()).to(inp.q.dtype), k=l2norm(inp.k.float()).to(inp.k.dtype))
    dtype = _kernel_dtype(inp)
    minimum = min_head_dim(dtype, inp.q.device)
    width = value_slice(dtype, max(inp.q.shape[-1], minimum))
    return run_value_slices(inp, width, lambda part: run_padded(
        part, minimum, lambda x: _run_kernels(x, output_final_state, chunk_size)))


def value_slice(dtype: torch.dtype, K: int) -> int:
    """The widest value slice the kernels run at with operands of ``dtype`` and K key columns: VALUE_SLICE's state-tile
    elements over K padded to a power of two, at most its value columns (wider values run in slices:
    run_value_slices)."""
    elements, widest = VALUE_SLICE[dtype.itemsize]
    return min(elements // next_pow2(K), widest)


def chunk_cap(dtype: torch.dtype, K: int) -> int:
    """The kernels' largest chunk for operands of ``dtype`` and K key columns: MAX_CHUNK, but 32 for fp32 operands with
    K > 128 (their tf32x3 products stage the operands' split parts in shared memory: at 64 the dk / dv kernel would
    take 314 KB; benchmarks/profiling/compile_sm90.py)."""
    return 32 if dtype == torch.float32 and K > 128 else MAX_CHUNK


def _run_kernels(inp: OpInputs, output_final_state: bool, chunk_size: int) -> tuple[torch.Tensor, FenwickState | None]:
    """backend on the kernels: (o [B, T, H, V] in v's dtype, final state or None)."""
    C = kernel_chunk_size(chunk_size, chunk_cap(_kernel_dtype(inp), inp.q.shape[-1]))
    flat = _flatten(inp)
    if inp.level_scales is None:
        return _run_plain(inp, flat, output_final_state, C)
    state = inp.initial_state
    bounds, positions = flat.bounds, flat.positions  # kernel chunks from the chunk start before each first token
    J, h0, has_init, first_level, seeds = _chunk_levels(flat, state, C)
    plan = LevelScanPlan([a - p % C for a, p in zip(bounds, positions)], bounds[:-1], bounds[1:],
                         [p // C for p in positions], C, J, has_init, inp.scale, per_channel=_per_channel(inp),
                         first_level=first_level)
    first = _first_chunk_layout(plan, seeds) if seeds is not None else None
    gate = _read_gate(flat.g, plan, inp.report_finite)
    tokens, at, last = None, (), None
    if output_final_state:  # the rows a final state's torch ops read: the last chunks', and the seeded first ones'
        last = _last_chunks(tuple(plan.bos), tuple(plan.los), tuple(plan.eos), C, flat.q.device)
        tokens, at = _row_tables(((first.tokens,) if first is not None else ()) + (last[0],), flat.q.device)
    o, final, *gathered = LevelScanMamba2.apply(flat.q, flat.k, flat.v, flat.g, gate, flat.lam, h0, plan, tokens,
                                                seeds.levels if seeds is not None else None, first)
    o = o.reshape(inp.v.shape).to(inp.v.dtype)
    if not output_final_state:
        return o, None
    rows = _Rows(*gathered)
    n_in = state.num_levels if state is not None else 0
    width = final.shape[1] + chunk_bits(C) + 1
    moved = first_levels(seeds, rows.at(rows.g, at[0]), first, width, C) if seeds is not None else None
    in_chunk = _last_chunk_levels(rows, at[-1], *last[1:], flat.v.shape[1])
    return o, _final_state(flat, in_chunk, final, n_in, moved)


def _run_plain(inp: OpInputs, flat: _Flat, output_final_state: bool, C: int
               ) -> tuple[torch.Tensor, FenwickState | None]:
    """A plain call on the PLAIN kernels: every sequence from its first token, its one-level state (if any) as the
    single chunk level. -> (o [B, T, H, V] in v's dtype, the final one-level state or None)."""
    state, N = inp.initial_state, len(flat.bounds) - 1
    H, K, V = flat.v.shape[1], flat.q.shape[2], flat.v.shape[2]
    if state is not None:
        h0 = state.levels.float().contiguous()
    else:
        h0 = flat.v.new_zeros((1, 1, H, K, V), dtype=torch.float32).expand(N, 1, H, K, V)
    plan = LevelScanPlan(flat.bounds[:-1], flat.bounds[:-1], flat.bounds[1:], [0] * N, C, 1, state is not None,
                         inp.scale, plain=True, per_channel=_per_channel(inp))
    gate = _read_gate(flat.g, plan, inp.report_finite)
    o, final = LevelScanMamba2.apply(flat.q, flat.k, flat.v, flat.g, gate, flat.lam, h0, plan, None)
    o = o.reshape(inp.v.shape).to(inp.v.dtype)
    if not output_final_state:
        return o, None
    ends = [p + b - a for a, b, p in zip(flat.bounds, flat.bounds[1:], flat.positions)]
    return o, FenwickState(final, torch.tensor(ends))
