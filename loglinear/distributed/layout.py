"""Where every rank's shard sits in the global sequence(s), agreed by one small all_gather.

Rank r holds the contiguous global token range [start_r, end_r) (any lengths >= 1, in rank order of the
process group). Every rank derives, for every rank, the static shape of that shard's boundary map
(levelmap.LevelMap): whether it is constant (the state leaving the shard ignores the one entering it:
rank 0, or a sequence starts inside the shard) and its route depth d = bit_length((p1-1) XOR (p0-1)).

Dense batches [B, T_r]: the B rows are B sequences, all starting on rank 0, carried state rows R = B.
Varlen (cu_seqlens, B = 1): global packing, the same on every rank; only the sequence crossing a shard
boundary carries state (R = 1); the shard's own call packs the pieces of the sequences it overlaps.

The all_gather reads its result on the host (a device sync under NCCL). Inside ``shared_shard_shapes()``
(apply_context_parallel opens it around every model forward: every layer sees the same shards) it runs
once per group and set of this rank's shapes, and the other calls reuse its result. Profiler scope:
cp/shard_shapes_all_gather.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from loglinear.fenwick import bit_length
from loglinear.inputs import check_cu_seqlens

__all__ = ["ShardLayout", "shard_layout", "shared_shard_shapes"]

_SHARED: ContextVar[dict | None] = ContextVar("shared_shard_shapes", default=None)


@dataclass
class ShardLayout:
    """This rank's view of the sharding.

    rank, world:   position in the process group
    start, end:    this shard's global token range
    resets:        [world] the shard's boundary map is constant (the state leaving it ignores the one entering)
    carries:       this shard's first sequence continues from the previous shard (reads the incoming state)
    depths:        [world] route depth per rank, each [R] int64
    cu_seqlens:    local packing for the shard's op call (varlen), else None
    positions:     [N] int64 start position of each local sequence (row) of the shard's op call
    init_rows:     [N] global sequence whose initial state a local row starts from (None: carried row)
    local_slice:   the local row(s) whose final state leaves the shard (carried into the next rank)
    carried_rows:  R, rows of the state carried across shard boundaries
    ending_rows:   local rows whose sequence ends inside this shard
    """

    rank: int
    world: int
    start: int
    end: int
    resets: list[bool]
    depths: list[torch.Tensor]
    carries: bool
    cu_seqlens: torch.Tensor | None
    positions: torch.Tensor
    init_rows: list[int | None]
    local_slice: slice
    carried_rows: int
    ending_rows: list[int]

    @property
    def reset(self) -> bool:
        return self.resets[self.rank]

    @property
    def depth(self) -> torch.Tensor:
        return self.depths[self.rank]


@contextmanager
def shared_shard_shapes() -> Iterator[None]:
    """Within this scope, shard_layout gathers the shapes once per (group, this rank's shapes) and reuses
    them. Only for calls that see the same shards on every rank (the layers of one forward pass): every
    rank must open and close it at the same point of its calls."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _all_gather_shapes(group: dist.ProcessGroup, dims: list[int], device: torch.device) -> list[list[int]]:
    """all_gather of small integer vectors (shard length and shape fields) over the group."""
    backend = dist.get_backend(group)
    device = device if backend == "nccl" else torch.device("cpu")
    with record_function("cp/shard_shapes_all_gather"):
        mine = torch.tensor(dims, dtype=torch.int64, device=device)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, mine, group=group)
        return [t.tolist() for t in out]


def _gather_shapes(group: dist.ProcessGroup, dims: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's dims, [world][len(dims)]: gathered, or reused inside shared_shard_shapes()."""
    shared = _SHARED.get()
    if shared is None:
        return _all_gather_shapes(group, dims, device)
    key = (group, device.type, tuple(dims))
    if key not in shared:
        shared[key] = _all_gather_shapes(group, dims, device)
    return shared[key]


def _depth(p0: torch.Tensor, p1: torch.Tensor) -> torch.Tensor:
    """Route depth of a shard continuing at p0 (>= 1) and ending before p1: [R] int64."""
    return bit_length((p1 - 1) ^ (p0 - 1))


def _dense(lengths: list[int], rank: int, pos0: torch.Tensor) -> ShardLayout:
    world, B = len(lengths), pos0.shape[0]
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    depths = [torch.zeros(B, dtype=torch.int64)] + [
        _depth(pos0 + bounds[r], pos0 + bounds[r + 1]) for r in range(1, world)
    ]
    return ShardLayout(
        rank=rank, world=world, start=bounds[rank], end=bounds[rank + 1],
        resets=[r == 0 for r in range(world)], depths=depths, carries=rank > 0, cu_seqlens=None,
        positions=pos0 + bounds[rank], init_rows=list(range(B)) if rank == 0 else [None] * B,
        local_slice=slice(0, B), carried_rows=B, ending_rows=list(range(B)) if rank == world - 1 else [],
    )


def _varlen(lengths: list[int], rank: int, seq_bounds: list[int], pos0: torch.Tensor) -> ShardLayout:
    world = len(lengths)
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    seq_of = lambda t: max(n for n, b in enumerate(seq_bounds[:-1]) if b <= t)  # noqa: E731
    resets, depths = [], []
    for r in range(world):
        a, b = bounds[r], bounds[r + 1]
        first, last = seq_of(a), seq_of(b - 1)
        reset = first != last or seq_bounds[first] == a
        resets.append(reset)
        p0 = pos0[first] + a - seq_bounds[first]
        depths.append(torch.zeros(1, dtype=torch.int64) if reset else _depth(p0, p0 + b - a).reshape(1))
    a, b = bounds[rank], bounds[rank + 1]
    first, last = seq_of(a), seq_of(b - 1)
    carries = seq_bounds[first] < a
    inner = [seq_bounds[n] - a for n in range(first + 1, last + 1)]
    positions = pos0[first : last + 1].clone()
    positions[0] += a - seq_bounds[first]
    n_local = last - first + 1
    return ShardLayout(
        rank=rank, world=world, start=a, end=b, resets=resets, depths=depths, carries=carries,
        cu_seqlens=torch.tensor([0] + inner + [b - a], dtype=torch.int64), positions=positions,
        init_rows=[None if (n == first and carries) else n for n in range(first, last + 1)],
        local_slice=slice(n_local - 1, n_local), carried_rows=1,
        ending_rows=[n - first for n in range(first, last + 1) if seq_bounds[n + 1] <= b],
    )


def shard_layout(
    group: dist.ProcessGroup, q: torch.Tensor, v: torch.Tensor, level_scales: torch.Tensor,
    cu_seqlens: torch.Tensor | None, init_positions: torch.Tensor | None,
) -> ShardLayout:
    """Gather every rank's shard length (and check the shapes agree), then lay the shards out.

    q: [B, T_r, G, K]; v: [B, T_r, H, V]; level_scales: [B, T_r, H, L] (this rank's shard);
    cu_seqlens: global [N+1] packing (same on every rank) or None; init_positions: [N] or None.
    """
    B, T, G, K = q.shape
    H, V, L = v.shape[2], v.shape[3], level_scales.shape[3]
    fields = ["T", "B", "G", "K", "H", "V", "L"]
    gathered = _gather_shapes(group, [T, B, G, K, H, V, L], q.device)
    rank = dist.get_rank(group)
    for r, row in enumerate(gathered):
        for name, theirs, ours in list(zip(fields, row, gathered[rank]))[1:]:
            if theirs != ours:
                raise ValueError(
                    f"context parallel shards disagree on {name}: rank {rank} has {ours}, rank {r} has {theirs} "
                    f"(q {tuple(q.shape)} [B, T, G, K], v {tuple(v.shape)} [B, T, H, V], "
                    f"level_scales {tuple(level_scales.shape)} [B, T, H, L]; only T may differ)"
                )
    lengths = [row[0] for row in gathered]
    total = sum(lengths)
    if cu_seqlens is None:
        pos0 = init_positions if init_positions is not None else torch.zeros(B, dtype=torch.int64)
        return _dense(lengths, rank, pos0)
    try:
        seq_bounds = check_cu_seqlens(cu_seqlens, B, total)
    except ValueError as err:
        raise ValueError(f"{err}; cu_seqlens is the global packing of all shards (lengths {lengths})") from None
    n_seq = len(seq_bounds) - 1
    pos0 = init_positions if init_positions is not None else torch.zeros(n_seq, dtype=torch.int64)
    return _varlen(lengths, rank, seq_bounds, pos0)
