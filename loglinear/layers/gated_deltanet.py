"""Log-linear Gated DeltaNet layer (spec section 6).

    q, k = L2norm(SiLU(conv(W_q x))), L2norm(SiLU(conv(W_k x))): [H, K];  v = SiLU(conv(W_v x)): [H, V]
    beta = sigmoid(W_b x);  g = -exp(A_log) softplus(W_a x + dt_bias)
    o = log_linear_gated_deltanet(q, k, v, g, beta, lambda, scale=K^-1/2)
    out = o_proj(RMSNorm_V(o) * SiLU(W_g x))

The three short convolutions are one depthwise conv over the concatenated channels. use_log_linear=False
drops W_lambda and uses lambda = 1: plain Gated DeltaNet, everything else identical.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loglinear.inputs import check_positive_ints, check_value_head_dim
from loglinear.layers.mixer import DEFAULT_MAX_LEVELS, FenwickMixer, MixerInputs, check_dt_range, dt_bias_init
from loglinear.layers.norm import GatedRMSNorm, wide
from loglinear.variants import GATED_DELTANET

__all__ = ["LogLinearGatedDeltaNet"]


class LogLinearGatedDeltaNet(FenwickMixer):
    """Log-linear Gated DeltaNet mixer: [B, T, hidden_size] -> [B, T, hidden_size] (see module docstring)."""

    variant = GATED_DELTANET
    l2norm_qk = True

    def __init__(
        self, hidden_size: int, num_heads: int, head_dim: int = 64, expand_v: float = 2.0, conv_kernel: int = 4,
        use_log_linear: bool = True, max_levels: int = DEFAULT_MAX_LEVELS, chunk_size: int = 64,
        norm_eps: float = 1e-5, dt_min: float = 1e-3, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
        level_activation: str = "softplus", layer_idx: int | None = None,
    ):
        check_positive_ints(head_dim=head_dim)
        self.head_k_dim, self.head_v_dim = head_dim, check_value_head_dim(head_dim, expand_v)
        self.key_dim, self.value_dim = num_heads * head_dim, num_heads * self.head_v_dim
        self.dt_range = check_dt_range(dt_min, dt_max, dt_init_floor)
        super().__init__(
            hidden_size, num_heads, 2 * self.key_dim + self.value_dim, conv_kernel=conv_kernel, conv_bias=False,
            use_log_linear=use_log_linear, max_levels=max_levels, chunk_size=chunk_size,
            level_activation=level_activation, layer_idx=layer_idx,
        )
        self.qkv_proj = nn.Linear(hidden_size, 2 * self.key_dim + self.value_dim, bias=False)
        self.ab_proj = nn.Linear(hidden_size, 2 * num_heads, bias=False)
        self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, norm_before_gate=True)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.init_special_parameters()

    @property
    def scale(self) -> float:
        return self.head_k_dim ** -0.5

    def special_parameters(self) -> dict[str, torch.Tensor]:
        H = self.num_heads
        return super().special_parameters() | {
            "A_log": torch.log(torch.empty(H).uniform_(1e-4, 16)),
            "dt_bias": dt_bias_init(H, *self.dt_range),
        }

    def conv_inputs(self, x):
        return self.qkv_proj(x), {"ab": self.ab_proj(x), "gate": self.g_proj(x)}

    def op_inputs(self, conv_out, rest):
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        a, b = wide(rest["ab"]).chunk(2, dim=-1)
        H = self.num_heads
        return MixerInputs(
            q=q.reshape(-1, H, self.head_k_dim), k=k.reshape(-1, H, self.head_k_dim),
            v=v.reshape(-1, H, self.head_v_dim),
            gates={"g": -torch.exp(wide(self.A_log)) * F.softplus(a + wide(self.dt_bias)), "beta": torch.sigmoid(b)},
            extra={"gate": rest["gate"]},
        )

    def output(self, o, inputs):
        return self.o_proj(self.norm(o.reshape(-1, self.value_dim), inputs.extra["gate"]))
