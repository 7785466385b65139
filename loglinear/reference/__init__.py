"""Exact, readable, slow references (float64 capable): materialized (quadratic) and recurrent forms.

``materialized`` / ``recurrent`` take any variant (loglinear.variants) and the generic op's arguments; the named
forms take the public ops' arguments (q, k: [B, T, G, K]; v: [B, T, H, V]; ...) and are
what every fast path is tested against.
"""

from loglinear.reference.api import (
    materialized,
    recurrent,
    log_linear_gated_deltanet_materialized,
    log_linear_gated_deltanet_recurrent,
    log_linear_mamba2_materialized,
    log_linear_mamba2_recurrent,
)

__all__ = [
    "materialized",
    "recurrent",
    "log_linear_mamba2_materialized",
    "log_linear_mamba2_recurrent",
    "log_linear_gated_deltanet_materialized",
    "log_linear_gated_deltanet_recurrent",
]
