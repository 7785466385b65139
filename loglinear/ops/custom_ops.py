"""torch.library custom ops, so torch.compile treats log-linear attention as one opaque graph node.

    loglinear::fenwick_attention       (o, levels', positions') = fenwick_attention(...)   (any variant, backend)
    loglinear::fenwick_attention_bwd   its gradients, recomputed: the forward is re-run under autograd
                                       and differentiated (the backends' own backward does the work)

The forward is what the mixers call under torch.compile (see loglinear.ops.stateful for the arguments);
eager calls skip the custom op and use native autograd. Output shapes must not depend on data, so a
log-linear output state always holds max_levels levels here (zero-padded; an eager cache holds
ceil(log2 T) + 1): a compiled decoder keeps static shapes and never recompiles as T grows.

    attention(variant, q, k, v, gates, level_scales, ...)   a compile-friendly stateless version of the public
                                                             op (o only), for users who compile their own modules.
"""

from __future__ import annotations

import torch

from loglinear.ops.stateful import fenwick_attention
from loglinear.state import FenwickState
from loglinear.variants import Variant, get

__all__ = ["fenwick_attention_op", "attention"]


def _state_dtype(q: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    return torch.float64 if torch.float64 in (q.dtype, v.dtype) else torch.float32


@torch.library.custom_op("loglinear::fenwick_attention", mutates_args=())
def fenwick_attention_op(
    variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: list[torch.Tensor],
    level_scales: torch.Tensor | None, levels: torch.Tensor | None, positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, scale: float, chunk_size: int, max_levels: int, output_state: bool,
    l2norm_qk: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See loglinear.ops.stateful.fenwick_attention (same arguments and results)."""
    o, new_levels, new_positions = fenwick_attention(
        variant, q, k, v, gates, level_scales, levels, positions, cu_seqlens, scale, chunk_size, max_levels,
        output_state, l2norm_qk,
    )
    if output_state and level_scales is not None:
        new_levels = FenwickState(new_levels, new_positions).with_levels(max_levels).levels
    return o, new_levels, new_positions


@fenwick_attention_op.register_fake
def _(variant, q, k, v, gates, level_scales, levels, positions, cu_seqlens, scale, chunk_size, max_levels,
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
    v: torch.Tensor, gates: list[torch.Tensor], level_scales: torch.Tensor | None, levels: torch.Tensor | None,
    positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float, chunk_size: int,
    max_levels: int, output_state: bool, l2norm_qk: bool,
) -> list[torch.Tensor]:
    """Gradients of (q, k, v, *gates, level_scales, levels), the absent ones omitted."""
    inputs = (q, k, v, *gates, level_scales, levels)
    present = [i for i, x in enumerate(inputs) if x is not None]
    n_gates = len(gates)

    def forward(*diff: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args = list(inputs)
        for i, x in zip(present, diff):
            args[i] = x
        q, k, v, *rest = args
        o, new_levels, _ = fenwick_attention(
            variant, q, k, v, rest[:n_gates], *rest[n_gates:], positions, cu_seqlens, scale, chunk_size, max_levels,
            output_state, l2norm_qk,
        )
        return (o, new_levels) if grad_levels is not None else (o,)

    _, vjp = torch.func.vjp(forward, *[inputs[i] for i in present])
    return list(vjp((grad_o, grad_levels) if grad_levels is not None else (grad_o,)))


@_fenwick_attention_bwd.register_fake
def _(variant, grad_o, grad_levels, q, k, v, gates, level_scales, levels, *args):
    return [torch.empty_like(x) for x in (q, k, v, *gates, level_scales, levels) if x is not None]


def _setup_context(ctx, inputs, output) -> None:
    (variant, q, k, v, gates, level_scales, levels, positions, cu_seqlens, *flags) = inputs
    ctx.variant, ctx.flags, ctx.n_gates = variant, flags, len(gates)
    ctx.present = [x is not None for x in (level_scales, levels, positions, cu_seqlens)]
    ctx.save_for_backward(q, k, v, *gates, *[x for x in (level_scales, levels, positions, cu_seqlens) if x is not None])


def _backward(ctx, grad_o, grad_levels, grad_positions):
    saved = list(ctx.saved_tensors)
    q, k, v = saved[:3]
    gates = saved[3 : 3 + ctx.n_gates]
    rest = iter(saved[3 + ctx.n_gates :])
    level_scales, levels, positions, cu_seqlens = (next(rest) if p else None for p in ctx.present)
    output_state = ctx.flags[3]
    grads = iter(_fenwick_attention_bwd(
        ctx.variant, grad_o, grad_levels if output_state else None, q, k, v, gates, level_scales, levels,
        positions, cu_seqlens, *ctx.flags,
    ))
    dq, dk, dv = next(grads), next(grads), next(grads)
    dgates = [next(grads) for _ in gates]
    dlam, dlevels = (next(grads) if x is not None else None for x in (level_scales, levels))
    return None, dq, dk, dv, dgates, dlam, dlevels, None, None, None, None, None, None, None


fenwick_attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(
    variant: Variant | str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor],
    level_scales: torch.Tensor, *, scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False, chunk_size: int = 64,
) -> torch.Tensor:
    """loglinear.ops.attention without states, as a custom op: o [B, T, H, V]."""
    variant = get(variant)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return fenwick_attention_op(
        variant.name, q, k, v, [gates[name] for name in variant.gate_names], level_scales, None, None, cu_seqlens,
        scale, chunk_size, 62, False, use_qk_l2norm,
    )[0]
