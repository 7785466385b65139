"""Config values that cannot work are refused with a ValueError (a TypeError for a flag) naming them (they used to
give NaN logits or a silently truncated head dim)."""

import pytest

from loglinear.models import LogLinearGatedDeltaNetConfig, LogLinearMamba2Config


@pytest.mark.parametrize("cls", [LogLinearMamba2Config, LogLinearGatedDeltaNetConfig])
@pytest.mark.parametrize("field,value,match", [
    ("norm_eps", float("nan"), "norm_eps must be a finite number"),
    ("norm_eps", float("inf"), "norm_eps must be a finite number"),
    ("time_step_max", float("inf"), "time steps must be finite"),
    ("time_step_min", float("nan"), "time steps must be finite"),
])
def test_non_finite_values(cls, field, value, match):
    with pytest.raises(ValueError, match=match):
        cls(hidden_size=64, num_heads=4, **{field: value})


def test_gated_deltanet_heads_must_divide_the_width():
    with pytest.raises(ValueError, match="hidden_size = 100 must be a multiple of num_heads = 3"):
        LogLinearGatedDeltaNetConfig(hidden_size=100, num_heads=3)
    assert LogLinearGatedDeltaNetConfig(hidden_size=100, num_heads=3, head_dim=32).head_dim == 32


def test_level_activation_must_be_known():
    with pytest.raises(ValueError, match=r"level_activation must be one of \['sigmoid', 'softplus'\], got 'relu'"):
        LogLinearMamba2Config(hidden_size=64, num_heads=4, level_activation="relu")


@pytest.mark.parametrize("cls", [LogLinearMamba2Config, LogLinearGatedDeltaNetConfig])
def test_use_log_linear_must_be_a_bool(cls):
    """The string "false" (a hand-edited config) would otherwise make a log-linear model."""
    with pytest.raises(TypeError, match="use_log_linear must be a bool, got str 'false'"):
        cls(hidden_size=64, num_heads=4, use_log_linear="false")
    assert cls(hidden_size=64, num_heads=4, use_log_linear=False).use_log_linear is False
