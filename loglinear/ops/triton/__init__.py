"""Fused Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1). Registers the "triton" backends."""

from loglinear.ops.api import register_backend

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

if triton is not None:
    from loglinear.ops.triton.mamba2 import mamba2_triton

    register_backend("mamba2", "triton", mamba2_triton)

    from loglinear.ops.triton.gated_deltanet import triton_backend as gated_deltanet_triton

    register_backend("gated_deltanet", "triton", gated_deltanet_triton)
