"""Context-parallel argument errors and the one-rank case (an in-process gloo group of size 1)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import loglinear
from helpers import assert_close, make_inputs, mamba2_args
from loglinear.distributed import context_parallel_log_linear_gated_deltanet, context_parallel_log_linear_mamba2
from loglinear.state import FenwickState


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_needs_a_process_group():
    x = mamba2_args(make_inputs(T=5))
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_log_linear_mamba2(*x.values())


def test_one_rank_is_the_op(one_rank):
    x = make_inputs(B=2, T=11, G=1, H=2, generator=torch.Generator().manual_seed(3))
    o, final = context_parallel_log_linear_gated_deltanet(*x.values(), chunk_size=4, output_final_state=True)
    ref, ref_final = loglinear.log_linear_gated_deltanet(*x.values(), chunk_size=4, output_final_state=True)
    assert_close(o, ref, what="o")
    assert_close(final.levels, ref_final.with_levels(final.num_levels).levels, what="final state")


def test_fresh_rank_calls_the_op_without_a_state(one_rank, monkeypatch):
    """Rows that all start at position 0 with no initial state: the op gets no state (a zero one would put the
    kernels on their initial-state path); the scan stays in the graph, so the backward still runs (and is exact).
    The only rank is also the last: it computes no local state (no op call for it)."""
    from loglinear.distributed import ops

    seen, op = [], ops.attention

    def spy(*args, **kwargs):
        seen.append(kwargs["initial_state"])
        return op(*args, **kwargs)

    monkeypatch.setattr(ops, "attention", spy)
    x = make_inputs(B=2, T=11, G=1, H=2, generator=torch.Generator().manual_seed(4))
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    context_parallel_log_linear_gated_deltanet(*leaves.values(), chunk_size=4)[0].square().sum().backward()
    assert seen == [None], "the last rank's only op call is its output call, and a fresh rank's takes no state"
    ref = {n: t.clone().requires_grad_() for n, t in x.items()}
    loglinear.log_linear_gated_deltanet(*ref.values(), chunk_size=4)[0].square().sum().backward()
    for n in x:
        assert_close(leaves[n].grad, ref[n].grad, what=f"d{n}")


@pytest.mark.parametrize("lengths, rank, expected", [([4096, 4096], 1, 13), ([5, 9, 1], 2, 5), ([7, 3], 0, 1)])
def test_op_states_hold_only_the_levels_a_start_position_can_fill(lengths, rank, expected):
    """Without an initial state, a shard starting at p gets levels_needed(p) levels (the state after tokens
    0..p-1: levels 0..bit_length(p-1)); with one, all L."""
    from loglinear.distributed.layout import _dense
    from loglinear.distributed.ops import _op_levels_count

    layout = _dense(lengths, rank, torch.zeros(2, dtype=torch.int64))
    assert _op_levels_count(layout, None, 21) == expected
    assert _op_levels_count(layout, FenwickState.zeros(2, 1, 4, 3), 21) == 21


def test_bad_initial_state(one_rank):
    x = mamba2_args(make_inputs(B=2, T=6))
    with pytest.raises(TypeError, match="initial_state must be a FenwickState"):
        context_parallel_log_linear_mamba2(*x.values(), initial_state=torch.zeros(2, 1, 2, 4, 3))
    state = FenwickState.zeros(3, 2, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"initial_state holds 3 sequences .* expected 2"):
        context_parallel_log_linear_mamba2(*x.values(), initial_state=state)
    state = FenwickState.zeros(2, 2, 4, 3, num_levels=9, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"initial_state has 9 levels .* more than level_scales' L = 5"):
        context_parallel_log_linear_mamba2(*x.values(), initial_state=state)


def test_cu_seqlens_must_be_global(one_rank):
    x = mamba2_args(make_inputs(B=1, T=6))
    with pytest.raises(ValueError, match=r"to T = 6, got \[0, 2, 5\]; cu_seqlens is the global packing"):
        context_parallel_log_linear_mamba2(*x.values(), cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(TypeError, match="cu_seqlens must be an int32/int64 tensor"):
        context_parallel_log_linear_mamba2(*x.values(), cu_seqlens=[0, 6])


def test_shard_bounds_cover_the_sequence_once():
    from loglinear.distributed import shard_bounds

    for length, world in ((22, 4), (7, 7), (1000, 3)):
        bounds = [shard_bounds(length, world, r) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [e - s for s, e in bounds]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValueError, match="cannot split length 3 over 4 ranks"):
        shard_bounds(3, 4, 0)


def test_shard_inputs_are_validated_like_the_op(one_rank):
    x = mamba2_args(make_inputs(B=2, T=6))
    x["k"] = x["k"][:, :, :, :3]
    with pytest.raises(ValueError, match=r"k must match q's shape"):
        context_parallel_log_linear_mamba2(*x.values())
