"""Log-linear Mamba-2 layer (spec section 6).

    in_proj(x) -> z [H P], xBC [H P + 2 G N], dt [H];   xBC <- SiLU(causal depthwise conv(xBC))
    dt = softplus(dt + dt_bias);  g = -exp(A_log) dt;  q = C, k = B: [G, N];  v = x dt: [H, P]
    y = log_linear_mamba2(q, k, v, g, lambda, scale=1) + D x;   out = out_proj(RMSNorm(y * SiLU(z)))

The gated RMSNorm spans all H P channels, or each of norm_groups equal parts of them (mamba_ssm and transformers
normalise per q/k group: norm_groups = n_groups).

lambda_t[h, l] = softplus(Ls[h, l] (W_lambda x_t)[h, l]) (LevelScales; or 2 sigmoid, level_activation).
use_log_linear=False drops W_lambda and uses lambda = 1: plain Mamba-2 (SSD), everything else identical.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loglinear.inputs import check_multiple, check_positive_ints
from loglinear.layers.mixer import DEFAULT_MAX_LEVELS, FenwickMixer, MixerInputs, check_dt_range, dt_bias_init
from loglinear.layers.norm import GatedRMSNorm, wide
from loglinear.variants import MAMBA2

__all__ = ["LogLinearMamba2"]


class LogLinearMamba2(FenwickMixer):
    """Log-linear Mamba-2 mixer: [B, T, hidden_size] -> [B, T, hidden_size] (see module docstring)."""

    variant = MAMBA2

    def __init__(
        self, hidden_size: int, num_heads: int, head_dim: int = 64, state_size: int = 128, n_groups: int = 1,
        conv_kernel: int = 4, use_log_linear: bool = True, max_levels: int = DEFAULT_MAX_LEVELS,
        chunk_size: int = 64, norm_eps: float = 1e-5, dt_min: float = 1e-3, dt_max: float = 0.1,
        dt_init_floor: float = 1e-4, level_activation: str = "softplus", norm_groups: int = 1,
        layer_idx: int | None = None,
    ):
        check_positive_ints(num_heads=num_heads, head_dim=head_dim, state_size=state_size, n_groups=n_groups)
        check_multiple("num_heads", num_heads, "n_groups", n_groups)
        self.head_dim, self.state_size, self.n_groups = head_dim, state_size, n_groups
        self.d_inner = num_heads * head_dim
        self.dt_range = check_dt_range(dt_min, dt_max, dt_init_floor)
        super().__init__(
            hidden_size, num_heads, self.d_inner + 2 * n_groups * state_size, conv_kernel=conv_kernel,
            conv_bias=True, use_log_linear=use_log_linear, max_levels=max_levels, chunk_size=chunk_size,
            level_activation=level_activation, layer_idx=layer_idx,
        )
        self.in_proj = nn.Linear(hidden_size, 2 * self.d_inner + 2 * n_groups * state_size + num_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(self.d_inner, eps=norm_eps, norm_before_gate=False, groups=norm_groups)
        self.out_proj = nn.Linear(self.d_inner, hidden_size, bias=False)
        self.init_special_parameters()

    @property
    def key_groups(self) -> int:
        return self.n_groups

    @property
    def scale(self) -> float:
        return 1.0

    def special_parameters(self) -> dict[str, torch.Tensor]:
        H = self.num_heads
        return super().special_parameters() | {
            "A_log": torch.log(torch.empty(H).uniform_(1, 16)),
            "dt_bias": dt_bias_init(H, *self.dt_range),
            "D": torch.ones(H),
        }

    def conv_inputs(self, x):
        z, xbc, dt = self.in_proj(x).split([self.d_inner, self.conv_channels, self.num_heads], dim=-1)
        return xbc, {"z": z, "dt": dt}

    def op_inputs(self, conv_out, rest):
        GN = self.n_groups * self.state_size
        xs, b, c = conv_out.split([self.d_inner, GN, GN], dim=-1)
        dt = F.softplus(wide(rest["dt"]) + wide(self.dt_bias))  # [Ntok, H]
        xs = xs.reshape(-1, self.num_heads, self.head_dim)
        return MixerInputs(
            q=c.reshape(-1, self.n_groups, self.state_size), k=b.reshape(-1, self.n_groups, self.state_size),
            v=(xs * dt[..., None]).to(xs.dtype), gates={"g": -torch.exp(wide(self.A_log)) * dt},
            extra={"x": xs, "z": rest["z"]},
        )

    def output(self, o, inputs):
        y = o + self.D[:, None].to(o.dtype) * inputs.extra["x"]
        return self.out_proj(self.norm(y.reshape(-1, self.d_inner), inputs.extra["z"]))
