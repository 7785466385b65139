"""Gradients: torch.autograd.gradcheck in float64 for every input, the initial state included."""

import pytest
import torch

from helpers import assert_close, make_inputs, slice_time
from loglinear import FenwickState, log_linear_gated_deltanet, log_linear_mamba2
from loglinear import reference as R


def _prefilled_state(x, positions, variant):
    """A state from real prefixes of different lengths, then perturbed so every level slot is exercised."""
    states = []
    for row, p in enumerate(positions):
        xr = {n: t[row : row + 1, :p] for n, t in x.items()}
        states.append(_call(variant, xr, None, 4)[1])
    L = max(s.num_levels for s in states)
    levels = torch.cat([s.with_levels(L).levels for s in states])
    levels = levels + 0.1 * torch.randn_like(levels)
    return FenwickState(levels.detach().requires_grad_(), torch.tensor(positions))


def _call(variant, x, state, chunk_size, **kw):
    if variant == "mamba2":
        return log_linear_mamba2(x["q"], x["k"], x["v"], x["g"], x["level_scales"], initial_state=state,
                                 output_final_state=True, chunk_size=chunk_size, **kw)
    return log_linear_gated_deltanet(x["q"], x["k"], x["v"], x["g"], x["beta"], x["level_scales"],
                                     initial_state=state, output_final_state=True, chunk_size=chunk_size,
                                     use_qk_l2norm=True, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mamba2", "gated_deltanet"])
@pytest.mark.parametrize("with_state", [False, True])
def test_gradcheck_every_input(variant, with_state):
    pre = make_inputs(2, 14, 1, 2, K=3, V=2, L=6)
    x = slice_time(pre, 7, 14) if with_state else slice_time(pre, 0, 9)
    names = ["q", "k", "v", "g", "level_scales"] + (["beta"] if variant == "gated_deltanet" else [])
    state = _prefilled_state(pre, [3, 6], variant) if with_state else None
    inputs = [x[n].clone().requires_grad_() for n in names]
    if with_state:
        inputs.append(state.levels)

    def fn(*args):
        xs = dict(x, **dict(zip(names, args)))
        st = FenwickState(args[-1], state.positions) if with_state else None
        o, final = _call(variant, xs, st, 4)
        return o, final.levels

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("variant", ["mamba2", "gated_deltanet"])
def test_gradients_match_reference_at_size(variant):
    """All gradients of the chunk path equal autograd through the recurrent reference (T = 70, GQA, varlen)."""
    lengths = [29, 41]
    x = make_inputs(1, sum(lengths), 2, 4, K=5, V=3)
    cu = torch.tensor([0, 29, 70])
    names = ["q", "k", "v", "g", "level_scales"] + (["beta"] if variant == "gated_deltanet" else [])
    do = torch.randn(1, 70, 4, 3, dtype=torch.float64)
    grads = []
    for impl in ("chunk", "reference"):
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        xs = dict(x, **leaves)
        if impl == "chunk":
            o, _ = _call(variant, xs, None, 8, cu_seqlens=cu)
        elif variant == "mamba2":
            o, _ = R.log_linear_mamba2_recurrent(xs["q"], xs["k"], xs["v"], xs["g"], xs["level_scales"], cu_seqlens=cu)
        else:
            o, _ = R.log_linear_gated_deltanet_recurrent(**xs, cu_seqlens=cu, use_qk_l2norm=True)
        grads.append(torch.autograd.grad((o * do).sum(), list(leaves.values())))
    for n, a, b in zip(names, *grads):
        assert_close(a, b, 1e-10, f"d{n}")
