"""The chunkwise PyTorch path against the float64 references: shapes, chunk sizes, GQA, batches."""

import pytest
import torch

from helpers import assert_close, large_writes, make_inputs, mamba2_args
from loglinear import log_linear_gated_deltanet, log_linear_mamba2
from loglinear import reference as R
from loglinear.variants import REGISTRY
from loglinear.variants.mamba2 import suffix_sum

SHAPES = [(1, 1, 1, 1), (2, 2, 1, 2), (2, 63, 1, 2), (1, 64, 2, 2), (2, 65, 1, 3), (1, 100, 2, 4), (1, 257, 1, 1)]


@pytest.mark.parametrize("B,T,G,H", SHAPES)
@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_mamba2_matches_materialized(B, T, G, H, chunk_size):
    x = mamba2_args(make_inputs(B, T, G, H))
    o, _ = log_linear_mamba2(**x, chunk_size=chunk_size)
    assert_close(o, R.log_linear_mamba2_materialized(**x), 1e-12, "mamba2")


@pytest.mark.parametrize("B,T,G,H", SHAPES)
@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_gated_deltanet_matches_materialized(B, T, G, H, chunk_size):
    x = make_inputs(B, T, G, H)
    o, _ = log_linear_gated_deltanet(**x, chunk_size=chunk_size, use_qk_l2norm=True)
    assert_close(o, R.log_linear_gated_deltanet_materialized(**x, use_qk_l2norm=True), 1e-12, "gdn")


@pytest.mark.parametrize("chunk_size", [1, 2, 8, 32])
def test_final_state_matches_recurrent(chunk_size):
    x = make_inputs(2, 45, 1, 2)
    _, ref = R.log_linear_gated_deltanet_recurrent(**x, output_final_state=True)
    o, st = log_linear_gated_deltanet(**x, output_final_state=True, chunk_size=chunk_size)
    assert torch.equal(st.positions, ref.positions) and st.levels.shape == ref.levels.shape
    assert_close(st.levels, ref.levels, 1e-12, "gdn state")
    _, ref = R.log_linear_mamba2_recurrent(**mamba2_args(x), output_final_state=True)
    _, st = log_linear_mamba2(**mamba2_args(x), output_final_state=True, chunk_size=chunk_size)
    assert_close(st.levels, ref.levels, 1e-12, "mamba2 state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs(dtype):
    x = make_inputs(2, 70, 1, 2, K=16, V=8)
    ref = R.log_linear_gated_deltanet_materialized(**x)
    low = {n: t.to(dtype) for n, t in x.items()}
    o, st = log_linear_gated_deltanet(**low, output_final_state=True)
    assert o.dtype == dtype and st.levels.dtype == torch.float32
    assert_close(o.double(), ref, 1e-5 if dtype == torch.float32 else 2e-2, str(dtype))


def test_long_sequence_is_stable():
    """Strong decays over many chunks: chunk-local cumsums keep every exp bounded."""
    x = make_inputs(1, 4096, 1, 1, K=4, V=2, dtype=torch.float32)
    x["g"] = x["g"] * 20
    o, st = log_linear_gated_deltanet(**x, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(st.levels).all()
    o, st = log_linear_mamba2(**mamba2_args(x), output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(st.levels).all()


def test_extra_levels_are_ignored():
    x = mamba2_args(make_inputs(1, 20, 1, 2))
    o, _ = log_linear_mamba2(**x)
    more = dict(x, level_scales=torch.cat([x["level_scales"], torch.randn(1, 20, 2, 3, dtype=torch.float64)], -1))
    o2, _ = log_linear_mamba2(**more)
    assert torch.equal(o, o2)


def test_unit_lambda_chunk_path_is_the_plain_model():
    """lambda = 1: the chunk path equals plain Mamba-2 / Gated DeltaNet (independent recurrences in tests/reference)."""
    from reference.test_reference import plain_gated_deltanet, plain_mamba2

    x = make_inputs(2, 50, 1, 2)
    x["level_scales"] = torch.ones_like(x["level_scales"])
    o, _ = log_linear_mamba2(**mamba2_args(x), scale=0.5, chunk_size=8)
    assert_close(o, plain_mamba2(x["q"], x["k"], x["v"], x["g"], 0.5), 1e-12, "mamba2")
    o, _ = log_linear_gated_deltanet(**x, scale=0.5, chunk_size=8)
    assert_close(o, plain_gated_deltanet(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5), 1e-12, "gdn")


@pytest.mark.parametrize("shape,dim", [((7,), 0), ((5, 3), 0), ((2, 9, 3), 1), ((2, 3, 4), -1)])
def test_suffix_sum_sums_from_each_position_to_the_end(shape, dim):
    x = torch.randn(shape, dtype=torch.float64)
    n = x.shape[dim]
    want = torch.stack([x.narrow(dim, t, n - t).sum(dim) for t in range(n)], dim)
    torch.testing.assert_close(suffix_sum(x, dim), want, rtol=1e-12, atol=1e-12)


def test_carry_past_is_the_fenwick_carry():
    """carry_past (host-side position, slices) = fenwick.carry, widening the levels when the target is past them."""
    from loglinear.fenwick import carry
    from loglinear.ops.torch_chunk import carry_past

    for position in (1, 2, 6, 8, 12, 64, 96):
        levels = torch.randn(2, 5, 3, 4, 2, dtype=torch.float64)
        got = carry_past(levels, position)
        wide = torch.nn.functional.pad(levels, (0, 0, 0, 0, 0, 0, 0, got.shape[1] - 5))
        assert got.shape[1] == max(5, (position & -position).bit_length() + 1)
        torch.testing.assert_close(got, carry(wide, torch.full((2,), position)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("position, width, J", [(16, 5, 3), (32, 3, 4), (48, 8, 4), (64, 2, 6), (192, 6, 4)])
def test_chunk_levels_from_a_boundary_is_the_carried_chunk_levels(position, width, J):
    """chunk_levels_from at a chunk-aligned position (its own backward) = carry_past then the chunk levels c+1 .. c+J,
    zero-padded, values and the state's gradient; levels wider than the target included."""
    from loglinear.fenwick import ctz
    from loglinear.ops.torch_chunk import carry_past, chunk_levels_from

    C, c, target = 8, 3, ctz(position) + 1
    levels = torch.randn(2, width, 3, 4, 2, dtype=torch.float64, requires_grad=True)
    carried = carry_past(levels, position)[:, c + 1 :]
    want = torch.nn.functional.pad(carried, (0, 0, 0, 0, 0, 0, 0, J - carried.shape[1]))
    got, _ = chunk_levels_from(levels, (target, target), (target - c - 1,) * 2, C, J)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    d_out = torch.randn_like(want)
    (d_want,) = torch.autograd.grad(want, levels, d_out)
    (d_got,) = torch.autograd.grad(got, levels, d_out)
    torch.testing.assert_close(d_got, d_want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("width", [2, 6, 9])
@pytest.mark.parametrize("through, into", [((3, 5, 3, 9, 4), (2, 1, 0, 5, 0)), ((3, 3, 3), (0, 2, 5)),
                                           ((3, 3), (2, 2)), ((6, 6), (2, 2)), ((6, 3), (2, 2)),
                                           ((5, 9), (1, 5))])
def test_chunk_levels_from_rows_of_their_own(width, through, into):
    """Rows with their own through and into (carries to different targets, in-chunk sums into a chunk level, both)
    = the formula row by row, written with slices and sums, and the in-chunk levels of some rows (zero-padded to
    c + 1, a row twice); values and the state's gradient through both outputs."""
    from loglinear.ops.torch_chunk import chunk_levels_from

    C, c, J = 8, 3, 6
    levels = torch.randn(len(through), width, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    picked = (len(through) - 1, 0, len(through) - 1)

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for n, (t, j0) in enumerate(zip(through, into)):
            out = torch.zeros(J, 2, 3, 2, dtype=torch.float64)
            for j in range(J):
                kept = levels[n, c + 1 + j] if t < c + 1 + j < width else 0.0
                out[j] = kept + (levels[n, : t + 1].sum(0) if j == j0 else 0.0)
            rows.append(out)
        in_chunk = torch.nn.functional.pad(levels[list(picked), : c + 1], (0, 0) * 3 + (0, max(0, c + 1 - width)))
        return torch.stack(rows), in_chunk

    want, want_in = reference()
    got, got_in = chunk_levels_from(levels, through, into, C, J, in_chunk=picked)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_in, want_in, rtol=1e-12, atol=1e-12)
    d_out, d_in = torch.randn_like(want), torch.randn_like(want_in)
    (d_want,) = torch.autograd.grad((want * d_out).sum() + (want_in * d_in).sum(), levels)
    (d_got,) = torch.autograd.grad((got * d_out).sum() + (got_in * d_in).sum(), levels)
    torch.testing.assert_close(d_got, d_want, rtol=1e-12, atol=1e-12)
    for used in (0, 1):  # one output used alone
        (d_want,) = torch.autograd.grad(reference()[used], levels, (d_out, d_in)[used])
        got_one = chunk_levels_from(levels, through, into, C, J, in_chunk=picked)[used]
        (d_got,) = torch.autograd.grad(got_one, levels, (d_out, d_in)[used])
        torch.testing.assert_close(d_got, d_want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("through, into, width", [((2,), (0,), 3), ((4,), (4,), 3), ((8,), (0,), 3), ((4,), (0,), 9),
                                                  ((4, 4), (0,), 3)])
def test_chunk_levels_from_rejects_what_it_would_drop(through, into, width):
    """In-chunk levels above through (through < c), a chunk level past J, levels past c + 1 + J, a row without its
    through and into, in-chunk levels of a row that is not there: each a ValueError naming the function."""
    from loglinear.ops.torch_chunk import chunk_levels_from

    with pytest.raises(ValueError, match="chunk_levels_from takes"):
        chunk_levels_from(torch.zeros(1, width, 1, 2, 2), through, into, 8, 4)
    with pytest.raises(ValueError, match="chunk_levels_from takes in_chunk rows"):
        chunk_levels_from(torch.zeros(1, 3, 1, 2, 2), (3,), (0,), 8, 4, in_chunk=(1,))


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("position", [None, 5])
def test_backward_writes_whole_size_tensors_a_fixed_number_of_times(name, position):
    """Chunks and packed sequences are cut into views with one autograd node each, so the backward writes fewer than
    one more whole-size tensor per added chunk or sequence (a node per chunk or sequence writes a zero tensor of the
    whole size each: O(N^2))."""
    few_chunks = large_writes(name, [64], 16, position, "torch")[1]  # 4 chunks
    many_chunks = large_writes(name, [64], 2, position, "torch")[1]  # 32 chunks
    assert many_chunks - few_chunks < 32 - 4, (few_chunks, many_chunks)
    few_sequences = large_writes(name, [64, 64], 16, position, "torch")[1]
    many_sequences = large_writes(name, [8] * 16, 16, position, "torch")[1]
    assert many_sequences - few_sequences < 16 - 2, (few_sequences, many_sequences)
