"""loglinear: log-linear attention (Guo et al., 2025) for PyTorch -- log-linear Mamba-2, Gated DeltaNet and GLA."""

from loglinear import _auto
from loglinear.ops import log_linear_gated_deltanet, log_linear_gla, log_linear_mamba2
from loglinear.state import FenwickState

__version__ = "0.1.0"
__all__ = ["log_linear_mamba2", "log_linear_gated_deltanet", "log_linear_gla", "FenwickState", "__version__"]

# the model types "loglinear_mamba2" / "loglinear_gated_deltanet" / "loglinear_gla" in transformers' Auto classes,
# without importing transformers here (see loglinear._auto)
_auto.install()
