"""Log-linear Mamba-2 on fused Triton kernels: fwd.py (chunk-level scan), chunk.py (chunk-parallel kernels),
bwd.py (reverse scan), composed in backend.py."""
