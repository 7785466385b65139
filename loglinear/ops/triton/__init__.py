"""Fused Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1). Registers the "triton" backends.

Layout: shared/ (launch config, tiles, numeric rules, head padding, device tables, the Fenwick level
cascade and in-chunk helpers), mamba2/ and gated_deltanet/ (one stage per file, composed in backend.py),
decode.py (the fused one-token step of every variant). GLA runs on mamba2/'s kernels: its per-channel decay is
their PER_CHANNEL switch.
"""

from loglinear.ops.backends import Backend, register_backend

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

if triton is not None:
    from loglinear.ops.triton.decode import decode_backend
    # aliases that are not the subpackages' names: `import loglinear.ops.triton.mamba2.backend as m` is the module
    from loglinear.ops.triton.gated_deltanet import backend as gdn_kernels
    from loglinear.ops.triton.mamba2 import backend as mamba2_kernels

    register_backend("mamba2", "triton", Backend(mamba2_kernels.backend, mamba2_kernels.supports, decode_backend,
                                                 plain=True, takes_raw_log_decays=True))
    register_backend("gated_deltanet", "triton",
                     Backend(gdn_kernels.backend, gdn_kernels.supports, decode_backend, plain=True,
                             takes_raw_log_decays=True))
    register_backend("gla", "triton", Backend(mamba2_kernels.backend, mamba2_kernels.supports, decode_backend,
                                              plain=True, takes_raw_log_decays=True))
