"""loglinear: log-linear attention (Guo et al., 2025) for PyTorch -- log-linear Mamba-2 and Gated DeltaNet."""

from loglinear.ops import log_linear_gated_deltanet, log_linear_mamba2
from loglinear.state import FenwickState

__version__ = "0.1.0"
__all__ = ["log_linear_mamba2", "log_linear_gated_deltanet", "FenwickState", "__version__"]
