"""Log-linear GLA (a log-decay per key channel) on the torch backend against both float64 references: outputs,
final states and the gradients of every input and of the initial state (T = 1, T not a multiple of the chunk, G < H,
batches, cu_seqlens, continuation at a nonzero position, very negative and -inf gates); g equal over the channels
is log-linear Mamba-2, lambda = 1 is plain GLA; the decode step, the custom op, the context-parallel pieces, the
containment of a non-finite gate channel, and bad gate shapes."""

import pytest
import torch

from helpers import assert_close, gla_inputs
from loglinear import FenwickState, log_linear_gla, log_linear_mamba2
from loglinear import reference as R
from loglinear.distributed.levelmap import apply_mat, route
from loglinear.fenwick import bit_length, levels_needed
from loglinear.inputs import expand_groups
from loglinear.ops import attention, custom_ops
from loglinear.ops.decode import decode_step
from loglinear.variants import GLA, REGISTRY


def _leaves(x: dict) -> dict:
    return {n: t.detach().clone().requires_grad_() for n, t in x.items()}


def _grads(loss: torch.Tensor, leaves: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss, leaves)


def _materialized(x: dict, **kw) -> torch.Tensor:
    return R.materialized(GLA, x["q"], x["k"], x["v"], {"g": x["g"]}, x["level_scales"], **kw)


def _recurrent(x: dict, **kw) -> tuple[torch.Tensor, FenwickState]:
    return R.recurrent(GLA, x["q"], x["k"], x["v"], {"g": x["g"]}, x["level_scales"], output_final_state=True, **kw)


def test_registered():
    assert REGISTRY["gla"] is GLA and GLA.title == "GLA" and GLA.gates[0].per_channel


@pytest.mark.parametrize("B,T,G,H,chunk", [(1, 1, 1, 1, 4), (2, 21, 1, 2, 4), (2, 37, 2, 2, 16), (1, 10, 1, 3, 1)],
                         ids=["T1", "ragged-GQA", "C16", "C1"])
def test_matches_both_references_with_gradients(B, T, G, H, chunk):
    x = gla_inputs(B, T, G, H, seed=T)
    ours, ref = _leaves(x), _leaves(x)
    o, state = log_linear_gla(**ours, chunk_size=chunk, output_final_state=True, backend="torch")
    o_mat = _materialized(ref)
    o_rec, state_rec = _recurrent(x)
    assert_close(o, o_mat, 1e-12, "o vs materialized")
    assert_close(o, o_rec, 1e-12, "o vs recurrent")
    assert_close(state.levels, state_rec.levels, 1e-12, "final state")
    assert state.positions.tolist() == [T] * B
    w = torch.randn_like(o_mat)
    got, want = _grads((o * w).sum(), list(ours.values())), _grads((o_mat * w).sum(), list(ref.values()))
    for name, a, e in zip(ours, got, want):
        assert_close(a, e, 1e-11, f"d{name}")


def test_continuation_at_nonzero_positions_with_state_gradients():
    """Rows at different positions (11 and 6 tokens seen): the continuation equals the reference from the state,
    with gradients of the initial state, and one long call."""
    lengths, T = [11, 6], 13
    full = gla_inputs(2, 11 + T, seed=3)
    rows = [{n: t[b : b + 1, : lengths[b]] for n, t in full.items()} for b in range(2)]
    L = full["level_scales"].shape[-1]
    prefix = [_recurrent(row)[1].with_levels(L).levels for row in rows]
    state = FenwickState(torch.cat(prefix), torch.tensor(lengths))
    tail = {n: torch.stack([t[b, lengths[b] : lengths[b] + T] for b in range(2)]) for n, t in full.items()}
    ours, ref = _leaves(tail), _leaves(tail)
    s_ours, s_ref = state.levels.clone().requires_grad_(), state.levels.clone().requires_grad_()
    o, final = log_linear_gla(**ours, initial_state=FenwickState(s_ours, state.positions), output_final_state=True,
                              chunk_size=4)
    o_ref, final_ref = R.recurrent(GLA, ref["q"], ref["k"], ref["v"], {"g": ref["g"]}, ref["level_scales"],
                                   initial_state=FenwickState(s_ref, state.positions), output_final_state=True)
    assert_close(o, o_ref, 1e-12, "o")
    assert_close(final.levels, final_ref.with_levels(final.num_levels).levels, 1e-12, "final state")
    assert final.positions.tolist() == [n + T for n in lengths]
    w, ws = torch.randn_like(o), torch.randn_like(final.levels)
    got = _grads((o * w).sum() + (final.levels * ws).sum(), [*ours.values(), s_ours])
    want = _grads((o_ref * w).sum() + (final_ref.with_levels(final.num_levels).levels * ws).sum(),
                  [*ref.values(), s_ref])
    for name, a, e in zip([*ours, "initial_state"], got, want):
        assert_close(a, e, 1e-11, f"d{name}")
    for b, n in enumerate(lengths):
        row = {name: t[b : b + 1, : n + T] for name, t in full.items()}
        one_call, _ = log_linear_gla(**row, chunk_size=4)
        assert_close(o[b], one_call[0, n:], 1e-12, f"row {b} = one long call")


def test_cu_seqlens_with_states_and_gradients():
    bounds = [0, 5, 6, 19]
    x = gla_inputs(1, 19, G=1, H=2, seed=5)
    state = FenwickState(torch.randn(3, 4, 2, 4, 3, dtype=torch.float64) * 0.3, torch.tensor([3, 0, 9]))
    cu = torch.tensor(bounds)
    ours, ref = _leaves(x), _leaves(x)
    o, final = log_linear_gla(**ours, cu_seqlens=cu, initial_state=state, output_final_state=True, chunk_size=4)
    o_ref, final_ref = R.recurrent(GLA, ref["q"], ref["k"], ref["v"], {"g": ref["g"]}, ref["level_scales"],
                                   cu_seqlens=cu, initial_state=state, output_final_state=True)
    assert_close(o, o_ref, 1e-12, "o")
    assert_close(final.levels, final_ref.with_levels(final.num_levels).levels, 1e-12, "final state")
    w = torch.randn_like(o)
    got, want = _grads((o * w).sum(), list(ours.values())), _grads((o_ref * w).sum(), list(ref.values()))
    for name, a, e in zip(ours, got, want):
        assert_close(a, e, 1e-11, f"d{name}")


def test_strongly_negative_gates_are_stable():
    """Decays far below what exp(G_t) exp(-G_s) over a chunk could hold (exp(+900) overflows float64, exp(+90)
    float32), and -inf (a hard reset of a channel): finite outputs and gradients, equal to the references."""
    x = gla_inputs(2, 45, seed=7)
    g = x["g"].clone()
    g[:, :, 0, 1] = -30.0  # head 0, channel 1: e^-960 over a chunk of 32
    g[:, 20:, 1, :2] = -3.0  # float32's range: e^-96
    g[0, 9, 1, 3] = -torch.inf
    g[1, 33, 0, 0] = -torch.inf
    x["g"] = g
    ours = _leaves(x)
    o, state = log_linear_gla(**ours, chunk_size=32, output_final_state=True)
    o_rec, state_rec = _recurrent(x)
    assert_close(o, o_rec, 1e-12, "o (float64)")
    assert_close(state.levels, state_rec.levels, 1e-12, "state (float64)")
    grads = _grads(o.square().sum() + state.levels.square().sum(), list(ours.values()))
    assert all(torch.isfinite(d).all() for d in grads)
    finite = dict(x, g=x["g"].clamp_min(-750.0))  # the materialized reference needs finite gates (-750: exp = 0)
    assert_close(o, _materialized(finite), 1e-12, "o vs materialized")
    o32, _ = log_linear_gla(**{n: t.float() for n, t in x.items()}, chunk_size=64)
    assert torch.isfinite(o32).all()
    assert_close(o32.double(), o_rec, 1e-5, "o (float32)")


def test_equal_channels_are_log_linear_mamba2():
    x = gla_inputs(2, 29, G=1, H=2, seed=11)
    g = x["g"][..., 0]  # [B, T, H]
    gla = dict(x, g=g[..., None].expand_as(x["g"]))
    o, state = log_linear_gla(**gla, chunk_size=8, output_final_state=True)
    o_m, state_m = log_linear_mamba2(**dict(x, g=g), chunk_size=8, output_final_state=True)
    torch.testing.assert_close(o, o_m, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(state.levels, state_m.levels, rtol=1e-13, atol=1e-13)


def test_unit_level_scales_are_plain_gla():
    """lambda = 1: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t."""
    x = gla_inputs(2, 19, G=1, H=2, seed=13)
    x["level_scales"] = torch.ones_like(x["level_scales"])
    o, _ = log_linear_gla(**x, chunk_size=4, scale=0.7)
    q, k = x["q"].expand(-1, -1, 2, -1), x["k"].expand(-1, -1, 2, -1)
    S = torch.zeros(2, 2, 4, 3, dtype=torch.float64)
    outs = []
    for t in range(19):
        S = torch.exp(x["g"][:, t])[..., None] * S + k[:, t, :, :, None] * x["v"][:, t, :, None, :]
        outs.append(0.7 * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    assert_close(o, torch.stack(outs, 1), 1e-13, "plain GLA")


def test_decode_steps_continue_a_prefill():
    x = gla_inputs(3, 12, G=1, H=2, seed=17)
    o_full, final_full = log_linear_gla(**x, chunk_size=4, output_final_state=True)
    _, state = log_linear_gla(**{n: t[:, :7] for n, t in x.items()}, chunk_size=4, output_final_state=True)
    levels, positions, scale = state.with_levels(x["level_scales"].shape[-1]).levels, state.positions, 4**-0.5
    for t in range(7, 10):
        tok = {n: v[:, t] for n, v in x.items()}
        o, levels = decode_step("gla", tok["q"], tok["k"], tok["v"], {"g": tok["g"]}, tok["level_scales"], levels,
                                positions, scale)
        positions = positions + 1
        assert_close(o, o_full[:, t], 1e-12, f"decode_step at {t}")
    for t in range(10, 12):  # the public op's T == 1 path
        o, state = log_linear_gla(**{n: v[:, t : t + 1] for n, v in x.items()},
                                  initial_state=FenwickState(levels, positions), output_final_state=True)
        levels, positions = state.levels, state.positions
        assert_close(o[:, 0], o_full[:, t], 1e-12, f"op step at {t}")
    assert_close(levels, final_full.with_levels(levels.shape[1]).levels, 1e-12, "state after the steps")


def test_custom_op():
    x = gla_inputs(2, 9, seed=19)
    gates = {"g": x["g"]}
    compiled = custom_ops.attention("gla", x["q"], x["k"], x["v"], gates, x["level_scales"], chunk_size=4)
    assert_close(compiled, attention("gla", x["q"], x["k"], x["v"], gates, x["level_scales"])[0], 1e-12, "custom op")


def test_context_parallel_pieces():
    """A shard at position p maps an entering state X to  shard_transition . route(X) + local_state."""
    p, T = 13, 11
    x = gla_inputs(2, T, G=1, H=2, start=p, seed=23)
    L = x["level_scales"].shape[-1]
    X = torch.randn(2, L, 2, 4, 3, dtype=torch.float64)
    positions = torch.tensor([p, p])
    _, out = log_linear_gla(**x, initial_state=FenwickState(X, positions), output_final_state=True, chunk_size=4)
    _, local = log_linear_gla(**x, initial_state=FenwickState(torch.zeros_like(X), positions),
                              output_final_state=True, chunk_size=4)
    closed = GLA.local_state(expand_groups(x["k"], 2), x["v"], {"g": x["g"]}, p, L)
    assert_close(closed, local.with_levels(L).levels, 1e-12, "local_state")
    mat = GLA.shard_transition(x["k"], {"g": x["g"]}, 4)
    assert mat.shape == (2, 2, *GLA.transition_shape(4))
    depth = bit_length(torch.tensor([(p + T - 1) ^ (p - 1)] * 2))
    assert_close(out.with_levels(L).levels, apply_mat(mat, route(X, depth)) + closed, 1e-12, "boundary map")


def test_a_non_finite_gate_channel_stays_put():
    x = gla_inputs(2, 21, seed=29)
    bad = dict(x, g=x["g"].clone())
    bad["g"][1, 9, 0, 2] = torch.nan
    o, state = log_linear_gla(**bad, chunk_size=8, output_final_state=True)
    clean, _ = log_linear_gla(**x, chunk_size=8)
    assert torch.isnan(o[1, 9:, 0]).all() and torch.isnan(state.levels[1, :, 0]).all()
    assert torch.equal(o[1, :9], clean[1, :9]) and torch.equal(o[0], clean[0])
    assert torch.equal(o[1, :, 1], clean[1, :, 1])  # the other head


def test_bad_gate_shapes():
    x = gla_inputs(2, 5, seed=31)
    with pytest.raises(ValueError, match=r"g must be \[B, T, H, K\] \(4 dims\), got shape \(2, 5, 2\)"):
        log_linear_gla(**dict(x, g=x["g"][..., 0]))
    with pytest.raises(ValueError, match=r"g must be \[B, T, H, K\] with B, T, H, K = 2, 5, 2, 4, got shape \(2, 5, 2"):
        log_linear_gla(**dict(x, g=x["g"][..., :3]))
    with pytest.raises(ValueError, match=r"gla's per-token inputs g \[B, T, H, K\]"):
        attention("gla", x["q"], x["k"], x["v"], {"beta": x["g"]}, x["level_scales"])
    tok = {n: t[:, 0] for n, t in x.items()}
    levels = torch.zeros(2, 1, 2, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"g must be \[N, H, K\] \(3 dims\)"):
        decode_step("gla", tok["q"], tok["k"], tok["v"], {"g": tok["g"][..., 0]}, tok["level_scales"], levels,
                    torch.tensor([0, 0]), 0.5)
    with pytest.raises(ValueError, match=r"g must be \[N, H, K\] = \[2, 2, 4\]"):
        decode_step("gla", tok["q"], tok["k"], tok["v"], {"g": tok["g"][:, :1]}, tok["level_scales"], levels,
                    torch.tensor([0, 0]), 0.5)


@pytest.mark.interpreter
@pytest.mark.parametrize("fenwick", [True, False])
def test_fused_decode_step_is_the_torch_step(fenwick):
    """The fused kernel's per-channel transition (Triton interpreter on CPU) = the PyTorch step: G < H, rows at
    different positions (carries of 0, 1 and 3 levels, and position 0), fast-forgetting channels; the plain step
    too. decode_step picks the kernel on the triton backend."""
    N, G, H, K, V = 4, 1, 2, 8, 5
    gen = torch.Generator().manual_seed(23)
    kw = dict(dtype=torch.float64, generator=gen)
    q, k, v = torch.randn(N, G, K, **kw), torch.randn(N, G, K, **kw), torch.randn(N, H, V, **kw)
    g = GLA.sample_gates(N, 1, H, K, **kw)["g"][:, 0]  # [N, H, K]
    positions = torch.tensor([5, 8, 0, 13])
    L = levels_needed(14) if fenwick else 1
    levels, lam = torch.randn(N, L, H, K, V, **kw), 0.2 + torch.rand(N, H, L, **kw)
    args = (q, k, v, {"g": g}, lam if fenwick else None, levels, positions, 0.5)
    o, new = decode_step("gla", *args, fenwick=fenwick, backend="triton")
    o_ref, new_ref = decode_step("gla", *args, fenwick=fenwick, backend="torch")
    assert_close(o, o_ref, 1e-12, "o")
    assert_close(new, new_ref, 1e-12, "levels")
