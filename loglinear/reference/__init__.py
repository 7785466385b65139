"""Exact, readable, slow references (float64 capable): materialized (quadratic) and recurrent forms.

The public entry points take the op's arguments (q, k: [B, T, G, K]; v: [B, T, H, V]; ...) and are
what every fast path is tested against.
"""

from loglinear.reference.api import (
    log_linear_gated_deltanet_materialized,
    log_linear_gated_deltanet_recurrent,
    log_linear_mamba2_materialized,
    log_linear_mamba2_recurrent,
)

__all__ = [
    "log_linear_mamba2_materialized",
    "log_linear_mamba2_recurrent",
    "log_linear_gated_deltanet_materialized",
    "log_linear_gated_deltanet_recurrent",
]
