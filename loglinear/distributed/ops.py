"""Context-parallel log-linear attention: one sequence sharded over the ranks of a process group.

Composition (every rank, on its own shard; the public op runs with any backend):

  1. layout     one all_gather of the shard lengths; every rank knows where every shard sits
  2. local      the state leaving the shard if nothing came in:  local  [R, L, H, K, V]; the op from a
                zero state at the shard's start position, or (without initial states) the variant's closed
                form if it has one (Variant.local_state; Mamba-2: O(T K V))
  3. transition the shard's transition product  mat  (Variant.shard_transition: exp(sum g) for Mamba-2, the
                K x K delta-rule product for Gated DeltaNet, diag(exp(sum g)) for GLA)
  4. scan       incoming = exclusive prefix scan of  x -> mat . route(x) + local  over ranks
                (ceil(log2 P) rounds of point-to-point messages, each O(L H K V) -- O(log T) states)
  5. output     op(shard, initial_state = incoming)  ->  o, exactly the single-process output

The last rank skips steps 2 and 3: its state leaves the sequence, so nobody reads its local or mat (the
scan gets zeros and no transition from it; see scan.py).

The op calls get only the levels a state can hold at the shard's positions (levels_needed(p), when no
initial state is given), and no state at all on a rank where every row starts fresh (rank 0 of a dense
batch): a zero state would still put the kernels on their initial-state path (reads of every level
above the shard's own in every chunk, a reverse scan with a GEMM per chunk on whole state tiles, the
first chunk through the torch path at position 0), which costs time in proportion to the shard length.

Backward mirrors it: autograd runs through both op calls and the transition, and the scan's backward
is the reverse scan of the adjoint maps (scan.py). Gradients of the states entering each shard flow back
to the ranks that produced them.

Profiler scopes (torch.profiler.record_function): cp/local_state, cp/transition, cp/shard_op (the output
call's forward), with cp/shard_shapes_all_gather (layout.py), cp/scan_forward, cp/scan_backward,
cp/mat_grad (scan.py) and cp/halo_forward, cp/halo_backward (halo.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from loglinear.distributed.layout import ShardLayout, shard_layout
from loglinear.distributed.scan import incoming_states
from loglinear.fenwick import levels_needed
from loglinear.inputs import check_inputs, expand_groups, l2norm
from loglinear.ops.finite import floor_log_decays
from loglinear.ops.api import attention
from loglinear.state import FenwickState
from loglinear.variants import GATED_DELTANET, MAMBA2, Variant, get

__all__ = [
    "context_parallel_attention", "context_parallel_log_linear_mamba2", "context_parallel_log_linear_gated_deltanet",
]


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallel ops need torch.distributed initialised (dist.init_process_group)")
    return group if group is not None else dist.group.WORLD


def _compute_dtype(q: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The op's compute (and state) dtype: float64 if q or v is, else float32."""
    return torch.float64 if torch.float64 in (q.dtype, v.dtype) else torch.float32


def _check_initial_state(state: object, cu_seqlens: torch.Tensor | None, batch: int) -> FenwickState | None:
    if state is None:
        return None
    if not isinstance(state, FenwickState):
        raise TypeError(f"initial_state must be a FenwickState or None, got {type(state).__name__}")
    n_seq = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    if state.num_sequences != n_seq:
        raise ValueError(
            f"initial_state holds {state.num_sequences} sequences (levels {tuple(state.levels.shape)}), expected "
            f"{n_seq}: one per {'row of the batch' if cu_seqlens is None else 'packed sequence of cu_seqlens'}, "
            "the same on every rank"
        )
    return state


def _base_levels(
    layout: ShardLayout, initial_state: FenwickState | None, shape: tuple[int, ...], dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Levels of the shard's call before the incoming state is added: the initial state of every sequence
    starting here, zeros for the carried one.  -> [N, L, H, K, V]."""
    zero = torch.zeros(shape, dtype=dtype, device=device)
    if initial_state is None:
        return zero.expand(len(layout.init_rows), *shape).clone()
    if initial_state.num_levels > shape[0]:
        raise ValueError(
            f"initial_state has {initial_state.num_levels} levels (levels {tuple(initial_state.levels.shape)}), more "
            f"than level_scales' L = {shape[0]}; L must cover the state and the global length"
        )
    init = initial_state.with_levels(shape[0]).levels.to(dtype)
    return torch.stack([zero if row is None else init[row] for row in layout.init_rows])


def _op_levels_count(layout: ShardLayout, initial_state: FenwickState | None, num_levels: int) -> int:
    """Levels of the op calls' states: all num_levels with an initial state (it may use them), else those a
    state of sequences from position 0 can hold at the shard's positions (the rest are zero whatever the
    inputs, and so is their contribution to any gradient)."""
    if initial_state is not None:
        return num_levels
    return levels_needed(max(int(layout.positions.max()), 1))


class _KeepInGraph(torch.autograd.Function):
    """(o, unused) -> o, with ``unused`` in o's autograd graph (its gradient: None, read as zeros): the
    cross-rank scan's backward, a collective, runs on this rank also when its op call did not read the
    incoming state."""

    @staticmethod
    def forward(ctx, o: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _ending_state(final: FenwickState | None, layout: ShardLayout) -> FenwickState | None:
    if final is None or not layout.ending_rows:
        return None
    rows = torch.tensor(layout.ending_rows)
    return FenwickState(final.levels.index_select(0, rows.to(final.levels.device)), final.positions[rows])


def _boundary_map(
    layout: ShardLayout, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
    local: Callable[[], torch.Tensor], transition: Callable[[], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This shard's map x -> mat . route(x) + local for the scan: (local [R, L, H, K, V], mat or None when
    the layout resets here). The last rank's is read by no one: zeros and None, nothing computed."""
    if layout.rank == layout.world - 1:
        return torch.zeros(shape, dtype=dtype, device=device), None
    with record_function("cp/local_state"):
        own = local().to(dtype)
    with torch.autocast(device.type, enabled=False), record_function("cp/transition"):
        return own, None if layout.reset else transition()


def context_parallel_attention(
    variant: Variant | str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor],
    level_scales: torch.Tensor, *, group: dist.ProcessGroup | None = None, scale: float | None = None,
    initial_state: FenwickState | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False, chunk_size: int = 64,
) -> tuple[torch.Tensor, FenwickState | None]:
    """loglinear.ops.attention over a sequence sharded along T across the ranks of ``group`` (steps 1-5 of the
    module docstring).

    Every rank passes its contiguous shard (rank order = sequence order, any lengths >= 1):
    q, k: [B, T_r, G, K]; v: [B, T_r, H, V]; gates: the variant's {name: [B, T_r, H] (per channel: [B, T_r, H, K])};
    level_scales: [B, T_r, H, L] with L covering the *global* length. cu_seqlens: the global packing [N+1] (B = 1),
    the same on every rank. initial_state: FenwickState of the N global sequences, the same on every rank (each rank
    reads the rows of the sequences starting in its shard; their gradients land on that rank).
    Returns this shard's o: [B, T_r, H, V] (equal to the single-process op's slice) and, if
    output_final_state, the final states of the sequences that end in this shard (None if none).
    All ranks must call together (and backpropagate together).
    """
    variant = get(variant)
    group = _group(group)
    floored = floor_log_decays(check_inputs(variant, q, k, v, gates, level_scales, scale, None, None)).gates
    initial_state = _check_initial_state(initial_state, cu_seqlens, q.shape[0])
    positions = initial_state.positions if initial_state is not None else None
    layout = shard_layout(group, q, v, level_scales, cu_seqlens, positions)
    dtype = _compute_dtype(q, v)
    H, K, V, L = v.shape[2], q.shape[3], v.shape[3], level_scales.shape[3]
    n = _op_levels_count(layout, initial_state, L)
    base = _base_levels(layout, initial_state, (n, H, K, V), dtype, q.device)
    fresh = initial_state is None and not layout.carries  # every row from position 0 with a zero state
    local_cu = layout.cu_seqlens.to(q.device) if layout.cu_seqlens is not None else None
    run = lambda levels, final: attention(  # noqa: E731
        variant, q, k, v, gates, level_scales, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
        initial_state=None if levels is None else FenwickState(levels, layout.positions), output_final_state=final,
        cu_seqlens=local_cu,
    )
    R = layout.carried_rows
    wide = {name: x.to(dtype) for name, x in floored.items()}  # g = -inf: a reset, as in the op

    def own_local() -> torch.Tensor:
        if variant.local_state is not None and initial_state is None:
            start = int(layout.cu_seqlens[-2]) if layout.cu_seqlens is not None else 0  # the last sequence's tokens
            last = {name: x[:, start:] for name, x in wide.items()}
            kk, vv = expand_groups(k, H)[:, start:].to(dtype), v[:, start:].to(dtype)
            return variant.local_state(kk, vv, last, int(layout.positions[-1]), L)
        return run(None if fresh else base, True)[1].with_levels(L).levels[layout.local_slice]

    def transition() -> torch.Tensor:
        kk = l2norm(k.to(dtype)) if use_qk_l2norm else k.to(dtype)
        return variant.shard_transition(kk, wide, chunk_size)

    local, mat = _boundary_map(layout, (R, L, H, K, V), dtype, q.device, own_local, transition)
    with torch.autocast(q.device.type, enabled=False):  # boundary states stay in the state dtype under AMP
        incoming = incoming_states(local, mat, (R, H, *variant.transition_shape(K)), layout, group,
                                   anchors=(q, k, v, *gates.values(), level_scales))
    with record_function("cp/shard_op"):
        if fresh:
            o, final = run(None, output_final_state)
        else:
            o, final = run(torch.cat([base[:R] + incoming[:, :n], base[R:]]), output_final_state)
    if fresh:
        o = _KeepInGraph.apply(o, incoming)
    return o, _ending_state(final, layout)


def context_parallel_log_linear_mamba2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, level_scales: torch.Tensor, *,
    group: dist.ProcessGroup | None = None, scale: float | None = None, initial_state: FenwickState | None = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
) -> tuple[torch.Tensor, FenwickState | None]:
    """loglinear.log_linear_mamba2 over a sequence sharded along T across the ranks of ``group``
    (see context_parallel_attention; g: [B, T_r, H])."""
    return context_parallel_attention(
        MAMBA2, q, k, v, {"g": g}, level_scales, group=group, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
    )


def context_parallel_log_linear_gated_deltanet(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    level_scales: torch.Tensor, *, group: dist.ProcessGroup | None = None, scale: float | None = None,
    initial_state: FenwickState | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False, chunk_size: int = 64,
) -> tuple[torch.Tensor, FenwickState | None]:
    """loglinear.log_linear_gated_deltanet over a sequence sharded along T across the ranks of ``group``
    (see context_parallel_attention; g, beta: [B, T_r, H]). The shard's K x K transition product travels with its
    state in the scan."""
    return context_parallel_attention(
        GATED_DELTANET, q, k, v, {"g": g, "beta": beta}, level_scales, group=group, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
    )
