"""Public log-linear attention ops (loglinear.ops.api) and their backends (loglinear.ops.backends)."""

from loglinear.ops.api import attention, log_linear_gated_deltanet, log_linear_gla, log_linear_mamba2
from loglinear.ops.backends import register_backend, select_backend
from loglinear.ops import triton as _triton_backends  # noqa: F401  (registers the "triton" backends)

__all__ = [
    "attention", "log_linear_mamba2", "log_linear_gated_deltanet", "log_linear_gla", "register_backend",
    "select_backend",
]
