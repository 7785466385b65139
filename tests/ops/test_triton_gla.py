"""Triton log-linear GLA (the Mamba-2 kernels with a per-channel gate; TRITON_INTERPRET=1 on CPU tensors) vs the
float64 recurrent reference: outputs, final states and every gradient (q, k, v, g, level_scales, the initial
state's levels), with every kernel output buffer poisoned with NaN first and the torch path forbidden.
"""

import pytest
import torch

from helpers import assert_close, compare_with_reference, gla_inputs
from loglinear import FenwickState, log_linear_gla, log_linear_mamba2
from loglinear import reference as R
from loglinear.ops import finite
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


@pytest.mark.parametrize("plain", [False, True])
def test_gradients_stay_per_head_where_the_launch_rule_would_sum_them(plain, monkeypatch):
    """With every launch asking for whole groups per program (CHUNK_PROGRAMS 1), a per-channel gate's dq / dk still
    come per head: its gate terms q * dq, k * dk need each head's own."""
    from loglinear.ops.triton.shared import launch

    monkeypatch.setattr(launch, "CHUNK_PROGRAMS", 1)
    x = gla_inputs(1, 40, 1, 4, 16, 8)
    if plain:
        x.pop("level_scales")
    _compare(x, state=_state([16], 4, 16, 8, 1 if plain else 7))


def test_key_blocks(monkeypatch):
    """K wider than the in-chunk kernels' key block (16 here): their programs take the key channels in blocks."""
    monkeypatch.setattr(backend, "KEY_BLOCK", 16)
    _compare(gla_inputs(1, 70, 1, 2, 48, 8), chunk_size=32)


def test_deposit_blocks(monkeypatch):
    """The deposit kernel's merged blocks of four chunks with a per-channel gate (chunk 16: 9 and 6 chunks, the
    second sequence from a state at chunk 3), its K rows in two programs of 16 (per-row gate totals and decays)."""
    monkeypatch.setattr(backend, "DEPOSIT_ROWS", 16)
    x = gla_inputs(1, 240, 1, 2, 32, 8)
    _compare(x, cu_seqlens=torch.tensor([0, 140, 240]), state=_state([0, 48], 2, 32, 8, levels=8))


def test_continuation_from_states_varlen():
    """States inside a chunk (21: chunk 1; 37: chunk 2, whose first cascade merges into chunk level 0, below the
    levels a state there holds), at 0 and at an aligned one (junk in every level, gradients reach them), four
    sequences of one varlen call."""
    x = gla_inputs(1, 90, 1, 2, 8, 5, start=48)
    _compare(x, cu_seqlens=torch.tensor([0, 3, 37, 60, 90]), state=_state([21, 0, 48, 37], 2, 8, 5, levels=8))


def test_all_zero_initial_levels_are_skipped_exactly():
    """States at aligned positions with all-zero chunk levels (a state a call leaves holds only its position's
    levels), which the readouts skip: outputs, dlambda (written as 0 in their columns: the buffers start as NaN) and
    every level's gradient still exact. Sequence 0 keeps its other levels, sequence 1 only chunk level 0."""
    state = _state([64, 48], 2, 8, 5, levels=9)
    state.levels[0, 5] = 0  # chunk level 0 of sequence 0 (16-token chunks: token level 5)
    state.levels[1, 6:] = 0  # sequence 1: every chunk level above 0
    _compare(gla_inputs(2, 100, 1, 2, 8, 5, start=64), state=state)


def test_a_call_inside_one_chunk_from_states():
    """Every sequence ends before its next chunk boundary: each is one front-padded chunk whose final state holds
    the state's buckets where its last token reads them, and the gradients (the gate's through its chunk sums too)
    still reach every input."""
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
    decay from first to last row within exp(-30), diagonal_span, on every channel; one sub-chunk just inside the span,
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


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_precision(dtype, tol):
    """16-bit inputs. In fp16 a sub-chunk's diagonal block goes through the products only within a decay span of 6
    (diagonal_span): the fast-forgetting channels' sub-chunks take it column by column (at bf16's span of 30 their
    keys, scaled by up to exp(30), would overflow fp16)."""
    _compare(gla_inputs(1, 37, 1, 2, 16, 8), dtype=dtype, tol=tol)


def _below_floor(g: torch.Tensor) -> torch.Tensor:
    """g [1, T, H, K] with log-decays at or below the floor on some channels (hard resets -inf, -1e30, -200, the floor
    itself) at tokens 1, 10, 25, 36, 45 and 57 (test_gates_at_and_below_the_floor); -> the mask of those entries."""
    floor = finite.LOG_DECAY_FLOOR[torch.float32]
    for t, h, channels, value in [(1, 0, slice(2, 3), -torch.inf), (10, 1, slice(0, 2), -1e30),
                                  (25, 0, slice(3, 4), -200.0), (25, 0, slice(4, 5), floor),
                                  (25, 1, slice(5, 8), -torch.inf), (36, 1, slice(6, 7), -torch.inf),
                                  (45, 1, slice(None), -torch.inf), (57, 0, slice(0, 1), -1e30)]:
        g[0, t, h, channels] = value
    return g <= floor


def _run(x: dict, state: FenwickState | None, **kw) -> tuple[torch.Tensor, ...]:
    """(o, final levels, the gradients of q, k, v, g, level_scales and the initial levels) of one GLA call in fp32,
    under cotangents drawn from a fixed seed."""
    leaves = {n: t.detach().float().requires_grad_() for n, t in x.items()}
    levels = state.levels.detach().float().requires_grad_() if state is not None else None
    st = FenwickState(levels, state.positions) if state is not None else None
    o, final = log_linear_gla(**{"level_scales": None, **leaves}, initial_state=st, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(1)
    d_o, d_state = (torch.randn(y.shape, generator=gen) for y in (o, final.levels))
    loss = (o * d_o).sum() + (final.levels * d_state).sum()
    inputs = [*leaves.values(), *([levels] if levels is not None else [])]
    return o, final.levels, *torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("plain", [False, True], ids=["fenwick", "plain"])
def test_gates_at_and_below_the_floor(plain):
    """Log-decays at or below the floor on some channels (hard resets g = -inf, -1e30, -200, the floor itself) in the
    torch prefix of a state at an unaligned position, in a sequence the prefix finishes, in kernel chunks and in the
    final state's last chunks of a varlen call (plain: all on the kernels): the kernels floor g where they read it,
    so the outputs, the final state and every gradient match the float64 reference and the torch backend (which
    floors g before it runs), and dg is exactly 0 where g <= floor."""
    x = gla_inputs(1, 60, 1, 2, 8, 5, start=48)
    cu = torch.tensor([0, 3, 37, 60])  # from positions 21, 5 and 48 (aligned)
    state = _state([21, 5, 48], 2, 8, 5, levels=1 if plain else 8)
    if plain:
        x.pop("level_scales")
    bad = _below_floor(x["g"])
    _compare(x, cu_seqlens=cu, state=state, chunk_size=16)
    kernels = _run(x, state, cu_seqlens=cu, chunk_size=16)
    torch_path = _run(x, state, cu_seqlens=cu, chunk_size=16, backend="torch")
    names = ["o", "final state", "dq", "dk", "dv", "dg", *(["dlevel_scales"] if not plain else []), "dinitial state"]
    for name, a, e in zip(names, kernels, torch_path):
        _close_or_tiny(a.double(), e.double(), FP32_TOL, name)
    dg_kernels, dg_torch = kernels[5], torch_path[5]
    assert (dg_kernels[bad] == 0).all() and (dg_torch[bad] == 0).all(), "dg is not 0 where g <= floor"
    assert (dg_kernels[~bad] != 0).float().mean() > 0.9  # and not 0 elsewhere


def test_the_op_adds_no_pass_over_the_gate(monkeypatch):
    """On the kernels, a per-channel gate is floored where they read it: the op floors no tensor of the gate's size
    in torch (only the few rows of a torch prefix or a final state's last chunk)."""
    floored = []
    apply = finite._Floor.apply
    monkeypatch.setattr(finite._Floor, "apply", lambda g, floor: floored.append(g.numel()) or apply(g, floor))
    x = {n: t.float().requires_grad_() for n, t in gla_inputs(1, 60, 1, 2, 8, 5, start=48).items()}
    o, state = log_linear_gla(**x, initial_state=_state([21], 2, 8, 5, levels=8), output_final_state=True,
                              chunk_size=16)
    (o.sum() + state.levels.sum()).backward()
    assert floored and max(floored) <= 16 * 2 * 8, f"floored {floored} entries, the gate has {x['g'].numel()}"


def test_the_gate_gradient_reads_g_only_where_the_floor_is_reached(monkeypatch):
    """The gate-gradient kernel reads g (for the floor's zero gradient) only in chunks whose G reaches the floor:
    handed a g of -inf in place of the call's, the chunks of moderate gates keep their gradient and a chunk with a
    hard reset, where it reads g, gives 0."""
    x = {n: t.float() for n, t in gla_inputs(1, 48, 1, 2, 8, 5).items()}
    x["g"][0, 20, 1, 3] = -float("inf")  # the second of three chunks of 16 reaches the floor (head 1, channel 3)
    dg_true = _run(x, None, chunk_size=16)[5]
    gate_grad = backend._gate_grad
    monkeypatch.setattr(backend, "_gate_grad", lambda d_gate, totals, g, *rest: gate_grad(
        d_gate, totals, torch.full_like(g, -float("inf")), *rest))
    dg = _run(x, None, chunk_size=16)[5]
    assert (dg[0, 16:32, 1] == 0).all(), "the reset's chunk did not read g"
    other = torch.ones_like(dg, dtype=torch.bool)
    other[0, 16:32, 1] = False
    assert torch.equal(dg[other], dg_true[other]) and (dg_true[other] != 0).float().mean() > 0.9


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_bad_gate_spoils_only_what_comes_after_it(value):
    """NaN or +inf in one channel of the per-channel gate (read unfloored by the finite check, floored by the kernels):
    that head's outputs from the token on are NaN, every other output is as without it."""
    x = {n: t.float() for n, t in gla_inputs(1, 40, 1, 2, 8, 5).items()}
    o_ref, _ = log_linear_gla(**x, chunk_size=16)
    x["g"][0, 21, 1, 3] = value
    o, _ = log_linear_gla(**x, chunk_size=16)
    assert torch.equal(o[0, :21], o_ref[0, :21]) and torch.equal(o[0, :, 0], o_ref[0, :, 0])
    assert o[0, 21:, 1].isnan().all()
