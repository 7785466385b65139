"""Every bad input raises a ValueError/TypeError that names the argument."""

import pytest
import torch

from helpers import make_inputs, mamba2_args
from loglinear import FenwickState, log_linear_gated_deltanet, log_linear_mamba2
from loglinear.ops.decode import decode_step
from loglinear.variants import GATED_DELTANET


def base():
    return make_inputs(2, 10, 1, 2, K=4, V=3)


def call(x, **kw):
    return log_linear_gated_deltanet(**x, **kw)


@pytest.mark.parametrize("name,value,error,match", [
    ("q", torch.randn(2, 10, 4), ValueError, "q must be"),
    ("k", torch.randn(2, 10, 1, 5, dtype=torch.float64), ValueError, "k must match"),
    ("v", torch.randn(2, 9, 2, 3, dtype=torch.float64), ValueError, "v must be"),
    ("v", torch.randn(2, 10, 3, 3, dtype=torch.float64), ValueError, "g must be .* H = 2, 10, 3"),
    ("g", torch.randn(2, 10, 3, dtype=torch.float64), ValueError, "g must be"),
    ("beta", torch.rand(2, 10, dtype=torch.float64), ValueError, "beta must be"),
    ("level_scales", torch.rand(2, 10, 3, 5, dtype=torch.float64), ValueError, "level_scales must be"),
    ("q", torch.randint(0, 3, (2, 10, 1, 4)), TypeError, "q must be a floating-point"),
    ("g", [0.0], TypeError, "g must be a torch.Tensor"),
])
def test_bad_tensors(name, value, error, match):
    x = base()
    x[name] = value
    with pytest.raises(error, match=match):
        call(x)


def test_heads_not_divisible_by_groups():
    x = make_inputs(1, 4, 2, 3)
    with pytest.raises(ValueError, match="multiple of the q/k groups"):
        call(x)


def test_too_few_levels():
    x = base()
    x["level_scales"] = x["level_scales"][..., :3]  # 10 positions need 5 levels
    with pytest.raises(ValueError, match="level_scales has L = 3 .* need L >= 5"):
        call(x)


def test_too_few_levels_for_continued_positions():
    x = base()
    x["level_scales"] = x["level_scales"][..., :5]
    state = FenwickState.zeros(2, 2, 4, 3, dtype=torch.float64)
    state.positions = torch.tensor([100, 3])
    with pytest.raises(ValueError, match="positions up to 110 need L >= 8"):
        call(x, initial_state=state)


def test_empty_sequence():
    x = {n: t[:, :0] for n, t in base().items()}
    with pytest.raises(ValueError, match="T >= 1"):
        call(x)


@pytest.mark.parametrize("cu,match", [
    (torch.tensor([0, 4, 10]), "batch size 1"),
])
def test_cu_seqlens_needs_batch_one(cu, match):
    with pytest.raises(ValueError, match=match):
        call(base(), cu_seqlens=cu)


@pytest.mark.parametrize("cu,error,match", [
    (torch.tensor([0, 4, 9]), ValueError, "from 0 to T = 10"),
    (torch.tensor([1, 4, 10]), ValueError, "from 0 to T = 10"),
    (torch.tensor([0, 6, 4, 10]), ValueError, "increase strictly"),
    (torch.tensor([[0, 10]]), ValueError, "1-D"),
    (torch.tensor([0.0, 10.0]), TypeError, "int32/int64"),
])
def test_bad_cu_seqlens(cu, error, match):
    x = {n: t[:1] for n, t in base().items()}
    with pytest.raises(error, match=match):
        call(x, cu_seqlens=cu)


def test_state_mismatches():
    x = base()
    with pytest.raises(TypeError, match="FenwickState"):
        call(x, initial_state=torch.zeros(2, 1, 2, 4, 3))
    with pytest.raises(ValueError, match=r"\[2, L, 2, 4, 3\]"):
        call(x, initial_state=FenwickState.zeros(2, 3, 4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[2, L, 2, 4, 3\]"):
        call(x, initial_state=FenwickState.zeros(2, 2, 4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"N = number of sequences"):
        call(x, initial_state=FenwickState.zeros(3, 2, 4, 3, dtype=torch.float64))
    one = {n: t[:1] for n, t in x.items()}
    with pytest.raises(ValueError, match=r"\[2, L, 2, 4, 3\]"):
        call(one, cu_seqlens=torch.tensor([0, 4, 10]), initial_state=FenwickState.zeros(3, 2, 4, 3))


def test_state_constructor_checks():
    with pytest.raises(ValueError, match="positions must have shape"):
        FenwickState(torch.zeros(2, 1, 1, 1, 1), torch.tensor([1]))
    with pytest.raises(ValueError, match=">= 0"):
        FenwickState(torch.zeros(1, 1, 1, 1, 1), torch.tensor([-1]))
    with pytest.raises(TypeError, match="positions must be integers .* torch.float32"):
        FenwickState(torch.zeros(1, 1, 1, 1, 1), torch.tensor([3.5]))
    with pytest.raises(ValueError, match=r"\[N, L, H, K, V\]"):
        FenwickState(torch.zeros(1, 1, 1, 1), torch.tensor([1]))
    with pytest.raises(ValueError, match="FenwickState.zeros: num_sequences must be a positive int, got -1"):
        FenwickState.zeros(-1, 2, 4, 3)
    with pytest.raises(ValueError, match="FenwickState.zeros: num_levels must be a positive int, got 2.5"):
        FenwickState.zeros(1, 2, 4, 3, num_levels=2.5)


def test_mismatched_devices():
    x = base()
    x["v"] = x["v"].to("meta")
    with pytest.raises(ValueError, match="v is on meta"):
        call(x)


def test_bad_chunk_size_and_scale():
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        log_linear_mamba2(**mamba2_args(base()), chunk_size=48)
    with pytest.raises(TypeError, match="scale must be a float"):
        log_linear_mamba2(**mamba2_args(base()), scale="big")
    for bad in (float("nan"), float("inf")):  # every output would be NaN / inf
        with pytest.raises(ValueError, match="scale must be finite"):
            log_linear_mamba2(**mamba2_args(base()), scale=bad)


def test_bad_backend_env(monkeypatch):
    monkeypatch.setenv("LOGLINEAR_BACKEND", "cuda")
    with pytest.raises(ValueError, match="LOGLINEAR_BACKEND must be"):
        log_linear_mamba2(**mamba2_args(base()))


@pytest.mark.parametrize("shape,match", [
    ((0, 10, 1, 4), r"q must be \[B, T, G, K\] with B, G, K >= 1, got shape \(0, 10, 1, 4\)"),
    ((2, 10, 0, 4), r"q must be \[B, T, G, K\] with B, G, K >= 1, got shape \(2, 10, 0, 4\)"),
    ((2, 10, 1, 0), r"q must be \[B, T, G, K\] with B, G, K >= 1, got shape \(2, 10, 1, 0\)"),
])
def test_empty_q_dims(shape, match):
    x = base()
    if shape[0] == 0:
        x = {n: t[:0] for n, t in x.items()}
    x["q"] = x["k"] = torch.randn(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        call(x)


def test_no_value_heads():
    x = base()
    x["v"] = torch.randn(2, 10, 0, 3, dtype=torch.float64)
    x["g"], x["beta"] = x["g"][..., :0], x["beta"][..., :0]
    x["level_scales"] = x["level_scales"][:, :, :0]
    with pytest.raises(ValueError, match=r"v must be \[B, T, H, V\] with H >= 1, got shape \(2, 10, 0, 3\)"):
        call(x)


def test_cu_seqlens_on_another_device():
    x = {n: t[:1] for n, t in base().items()}
    with pytest.raises(ValueError, match="cu_seqlens is on meta"):
        call(x, cu_seqlens=torch.tensor([0, 4, 10], device="meta"))


def test_state_positions_of_wrong_length():
    state = FenwickState.zeros(2, 2, 4, 3, dtype=torch.float64)
    state.positions = torch.tensor([1, 2, 3])  # the dataclass field, replaced after construction
    with pytest.raises(ValueError, match=r"initial_state.positions must be \[N\] = \[2\], got shape \(3,\)"):
        call(base(), initial_state=state)


@pytest.mark.parametrize("chunk_size,error,match", [
    (True, TypeError, "chunk_size must be an int .* got bool"),
    (16.0, TypeError, "chunk_size must be an int .* got float"),
    (0, ValueError, "chunk_size must be a power of two >= 1, got 0"),
])
def test_chunk_size_type(chunk_size, error, match):
    with pytest.raises(error, match=match):
        call(base(), chunk_size=chunk_size)


@pytest.mark.parametrize("flag, value", [("output_final_state", "yes"), ("use_qk_l2norm", "false"),
                                         ("output_final_state", 1), ("use_qk_l2norm", None)])
def test_flags_must_be_bools(flag, value):
    """A flag that is not a bool is refused: the string "false" would otherwise count as true."""
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got {type(value).__name__}"):
        call(base(), **{flag: value})


def test_chunk_size_checked_on_the_decode_path():
    x = {n: t[:, :1] for n, t in base().items()}
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        call(x, initial_state=FenwickState.zeros(2, 2, 4, 3, dtype=torch.float64), chunk_size=3)


def step_args(**changes):
    """Valid Gated DeltaNet decode_step arguments (N = 2, G = 1, H = 2, K = 4, V = 3, L = 3, positions 3 and 2),
    then ``changes`` (g and beta go into the gates)."""
    x = {n: t[:, 0] for n, t in make_inputs(2, 1, 1, 2, K=4, V=3, L=3).items()}
    args = x | {"levels": torch.randn(2, 3, 2, 4, 3, dtype=torch.float64), "positions": torch.tensor([3, 2]),
                "scale": 0.5} | changes
    gates = {"g": args.pop("g"), "beta": args.pop("beta")}
    return {"variant": GATED_DELTANET, "gates": gates} | args


def f64(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_decode_step_accepts_valid_arguments():
    o, levels = decode_step(**step_args())
    assert o.shape == (2, 2, 3) and levels.shape == (2, 3, 2, 4, 3)


@pytest.mark.parametrize("changes,error,match", [
    ({"q": f64(2, 1, 1, 4)}, ValueError, r"q must be \[N, G, K\] \(3 dims\), got shape \(2, 1, 1, 4\)"),
    ({"q": torch.ones(2, 1, 4, dtype=torch.int64)}, TypeError,
     "q must be a floating-point tensor .* dtype torch.int64"),
    ({"k": f64(2, 1, 5)}, ValueError, r"k must be \[N, G, K\] = \[2, 1, 4\], got shape \(2, 1, 5\)"),
    ({"v": f64(3, 2, 3)}, ValueError, r"v must be \[N, H, V\] = \[2, 2, 3\], got shape \(3, 2, 3\)"),
    ({"v": f64(2, 2, 5)}, ValueError, r"levels must be \[N, L, H, K, V\] = \[2, 3, 2, 4, 5\]"),
    ({"q": f64(2, 3, 4), "k": f64(2, 3, 4)}, ValueError, "H = 2 .* multiple of the q/k groups G = 3"),
    ({"g": f64(2, 3)}, ValueError, r"g must be \[N, H\] = \[2, 2\], got shape \(2, 3\)"),
    ({"beta": f64(2)}, ValueError, r"beta must be \[N, H\] \(2 dims\)"),
    ({"level_scales": f64(2, 2, 2)}, ValueError, r"level_scales must be \[N, H, >= L\] = \[2, 2, >= 3\]"),
    ({"level_scales": None}, TypeError, "level_scales must be a torch.Tensor .* got NoneType"),
    ({"levels": f64(2, 3, 2, 5, 3)}, ValueError, r"levels must be \[N, L, H, K, V\] = \[2, 3, 2, 4, 3\]"),
    ({"levels": torch.ones(2, 3, 2, 4, 3, dtype=torch.int64)}, TypeError, "levels must be a floating-point"),
    ({"positions": torch.tensor([3])}, ValueError, r"positions must be \[N\] = \[2\], got shape \(1,\)"),
    ({"positions": torch.tensor([3.0, 2.0])}, TypeError,
     "positions must be an int32/int64 tensor .* dtype torch.float32"),
    ({"positions": torch.tensor([8, 2])}, ValueError, "levels has L = 3 levels .* position 8 needs L >= 5"),
    ({"v": f64(2, 2, 3).to("meta")}, ValueError, "v is on meta but levels is on cpu"),
    ({"scale": float("nan")}, ValueError, "scale must be a finite float, got nan"),
    ({"scale": "0.5"}, ValueError, "scale must be a finite float, got '0.5'"),
    ({"fenwick": "false"}, TypeError, "fenwick must be a bool, got str 'false'"),
    ({"l2norm_qk": 1}, TypeError, "l2norm_qk must be a bool, got int 1"),
])
def test_decode_step_bad_arguments(changes, error, match):
    with pytest.raises(error, match=match):
        decode_step(**step_args(**changes))


def test_plain_decode_step_needs_no_level_scales_or_levels_for_positions():
    o, levels = decode_step(**step_args(level_scales=None, levels=f64(2, 1, 2, 4, 3), positions=torch.tensor([8, 2])),
                            fenwick=False)
    assert o.shape == (2, 2, 3) and levels.shape == (2, 1, 2, 4, 3)
