"""Randomly drawn calls of every variant on the Triton kernels (CPU: the interpreter) against the float64
recurrent reference: the variant, plain or log-linear, batch or packed sequences (cu_seqlens), lengths, heads and
groups, head dims, chunk size, incoming states at drawn positions (one position for all rows or one per sequence),
use_qk_l2norm, the final state or none, values beyond the models' ranges (negative lambda, a growing log-decay,
other gates outside (0, 1)); outputs, final states and every gradient, the initial state's too. The same draws without
gradients (cut to one token per sequence half the time, which after a state is the fused one-token step): outputs
and final states.

The parametrized kernel tests pin the cases each path was built for; these draws cross them in combinations
nobody listed. Each run draws new calls (hypothesis prints a failing one, to be pinned as an @example)."""

import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from loglinear import FenwickState
from loglinear import reference as R
from loglinear.fenwick import levels_needed
from loglinear.ops.api import attention
from loglinear.ops.backends import select_backend
from loglinear.variants import REGISTRY, get

RTOL = 1e-4  # fp32 kernels against float64


def _has_kernels(name: str) -> bool:
    try:
        return select_backend(REGISTRY[name], torch.device("cpu"), "triton") == "triton"
    except ValueError:
        return False


VARIANTS = sorted(name for name in REGISTRY if _has_kernels(name))  # every registered variant with Triton kernels


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, floor: float = 0.0) -> None:
    """Norm-wise relative error below RTOL, relative to at least 1% of a unit-sized tensor's norm (or ``floor``,
    if larger): a gradient that is exactly 0 in float64 (a gate at position 0 that nothing before it carries) is
    compared absolutely there."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    floor = max(floor, 1e-2 * expected.numel() ** 0.5)
    err = ((actual.double() - expected).norm() / expected.norm().clamp_min(floor)).item()
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL:.0e}"


@st.composite
def calls(draw):
    """One call: (variant name, inputs {q, k, v, gates, level_scales} float64, initial FenwickState or None,
    cu_seqlens or None, kwargs of the op, the seed of the cotangents the gradients are taken with)."""
    name = draw(st.sampled_from(VARIANTS))
    plain = draw(st.booleans())
    G, H = draw(st.sampled_from([(1, 1), (1, 2), (2, 2), (2, 4)]))
    K, V = draw(st.sampled_from([4, 8, 16])), draw(st.sampled_from([3, 8, 16]))
    chunk = draw(st.sampled_from([16, 32, 64]))
    if draw(st.booleans()):  # packed sequences
        lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
        B, T, N = 1, sum(lengths), len(lengths)
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    else:
        B, T = draw(st.integers(1, 2)), draw(st.integers(1, 70))
        N, cu_seqlens = B, None
    position = st.sampled_from([0, 1, chunk - 1, chunk, 2 * chunk, 4 * chunk]) | st.integers(0, 300)
    positions = None
    if draw(st.booleans()):  # an incoming state
        positions = [draw(position)] * N if draw(st.booleans()) else [draw(position) for _ in range(N)]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kw = dict(dtype=torch.float64, generator=gen)
    end = max(positions or [0]) + T
    gates = get(name).sample_gates(B, T, H, K, **kw)
    lam_low = 0.2
    if draw(st.booleans()):  # beyond the models' ranges: the op computes the formula for any finite value
        lam_low = -0.6
        gates = {gate.name: gates[gate.name] * (-0.02 if gate.log_decay else 2.0) - (0 if gate.log_decay else 0.2)
                 for gate in get(name).gates}
    x = {"q": torch.randn(B, T, G, K, **kw), "k": torch.randn(B, T, G, K, **kw) / K**0.5,
         "v": torch.randn(B, T, H, V, **kw), "gates": gates,
         "level_scales": None if plain else lam_low + torch.rand(B, T, H, levels_needed(end) + 1, **kw)}
    state = None
    if positions is not None:
        L = 1 if plain else levels_needed(max(max(positions), 1))
        state = FenwickState(0.3 * torch.randn(N, L, H, K, V, **kw), torch.tensor(positions))
    options = {"output_final_state": draw(st.booleans()), "chunk_size": chunk, "use_qk_l2norm": draw(st.booleans())}
    return name, x, state, cu_seqlens, options, draw(st.integers(0, 2**31 - 1))


def _run(op, name, x, state, cu_seqlens, options, dtype):
    """op on leaves of x (and of the state's levels) in dtype: (o, final levels or None, leaves)."""
    leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in x.items() if n != "gates" and t is not None}
    gates = {n: t.detach().to(dtype).requires_grad_() for n, t in x["gates"].items()}
    init = None
    if state is not None:
        levels = state.levels.detach().to(dtype).requires_grad_()
        init, leaves["initial_state"] = FenwickState(levels, state.positions), levels
    o, final = op(name, leaves["q"], leaves["k"], leaves["v"], gates, leaves.get("level_scales"),
                  initial_state=init, cu_seqlens=cu_seqlens, **options)
    return o, None if final is None else final.levels, {**leaves, **gates}


def _outputs_match(name, x, state, cu_seqlens, options, grad: bool) -> tuple[tuple, tuple]:
    """The op (fp32, gradients enabled or not) and the float64 reference on one call, their outputs and final states
    compared -> (the op's, the reference's) (o, final levels or None, leaves) (_run)."""
    with torch.set_grad_enabled(grad):
        ours = _run(attention, name, x, state, cu_seqlens, options, torch.float32)
    reference = {n: v for n, v in options.items() if n != "chunk_size"}
    ref = _run(R.recurrent, name, x, state, cu_seqlens, reference, torch.float64)
    _close(ours[0], ref[0], "o")
    assert (ours[1] is None) == (ref[1] is None)
    if ours[1] is not None:
        _close(ours[1], ref[1], "final state")
    return ours, ref


def _one_token_sequences():
    """A drawn call pinned: plain Mamba-2 on two packed sequences of one token each, a growing log-decay,
    use_qk_l2norm and the final state. The gate's gradient is exactly 0 in float64 (each q.dq cancels its k.dk),
    and in fp32 the rounding of those terms: 1.01e-4 of a floor of 1% of a unit tensor's norm, which it failed."""
    gen = torch.Generator().manual_seed(1)
    kw = dict(dtype=torch.float64, generator=gen)
    x = {"q": torch.randn(1, 2, 1, 16, **kw), "k": torch.randn(1, 2, 1, 16, **kw) / 4,
         "v": torch.randn(1, 2, 1, 16, **kw), "gates": {"g": torch.tensor([[[0.0047], [0.0064]]], dtype=torch.float64)},
         "level_scales": None}
    options = {"output_final_state": True, "chunk_size": 16, "use_qk_l2norm": True}
    return "mamba2", x, None, torch.tensor([0, 1, 2]), options, 3


@settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.generate],  # no shrinking: report the draw
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(call=calls())
@example(call=_one_token_sequences())
def test_random_call_matches_reference(triton_kernels, no_torch_path, call):
    name, x, state, cu_seqlens, options, seed = call
    gen = torch.Generator().manual_seed(seed)  # the output cotangents'
    (o, final, leaves), (o_ref, final_ref, leaves_ref) = _outputs_match(name, x, state, cu_seqlens, options, True)
    d_o = torch.randn(o_ref.shape, dtype=o_ref.dtype, generator=gen)
    d_final = None if final is None else torch.randn(final_ref.shape, dtype=final_ref.dtype, generator=gen)
    terms = [o_ref * d_o] + ([] if final is None else [final_ref * d_final])
    loss_ref = sum(t.sum() for t in terms)
    loss = (o.double() * d_o).sum() + (0 if final is None else (final.double() * d_final).sum())
    grads_ref = torch.autograd.grad(loss_ref, list(leaves_ref.values()))
    grads = torch.autograd.grad(loss, list(leaves.values()))
    # a log-decay gate's gradient is a difference of sums of the loss's terms (q.dq - k.dk per token, summed over the
    # later tokens: the telescoping in loglinear/ops/triton/mamba2/chunk.py), which can cancel to exactly 0 in
    # float64 (a sequence of one token): in fp32 what is left is their rounding, so it is measured against their size
    decays = {gate.name for gate in get(name).gates if gate.log_decay}
    cancel = 1e-2 * sum(t.detach().abs().sum().item() for t in terms)
    for n, a, e in zip(leaves, grads, grads_ref):
        _close(a, e, f"d{n}", floor=cancel if n in decays else 0.0)


def _first_tokens(x: dict, cu_seqlens: torch.Tensor | None) -> tuple[dict, torch.Tensor | None]:
    """x cut to each sequence's first token ([B, 1, ...]; packed: the sequences' first tokens, cu_seqlens then
    [0, 1, .., N])."""
    first = torch.tensor([0]) if cu_seqlens is None else cu_seqlens[:-1]
    cut = lambda t: None if t is None else t.index_select(1, first)  # noqa: E731
    x = {n: {g: cut(u) for g, u in t.items()} if n == "gates" else cut(t) for n, t in x.items()}
    return x, None if cu_seqlens is None else torch.arange(len(cu_seqlens))


@settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(call=calls(), one_token=st.booleans())
def test_random_call_without_gradients_matches_reference(triton_kernels, no_torch_path, call, one_token):
    name, x, state, cu_seqlens, options, _ = call
    if one_token:
        x, cu_seqlens = _first_tokens(x, cu_seqlens)
    _outputs_match(name, x, state, cu_seqlens, options, False)
