"""Configurations of the log-linear causal LMs (model_type "loglinear_mamba2" / "loglinear_gated_deltanet" /
"loglinear_gla").

All stack pre-norm blocks  x + mixer(RMSNorm(x)),  x + SwiGLU(RMSNorm(x))  (the MLP is dropped with
intermediate_size=0), between a token embedding and an LM head (optionally tied).
use_log_linear=False gives the plain Mamba-2 / Gated DeltaNet / GLA model with everything else identical.
level_activation: how the level weights lambda are formed ("softplus", the paper's; "sigmoid": 2 sigmoid, exactly 1
with a zero lambda projection, loglinear.layers.levels).
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from loglinear.inputs import (
    check_bools,
    check_expanded_head_dim,
    check_multiple,
    check_positive_ints,
    check_power_of_two,
    check_value_head_dim,
)
from loglinear.layers.levels import LEVEL_ACTIVATIONS

__all__ = ["LogLinearMamba2Config", "LogLinearGatedDeltaNetConfig", "LogLinearGLAConfig"]


def _default_intermediate(hidden_size: int) -> int:
    """SwiGLU width 8/3 * hidden, rounded up to a multiple of 32."""
    return -(-(8 * hidden_size // 3) // 32) * 32


class _FenwickConfig(PretrainedConfig):
    """Fields shared by every variant (see the variant classes)."""

    def __init__(
        self, vocab_size: int = 32000, hidden_size: int = 256, num_hidden_layers: int = 4, num_heads: int = 4,
        head_dim: int | None = None, use_log_linear: bool = True, max_levels: int = 21,
        level_activation: str = "softplus", conv_kernel: int = 4,
        chunk_size: int = 64, intermediate_size: int | None = None, norm_eps: float = 1e-5,
        initializer_range: float = 0.02, tie_word_embeddings: bool = False, use_cache: bool = True,
        pad_token_id: int | None = None, bos_token_id: int | None = 1, eos_token_id: int | None = 2, **kwargs,
    ):
        check_positive_ints(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                            num_heads=num_heads, chunk_size=chunk_size)
        check_bools(use_log_linear=use_log_linear)
        if not isinstance(conv_kernel, int) or isinstance(conv_kernel, bool) or conv_kernel < 0:
            raise ValueError(f"conv_kernel must be an int >= 0 (0: no short convolution), got {conv_kernel!r}")
        if not isinstance(max_levels, int) or not 1 <= max_levels <= 62:
            raise ValueError(f"max_levels must be an int in [1, 62] (2^(max_levels-1) tokens), got {max_levels!r}")
        check_power_of_two(chunk_size=chunk_size)
        if level_activation not in LEVEL_ACTIVATIONS:
            raise ValueError(f"level_activation must be one of {sorted(LEVEL_ACTIVATIONS)}, got {level_activation!r}")
        if intermediate_size is not None and (not isinstance(intermediate_size, int) or intermediate_size < 0):
            raise ValueError(f"intermediate_size must be an int >= 0 (0: no MLP) or None, got {intermediate_size!r}")
        if not isinstance(norm_eps, (int, float)) or not math.isfinite(norm_eps) or norm_eps <= 0:
            raise ValueError(f"norm_eps must be a finite number > 0, got {norm_eps!r}")
        if pad_token_id is not None and not 0 <= pad_token_id < vocab_size:
            raise ValueError(f"pad_token_id must be None or in [0, vocab_size = {vocab_size}), got {pad_token_id!r}")
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_heads = num_hidden_layers, num_heads
        self.head_dim = head_dim
        self.use_log_linear, self.max_levels, self.level_activation = use_log_linear, max_levels, level_activation
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.intermediate_size = _default_intermediate(hidden_size) if intermediate_size is None else intermediate_size
        self.norm_eps, self.initializer_range, self.use_cache = norm_eps, initializer_range, use_cache
        super().__init__(
            tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
            eos_token_id=eos_token_id, **kwargs,
        )

    @classmethod
    def default_num_heads(cls, hidden_size: int) -> int:
        """Heads of 64 channels (at least one)."""
        return max(1, hidden_size // 64)

    def _check_time_steps(self) -> None:
        values = (self.time_step_min, self.time_step_max, self.time_step_floor)
        finite = all(isinstance(x, (int, float)) and math.isfinite(x) for x in values)
        if not (finite and 0 < self.time_step_floor and 0 < self.time_step_min <= self.time_step_max):
            raise ValueError(
                f"time steps must be finite with 0 < time_step_min <= time_step_max and time_step_floor > 0, got "
                f"min = {self.time_step_min}, max = {self.time_step_max}, floor = {self.time_step_floor}"
            )

    def _shared_mixer_kwargs(self) -> dict:
        return dict(
            hidden_size=self.hidden_size, num_heads=self.num_heads, head_dim=self.head_dim,
            conv_kernel=self.conv_kernel, use_log_linear=self.use_log_linear, max_levels=self.max_levels,
            level_activation=self.level_activation, chunk_size=self.chunk_size, norm_eps=self.norm_eps,
        )


class LogLinearMamba2Config(_FenwickConfig):
    """Log-linear Mamba-2 LM.  Mixer: num_heads x head_dim channels (head_dim default expand * hidden / heads),
    state_size (N) per group, n_groups q/k groups; dt initialised log-uniform in [time_step_min, time_step_max];
    the gated RMSNorm over all channels or per each of norm_groups equal parts (mamba_ssm / transformers: n_groups)."""

    model_type = "loglinear_mamba2"

    @classmethod
    def default_num_heads(cls, hidden_size: int) -> int:
        """Heads of 64 channels at expand 2 (at least one)."""
        return max(1, 2 * hidden_size // 64)

    def __init__(
        self, state_size: int = 64, expand: int = 2, n_groups: int = 1, time_step_min: float = 1e-3,
        time_step_max: float = 0.1, time_step_floor: float = 1e-4, norm_groups: int = 1, **kwargs,
    ):
        super().__init__(**kwargs)
        if self.head_dim is None:
            if expand * self.hidden_size % self.num_heads:
                raise ValueError(f"expand * hidden_size = {expand * self.hidden_size} "
                                 f"must divide into num_heads = {self.num_heads}")
            self.head_dim = expand * self.hidden_size // self.num_heads
        self.state_size, self.expand, self.n_groups, self.norm_groups = state_size, expand, n_groups, norm_groups
        self.time_step_min, self.time_step_max, self.time_step_floor = time_step_min, time_step_max, time_step_floor
        check_positive_ints(head_dim=self.head_dim)
        self._check_time_steps()
        check_positive_ints(state_size=state_size, expand=expand, n_groups=n_groups)
        check_multiple("num_heads", self.num_heads, "n_groups", n_groups)
        check_positive_ints(norm_groups=norm_groups)
        check_multiple("num_heads * head_dim", self.num_heads * self.head_dim, "norm_groups", norm_groups)

    def mixer_kwargs(self) -> dict:
        return self._shared_mixer_kwargs() | dict(
            state_size=self.state_size, n_groups=self.n_groups, dt_min=self.time_step_min,
            dt_max=self.time_step_max, dt_init_floor=self.time_step_floor, norm_groups=self.norm_groups,
        )


class LogLinearGatedDeltaNetConfig(_FenwickConfig):
    """Log-linear Gated DeltaNet LM.  Mixer: num_heads heads of key dim head_dim (default hidden / heads) and
    value dim expand_v * head_dim."""

    model_type = "loglinear_gated_deltanet"

    def __init__(
        self, expand_v: float = 2.0, time_step_min: float = 1e-3, time_step_max: float = 0.1,
        time_step_floor: float = 1e-4, **kwargs,
    ):
        super().__init__(**kwargs)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size = {self.hidden_size} must be a multiple of num_heads = "
                                 f"{self.num_heads} (the default head_dim), or give head_dim")
            self.head_dim = self.hidden_size // self.num_heads
        self.expand_v = expand_v
        self.time_step_min, self.time_step_max, self.time_step_floor = time_step_min, time_step_max, time_step_floor
        check_positive_ints(head_dim=self.head_dim)
        self._check_time_steps()
        check_value_head_dim(self.head_dim, expand_v)

    def mixer_kwargs(self) -> dict:
        return self._shared_mixer_kwargs() | dict(
            expand_v=self.expand_v, dt_min=self.time_step_min, dt_max=self.time_step_max,
            dt_init_floor=self.time_step_floor,
        )


class LogLinearGLAConfig(_FenwickConfig):
    """Log-linear GLA LM.  Mixer: num_heads heads of key dim head_dim = expand_k * hidden / heads and value dim
    expand_v * hidden / heads; the per-channel gate logsigmoid(W_g2 W_g1 x + b) / gate_logit_normalizer with W_g of
    rank gate_low_rank_dim. head_dim follows from expand_k (give expand_k to change it)."""

    model_type = "loglinear_gla"

    def __init__(
        self, expand_k: float = 0.5, expand_v: float = 1.0, gate_low_rank_dim: int = 16,
        gate_logit_normalizer: float = 16.0, conv_kernel: int = 0, **kwargs,
    ):
        super().__init__(conv_kernel=conv_kernel, **kwargs)
        head_k_dim = check_expanded_head_dim("expand_k", expand_k, self.hidden_size, self.num_heads)
        check_expanded_head_dim("expand_v", expand_v, self.hidden_size, self.num_heads)
        if self.head_dim is None:
            self.head_dim = head_k_dim
        elif self.head_dim != head_k_dim:
            raise ValueError(f"head_dim of GLA is int(hidden_size * expand_k) / num_heads = {head_k_dim} (give "
                             f"expand_k to change it), got head_dim = {self.head_dim!r}")
        check_positive_ints(gate_low_rank_dim=gate_low_rank_dim)
        finite = isinstance(gate_logit_normalizer, (int, float)) and math.isfinite(gate_logit_normalizer)
        if not (finite and gate_logit_normalizer > 0):
            raise ValueError(f"gate_logit_normalizer must be a finite number > 0, got {gate_logit_normalizer!r}")
        self.expand_k, self.expand_v = expand_k, expand_v
        self.gate_low_rank_dim, self.gate_logit_normalizer = gate_low_rank_dim, gate_logit_normalizer

    def mixer_kwargs(self) -> dict:
        kwargs = {name: value for name, value in self._shared_mixer_kwargs().items() if name != "head_dim"}
        return kwargs | dict(
            expand_k=self.expand_k, expand_v=self.expand_v, gate_low_rank_dim=self.gate_low_rank_dim,
            gate_logit_normalizer=self.gate_logit_normalizer,
        )
