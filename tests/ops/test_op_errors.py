"""Every bad input raises a ValueError/TypeError that names the argument."""

import pytest
import torch

from helpers import make_inputs, mamba2_args
from loglinear import FenwickState, log_linear_gated_deltanet, log_linear_mamba2


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
    with pytest.raises(ValueError, match=r"\[N, L, H, K, V\]"):
        FenwickState(torch.zeros(1, 1, 1, 1), torch.tensor([1]))


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


def test_bad_backend_env(monkeypatch):
    monkeypatch.setenv("LOGLINEAR_BACKEND", "cuda")
    with pytest.raises(ValueError, match="LOGLINEAR_BACKEND must be"):
        log_linear_mamba2(**mamba2_args(base()))
