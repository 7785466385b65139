"""What every log-linear mixer layer shares: the token layout, the short convolution, the level weights
lambda, the state, and the attention call. A variant's layer names its variant (loglinear.variants) and
supplies its projections (``conv_inputs``, ``op_inputs``) and its output (``output``).

    x [B, T, D] --flatten real tokens--> [Ntok, D] --conv_inputs--> (conv channels, rest)
       --ShortConvolution + SiLU--> op_inputs --> q, k, v, the variant's gates (+ what output needs)
       --fenwick_attention (lambda from LevelScales, or 1 when use_log_linear=False)--> o [Ntok, H, V]
       --output--> [Ntok, D] --unflatten--> [B, T, D]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loglinear.inputs import (
    check_bools, check_in_range, check_nonnegative_ints, check_positive_ints, check_power_of_two,
)
from loglinear.layers.conv import ShortConvolution
from loglinear.layers.levels import LevelScales
from loglinear.layers.sequence import TokenLayout
from loglinear.ops.decode import KEY_WINDOW, KeyWindow, decode_step, lazy_level_states
from loglinear.ops.stateful import fenwick_attention
from loglinear.state import FenwickState, LevelsView
from loglinear.variants import Variant

__all__ = ["MixerState", "StaticState", "MixerInputs", "FenwickMixer", "check_dt_range", "dt_bias_init"]

DEFAULT_MAX_LEVELS = 21  # 2^20 tokens


def check_dt_range(dt_min: float, dt_max: float, dt_init_floor: float) -> tuple[float, float, float]:
    """The time-step initialisation range of dt_bias_init: 0 < dt_min <= dt_max, dt_init_floor >= 0 (finite), or a
    ValueError naming the bad value."""
    check_in_range("dt_min", dt_min, 0, math.inf, low_closed=False)
    check_in_range("dt_max", dt_max, dt_min, math.inf, low_closed=True)
    check_in_range("dt_init_floor", dt_init_floor, 0, math.inf, low_closed=True)
    return dt_min, dt_max, dt_init_floor


def dt_bias_init(num_heads: int, dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4) -> torch.Tensor:
    """dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max] (>= dt_floor), as in Mamba-2.  -> [H]."""
    log_dt = torch.rand(num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
    dt = torch.exp(log_dt).clamp(min=dt_floor)
    return dt + torch.log(-torch.expm1(-dt))


@dataclass
class MixerState(LevelsView):
    """Decoding state of one mixer for N sequences.

    levels:    [N, L, H, K, V] Fenwick level states (L = ceil(log2 T) + 1 log-linear, 1 plain), fp32
    positions: [N] int64 CPU, tokens seen by each sequence
    conv:      [N, W-1, C], the last W-1 inputs of the short convolution
    (plain fields, no validation: the state also flows through torch.compile graphs)
    """

    levels: torch.Tensor
    positions: torch.Tensor
    conv: torch.Tensor

    @property
    def attn(self) -> FenwickState:
        return FenwickState(self.levels, self.positions)

    def nbytes(self) -> int:
        """Bytes of the level and conv states."""
        return sum(x.numel() * x.element_size() for x in (self.levels, self.conv))

    def select(self, index: torch.Tensor) -> "MixerState":
        """Rows ``index`` (beam reordering, batch selection)."""
        index = torch.as_tensor(index, dtype=torch.int64)
        return MixerState(
            self.levels.index_select(0, index.to(self.levels.device)), self.positions[index.cpu()],
            self.conv.index_select(0, index.to(self.conv.device)),
        )


@dataclass
class StaticState:
    """One mixer's decoding state in the static buffers of CUDA-graph decoding (loglinear.models.graphs), which
    ``FenwickMixer.step_`` updates in place.

    levels:     [N, L, H, K, V] (L = max_levels log-linear, 1 plain; a level a position does not hold is zero);
                with log_scales stored lazily: level l's state is levels[:, l] * exp(log_scales[:, l]), for the
                delta rule after the window's pending projections (loglinear.ops.decode; an emptied level may keep
                its tile at log-scale -inf), and may then be bfloat16 (FenwickCache's level_dtype)
    log_scales: [N, L, H] ([N, L, H, K] for a per-channel gate), float32 (float64 with float64 levels), for a
                log-linear layer with lazy levels (``Variant.lazy_levels``: Mamba-2, GLA, Gated DeltaNet), else None
    window:     the delta rule's KeyWindow of the last W tokens beside lazy levels (Gated DeltaNet; FenwickCache's
                key_window, default KEY_WINDOW; past the first turn after a load they stand for levels 0..log2 W),
                else None
    conv:       [N, W-1, C]
    """

    levels: torch.Tensor
    log_scales: torch.Tensor | None
    window: KeyWindow | None
    conv: torch.Tensor

    def load(self, state: MixerState) -> None:
        """Copy ``state`` in: its levels zero-padded to L, log-scales 0, an empty window starting at its positions."""
        levels = state.levels
        self.levels[:, : levels.shape[1]].copy_(levels)
        self.levels[:, levels.shape[1] :].zero_()
        if self.log_scales is not None:
            self.log_scales.zero_()
        if self.window is not None:
            self.window.load_at(state.positions)
        self.conv.copy_(state.conv)

    def level_states(self, positions: torch.Tensor) -> torch.Tensor:
        """The level states [N, L, H, K, V] after ``positions`` [N] tokens: ``levels`` itself, or lazily stored
        ones multiplied out, new (in the log-scales' dtype)."""
        if self.log_scales is None:
            return self.levels
        return lazy_level_states(self.levels, self.log_scales, self.window, positions)

    def nbytes(self) -> int:
        parts = (self.levels, self.log_scales, self.conv)
        return sum(x.numel() * x.element_size() for x in parts if x is not None) + (
            self.window.nbytes() if self.window is not None else 0)


@dataclass
class MixerInputs:
    """Per-token op inputs of a mixer.  q, k: [Ntok, G, K]; v: [Ntok, H, V]; gates: the variant's {name: [Ntok, H]}
    (per channel: [Ntok, H, K]); extra: what the layer's output needs."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gates: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor]


class FenwickMixer(nn.Module):
    """Base of the log-linear mixers (see module docstring).  Subclasses set variant, scale, l2norm_qk."""

    variant: Variant
    l2norm_qk: bool = False

    def __init__(
        self, hidden_size: int, num_heads: int, conv_channels: int, *, conv_kernel: int = 4, conv_bias: bool = False,
        use_log_linear: bool = True, max_levels: int = DEFAULT_MAX_LEVELS, chunk_size: int = 64,
        level_activation: str = "softplus", layer_idx: int | None = None,
    ):
        check_positive_ints(hidden_size=hidden_size, num_heads=num_heads, chunk_size=chunk_size)
        check_bools(use_log_linear=use_log_linear, conv_bias=conv_bias)
        if not isinstance(conv_kernel, int) or isinstance(conv_kernel, bool) or conv_kernel < 0:
            raise ValueError(f"conv_kernel must be an int >= 0 (0: no short convolution), got {conv_kernel!r}")
        check_power_of_two(chunk_size=chunk_size)
        if layer_idx is not None:
            check_nonnegative_ints(layer_idx=layer_idx)
        super().__init__()
        self.hidden_size, self.num_heads, self.conv_channels = hidden_size, num_heads, conv_channels
        self.use_log_linear, self.max_levels, self.chunk_size = use_log_linear, max_levels, chunk_size
        self.layer_idx = layer_idx
        self.conv = ShortConvolution(conv_channels, conv_kernel, bias=conv_bias) if conv_kernel else None
        self.level_scales = (LevelScales(hidden_size, num_heads, max_levels, level_activation) if use_log_linear
                             else None)

    # --- what a variant provides -------------------------------------------------------------
    def conv_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """x: [Ntok, D] -> (channels to convolve [Ntok, C], other projections)."""
        raise NotImplementedError

    def op_inputs(self, conv_out: torch.Tensor, rest: dict[str, torch.Tensor]) -> MixerInputs:
        """short_conv's output [Ntok, C] and the other projections -> the op's per-token inputs."""
        raise NotImplementedError

    def output(self, o: torch.Tensor, inputs: MixerInputs) -> torch.Tensor:
        """o: [Ntok, H, V] -> [Ntok, D]."""
        raise NotImplementedError

    @property
    def scale(self) -> float:
        raise NotImplementedError

    @property
    def key_groups(self) -> int:
        """G, the q/k groups of ``op_inputs`` (one per head unless the variant's layer shares them)."""
        return self.num_heads

    def special_parameters(self) -> dict[str, torch.Tensor]:
        """Initial values of the parameters that are not plain Linear/Conv weights: {name: tensor}."""
        if self.level_scales is None:
            return {}
        return {"level_scales.level_scale": torch.ones_like(self.level_scales.level_scale)}

    @torch.no_grad()
    def init_special_parameters(self, copy=torch.Tensor.copy_) -> None:
        """Write ``special_parameters`` (``copy(param, value)``: the HF models pass transformers' guarded copy)."""
        for name, value in self.special_parameters().items():
            copy(self.get_parameter(name), value.to(self.get_parameter(name).device))

    # --- shared -------------------------------------------------------------------------------
    def short_conv(
        self, x: torch.Tensor, layout: TokenLayout, state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [Ntok, C]; state: [N, W-1, C] or None -> (SiLU(causal conv of x), the new state [N, W-1, C]); without
        a convolution (conv_kernel = 0) x itself and an empty state [N, 0, C]."""
        if self.conv is None:
            return x, x.new_zeros(layout.num_sequences, 0, x.shape[1])
        y, new_state = self.conv.step(x, layout, state)
        return F.silu(y), new_state

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None, state: MixerState | None = None, output_state: bool = False,
        layout: TokenLayout | None = None,
    ) -> tuple[torch.Tensor, MixerState | None]:
        """hidden_states: [B, T, D]; attention_mask: [B, >= T] (0 = padding, any side); cu_seqlens: [N + 1]
        (packed, B = 1); state: the MixerState of the N sequences (continue them). Returns ([B, T, D], state)."""
        B, T, _ = self._check_forward(hidden_states, state, output_state)
        if layout is None:
            layout = TokenLayout.build(B, T, attention_mask, cu_seqlens, hidden_states.device)
        x = layout.flatten(hidden_states)
        inputs, lam, conv_state = self._token_inputs(x, layout, state.conv if state is not None else None)
        o, levels, positions = self._attend(inputs, lam, layout, state, output_state)
        y = layout.unflatten(self.output(o, inputs))
        if not output_state:
            return y, None
        return y, MixerState(levels, positions, conv_state)

    def static_state(self, state: MixerState, level_dtype: torch.dtype | None = None,
                     key_window: int | None = None) -> StaticState:
        """Static buffers for ``step_`` shaped like ``state`` with the levels this layer can reach (max_levels
        log-linear, 1 plain), lazy where the variant allows it (log-scales in the step's compute dtype; the delta
        rule's key window of ``key_window`` tokens, None: KEY_WINDOW); the levels in ``level_dtype`` (None: the
        states' own; another one needs lazy levels). Not yet loaded."""
        levels = state.levels
        L = self.max_levels if self.level_scales is not None else 1
        dtype = level_dtype or levels.dtype
        log_scales, window = None, None
        N, H, K = levels.shape[0], levels.shape[2], levels.shape[3]
        if self.level_scales is not None and self.variant.lazy_levels:
            compute = torch.float64 if dtype == torch.float64 else torch.float32
            channels = (K,) if self.variant.gates[0].per_channel else ()
            log_scales = levels.new_zeros(N, L, H, *channels, dtype=compute)
            if self.variant.delta_rule:
                window = KeyWindow.empty_at(state.positions.to(levels.device), key_window or KEY_WINDOW,
                                            self.key_groups, H, K, levels.shape[4], compute)
        elif dtype != levels.dtype:
            what = "a plain layer" if self.level_scales is None else f"{self.variant.title}'s layer"
            raise ValueError(f"level_dtype={level_dtype} needs lazy levels (Variant.lazy_levels): {what} rewrites "
                             "its levels every token, and would round them every token")
        return StaticState(levels.new_empty(N, L, *levels.shape[2:], dtype=dtype), log_scales, window,
                           torch.empty_like(state.conv))

    @torch.no_grad()
    def step_(self, hidden_states: torch.Tensor, state: StaticState, positions: torch.Tensor) -> torch.Tensor:
        """One token of each of N sequences, the state updated in place: the step a CUDA graph replays
        (loglinear.models.graphs). No host sync, fixed shapes, nothing allocated outlives the call.

        hidden_states: [N, 1, D]; state: from ``static_state``, written in place (levels, log-scales, conv);
        positions: [N] int64 on the levels' device, each sequence's tokens so far (the caller advances them).
        Returns [N, 1, D].
        """
        layout = TokenLayout.build(hidden_states.shape[0], 1, device=hidden_states.device)
        x = layout.flatten(hidden_states)
        inputs, lam, conv_state = self._token_inputs(x, layout, state.conv)
        state.conv.copy_(conv_state)
        o, _ = decode_step(
            self.variant, inputs.q, inputs.k, inputs.v, inputs.gates, lam, state.levels, positions, self.scale,
            fenwick=self.level_scales is not None, l2norm_qk=self.l2norm_qk, out=state.levels,
            log_scales=state.log_scales, window=state.window,
        )
        return layout.unflatten(self.output(o, inputs))

    def _token_inputs(self, x: torch.Tensor, layout: TokenLayout, conv_state: torch.Tensor | None):
        """x: [Ntok, D] -> (MixerInputs, lambda [Ntok, H, max_levels] or None, the new conv state [N, W-1, C])."""
        conv_in, rest = self.conv_inputs(x)
        features, conv_state = self.short_conv(conv_in, layout, conv_state)
        lam = self.level_scales(x) if self.level_scales is not None else None
        return self.op_inputs(features, rest), lam, conv_state

    def _check_forward(self, x: object, state: object, output_state: object) -> torch.Size:
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            what = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"hidden_states must be a floating-point tensor [B, T, {self.hidden_size}], got {what}")
        if x.dim() != 3 or x.shape[2] != self.hidden_size or not x.shape[0] * x.shape[1]:
            raise ValueError(f"hidden_states must be [B, T, hidden_size = {self.hidden_size}] with B, T >= 1, "
                             f"got shape {tuple(x.shape)}")
        check_bools(output_state=output_state)
        if state is not None and not isinstance(state, MixerState):
            raise TypeError(f"state must be a MixerState (from output_state=True), got {type(state).__name__}")
        return x.shape

    def _attend(self, inputs: MixerInputs, lam, layout: TokenLayout, state: MixerState | None, output_state: bool):
        levels, positions = (state.levels, state.positions) if state is not None else (None, None)
        if layout.active is not None:  # rows without tokens in this call keep their state
            if not layout.active.numel():
                return inputs.v.new_zeros(inputs.v.shape), *self._fresh(state, layout, inputs)
            if state is not None:
                levels, positions = levels.index_select(0, layout.active.to(levels.device)), positions[layout.active]
        view = layout.op_view
        args = (
            self.variant.name, view(inputs.q), view(inputs.k), view(inputs.v),
            [view(inputs.gates[name]) for name in self.variant.gate_names], view(lam) if lam is not None else None,
            levels, positions, layout.cu_seqlens, self.scale, self.chunk_size, self.max_levels, output_state,
            self.l2norm_qk,
        )
        if torch.compiler.is_compiling():
            from loglinear.ops.custom_ops import fenwick_attention_op

            o, levels, positions = fenwick_attention_op(*args)
        else:
            o, levels, positions = fenwick_attention(*args)
        if output_state and layout.active is not None:
            levels, positions = self._scatter(levels, positions, state, layout, inputs)
        return layout.from_op_view(o), levels, positions

    def _fresh(self, state: MixerState | None, layout: TokenLayout, inputs: MixerInputs, n_levels: int = 1):
        """The state of all N sequences before this call: [N, L, H, K, V] levels (zeros if none) and positions."""
        if state is not None:
            return FenwickState(state.levels, state.positions).with_levels(n_levels).levels, state.positions
        N, H, K, V = layout.num_sequences, inputs.v.shape[1], inputs.q.shape[2], inputs.v.shape[2]
        dtype = torch.promote_types(inputs.v.dtype, torch.float32)
        return inputs.v.new_zeros(N, n_levels, H, K, V, dtype=dtype), torch.zeros(N, dtype=torch.int64)

    def _scatter(self, levels, positions, state, layout: TokenLayout, inputs: MixerInputs):
        """New states of the active sequences written into the states of all N."""
        all_levels, all_positions = self._fresh(state, layout, inputs, levels.shape[1])
        all_positions = all_positions.clone()
        all_positions[layout.active] = positions
        return all_levels.index_copy(0, layout.active.to(levels.device), levels.to(all_levels.dtype)), all_positions
