"""The references behind the op's signature: validation, GQA, varlen and states as in the public ops."""

from __future__ import annotations

import torch

from loglinear.inputs import check_inputs, run_segments
from loglinear.reference import gated_deltanet, mamba2
from loglinear.state import FenwickState


def _no_state(levels: torch.Tensor | None, position: int) -> None:
    if levels is not None or position:
        raise ValueError("the materialized reference takes no initial_state; use the recurrent one")


def _materialized_core(form):
    def core(q, k, v, g, beta, lam, scale, levels, position):
        _no_state(levels, position)
        return form(q, k, v, g, beta, lam, scale), None

    return core


def _recurrent_core(form):
    def core(q, k, v, g, beta, lam, scale, levels, position):
        positions = torch.full((q.shape[0],), position, dtype=torch.int64)
        o, S, _ = form(q, k, v, g, beta, lam, scale, levels, positions)
        return o, S

    return core


_m2_mat = _materialized_core(lambda q, k, v, g, beta, lam, scale: mamba2.materialized(q, k, v, g, lam, scale))
_m2_rec = _recurrent_core(
    lambda q, k, v, g, beta, lam, scale, lv, pos: mamba2.recurrent(q, k, v, g, lam, scale, lv, pos)
)
_gdn_mat = _materialized_core(gated_deltanet.materialized)
_gdn_rec = _recurrent_core(gated_deltanet.recurrent)


def log_linear_mamba2_materialized(q, k, v, g, level_scales, *, scale=None, cu_seqlens=None) -> torch.Tensor:
    """Quadratic reference of log-linear Mamba-2: o [B, T, H, V] (see loglinear.log_linear_mamba2)."""
    inp = check_inputs(q, k, v, g, None, level_scales, scale, None, cu_seqlens, has_beta=False)
    return run_segments(inp, _m2_mat, False)[0]


def log_linear_mamba2_recurrent(
    q, k, v, g, level_scales, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Recurrent (decoding) reference of log-linear Mamba-2: (o [B, T, H, V], state)."""
    inp = check_inputs(q, k, v, g, None, level_scales, scale, initial_state, cu_seqlens, has_beta=False)
    return run_segments(inp, _m2_rec, output_final_state)


def log_linear_gated_deltanet_materialized(
    q, k, v, g, beta, level_scales, *, scale=None, cu_seqlens=None, use_qk_l2norm=False,
) -> torch.Tensor:
    """Quadratic reference of log-linear Gated DeltaNet: o [B, T, H, V]."""
    inp = check_inputs(q, k, v, g, beta, level_scales, scale, None, cu_seqlens, has_beta=True)
    return run_segments(inp, _gdn_mat, False, l2norm_qk=use_qk_l2norm)[0]


def log_linear_gated_deltanet_recurrent(
    q, k, v, g, beta, level_scales, *, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, use_qk_l2norm=False,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Recurrent (decoding) reference of log-linear Gated DeltaNet: (o [B, T, H, V], state)."""
    inp = check_inputs(q, k, v, g, beta, level_scales, scale, initial_state, cu_seqlens, has_beta=True)
    return run_segments(inp, _gdn_rec, output_final_state, l2norm_qk=use_qk_l2norm)
