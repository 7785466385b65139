"""Log-linear Gated Linear Attention layer (spec section 6b): GLA's block with the Fenwick level weights.

    q, k = W_q x, W_k x: [H, K];  v = W_v x: [H, V]
        (K = expand_k * hidden / H, V = expand_v * hidden / H: key expansion 0.5, value expansion 1)
    gk = logsigmoid(W_g2 W_g1 x + b) / 16: [H, K]   (low-rank W_g of rank 16: a log-decay per key channel)
    o = log_linear_gla(q, k, v, gk, lambda, scale=K^-1/2)
    out = o_proj(RMSNorm_V(o) * swish(W_r x))   (RMSNorm per head, then the output gate)

GLA's block has no short convolution (conv_kernel = 0, the default); conv_kernel = W > 0 adds the library's causal
conv + SiLU on q, k, v (FenwickMixer), as the Mamba-2 and Gated DeltaNet layers have. use_log_linear=False drops
W_lambda and uses lambda = 1: plain GLA, everything else identical.
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from loglinear.inputs import check_expanded_head_dim, check_positive_ints
from loglinear.layers.mixer import DEFAULT_MAX_LEVELS, FenwickMixer, MixerInputs
from loglinear.layers.norm import GatedRMSNorm, wide
from loglinear.variants import GLA

__all__ = ["LogLinearGLA"]


class LogLinearGLA(FenwickMixer):
    """Log-linear GLA mixer: [B, T, hidden_size] -> [B, T, hidden_size] (see module docstring)."""

    variant = GLA

    def __init__(
        self, hidden_size: int, num_heads: int, expand_k: float = 0.5, expand_v: float = 1.0,
        gate_low_rank_dim: int = 16, gate_logit_normalizer: float = 16.0, conv_kernel: int = 0,
        use_log_linear: bool = True, max_levels: int = DEFAULT_MAX_LEVELS, chunk_size: int = 64,
        norm_eps: float = 1e-5, level_activation: str = "softplus", layer_idx: int | None = None,
    ):
        check_positive_ints(hidden_size=hidden_size, num_heads=num_heads, gate_low_rank_dim=gate_low_rank_dim)
        self.head_k_dim = check_expanded_head_dim("expand_k", expand_k, hidden_size, num_heads)
        self.head_v_dim = check_expanded_head_dim("expand_v", expand_v, hidden_size, num_heads)
        if not isinstance(gate_logit_normalizer, (int, float)) or not gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer must be a number > 0, got {gate_logit_normalizer!r}")
        self.key_dim, self.value_dim = num_heads * self.head_k_dim, num_heads * self.head_v_dim
        self.gate_logit_normalizer = float(gate_logit_normalizer)
        super().__init__(
            hidden_size, num_heads, 2 * self.key_dim + self.value_dim, conv_kernel=conv_kernel, conv_bias=False,
            use_log_linear=use_log_linear, max_levels=max_levels, chunk_size=chunk_size,
            level_activation=level_activation, layer_idx=layer_idx,
        )
        self.qkv_proj = nn.Linear(hidden_size, 2 * self.key_dim + self.value_dim, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, self.key_dim, bias=True))
        self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, norm_before_gate=True)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.init_special_parameters()

    @property
    def scale(self) -> float:
        return self.head_k_dim ** -0.5

    def conv_inputs(self, x):
        return self.qkv_proj(x), {"gk": self.gk_proj(x), "gate": self.g_proj(x)}

    def op_inputs(self, conv_out, rest):
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        H, K = self.num_heads, self.head_k_dim
        gk = F.logsigmoid(wide(rest["gk"])) / self.gate_logit_normalizer
        return MixerInputs(
            q=q.reshape(-1, H, K), k=k.reshape(-1, H, K), v=v.reshape(-1, H, self.head_v_dim),
            gates={"g": gk.reshape(-1, H, K)}, extra={"gate": rest["gate"]},
        )

    def output(self, o, inputs):
        return self.o_proj(self.norm(o.reshape(-1, self.value_dim), inputs.extra["gate"]))
