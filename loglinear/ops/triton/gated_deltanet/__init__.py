"""Log-linear Gated DeltaNet on fused Triton kernels: chunking.py (token geometry), local.py (chunk-local
WY/UT stage), scan.py (Fenwick delta scan), composed in backend.py."""
