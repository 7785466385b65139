"""Fused Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1). Registers the "triton" backends.

Layout: shared/ (launch config, tiles, numeric rules, head padding, device tables, the Fenwick level
cascade and in-chunk helpers), mamba2/ and gated_deltanet/ (one stage per file, composed in backend.py),
decode.py (the fused one-token step of both variants).
"""

from loglinear.ops.api import register_backend

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

if triton is not None:
    from loglinear.ops.triton.gated_deltanet import backend as gated_deltanet
    from loglinear.ops.triton.mamba2 import backend as mamba2

    register_backend("mamba2", "triton", mamba2.backend, supports=mamba2.supports)
    register_backend("gated_deltanet", "triton", gated_deltanet.backend, supports=gated_deltanet.supports)
