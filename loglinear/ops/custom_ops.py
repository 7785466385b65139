"""torch.library custom ops, so torch.compile treats log-linear attention as one opaque graph node.

    loglinear::fenwick_attention       (o, levels', positions') = fenwick_attention(...)   (any backend)
    loglinear::fenwick_attention_bwd   its gradients, recomputed: the forward is re-run under autograd
                                       and differentiated (the backends' own backward does the work)

The forward is what the mixers call under torch.compile (see loglinear.layers.attention for the
arguments); eager calls skip the custom op and use native autograd. Output shapes must not depend on
data, so a log-linear output state always holds max_levels levels here (zero-padded; an eager cache
holds ceil(log2 T) + 1): a compiled decoder keeps static shapes and never recompiles as T grows.

    log_linear_mamba2 / log_linear_gated_deltanet   compile-friendly stateless versions of the public ops
                                                    (o only), for users who compile their own modules.
"""

from __future__ import annotations

import torch

from loglinear.layers.attention import fenwick_attention
from loglinear.state import FenwickState

__all__ = ["fenwick_attention_op", "log_linear_mamba2", "log_linear_gated_deltanet"]

_DIFF = ("q", "k", "v", "g", "beta", "level_scales", "levels")


def _state_dtype(q: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    return torch.float64 if torch.float64 in (q.dtype, v.dtype) else torch.float32


@torch.library.custom_op("loglinear::fenwick_attention", mutates_args=())
def fenwick_attention_op(
    variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
    level_scales: torch.Tensor | None, levels: torch.Tensor | None, positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, scale: float, chunk_size: int, max_levels: int, output_state: bool,
    l2norm_qk: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See loglinear.layers.attention.fenwick_attention (same arguments and results)."""
    o, new_levels, new_positions = fenwick_attention(
        variant, q, k, v, g, beta, level_scales, levels, positions, cu_seqlens, scale, chunk_size, max_levels,
        output_state, l2norm_qk,
    )
    if output_state and level_scales is not None:
        new_levels = FenwickState(new_levels, new_positions).with_levels(max_levels).levels
    return o, new_levels, new_positions


@fenwick_attention_op.register_fake
def _(variant, q, k, v, g, beta, level_scales, levels, positions, cu_seqlens, scale, chunk_size, max_levels,
      output_state, l2norm_qk):
    o = v.new_empty(v.shape)
    if not output_state:
        return o, v.new_empty(0), torch.empty(0, dtype=torch.int64)
    N = levels.shape[0] if levels is not None else (cu_seqlens.shape[0] - 1 if cu_seqlens is not None else v.shape[0])
    n_levels = 1 if level_scales is None else max_levels
    new_levels = v.new_empty(N, n_levels, v.shape[2], q.shape[3], v.shape[3], dtype=_state_dtype(q, v))
    return o, new_levels, torch.empty(N, dtype=torch.int64)


@torch.library.custom_op("loglinear::fenwick_attention_bwd", mutates_args=())
def _fenwick_attention_bwd(
    variant: str, grad_o: torch.Tensor, grad_levels: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None, level_scales: torch.Tensor | None,
    levels: torch.Tensor | None, positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float,
    chunk_size: int, max_levels: int, output_state: bool, l2norm_qk: bool,
) -> list[torch.Tensor]:
    """Gradients of (q, k, v, g, beta, level_scales, levels), the absent ones omitted."""
    inputs = (q, k, v, g, beta, level_scales, levels)
    present = [i for i, x in enumerate(inputs) if x is not None]

    def forward(*diff: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args = list(inputs)
        for i, x in zip(present, diff):
            args[i] = x
        o, new_levels, _ = fenwick_attention(
            variant, *args, positions, cu_seqlens, scale, chunk_size, max_levels, output_state, l2norm_qk,
        )
        return (o, new_levels) if grad_levels is not None else (o,)

    _, vjp = torch.func.vjp(forward, *[inputs[i] for i in present])
    return list(vjp((grad_o, grad_levels) if grad_levels is not None else (grad_o,)))


@_fenwick_attention_bwd.register_fake
def _(variant, grad_o, grad_levels, q, k, v, g, beta, level_scales, levels, *args):
    return [torch.empty_like(x) for x in (q, k, v, g, beta, level_scales, levels) if x is not None]


def _setup_context(ctx, inputs, output) -> None:
    (variant, q, k, v, g, beta, level_scales, levels, positions, cu_seqlens, *flags) = inputs
    ctx.variant, ctx.flags = variant, flags
    ctx.present = [x is not None for x in (beta, level_scales, levels, positions, cu_seqlens)]
    ctx.save_for_backward(q, k, v, g,
                          *[x for x in (beta, level_scales, levels, positions, cu_seqlens) if x is not None])


def _backward(ctx, grad_o, grad_levels, grad_positions):
    saved = list(ctx.saved_tensors)
    q, k, v, g = saved[:4]
    rest = iter(saved[4:])
    beta, level_scales, levels, positions, cu_seqlens = (next(rest) if p else None for p in ctx.present)
    output_state = ctx.flags[3]
    grads = iter(_fenwick_attention_bwd(
        ctx.variant, grad_o, grad_levels if output_state else None, q, k, v, g, beta, level_scales, levels,
        positions, cu_seqlens, *ctx.flags,
    ))
    per_input = [next(grads) if x is not None else None for x in (q, k, v, g, beta, level_scales, levels)]
    return (None, *per_input, None, None, None, None, None, None, None)


fenwick_attention_op.register_autograd(_backward, setup_context=_setup_context)


def log_linear_mamba2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, level_scales: torch.Tensor, *,
    scale: float | None = None, cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
) -> torch.Tensor:
    """loglinear.log_linear_mamba2 without states, as a custom op: o [B, T, H, V]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return fenwick_attention_op(
        "mamba2", q, k, v, g, None, level_scales, None, None, cu_seqlens, scale, chunk_size, 62, False, False
    )[0]


def log_linear_gated_deltanet(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    level_scales: torch.Tensor, *, scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False, chunk_size: int = 64,
) -> torch.Tensor:
    """loglinear.log_linear_gated_deltanet without states, as a custom op: o [B, T, H, V]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return fenwick_attention_op(
        "gated_deltanet", q, k, v, g, beta, level_scales, None, None, cu_seqlens, scale, chunk_size, 62, False,
        use_qk_l2norm,
    )[0]
