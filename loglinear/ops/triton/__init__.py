"""Fused Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1). Registers the "triton" backends."""

from loglinear.ops.backends import Backend, register_backend

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

if triton is not None:
    from loglinear.ops.triton import gated_deltanet, mamba2
    from loglinear.ops.triton.decode import decode_backend

    register_backend("mamba2", "triton", Backend(mamba2.mamba2_triton, mamba2.supports, decode_backend))
    register_backend("gated_deltanet", "triton",
                     Backend(gated_deltanet.triton_backend, gated_deltanet.supports, decode_backend))
