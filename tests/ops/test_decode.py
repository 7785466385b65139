"""The decode step (fused Triton kernel under TRITON_INTERPRET on CPU, and the PyTorch step) against the
float64 recurrent reference: both variants, GQA, rows at different positions (across carries), the plain
single-state recurrence, and the public ops' T == 1 dispatch."""

import dataclasses

import pytest
import torch

from helpers import assert_close, make_inputs, mamba2_args
from loglinear import FenwickState, log_linear_gated_deltanet, log_linear_mamba2
from loglinear import reference as R
from loglinear.fenwick import levels_needed
from loglinear.ops import decode as D
from loglinear.ops.triton import decode as triton_decode
from loglinear.ops.triton.decode import decode_backend, fused_decode_step
from loglinear.variants import GATED_DELTANET, GLA, MAMBA2

STEPS = {
    "torch": D.decode_step_torch,
    "triton": decode_backend,
}


@pytest.fixture(params=[(32, 4), (4, 1)], ids=["rows32-levels4", "rows4-levels1"])
def tiling(request, monkeypatch):
    """The fused step's programs: whole tiles at these K and four levels per program (L not a multiple of four),
    or blocks of 4 rows (the last one partial at K = 5), whose partial readouts the finish kernel sums, and one
    level per program (the delta rule always takes one)."""
    rows, levels = request.param
    monkeypatch.setattr(triton_decode, "ROW_BLOCK", rows)
    monkeypatch.setattr(triton_decode, "_levels_per_program",
                        lambda tile_bytes, BL, delta: 1 if delta else min(levels, BL))
    return request.param


def _gates(tok, gdn: bool) -> dict:
    return {"g": tok["g"], "beta": tok["beta"]} if gdn else {"g": tok["g"]}


def _variant(gdn: bool):
    return GATED_DELTANET if gdn else MAMBA2


def _prefix_states(x, gdn: bool, lengths: list[int]):
    """Reference states of row n after lengths[n] tokens (rows at different positions), stacked."""
    rec = R.log_linear_gated_deltanet_recurrent if gdn else R.log_linear_mamba2_recurrent
    args = x if gdn else mamba2_args(x)
    L = levels_needed(max(lengths) + 1)
    states = []
    H, K, V = x["v"].shape[2], x["q"].shape[3], x["v"].shape[3]
    for n, ln in enumerate(lengths):
        if ln == 0:
            states.append(FenwickState.zeros(1, H, K, V, num_levels=L, dtype=torch.float64).levels)
            continue
        row = {name: t[n : n + 1, :ln] for name, t in args.items()}
        _, st = rec(**row, output_final_state=True, **({"use_qk_l2norm": True} if gdn else {}))
        states.append(st.with_levels(L).levels)
    return torch.cat(states), torch.tensor(lengths)


def _reference_step(x, gdn: bool, lengths: list[int]):
    """o of the token following each row's prefix, from the recurrent reference over the whole row."""
    rec = R.log_linear_gated_deltanet_recurrent if gdn else R.log_linear_mamba2_recurrent
    args = x if gdn else mamba2_args(x)
    outs = []
    for n, ln in enumerate(lengths):
        row = {name: t[n : n + 1, : ln + 1] for name, t in args.items()}
        o, _ = rec(**row, **({"use_qk_l2norm": True} if gdn else {}))
        outs.append(o[:, ln])
    return torch.cat(outs)


def _held(p: int) -> set[int]:
    """The levels a state after p tokens holds, by the definition: level(p - 1, s) = bit_length((p - 1) XOR s) of
    each key s < p."""
    return {((p - 1) ^ s).bit_length() for s in range(p)}


def _token(x, lengths):
    idx = torch.tensor(lengths)
    return {name: t[torch.arange(t.shape[0]), idx] for name, t in x.items()}


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("gdn", [False, True])
@pytest.mark.parametrize("G,H,K,V", [(1, 2, 5, 3), (2, 4, 8, 16)])
def test_step_matches_reference(impl, gdn, G, H, K, V, tiling):
    lengths = [0, 1, 4, 7, 8, 15]  # fresh state, and carries into levels 1..4
    x = make_inputs(len(lengths), 17, G, H, K=K, V=V)
    levels, positions = _prefix_states(x, gdn, lengths)
    tok = _token(x, lengths)
    o, new = STEPS[impl](
        _variant(gdn), tok["q"], tok["k"], tok["v"], _gates(tok, gdn), tok["level_scales"], levels,
        positions, x["q"].shape[-1] ** -0.5, l2norm_qk=gdn,
    )
    assert_close(o, _reference_step(x, gdn, lengths), 1e-12, f"{impl} o")
    after, _ = _prefix_states(x, gdn, [n + 1 for n in lengths])
    assert_close(new, after[:, : new.shape[1]], 1e-12, f"{impl} state")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("gdn", [False, True])
def test_step_in_place_on_padded_levels(impl, gdn, tiling):
    """out=levels writes the new levels into the given tensor, equal to the step into a new one, on a state zero-padded
    to more levels than its positions need (the static buffers of CUDA-graph decoding). In place, the fused kernel
    touches only the levels the position holds before or after the token: a value planted in any other level (below
    the highest held level too) stays and is not read."""
    lengths = [0, 3, 8, 12, 5]
    x = make_inputs(5, 14, 1, 2, K=8, V=16, L=7)
    levels, positions = _prefix_states(x, gdn, lengths)
    levels = FenwickState(levels, positions).with_levels(7).levels
    tok = _token(x, lengths)
    args = (_variant(gdn), tok["q"], tok["k"], tok["v"], _gates(tok, gdn), tok["level_scales"])
    o_new, new = STEPS[impl](*args, levels, positions, 0.3, l2norm_qk=gdn)
    buffer = levels.clone()
    o, out = STEPS[impl](*args, buffer, positions, 0.3, l2norm_qk=gdn, out=buffer)
    assert out is buffer
    assert_close(o, o_new, 1e-14, "in-place o")
    assert_close(buffer, new, 1e-14, "in-place levels")
    after, _ = _prefix_states(x, gdn, [n + 1 for n in lengths])
    assert_close(new[:, : after.shape[1]], after, 1e-12, "padded state")
    assert not new[:, after.shape[1] :].any()
    if impl == "triton":
        planted = levels.clone()
        for n, p in enumerate(lengths):
            planted[n, [l for l in range(7) if l not in _held(p)]] = 7.0
        o2, _ = STEPS[impl](*args, planted, positions, 0.3, l2norm_qk=gdn, out=planted)
        assert_close(o2, o_new, 1e-14, "o with values planted in the levels the positions do not hold")
        for n, p in enumerate(lengths):
            touched = _held(p) | _held(p + 1)
            assert touched - _held(p), f"row {n}: the step must write a level it did not read (the carry's target)"
            for l in range(7):
                if l in touched:
                    assert_close(planted[n, l], new[n, l], 1e-14, f"row {n} level {l}")
                else:
                    assert (planted[n, l] == 7.0).all(), f"row {n}: level {l}, held neither before nor after, written"


@pytest.mark.parametrize("gdn", [False, True])
def test_fused_float32_state(gdn, tiling):
    lengths = [3, 8, 12]
    x = make_inputs(3, 14, 1, 2, K=16, V=32)
    levels, positions = _prefix_states(x, gdn, lengths)
    tok = {n: t.float() for n, t in _token(x, lengths).items()}
    o, new = fused_decode_step(
        tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"] if gdn else None, tok["level_scales"], levels.float(),
        positions, 0.25, l2norm_qk=gdn,
    )
    assert o.dtype == torch.float32 and new.dtype == torch.float32
    assert_close(o.double(), _reference_step(x, gdn, lengths) * 0.25 / 16**-0.5, 1e-5, "fp32 o")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("gdn", [False, True])
def test_plain_step_is_the_single_state_recurrence(impl, gdn):
    """fenwick=False: S <- exp(g) S (- beta k k^T S for GDN) + beta k v^T, o = scale S^T q, one level."""
    x = make_inputs(3, 1, 1, 2, K=4, V=5)
    tok = {n: t[:, 0] for n, t in x.items()}
    S = torch.randn(3, 1, 2, 4, 5, dtype=torch.float64)
    beta = tok["beta"] if gdn else torch.ones_like(tok["g"])
    k, q = tok["k"].expand(-1, 2, -1), tok["q"].expand(-1, 2, -1)
    expected = S[:, 0] - (beta[..., None, None] * k[..., None] * torch.einsum("nhk,nhkv->nhv", k, S[:, 0])[:, :, None]
                          if gdn else 0)
    expected = (torch.exp(tok["g"])[..., None, None] * expected
                + beta[..., None, None] * k[..., None] * tok["v"][:, :, None])
    for in_place in (False, True):  # a plain state is read at any position, 0 included, in place too
        levels = S.clone()
        o, new = STEPS[impl](
            _variant(gdn), tok["q"], tok["k"], tok["v"], _gates(tok, gdn), None, levels, torch.tensor([5, 0, 8]),
            0.5, fenwick=False, out=levels if in_place else None,
        )
        assert_close(new[:, 0], expected, 1e-13, f"plain state (in place: {in_place})")
        assert_close(o, 0.5 * torch.einsum("nhkv,nhk->nhv", expected, q), 1e-13, f"plain o (in place: {in_place})")


@pytest.mark.parametrize("gdn", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_public_op_uses_the_fused_step(monkeypatch, gdn, varlen):
    monkeypatch.setenv("LOGLINEAR_BACKEND", "triton")
    calls = []
    real = D.decode_step

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(D, "decode_step", counting)
    lengths = [5, 8]
    x = make_inputs(2, 10, 1, 2)
    levels, positions = _prefix_states(x, gdn, lengths)
    tok = {n: t[:, None] for n, t in _token(x, lengths).items()}
    kw = {"cu_seqlens": torch.tensor([0, 1, 2])} if varlen else {}
    if varlen:
        tok = {n: t.transpose(0, 1) for n, t in tok.items()}
    state = FenwickState(levels, positions)
    if gdn:
        o, st = log_linear_gated_deltanet(**tok, initial_state=state, output_final_state=True, use_qk_l2norm=True, **kw)
    else:
        o, st = log_linear_mamba2(**mamba2_args(tok), initial_state=state, output_final_state=True, **kw)
    assert calls, "the T == 1 call did not take the fused step"
    o = o[0] if varlen else o[:, 0]
    assert_close(o, _reference_step(x, gdn, lengths), 1e-12, "op o")
    assert st.positions.tolist() == [6, 9]
    after, _ = _prefix_states(x, gdn, [6, 9])
    assert_close(st.levels, after[:, : st.levels.shape[1]], 1e-12, "op state")


def test_public_op_keeps_autograd_when_grad_is_needed(monkeypatch):
    monkeypatch.setenv("LOGLINEAR_BACKEND", "torch")
    x = make_inputs(1, 4, 1, 2)
    _, st = log_linear_mamba2(**mamba2_args({n: t[:, :3] for n, t in x.items()}), output_final_state=True)
    monkeypatch.setenv("LOGLINEAR_BACKEND", "triton")
    tok = {n: t[:, 3:].clone().requires_grad_() for n, t in mamba2_args(x).items()}
    monkeypatch.setattr(D, "op_decode_step", lambda *a: pytest.fail("fused step used although a gradient is needed"))
    from loglinear.inputs import check_inputs

    inp = check_inputs(MAMBA2, tok["q"], tok["k"], tok["v"], {"g": tok["g"]}, tok["level_scales"], None, st, None)
    assert not D.fused_decode_applies(inp)


def test_fused_step_rejects_bad_levels():
    x = make_inputs(2, 1, 1, 2, K=4, V=3)
    tok = {n: t[:, 0] for n, t in x.items()}
    with pytest.raises(ValueError, match="levels must be"):
        fused_decode_step(tok["q"], tok["k"], tok["v"], tok["g"], None, tok["level_scales"],
                          torch.zeros(2, 2, 2, 4, 4, dtype=torch.float64), torch.tensor([1, 1]), 1.0)
    with pytest.raises(ValueError, match="level_scales"):
        fused_decode_step(tok["q"], tok["k"], tok["v"], tok["g"], None, tok["level_scales"][..., :1],
                          torch.zeros(2, 2, 2, 4, 3, dtype=torch.float64), torch.tensor([1, 1]), 1.0)


def _lazy_case(variant, N: int = 3, T: int = 14, H: int = 2, K: int = 8, V: int = 32, L: int = 6):
    """Inputs of ``variant`` (its own gates), and the reference per row: o at every position and the state after
    every prefix, [N, T + 1] states of L levels. V = 32: the fused step splits it into two blocks of columns, whose
    programs share each level's log-scale."""
    x = make_inputs(N, T, 1, H, K=K, V=V, L=L)
    x["g"] = variant.sample_gates(N, T, H, K, dtype=torch.float64)["g"]
    o, states = [], []
    for n in range(N):
        row = {name: t[n : n + 1] for name, t in x.items()}
        o.append(R.recurrent(variant, row["q"], row["k"], row["v"], {"g": row["g"]}, row["level_scales"])[0])
        states.append([FenwickState.zeros(1, H, K, V, num_levels=L, dtype=torch.float64).levels] + [
            R.recurrent(variant, *(row[a][:, :t] for a in "qkv"), {"g": row["g"][:, :t]},
                        row["level_scales"][:, :t], output_final_state=True)[1].with_levels(L).levels
            for t in range(1, T + 1)])
    return x, torch.cat(o), states


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("variant", [MAMBA2, GLA], ids=lambda v: v.name)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_lazy_levels_over_consecutive_steps(impl, variant, dtype, tiling):
    """log_scales (in place): level l's state is levels[:, l] * exp(log_scales[:, l]). From states stored with random
    log-scales, consecutive steps across carries give the reference outputs and states; a level the token only
    decays keeps its stored tile bit for bit, so does a level the carry empties (its log-scale -inf), and the two
    levels the token writes restart at log-scale 0.
    bfloat16 levels (float32 log-scales): the same within bf16 rounding."""
    x, o_ref, states = _lazy_case(variant)
    starts, L = [0, 5, 7], 6
    per_channel = variant.gates[0].per_channel
    tol, scale_dtype = (1e-12, torch.float64) if dtype == torch.float64 else (2e-2, torch.float32)
    log_scales = 0.5 * torch.randn(3, L, 2, *((8,) if per_channel else ()), dtype=torch.float64)

    def scales(ls: torch.Tensor) -> torch.Tensor:
        return torch.exp(ls.double())[..., None] if per_channel else torch.exp(ls.double())[..., None, None]

    levels = (torch.cat([states[n][p] for n, p in enumerate(starts)]) / scales(log_scales)).to(dtype)
    log_scales = log_scales.to(scale_dtype)
    for i in range(5):  # positions 0..4, 5..9, 7..11: carries into levels 1..4
        pos = torch.tensor([p + i for p in starts])
        tok = _token(x, pos.tolist())
        before, ls_before = levels.clone(), log_scales.clone()
        o, out = STEPS[impl](variant, tok["q"], tok["k"], tok["v"], {"g": tok["g"]}, tok["level_scales"], levels,
                             pos, x["q"].shape[-1] ** -0.5, out=levels, log_scales=log_scales)
        assert out is levels and levels.dtype == dtype
        assert_close(o.double(), torch.stack([o_ref[n, p] for n, p in enumerate(pos.tolist())]), tol, f"o at {i}")
        after = torch.cat([states[n][p + 1] for n, p in enumerate(pos.tolist())])
        assert_close(levels.double() * scales(log_scales), after, tol, f"levels at step {i}")
        kept, emptied = D.decayed_only(pos, L), D.emptied_levels(pos, L)
        touched = _held_mask(pos, L) | _held_mask(pos + 1, L)
        assert torch.equal(emptied, _held_mask(pos, L) & ~_held_mask(pos + 1, L))
        rewritten = touched & ~kept & ~emptied
        assert kept.any() and rewritten.any()
        assert torch.equal(levels[kept], before[kept]), "a level the token only decays was rewritten"
        assert torch.equal(levels[emptied], before[emptied]), "a level the carry empties was rewritten"
        g = tok["g"][:, None].to(scale_dtype).expand_as(ls_before)
        assert_close(log_scales[kept], ls_before[kept] + g[kept], 1e-6 if dtype == torch.bfloat16 else 1e-15, "kept")
        assert (log_scales[emptied] == float("-inf")).all(), "an emptied level's log-scale is not -inf"
        assert not log_scales[rewritten].any(), "a rewritten level's log-scale did not restart at 0"


@pytest.mark.parametrize("impl,rows,dtype,size", [
    *[(*case, size) for size in (2, 8) for case in (("torch", None, torch.float64), ("torch", None, torch.bfloat16),
                                                    ("triton", 32, torch.float64), ("triton", 32, torch.bfloat16))],
    ("triton", 4, torch.float64, 2),  # partial row blocks (the window's turns at size 8: the cases above)
], ids=lambda x: str(x).removeprefix("torch."))
def test_lazy_delta_rule_over_consecutive_steps(monkeypatch, impl, rows, dtype, size):
    """The delta rule's lazy levels (log_scales and a KeyWindow of ``size`` tokens, in place) against the step that
    rewrites every level, over consecutive steps across carries and the window's turns, from exact states at three
    positions (a window of zeros starting there, log-scales 0), GQA, l2norm. Until the first turn the step writes
    only level 0 and the carry's target between turns; from it on the window's block is in token form and no level
    0..log2 size is written. Every other held level keeps its tile bit for bit (log-scale + g, or -inf when emptied);
    at a turn the step rewrites the held levels (log-scale 0). The token's key (normalised), beta, value and gate take
    slot p mod size.
    bfloat16 levels (float32 compute): the same within bf16 rounding. The fused step's kept levels in row blocks of
    ``rows`` (K = 20: a partial last block), its turn in blocks of max(rows, 16) rows (two, the last partial, at
    rows = 4) over value columns padded to 16."""
    if rows is not None:
        monkeypatch.setattr(triton_decode, "ROW_BLOCK", rows)
    gen = torch.Generator().manual_seed(size)
    N, G, H, K, V, L, steps = 3, 1, 2, 20, 5, 7, 12
    pos = torch.tensor([0, 6, 29])
    held = _held_mask(pos, L)[:, :, None, None, None]
    exact = torch.randn(N, L, H, K, V, dtype=torch.float64, generator=gen) * held
    levels = exact.to(dtype)
    exact = levels.double()  # the reference starts where the rounded levels do
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    log_scales, window = torch.zeros(N, L, H, dtype=compute), D.KeyWindow.empty_at(pos, size, G, H, K, V, compute)
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    turns = blocks = 0
    for i in range(steps):
        q, k = torch.randn(N, G, K, dtype=torch.float64, generator=gen), torch.randn(N, G, K, dtype=torch.float64,
                                                                                     generator=gen)
        v = torch.randn(N, H, V, dtype=torch.float64, generator=gen)
        gates = {"g": -0.3 * torch.rand(N, H, dtype=torch.float64, generator=gen),
                 "beta": torch.rand(N, H, dtype=torch.float64, generator=gen)}
        lam = torch.rand(N, H, L, dtype=torch.float64, generator=gen)
        o_ref, exact = D.decode_step_torch(GATED_DELTANET, q, k, v, gates, lam, exact, pos, 0.3, l2norm_qk=True)
        before, ls_before = levels.clone(), log_scales.clone()
        o, out = STEPS[impl](GATED_DELTANET, q, k, v, gates, lam, levels, pos, 0.3, l2norm_qk=True, out=levels,
                             log_scales=log_scales, window=window)
        assert out is levels and levels.dtype == dtype
        assert_close(o.double(), o_ref, tol, f"o at step {i}")
        assert_close(D.lazy_level_states(levels.double(), log_scales.double(), window, pos + 1), exact, tol,
                     f"levels at step {i}")
        turn = ((pos % size == 0) & (pos > 0))[:, None].expand(N, L)
        turns += int(turn[:, 0].sum())
        kept, emptied = D.decayed_only(pos, L), D.emptied_levels(pos, L)
        block = D.token_form(pos + 1, window)[:, None] & (torch.arange(L) < size.bit_length())[None, :]
        blocks += int(block[:, 0].sum())
        assert torch.equal(levels[block], before[block]), "a level in token form was written"
        assert torch.equal(levels[kept & ~turn], before[kept & ~turn]), "a lazily decayed level was rewritten"
        assert torch.equal(levels[emptied], before[emptied]), "a level the carry empties was rewritten"
        g = gates["g"][:, None].to(compute).expand_as(ls_before)
        assert_close(log_scales[kept & ~turn], ls_before[kept & ~turn] + g[kept & ~turn], 1e-6, "kept")
        assert not log_scales[kept & turn].any(), "a level the window's turn rewrote kept its log-scale"
        assert (log_scales[emptied] == float("-inf")).all(), "an emptied level's log-scale is not -inf"
        slot = pos % size
        assert_close(window.keys[torch.arange(N), slot].double(), k / k.norm(dim=-1, keepdim=True), 1e-6, "window key")
        assert torch.equal(window.betas[torch.arange(N), slot], gates["beta"].to(compute)), "window beta"
        assert torch.equal(window.values[torch.arange(N), slot], v.to(compute)), "window value"
        assert torch.equal(window.gates[torch.arange(N), slot], gates["g"].to(compute)), "window gate"
        pos = pos + 1
    assert turns >= 3 and torch.equal(window.start, torch.tensor([0, 6, 29]))
    assert 0 < blocks < steps * N, "the steps should cover the token form and the tiles before the first turn"


def _held_mask(positions: torch.Tensor, L: int) -> torch.Tensor:
    return torch.tensor([[l in _held(p) for l in range(L)] for p in positions.tolist()])


def test_lazy_levels_reject_what_they_cannot_serve():
    x = make_inputs(2, 1, 1, 2, K=4, V=3, L=3)
    tok = {n: t[:, 0] for n, t in x.items()}
    levels, pos = torch.zeros(2, 3, 2, 4, 3, dtype=torch.float64), torch.tensor([1, 2])
    args = (tok["q"], tok["k"], tok["v"])
    ls = torch.zeros(2, 3, 2, dtype=torch.float64)
    window = D.KeyWindow.empty_at(pos, 4, 1, 2, 4, 3, torch.float64)
    with pytest.raises(ValueError, match="Gated DeltaNet's lazy levels need their KeyWindow"):
        D.decode_step(GATED_DELTANET, *args, _gates(tok, True), tok["level_scales"], levels, pos, 1.0, out=levels,
                      log_scales=ls)
    with pytest.raises(ValueError, match="Mamba-2 has none"):
        D.decode_step(MAMBA2, *args, {"g": tok["g"]}, tok["level_scales"], levels, pos, 1.0, out=levels,
                      log_scales=ls, window=window)
    with pytest.raises(ValueError, match="got log_scales=None"):
        D.decode_step(GATED_DELTANET, *args, _gates(tok, True), tok["level_scales"], levels, pos, 1.0, out=levels,
                      window=window)
    with pytest.raises(TypeError, match="window must be a KeyWindow"):
        D.decode_step(GATED_DELTANET, *args, _gates(tok, True), tok["level_scales"], levels, pos, 1.0, out=levels,
                      log_scales=ls, window=(window.keys, window.betas))
    with pytest.raises(ValueError, match=r"window.betas must be \[2, 4, 2\], torch.float64"):
        D.decode_step(GATED_DELTANET, *args, _gates(tok, True), tok["level_scales"], levels, pos, 1.0, out=levels,
                      log_scales=ls, window=dataclasses.replace(window, betas=window.betas.float()))
    with pytest.raises(ValueError, match=r"window.start must be \[2\], torch.int64"):
        D.decode_step(GATED_DELTANET, *args, _gates(tok, True), tok["level_scales"], levels, pos, 1.0, out=levels,
                      log_scales=ls, window=dataclasses.replace(window, start=pos.int()))
    for size in (3, 64):
        with pytest.raises(ValueError, match=rf"power of two in \[2, 32\], got {size}"):
            D.decode_step(GATED_DELTANET, *args, _gates(tok, True), tok["level_scales"], levels, pos, 1.0, out=levels,
                          log_scales=ls, window=D.KeyWindow.empty_at(pos, size, 1, 2, 4, 3, torch.float64))
    with pytest.raises(ValueError, match="in-place"):
        D.decode_step(MAMBA2, *args, {"g": tok["g"]}, tok["level_scales"], levels, pos, 1.0, log_scales=ls)
    with pytest.raises(ValueError, match=r"log_scales must be \[2, 3, 2, 4\]"):
        D.decode_step(GLA, *args, {"g": tok["g"][..., None].expand(-1, -1, 4)}, tok["level_scales"], levels, pos,
                      1.0, out=levels, log_scales=ls)
    with pytest.raises(TypeError, match="log_scales must be a tensor"):
        D.decode_step(MAMBA2, *args, {"g": tok["g"]}, tok["level_scales"], levels, pos, 1.0, out=levels,
                      log_scales=[0.0])
