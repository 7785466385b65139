"""Property-based: any shape, chunk size, start position -> chunk path == recurrent reference."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_close, make_inputs, mamba2_args, slice_time
from loglinear import log_linear_gated_deltanet, log_linear_mamba2
from loglinear import reference as R


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2), T=st.integers(1, 40), groups=st.sampled_from([(1, 1), (1, 2), (2, 4)]),
    K=st.integers(1, 5), V=st.integers(1, 4), chunk_size=st.sampled_from([1, 2, 4, 8, 16, 64]),
    start=st.integers(0, 20), gdn=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_chunk_equals_recurrent(B, T, groups, K, V, chunk_size, start, gdn, seed):
    G, H = groups
    gen = torch.Generator().manual_seed(seed)
    x = make_inputs(B, start + T, G, H, K=K, V=V, generator=gen)
    op = log_linear_gated_deltanet if gdn else log_linear_mamba2
    ref = R.log_linear_gated_deltanet_recurrent if gdn else R.log_linear_mamba2_recurrent
    args = x if gdn else mamba2_args(x)
    full, full_state = ref(**args, output_final_state=True)
    state = None
    if start:
        _, state = ref(**slice_time(args, 0, start), output_final_state=True)
    o, final = op(**slice_time(args, start, start + T), initial_state=state, output_final_state=True,
                  chunk_size=chunk_size)
    assert_close(o, full[:, start:], 1e-11, "outputs")
    assert_close(final.levels, full_state.levels, 1e-11, "state")
