"""The chunk-local triangular inverse of the Gated DeltaNet kernels (interpreter on CPU, or CUDA)."""

import torch
import triton
import triton.language as tl

from helpers import assert_close
from loglinear.ops.triton.gated_deltanet.local import unit_lower_inverse


@triton.jit
def _inverse_kernel(a_ptr, t_ptr, C: tl.constexpr):
    rc = tl.arange(0, C)
    offs = rc[:, None] * C + rc[None, :]
    tl.store(t_ptr + offs, unit_lower_inverse(tl.load(a_ptr + offs), C))


def test_triangular_inverse_stable_for_near_parallel_keys():
    """The chunk's (I + A)^-1 at C = 64 with near-parallel unit keys and beta near 1 (as in early training):
    exact to fp32 level. Summing powers of A (the earlier repeated squaring) is off by ~1e3 here in fp32
    and gave NaN on the GPU in tf32."""
    C = 64
    k = torch.nn.functional.normalize(torch.randn(1, 16, dtype=torch.float64) + 0.05 * torch.randn(C, 16), dim=-1)
    beta = 0.6 + 0.35 * torch.rand(C, dtype=torch.float64)
    G = torch.cumsum(-0.02 * torch.rand(C, dtype=torch.float64), 0)
    A = torch.tril(beta[:, None] * torch.exp(G[:, None] - G[None, :]) * (k @ k.T), -1)
    out = torch.full((C, C), float("nan"))
    _inverse_kernel[(1,)](A.float(), out, C)
    exact = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A)
    assert_close(out.double(), exact, 1e-5, "(I + A)^-1")
