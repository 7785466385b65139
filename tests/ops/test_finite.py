"""Non-finite inputs stay where they are (loglinear.ops.finite), on both backends (Triton under TRITON_INTERPRET=1):
a NaN or an infinity at token t leaves every output before t, the other sequences and their gradients exactly as
without it; g = -inf is a hard reset and very negative gates are exact, against the float64 reference."""

import pytest
import torch

from helpers import assert_close, compare_with_reference, gla_inputs, make_inputs
from loglinear import reference as R
from loglinear.inputs import check_inputs
from loglinear.ops import attention, backends
from loglinear.ops.backends import Backend, torch_chunk_backend
from loglinear.ops.finite import LOG_DECAY_FLOOR, FiniteCheck, finite_check, floor_log_decays
from loglinear.variants import GATED_DELTANET, GLA, MAMBA2

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the kernels run interpreted
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]
VARIANTS = [MAMBA2, GATED_DELTANET]
T_BAD = 13  # inside the second chunk of 8, not at its start
READ = ("q", "level_scales")  # read by their own token only


def _inputs(variant, B=2, T=29, dtype=torch.float32, **kw) -> dict[str, torch.Tensor]:
    x = make_inputs(B, T, 1, 2, K=8, V=4, **kw)  # one q/k group for two value heads
    return {n: t.to(DEVICE, dtype) for n, t in x.items() if n in ("q", "k", "v", "level_scales", *variant.gate_names)}


def _call(variant, x, backend, **kw):
    gates = {name: x[name] for name in variant.gate_names}
    return attention(variant, x["q"], x["k"], x["v"], gates, x["level_scales"], output_final_state=True,
                     chunk_size=8, backend=backend, **kw)


def _spoil(x, name, value, row, t):
    """A copy of x with input ``name`` of batch row ``row`` at token t, head/group 0, set to value."""
    bad = {n: t_.clone() for n, t_ in x.items()}
    bad[name][row, t, 0] = value
    return bad


def _cases(variant):
    names = ["q", "k", "v", "level_scales", *variant.gate_names]
    return [(variant, name, value) for name in names for value in (float("nan"), float("inf"), -float("inf"))
            if not (name == "g" and value == -float("inf"))]  # -inf is a valid log-decay (a hard reset)


# on the kernels (the interpreter is slow): NaN in an input that is only read (q) and in one the state carries
KERNEL_SPOILS = {"mamba2": ("q", "g"), "gated_deltanet": ("q", "beta")}


def _spoil_params():
    """Every input and bad value on the torch backend (the containment, loglinear.ops.finite, is the op's, before
    any backend); NaN in a read and a carried input on the kernels."""
    for variant in VARIANTS:
        for _, name, value in _cases(variant):
            yield pytest.param(variant, name, value, "torch", id=f"{variant.name}-{name}-{value}-torch")
            if value != value and name in KERNEL_SPOILS[variant.name]:
                yield pytest.param(variant, name, value, "triton", id=f"{variant.name}-{name}-{value}-triton",
                                   marks=pytest.mark.interpreter)


@pytest.mark.parametrize("variant, name, value, backend", list(_spoil_params()))
def test_a_bad_value_spoils_only_what_comes_after_it(variant, name, value, backend):
    x = _inputs(variant)
    o_ref, s_ref = _call(variant, x, backend)
    o, s = _call(variant, _spoil(x, name, value, row=1, t=T_BAD), backend)
    heads = [0, 1] if name in ("q", "k") else [0]  # q/k group 0 feeds both value heads
    others = [h for h in (0, 1) if h not in heads]
    assert torch.equal(o[0], o_ref[0]), "another sequence changed"
    assert torch.equal(o[1, :T_BAD], o_ref[1, :T_BAD]), "an output before the bad token changed"
    assert torch.equal(o[1, :, others], o_ref[1, :, others]), "another head changed"
    assert torch.equal(s.levels[0], s_ref.levels[0]) and torch.equal(s.levels[1][:, others], s_ref.levels[1][:, others])
    if name in READ:
        assert o[1, T_BAD, heads].isnan().all()
        assert torch.equal(o[1, T_BAD + 1 :], o_ref[1, T_BAD + 1 :]), "a read-only input spoiled later outputs"
        assert torch.equal(s.levels, s_ref.levels)
    else:
        assert o[1, T_BAD:, heads].isnan().all(), "an output after the bad token is not NaN"
        assert s.levels[1][:, heads].isnan().all(), "the final state of a spoiled sequence is not NaN"


def _gradient_params():
    """Inputs of both variants on the torch backend; on the kernels one carried input per variant."""
    for variant, name in [(MAMBA2, "k"), (MAMBA2, "g"), (GATED_DELTANET, "v"), (GATED_DELTANET, "beta"),
                          (GATED_DELTANET, "q")]:
        yield pytest.param(variant, name, "torch", id=f"{variant.name}-{name}-torch")
        if name in ("g", "beta"):
            yield pytest.param(variant, name, "triton", id=f"{variant.name}-{name}-triton",
                               marks=pytest.mark.interpreter)


@pytest.mark.parametrize("variant, name, backend", list(_gradient_params()))
def test_gradients_of_earlier_outputs_are_unchanged(variant, name, backend):
    """The gradients of a loss on the outputs before the bad token (and on another sequence) equal those of the
    same loss without it, for every input (the bad entry itself gets 0)."""
    x = _inputs(variant)
    w = torch.randn(2, 29, 2, 4, device=DEVICE)
    w[1, T_BAD:] = 0

    def grads(inputs):
        leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
        o, _ = _call(variant, leaves, backend)
        loss = (torch.where(w != 0, o, 0) * w).sum()
        return torch.autograd.grad(loss, list(leaves.values()))

    for n, got, expected in zip(x, grads(_spoil(x, name, float("nan"), row=1, t=T_BAD)), grads(x)):
        assert torch.isfinite(got).all(), f"d{n}: not finite"
        if n == name:
            assert (got[1, T_BAD, 0] == 0).all()
            got, expected = got.clone(), expected.clone()
            got[1, T_BAD, 0] = expected[1, T_BAD, 0] = 0
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=f"d{n} changed")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_varlen_other_sequences_are_untouched(variant, backend):
    bounds = [0, 10, 23, 29]
    cu = torch.tensor(bounds)
    x = _inputs(variant, B=1)
    o_ref, s_ref = _call(variant, x, backend, cu_seqlens=cu)
    o, s = _call(variant, _spoil(x, "k", float("nan"), row=0, t=15), backend, cu_seqlens=cu)
    assert torch.equal(o[0, :15], o_ref[0, :15]) and torch.equal(o[0, 23:], o_ref[0, 23:])
    assert o[0, 15:23].isnan().all()
    assert torch.equal(s.levels[[0, 2]], s_ref.levels[[0, 2]]) and s.levels[1].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("gate", [-float("inf"), -1e30])
def test_hard_reset_and_very_negative_gates_match_the_reference(variant, gate, backend):
    """g at two tokens (one of them in the middle of a chunk) set to -inf / -1e30 / -200: the outputs, the state
    and all gradients match the float64 recurrent reference (before: NaN, or wrong by O(1))."""
    x = make_inputs(2, 29, 1, 2, K=8, V=4)
    x = {n: t.to(DEVICE) for n, t in x.items() if n in ("q", "k", "v", "level_scales", *variant.gate_names)}
    x["g"][0, 11, 0] = x["g"][1, 16, 1] = gate
    compare_with_reference(
        lambda xs, st: _call(variant, xs, backend),
        lambda xs, st: R.recurrent(variant, xs["q"], xs["k"], xs["v"], {n: xs[n] for n in variant.gate_names},
                                   xs["level_scales"], output_final_state=True),
        x, tol=3e-5,
    )


def test_log_decay_floor_values_and_gradient():
    """The op's floor of a log-decay gate: max(g, floor), NaN staying NaN and -inf becoming the floor; the gradient
    passes where g is above the floor and is 0 at or below it."""
    floor = LOG_DECAY_FLOOR[torch.float32]
    g = torch.tensor([[[float("nan")], [float("-inf")], [2 * floor], [floor], [-5.0], [0.0]]], requires_grad=True)
    q, v = torch.randn(1, 6, 1, 4), torch.randn(1, 6, 1, 3)
    out = floor_log_decays(check_inputs(MAMBA2, q, q, v, {"g": g}, None, None, None, None)).gates["g"]
    assert torch.isnan(out[0, 0, 0]) and out[0, 1:, 0].tolist() == [floor, floor, floor, -5.0, 0.0]
    out.backward(torch.ones_like(out))
    assert g.grad[0, :, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def _gla_inputs(T=29) -> dict[str, torch.Tensor]:
    return {n: t.to(DEVICE) for n, t in gla_inputs(2, T, 1, 2, K=8, V=4).items()}


@pytest.mark.parametrize("variant", [MAMBA2, GATED_DELTANET, GLA], ids=lambda v: v.name)
def test_finite_check_reads_log_decays_unfloored(variant):
    """The finite check takes the log-decay gates as the call gives them (a backend may floor them itself): -inf
    there, even in every entry, is a hard reset and passes; NaN and +inf in them do not, nor -inf elsewhere."""
    x = _gla_inputs() if variant is GLA else _inputs(variant)

    def finite(name, index, value) -> bool:
        y = {n: t.clone() for n, t in x.items()}
        y[name][index] = value
        gates = {n: y[n] for n in variant.gate_names}
        return finite_check(check_inputs(variant, y["q"], y["k"], y["v"], gates, y["level_scales"], None, None,
                                         None))()

    assert finite("g", (1, 13, 0), -torch.inf) and finite("g", ..., -torch.inf) and finite("g", (0, 3), -1e30)
    assert not finite("g", (1, 13, 0), torch.nan) and not finite("g", (1, 13, 0), torch.inf)
    assert not finite("g", ..., torch.nan) and not finite("q", (0, 5, 0, 1), -torch.inf)
    if variant is GATED_DELTANET:
        assert not finite("beta", (0, 5, 1), -torch.inf)


def test_a_check_left_without_the_backends_peak_reads_the_gates_itself():
    """finite_check(raw_log_decays=True) leaves a per-channel log-decay gate to the backend's report: a reported
    peak is taken as given, and without one the answer reads the gate itself. A scalar log-decay gate is read by
    the check either way."""
    x = _gla_inputs()
    x["g"][1, 5, 0, 3] = torch.nan
    inp = check_inputs(GLA, x["q"], x["k"], x["v"], {"g": x["g"]}, x["level_scales"], None, None, None)
    assert not finite_check(inp, raw_log_decays=True)()
    check = finite_check(inp, raw_log_decays=True)
    check.report(torch.zeros((), device=DEVICE))
    assert check()
    check = finite_check(inp, raw_log_decays=True)
    check.report(torch.tensor(torch.inf, device=DEVICE))
    assert not check()
    check = finite_check(inp, raw_log_decays=False)
    check.report(torch.zeros((), device=DEVICE))
    assert not check()
    y = _inputs(MAMBA2)
    y["g"][0, 7, 1] = torch.nan
    assert not finite_check(check_inputs(MAMBA2, y["q"], y["k"], y["v"], {"g": y["g"]}, y["level_scales"], None,
                                         None, None), raw_log_decays=True)()


@pytest.mark.interpreter
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["chunk", "prefix"])
def test_the_gla_kernels_check_the_gate_they_read(monkeypatch, value, where):
    """The GLA kernels take g raw and report whether it is finite (from G's last row per chunk, and the torch
    prefix's rows of g): a NaN or +inf in one channel of g, in a kernel chunk or in the torch prefix of a call that
    continues a state at an unaligned position, is reported, and spoils that head from its token on and nothing
    else; the clean call reports finite."""
    verdicts = []
    report = FiniteCheck.report
    monkeypatch.setattr(FiniteCheck, "report",
                        lambda check, peak: (verdicts.append(bool(peak < torch.inf)), report(check, peak))[1])
    x, state, t_bad = {n: t.float() for n, t in _gla_inputs().items()}, None, T_BAD
    if where == "prefix":  # the state at position 3: tokens 0..4 of the call are the torch prefix
        _, state = _call(GLA, {n: t[:, :3] for n, t in x.items()}, "triton")
        t_bad = 2
    verdicts.clear()
    o_ref, s_ref = _call(GLA, x, "triton", initial_state=state)
    o, s = _call(GLA, _spoil_channel(x, value, t_bad), "triton", initial_state=state)
    assert verdicts == [True, False]
    assert torch.equal(o[0], o_ref[0]) and torch.equal(o[1, :t_bad], o_ref[1, :t_bad])
    assert torch.equal(o[1, :, 1], o_ref[1, :, 1]) and o[1, t_bad:, 0].isnan().all()
    assert torch.equal(s.levels[0], s_ref.levels[0]) and s.levels[1][:, 0].isnan().all()


def _spoil_channel(x, value, t):
    """A copy of GLA inputs x with g of batch row 1, token t, head 0, key channel 3 set to value."""
    bad = {n: t_.clone() for n, t_ in x.items()}
    bad["g"][1, t, 0, 3] = value
    return bad


@pytest.mark.parametrize("floors", [False, True], ids=["op-floors", "backend-floors"])
def test_the_op_floors_the_gates_unless_the_backend_does(monkeypatch, floors):
    """A backend whose Backend.takes_raw_log_decays is set gets the log-decay gate as the call gives it; any other the
    gate floored by the op."""
    seen = []

    def run(inp, *args):
        seen.append(inp.gates["g"].detach().clone())
        return torch_chunk_backend(floor_log_decays(inp), *args)

    monkeypatch.setitem(backends._REGISTERED, ("gla", "triton"), Backend(run, takes_raw_log_decays=floors))
    x = {n: t.float() for n, t in _gla_inputs().items()}
    x["g"][0, 7, 1, 2:5] = -torch.inf
    attention(GLA, x["q"], x["k"], x["v"], {"g": x["g"]}, x["level_scales"], backend="triton")
    expected = x["g"] if floors else x["g"].clamp_min(LOG_DECAY_FLOOR[torch.float32])
    assert len(seen) == 1 and torch.equal(seen[0], expected)


@pytest.mark.parametrize("plain", [False, True], ids=["fenwick", "plain"])
def test_a_call_the_backend_does_not_take_gets_floored_gates(plain):
    """float64 GLA asked of the triton backend (which floors its gates itself, but takes no float64) runs on the torch
    path, for which the op floors the gates: hard resets and gates far below the floor in some channels match the
    float64 reference (plain: as lambda = 1 over the Fenwick levels)."""
    x = _gla_inputs()
    if plain:
        x["level_scales"] = None
    x["g"][0, 11, 0, :3] = -torch.inf
    x["g"][1, 16, 1, 5:] = -1e30
    x["g"][1, 20, 0] = -200.0
    x = {n: t.requires_grad_() for n, t in x.items() if t is not None}
    args = (GLA, x["q"], x["k"], x["v"], {"g": x["g"]}, x.get("level_scales"))
    o, state = attention(*args, output_final_state=True, chunk_size=8, backend="triton")
    o_ref, state_ref = R.recurrent(*args, output_final_state=True)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(state.levels, state_ref.levels, 1e-10, "final state")
    d_o = torch.randn_like(o)
    for name, a, e in zip(x, torch.autograd.grad((o * d_o).sum(), list(x.values())),
                          torch.autograd.grad((o_ref * d_o).sum(), list(x.values()))):
        assert_close(a, e, 1e-10, f"d{name}")
