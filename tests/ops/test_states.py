"""States: continuation (prefill + chunk + single steps), batches at different positions, varlen."""

import pytest
import torch

from helpers import assert_close, make_inputs, mamba2_args, slice_time
from loglinear import FenwickState, log_linear_gated_deltanet, log_linear_mamba2
from loglinear import reference as R

OPS = {
    "mamba2": lambda x, **kw: log_linear_mamba2(**mamba2_args(x), **kw),
    "gated_deltanet": lambda x, **kw: log_linear_gated_deltanet(**x, **kw),
}


@pytest.mark.parametrize("variant", OPS)
@pytest.mark.parametrize("cuts", [(5, 20), (16, 32), (31, 33), (1, 2)])
@pytest.mark.parametrize("chunk_size", [4, 16])
def test_prefill_chunk_steps_equal_one_pass(variant, cuts, chunk_size):
    op = OPS[variant]
    T = 40
    x = make_inputs(2, T, 1, 2)
    full, full_state = op(x, output_final_state=True, chunk_size=chunk_size)
    a, b = cuts
    o1, st = op(slice_time(x, 0, a), output_final_state=True, chunk_size=chunk_size)
    o2, st = op(slice_time(x, a, b), initial_state=st, output_final_state=True, chunk_size=chunk_size)
    outs = [o1, o2]
    for t in range(b, T):
        o, st = op(slice_time(x, t, t + 1), initial_state=st, output_final_state=True, chunk_size=chunk_size)
        outs.append(o)
    assert_close(torch.cat(outs, 1), full, 1e-12, "outputs")
    assert torch.equal(st.positions, torch.tensor([T, T]))
    assert_close(st.levels, full_state.levels, 1e-12, "final state")


@pytest.mark.parametrize("variant", OPS)
def test_state_grows_logarithmically(variant):
    x = make_inputs(1, 40, 1, 1)
    _, st = OPS[variant](slice_time(x, 0, 1), output_final_state=True)
    for t in range(1, 40):
        assert st.num_levels == max(1, (t - 1).bit_length() + 1)
        _, st = OPS[variant](slice_time(x, t, t + 1), initial_state=st, output_final_state=True)


@pytest.mark.parametrize("variant", OPS)
def test_batch_rows_at_different_positions(variant):
    """Each row of a batch continues its own sequence from its own position."""
    op = OPS[variant]
    x = make_inputs(3, 30, 1, 2)
    starts = [3, 11, 16]
    states, expected = [], []
    for row, p in enumerate(starts):
        xr = {n: t[row : row + 1] for n, t in x.items()}
        _, st = op(slice_time(xr, 0, p), output_final_state=True)
        states.append(st)
        o, _ = op(slice_time(xr, p, p + 9), initial_state=st)
        expected.append(o)
    n_levels = max(s.num_levels for s in states)
    merged = FenwickState(
        torch.cat([s.with_levels(n_levels).levels for s in states]), torch.cat([s.positions for s in states])
    )
    batch = {n: torch.stack([t[r, p : p + 9] for r, p in enumerate(starts)]) for n, t in x.items()}
    o, st = op(batch, initial_state=merged, output_final_state=True)
    assert_close(o, torch.cat(expected), 1e-12, "batched continuation")
    assert st.positions.tolist() == [p + 9 for p in starts]


@pytest.mark.parametrize("variant", OPS)
@pytest.mark.parametrize("with_state", [False, True])
def test_varlen_equals_per_sequence(variant, with_state):
    op = OPS[variant]
    lengths = [7, 1, 33, 16]
    x = make_inputs(1, sum(lengths), 2, 4)
    cu = torch.tensor([0] + lengths).cumsum(0)
    init = None
    if with_state:
        pre = make_inputs(len(lengths), 5, 2, 4)
        _, init = op(pre, output_final_state=True)
    o, st = op(x, cu_seqlens=cu, initial_state=init, output_final_state=True)
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        one = slice_time(x, a, b)
        st_i = init.select([i]) if init is not None else None
        oi, sti = op(one, initial_state=st_i, output_final_state=True)
        assert_close(o[:, a:b], oi, 1e-12, f"sequence {i}")
        assert_close(st.levels[i : i + 1, : sti.num_levels], sti.levels, 1e-12, f"state {i}")
        assert int(st.positions[i]) == int(sti.positions[0])


@pytest.mark.parametrize("variant", ["mamba2", "gated_deltanet"])
def test_recurrent_reference_continuation(variant):
    """The chunk path continued from a state equals the recurrent reference over the whole sequence."""
    x = make_inputs(2, 50, 1, 2)
    op = OPS[variant]
    ref = R.log_linear_mamba2_recurrent if variant == "mamba2" else R.log_linear_gated_deltanet_recurrent
    args = mamba2_args(x) if variant == "mamba2" else x
    full, _ = ref(**args)
    _, st = op(slice_time(x, 0, 21), output_final_state=True, chunk_size=8)
    o, _ = op(slice_time(x, 21, 50), initial_state=st, chunk_size=8)
    assert_close(o, full[:, 21:], 1e-12, variant)
