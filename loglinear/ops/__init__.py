"""Public log-linear attention ops (see loglinear.ops.api)."""

from loglinear.ops.api import log_linear_gated_deltanet, log_linear_mamba2, register_backend, select_backend
from loglinear.ops import triton as _triton_backends  # noqa: F401  (registers the "triton" backends)

__all__ = ["log_linear_mamba2", "log_linear_gated_deltanet", "register_backend", "select_backend"]
