"""The mixer layers: cached prefill + single-token steps reproduce the full forward, padding and packing
equal per-sequence runs, the plain layers are exactly the single-state recurrence, the level cap, the
short convolution, gradients, and bad inputs."""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from loglinear.layers import LogLinearGatedDeltaNet, LogLinearGLA, LogLinearMamba2, TokenLayout
from loglinear.layers import mixer as mixer_module
from loglinear.layers.conv import ShortConvolution

D = 12


def make_layer(variant: str, use_log_linear: bool, max_levels: int = 21, **kwargs) -> torch.nn.Module:
    torch.manual_seed(len(variant) + 100 * use_log_linear)
    if variant == "mamba2":
        layer = LogLinearMamba2(D, 4, head_dim=3, state_size=5, n_groups=2, use_log_linear=use_log_linear,
                                chunk_size=4, max_levels=max_levels, **kwargs)
    elif variant == "gla":
        layer = LogLinearGLA(D, 2, gate_low_rank_dim=4, use_log_linear=use_log_linear, chunk_size=4,
                             max_levels=max_levels, **kwargs)
    else:
        layer = LogLinearGatedDeltaNet(D, 2, head_dim=4, expand_v=1.5, use_log_linear=use_log_linear, chunk_size=4,
                                       max_levels=max_levels, **kwargs)
    with torch.no_grad():  # random, non-default parameters everywhere (never the all-ones init)
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer.double()


NAMES = ("mamba2", "gated_deltanet", "gla")
VARIANTS = [(v, ll) for v in NAMES for ll in (True, False)]


@pytest.mark.parametrize("variant,ll", VARIANTS)
def test_prefill_then_steps_match_full_forward(variant, ll):
    layer = make_layer(variant, ll)
    x = torch.randn(3, 19, D, dtype=torch.float64)
    full, _ = layer(x)
    outs, state = [], None
    for t0, t1 in [(0, 6), (6, 7), (7, 8), (8, 13), (13, 14), (14, 15), (15, 16), (16, 17), (17, 19)]:
        y, state = layer(x[:, t0:t1], state=state, output_state=True)
        outs.append(y)
    assert_close(torch.cat(outs, 1), full, 1e-12, "steps")
    assert state.positions.tolist() == [19] * 3
    assert state.num_levels == (6 if ll else 1)  # ceil(log2 19) + 1


@pytest.mark.parametrize("variant", NAMES)
def test_key_groups_are_the_op_inputs_groups(variant):
    """FenwickMixer.key_groups (what a decoding cache's key window is sized by) is the G of the op's q and k."""
    layer = make_layer(variant, True)
    x = torch.randn(5, D, dtype=torch.float64)
    conv_in, rest = layer.conv_inputs(x)
    inputs = layer.op_inputs(conv_in, rest)
    assert inputs.q.shape[1] == inputs.k.shape[1] == layer.key_groups
    assert layer.key_groups == (2 if variant == "mamba2" else layer.num_heads)


@pytest.mark.parametrize("variant", ["gla", "mamba2", "gated_deltanet"])
def test_short_convolution_is_optional(variant):
    """Every mixer runs without one (conv_kernel = 0, GLA's default: the projections go to the op as they are, no
    conv state) or with one, and either way steps equal the full forward."""
    x = torch.randn(2, 11, D, dtype=torch.float64)
    for kernel in (0, 3):
        layer = make_layer(variant, True, conv_kernel=kernel)
        assert (layer.conv is None) == (kernel == 0)
        full, _ = layer(x)
        y1, state = layer(x[:, :5], output_state=True)
        y2, state = layer(x[:, 5:], state=state, output_state=True)
        assert_close(torch.cat([y1, y2], 1), full, 1e-12, f"conv_kernel {kernel}")
        assert state.conv.shape == (2, max(kernel - 1, 0), layer.conv_channels)


@pytest.mark.parametrize("variant,ll", VARIANTS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_equals_per_sequence_runs(variant, ll, side):
    layer = make_layer(variant, ll)
    lengths = [9, 4, 7]
    x = torch.randn(3, 9, D, dtype=torch.float64)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, 9 - n:] = 1 if side == "left" else 0
        mask[b, :n] = 1 if side == "right" else mask[b, :n]
    y, state = layer(x, attention_mask=mask, output_state=True)
    assert state.positions.tolist() == lengths
    for b, n in enumerate(lengths):
        real = mask[b].bool()
        ref, ref_state = layer(x[b : b + 1, real], output_state=True)
        assert_close(y[b, real], ref[0], 1e-12, f"row {b}")
        assert y[b, ~real].abs().max() == 0 if n < 9 else True
        assert_close(state.levels[b, : ref_state.num_levels], ref_state.levels[0], 1e-12, f"state {b}")
        assert_close(state.conv[b], ref_state.conv[0], 1e-14, f"conv state {b}")


@pytest.mark.parametrize("variant,ll", VARIANTS)
def test_row_without_tokens_keeps_its_state(variant, ll):
    """A chunk of a left-padded prompt may hold no token of a row: that row's state passes through."""
    layer = make_layer(variant, ll)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    _, state = layer(x[:, :3], attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]), output_state=True)
    assert state.positions.tolist() == [3, 0] and state.levels[1].abs().max() == 0
    y, state = layer(x[:, 3:], attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]), state=state,
                     output_state=True)
    ref0, _ = layer(x[:1])
    ref1, _ = layer(x[1:, 5:])
    assert_close(y[0], ref0[0, 3:], 1e-12, "row 0")
    assert_close(y[1, 2:], ref1[0], 1e-12, "row 1")
    assert y[1, :2].abs().max() == 0 and state.positions.tolist() == [7, 2]


@pytest.mark.parametrize("variant,ll", VARIANTS)
def test_cu_seqlens_equal_per_sequence_runs_and_continue(variant, ll):
    layer = make_layer(variant, ll)
    bounds = [0, 5, 6, 14]
    x = torch.randn(1, 14, D, dtype=torch.float64)
    cu = torch.tensor(bounds)
    y, state = layer(x, cu_seqlens=cu, output_state=True)
    nxt = torch.randn(1, 3, D, dtype=torch.float64)
    y2, _ = layer(nxt, cu_seqlens=torch.tensor([0, 1, 2, 3]), state=state, output_state=True)
    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
        ref, ref_state = layer(x[:, a:b], output_state=True)
        assert_close(y[:, a:b], ref, 1e-12, f"seq {n}")
        ref2, _ = layer(nxt[:, n : n + 1], state=ref_state)
        assert_close(y2[:, n], ref2[:, 0], 1e-12, f"continued seq {n}")


@pytest.mark.parametrize("variant", NAMES)
def test_plain_layer_is_the_single_state_recurrence(monkeypatch, variant):
    """use_log_linear=False: o_t = scale * q_t^T S_t with S_t = A_t S_{t-1} + beta_t k_t v_t^T
    (exactly Mamba-2 / GDN / GLA, whose decay is per key channel)."""
    layer = make_layer(variant, False)
    seen = {}
    real = mixer_module.fenwick_attention

    def spy(*args):
        seen["args"] = args
        return real(*args)

    monkeypatch.setattr(mixer_module, "fenwick_attention", spy)
    x = torch.randn(2, 11, D, dtype=torch.float64)
    layer(x)
    _, q, k, v, gates, lam, _, _, _, scale, *_ , l2 = seen["args"]
    g, beta = gates[0], gates[1] if len(gates) > 1 else None
    assert lam is None
    H = v.shape[2]
    q, k = q.repeat_interleave(H // q.shape[2], 2), k.repeat_interleave(H // k.shape[2], 2)
    if l2:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    beta = beta if beta is not None else torch.ones_like(v[..., 0])
    S = torch.zeros(2, H, q.shape[-1], v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(11):
        kt = k[:, t]
        if variant == "gated_deltanet":
            S = S - beta[:, t, :, None, None] * kt[..., None] * torch.einsum("bhk,bhkv->bhv", kt, S)[:, :, None]
        decay = torch.exp(g[:, t])[..., None] if variant == "gla" else torch.exp(g[:, t])[..., None, None]
        S = decay * S + beta[:, t, :, None, None] * kt[..., None] * v[:, t, :, None]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o_ref = torch.stack(outs, 1)
    o, _, _ = real(*seen["args"])
    assert_close(o, o_ref, 1e-12, "plain")


@pytest.mark.parametrize("variant", NAMES)
def test_level_cap_raises(variant):
    layer = make_layer(variant, True, max_levels=3)  # 4 tokens per sequence
    x = torch.randn(1, 5, D, dtype=torch.float64)
    layer(x[:, :4])
    with pytest.raises(ValueError, match="max_levels = 3 covers at most 4"):
        layer(x)
    _, state = layer(x[:, :4], output_state=True)
    with pytest.raises(ValueError, match="raise max_levels"):
        layer(x[:, 4:], state=state)
    make_layer(variant, False, max_levels=3)(x)  # a plain layer keeps one state: no cap


def test_short_convolution_matches_conv1d_and_carries_state():
    conv = ShortConvolution(6, 4, bias=True).double()
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight, conv.bias, groups=6).transpose(1, 2)
    layout = TokenLayout.build(2, 9)
    y, state = conv.step(layout.flatten(x), layout)
    assert_close(layout.unflatten(y), ref, 1e-14, "conv")
    first = TokenLayout.build(2, 2)
    _, s1 = conv.step(first.flatten(x[:, :2]), first)
    rest = TokenLayout.build(2, 7)
    y2, s2 = conv.step(rest.flatten(x[:, 2:]), rest, s1)
    assert_close(rest.unflatten(y2), ref[:, 2:], 1e-14, "conv continued")
    assert_close(s2, state, 0, "conv state")
    assert_close(state, x[:, -3:], 0, "conv state holds the last inputs")
    packed = TokenLayout.build(1, 18, cu_seqlens=torch.tensor([0, 9, 18]))  # the varlen (gather) path
    yp, sp = conv.step(packed.flatten(x.reshape(1, 18, 6)), packed)
    assert_close(yp.reshape(2, 9, 6), ref, 1e-14, "packed conv")
    assert_close(sp, state, 0, "packed conv state")


@pytest.mark.parametrize("variant", NAMES)
def test_gradients_through_layer_and_state(variant):
    layer = make_layer(variant, True)
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)

    def f(x):
        _, state = layer(x[:, :3], output_state=True)
        y, _ = layer(x[:, 3:], state=state)
        return y

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-7, fast_mode=True)
    loss = layer(x)[0].square().sum()
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


def test_bad_inputs_raise():
    layer = make_layer("mamba2", True)
    x = torch.randn(2, 4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="attention_mask must be"):
        layer(x, attention_mask=torch.ones(3, 4))
    with pytest.raises(ValueError, match="batch size 1"):
        layer(x, cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="cu_seqlens must increase"):
        layer(x[:1], cu_seqlens=torch.tensor([0, 3, 2, 4]))
    _, state = layer(x, output_state=True)
    with pytest.raises(ValueError, match="conv state must be"):
        layer(x[:1], state=state.select(torch.tensor([0, 1, 1])))


@pytest.mark.parametrize("variant", ["mamba2", "gated_deltanet"])
@pytest.mark.parametrize("x,error,match", [
    (torch.randn(4, D, dtype=torch.float64), ValueError,
     rf"hidden_states must be \[B, T, hidden_size = {D}\] with B, T >= 1, got shape \(4, {D}\)"),
    (torch.randn(2, 4, D + 1, dtype=torch.float64), ValueError,
     rf"hidden_states must be .* got shape \(2, 4, {D + 1}\)"),
    (torch.ones(2, 4, D, dtype=torch.int64), TypeError, "hidden_states must be a floating-point tensor .* torch.int64"),
    ([[0.0]], TypeError, "hidden_states must be a floating-point tensor .* got list"),
])
def test_bad_hidden_states(variant, x, error, match):
    with pytest.raises(error, match=match):
        make_layer(variant, True)(x)


def test_bad_state_mask_and_cu_seqlens():
    layer = make_layer("gated_deltanet", True)
    x = torch.randn(2, 4, D, dtype=torch.float64)
    _, state = layer(x, output_state=True)
    with pytest.raises(TypeError, match="state must be a MixerState .* got FenwickState"):
        layer(x, state=state.attn)
    with pytest.raises(ValueError, match=r"attention_mask \(2, 4\) marks no real token"):
        layer(x, attention_mask=torch.zeros(2, 4))
    additive = torch.tensor([[0.0, 0.0, 0.0, 0.0], [float("-inf"), 0.0, 0.0, 0.0]])  # 0 keep, -inf pad: inverted
    with pytest.raises(ValueError, match="attention_mask must hold 0 .padding. and 1 .real token. only, got -inf"):
        layer(x, attention_mask=additive)
    for mask in (torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), torch.tensor([[False, True, True, True]] * 2)):
        assert torch.isfinite(layer(x, attention_mask=mask)[0]).all()
    with pytest.raises(TypeError, match="cu_seqlens must be an int32/int64 tensor .* torch.float32"):
        layer(x[:1], cu_seqlens=torch.tensor([0.0, 2.0, 4.0]))
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D tensor \[N\+1\] with N >= 1, got shape \(0,\)"):
        layer(x[:1], cu_seqlens=torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D tensor .* got shape \(1, 3\)"):
        layer(x[:1], cu_seqlens=torch.tensor([[0, 2, 4]]))


@pytest.mark.parametrize("kwargs,match", [
    ({"hidden_size": -1}, "hidden_size must be a positive int, got -1"),
    ({"num_heads": 0}, "num_heads must be a positive int, got 0"),
    ({"conv_kernel": -1}, r"conv_kernel must be an int >= 0 \(0: no short convolution\), got -1"),
    ({"chunk_size": 48}, "chunk_size must be a power of two, got 48"),
    ({"chunk_size": 16.0}, "chunk_size must be a positive int, got 16.0"),
    ({"head_dim": 0}, "head_dim must be a positive int, got 0"),
    ({"expand_v": 0.1}, r"expand_v must give a value head dim int\(head_dim \* expand_v\) >= 1, got expand_v = 0.1"),
    ({"norm_eps": 0.0}, r"norm_eps must be a finite number in \(0, inf\], got 0.0"),
    ({"dt_min": float("nan")}, r"dt_min must be a finite number in \(0, inf\], got nan"),
    ({"dt_max": 1e-4}, r"dt_max must be a finite number in \[0.001, inf\], got 0.0001"),
    ({"dt_init_floor": -1.0}, r"dt_init_floor must be a finite number in \[0, inf\], got -1.0"),
    ({"layer_idx": -1}, "layer_idx must be an int >= 0, got -1"),
])
def test_bad_gated_deltanet_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LogLinearGatedDeltaNet(**({"hidden_size": D, "num_heads": 2, "head_dim": 4} | kwargs))


@pytest.mark.parametrize("kwargs,match", [
    ({"use_log_linear": "false"}, "use_log_linear must be a bool, got str 'false'"),
    ({"use_log_linear": 0}, "use_log_linear must be a bool, got int 0"),
])
def test_flags_of_the_layers_must_be_bools(kwargs, match):
    """A flag that is not a bool is refused by every layer (the string "false" would count as true)."""
    for layer in (LogLinearGatedDeltaNet, LogLinearMamba2):
        with pytest.raises(TypeError, match=match):
            layer(**({"hidden_size": D, "num_heads": 2, "head_dim": 4} | kwargs))


@pytest.mark.parametrize("kwargs,match", [
    ({"state_size": 0}, "state_size must be a positive int, got 0"),
    ({"n_groups": 0}, "n_groups must be a positive int, got 0"),
    ({"head_dim": 0}, "head_dim must be a positive int, got 0"),
    ({"n_groups": 3}, "num_heads = 2 must be a multiple of n_groups = 3"),
    ({"norm_groups": 3}, "groups must be a positive int dividing dim = 8, got 3"),
    ({"norm_eps": -1.0}, r"norm_eps must be a finite number in \(0, inf\], got -1.0"),
    ({"dt_min": 0.5, "dt_max": 0.1}, r"dt_max must be a finite number in \[0.5, inf\], got 0.1"),
])
def test_bad_mamba2_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LogLinearMamba2(**({"hidden_size": D, "num_heads": 2, "head_dim": 4, "state_size": 4} | kwargs))


@pytest.mark.parametrize("kwargs,match", [
    ({"expand_k": 0.3}, r"expand_k must give a width int\(hidden_size \* expand_k\) that is a positive multiple of "
                        r"num_heads = 2, got expand_k = 0.3 with hidden_size = 12"),
    ({"expand_v": 0.05}, "expand_v must give a width"),
    ({"gate_low_rank_dim": 0}, "gate_low_rank_dim must be a positive int, got 0"),
    ({"gate_logit_normalizer": 0}, "gate_logit_normalizer must be a number > 0, got 0"),
])
def test_bad_gla_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LogLinearGLA(**({"hidden_size": D, "num_heads": 2} | kwargs))


def test_gated_norm_groups_normalise_each_part():
    """groups = 2: each half of the channels has its own mean square; the weight spans all channels."""
    from loglinear.layers.norm import GatedRMSNorm

    norm = GatedRMSNorm(8, eps=1e-6, groups=2).double()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(8, dtype=torch.float64) + 0.5)
    x, z = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(3, 5, 8, dtype=torch.float64)
    y = x * F.silu(z)
    halves = [h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) for h in y.split(4, -1)]
    assert_close(norm(x, z), torch.cat(halves, -1) * norm.weight, 1e-12, "grouped gated norm")


def test_forward_arguments_named_in_errors():
    """A layer names its own arguments: hidden_states without tokens, an output_state that is not a bool."""
    layer = LogLinearMamba2(**{"hidden_size": D, "num_heads": 2, "head_dim": 4, "state_size": 4})
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, hidden_size = .*\] with B, T >= 1, "
                                         r"got shape \(2, 0, "):
        layer(torch.randn(2, 0, D))
    with pytest.raises(TypeError, match="output_state must be a bool, got str 'no'"):
        layer(torch.randn(2, 3, D), output_state="no")
