"""Triton log-linear GLA (the Mamba-2 kernels with a per-channel gate; TRITON_INTERPRET=1 on CPU tensors) vs the
float64 recurrent reference: outputs, final states and every gradient (q, k, v, g, level_scales, the initial
state's levels), with every kernel output buffer poisoned with NaN first and the torch path forbidden.
"""

import pytest
import torch

from helpers import assert_close, compare_with_reference, gla_inputs
from loglinear import FenwickState, log_linear_gla, log_linear_mamba2
from loglinear import reference as R
from loglinear.ops.triton.mamba2 import backend
from loglinear.variants import GLA

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("triton_kernels", "no_torch_path")]
FP32_TOL = 3e-5


def _state(positions: list[int], H: int, K: int, V: int, levels: int) -> FenwickState:
    return FenwickState(torch.randn(len(positions), levels, H, K, V, dtype=torch.float64), torch.tensor(positions))


def _close_or_tiny(actual, expected, tol, what):
    """Relative error below tol against max(||expected||, 1) (a gradient that is exactly 0 in the reference, dg at
    T = 1, must come out as rounding noise)."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual - expected).norm() / max(expected.norm().item(), 1.0)
    assert err <= tol, f"{what}: error {err:.3e} > {tol:.1e}"


def _compare(x: dict, *, state=None, cu_seqlens=None, chunk_size: int = 16, dtype=torch.float32,
             tol: float = FP32_TOL) -> None:
    """The kernels (in dtype) against the float64 recurrent reference: o, state and all gradients."""
    compare_with_reference(
        lambda xs, st: log_linear_gla(**{"level_scales": None, **xs}, initial_state=st, output_final_state=True,
                                      cu_seqlens=cu_seqlens, chunk_size=chunk_size),
        lambda xs, st: R.recurrent(GLA, xs["q"], xs["k"], xs["v"], {"g": xs["g"]}, xs.get("level_scales"),
                                   initial_state=st, output_final_state=True, cu_seqlens=cu_seqlens),
        x, state, tol=tol, dtype=dtype, grad_close=_close_or_tiny,
    )


@pytest.mark.parametrize(
    "B, T, G, H, K, V, chunk",
    [
        (1, 1, 1, 2, 8, 5, 16),  # one token
        (2, 37, 1, 2, 8, 5, 16),  # T not a multiple of the chunk, B > 1, K / V not powers of two; one sub-chunk
        (1, 70, 2, 4, 16, 8, 32),  # G < H, three chunk levels, two 16-row sub-chunks per chunk
    ],
)
def test_kernels_match_reference(B, T, G, H, K, V, chunk):
    _compare(gla_inputs(B, T, G, H, K, V), chunk_size=chunk)


def test_key_blocks(monkeypatch):
    """K wider than the in-chunk kernels' key block (16 here): their programs take the key channels in blocks."""
    monkeypatch.setattr(backend, "KEY_BLOCK", 16)
    _compare(gla_inputs(1, 70, 1, 2, 48, 8), chunk_size=32)


def test_continuation_from_states_varlen():
    """States at an unaligned position, at 0 and at an aligned one (junk in every level, gradients reach them),
    three sequences of one varlen call."""
    x = gla_inputs(1, 60, 1, 2, 8, 5, start=48)
    _compare(x, cu_seqlens=torch.tensor([0, 3, 37, 60]), state=_state([21, 0, 48], 2, 8, 5, levels=8))


def test_a_call_inside_one_chunk_from_states():
    """Every sequence ends before its next chunk boundary: the whole call runs on the torch prefix path, the kernels
    get no chunk at all, and the gradients (the gate's through its chunk sums too) still reach every input."""
    _compare(gla_inputs(2, 3, 1, 2, 8, 5, start=20), state=_state([5, 20], 2, 8, 5, levels=6))


def test_plain_varlen_with_states():
    """Plain GLA (level_scales None): the one-level kernels, states at any position."""
    x = gla_inputs(1, 50, 2, 4, 8, 5)
    x.pop("level_scales")
    _compare(x, cu_seqlens=torch.tensor([0, 19, 50]), state=_state([13, 0], 4, 8, 5, levels=1), chunk_size=32)


def test_strong_decays_are_exact():
    """Decays down to exp(-20) per token and hard resets (g = -inf) in some channels: every exponent the kernels
    take is <= 0, so nothing overflows and the result is the reference's."""
    x = gla_inputs(1, 150, 1, 2, 8, 5)
    x["g"] = -20 * torch.rand_like(x["g"]) * (torch.rand_like(x["g"]) < 0.5)
    x["g"][0, 9, 1, :3] = -torch.inf
    x["g"][0, 100, 0, 5:] = -torch.inf
    _compare(x, chunk_size=64)


def test_sub_chunks_with_long_and_short_spans():
    """One call with both ways of taking a sub-chunk's diagonal block: through the products across sub-chunks (its
    decay from first to last row within exp(-DIAGONAL_SPAN) on every channel; one sub-chunk just inside the span,
    with factors up to exp(28.5)), and column by column (decays of about exp(-4) per token over two sub-chunks)."""
    x = gla_inputs(1, 150, 1, 2, 8, 5)
    x["g"][0, 70:90] = -8 * torch.rand_like(x["g"][0, 70:90])
    x["g"][0, 97:112] = -1.9
    _compare(x, chunk_size=64)


def test_equal_channels_are_the_mamba2_kernels():
    """A gate equal over the key channels is log-linear Mamba-2: the per-channel build of the kernels gives the
    scalar one's outputs and gradients."""
    x = {n: t.float().requires_grad_() for n, t in gla_inputs(2, 24, 1, 2, 8, 5).items()}
    scalar = x["g"][..., 0].detach().requires_grad_()
    o_gla, s_gla = log_linear_gla(**{**x, "g": scalar[..., None].expand_as(x["g"])}, output_final_state=True,
                                  chunk_size=16)
    o_m2, s_m2 = log_linear_mamba2(**{**x, "g": scalar}, output_final_state=True, chunk_size=16)
    assert_close(o_gla, o_m2, 1e-5, "o")
    assert_close(s_gla.levels, s_m2.levels, 1e-5, "state")
    d_o = torch.randn_like(o_m2)
    grads = [torch.autograd.grad((o * d_o).sum(), [x["q"], x["k"], x["v"], scalar, x["level_scales"]])
             for o in (o_gla, o_m2)]
    for name, a, b in zip(["q", "k", "v", "g", "level_scales"], *grads):
        assert_close(a, b, 1e-5, f"d{name}")


def test_half_precision():
    _compare(gla_inputs(1, 37, 1, 2, 16, 8), dtype=torch.bfloat16, tol=3e-2)
