"""The references behind the op's signature: validation, GQA, varlen and states as in the public ops.

    materialized(variant, q, k, v, gates, level_scales, ...)   quadratic: O = scale (transfer * M^H) V
    recurrent(variant, q, k, v, gates, level_scales, ...)      token by token, with states (decoding semantics)

and the named forms of each variant (log_linear_mamba2_materialized, ...). level_scales=None is the plain
variant (lambda = 1; its state one level, the level states summed), as in the public ops.
"""

from __future__ import annotations

import torch

from loglinear.inputs import check_inputs, plain_over_levels, run_segments
from loglinear.reference import common
from loglinear.state import FenwickState
from loglinear.variants import GATED_DELTANET, MAMBA2, Variant, get

__all__ = [
    "materialized", "recurrent", "log_linear_mamba2_materialized", "log_linear_mamba2_recurrent",
    "log_linear_gated_deltanet_materialized", "log_linear_gated_deltanet_recurrent",
]


def materialized(
    variant: Variant | str, q, k, v, gates: dict[str, torch.Tensor], level_scales, *, scale=None, cu_seqlens=None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """Quadratic reference of any variant: o [B, T, H, V] (arguments as in loglinear.ops.attention; no state)."""
    variant = get(variant)
    inp = check_inputs(variant, q, k, v, gates, level_scales, scale, None, cu_seqlens)
    inp = inp.over_levels() if inp.plain else inp

    def core(q, k, v, gates, lam, scale, levels, position):
        transfer = variant.transfer_matrix(q, k, gates)
        return common.materialized(transfer, v, lam, scale), None

    return run_segments(inp, core, False, l2norm_qk=use_qk_l2norm)[0]


def recurrent(
    variant: Variant | str, q, k, v, gates: dict[str, torch.Tensor], level_scales, *, scale=None,
    initial_state=None, output_final_state=False, cu_seqlens=None, use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Recurrent (decoding) reference of any variant: (o [B, T, H, V], state)."""
    variant = get(variant)
    inp = check_inputs(variant, q, k, v, gates, level_scales, scale, initial_state, cu_seqlens)

    def core(q, k, v, gates, lam, scale, levels, position):
        positions = torch.full((q.shape[0],), position, dtype=torch.int64)
        o, S, _ = common.recurrent(variant, q, k, v, gates, lam, scale, levels, positions)
        return o, S

    run = lambda call, final: run_segments(call, core, final, l2norm_qk=use_qk_l2norm)  # noqa: E731
    return (plain_over_levels(run) if inp.plain else run)(inp, output_final_state)


def log_linear_mamba2_materialized(q, k, v, g, level_scales, *, scale=None, cu_seqlens=None) -> torch.Tensor:
    """Quadratic reference of log-linear Mamba-2: o [B, T, H, V] (see loglinear.log_linear_mamba2)."""
    return materialized(MAMBA2, q, k, v, {"g": g}, level_scales, scale=scale, cu_seqlens=cu_seqlens)


def log_linear_mamba2_recurrent(
    q, k, v, g, level_scales, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Recurrent (decoding) reference of log-linear Mamba-2: (o [B, T, H, V], state)."""
    return recurrent(MAMBA2, q, k, v, {"g": g}, level_scales, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def log_linear_gated_deltanet_materialized(
    q, k, v, g, beta, level_scales, *, scale=None, cu_seqlens=None, use_qk_l2norm=False,
) -> torch.Tensor:
    """Quadratic reference of log-linear Gated DeltaNet: o [B, T, H, V]."""
    return materialized(GATED_DELTANET, q, k, v, {"g": g, "beta": beta}, level_scales, scale=scale,
                        cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)


def log_linear_gated_deltanet_recurrent(
    q, k, v, g, beta, level_scales, *, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, use_qk_l2norm=False,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Recurrent (decoding) reference of log-linear Gated DeltaNet: (o [B, T, H, V], state)."""
    return recurrent(GATED_DELTANET, q, k, v, {"g": g, "beta": beta}, level_scales, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm)
