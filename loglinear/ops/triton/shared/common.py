"""Small pieces every kernel family uses: the interpreter switch, kernel-output allocation (NaN-poisoned in
tests), tile sides, the per-group gradient sum, and a register-vector pick."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_POISON = False

# Scan kernels take these as plain runtime ints (no recompile per sequence length or head count);
# K and V stay specialised (their divisibility gives vectorised loads).
SCAN_RUNTIME_ARGS = ["tokens", "H", "G", "L", "J"]
MAX_CHUNK_LEVELS = 32  # decay-vector length of the scans: T up to 2^32 chunks


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def set_poison(enabled: bool) -> None:
    """Tests: fill every buffer a kernel writes with NaN before it runs, to catch unwritten memory."""
    global _POISON
    _POISON = enabled


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised kernel output (NaN-filled when poisoning is on)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if _POISON else out


def group_sum(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    """Gradients per value head -> per q/k group: x [..., H, K] with H on `dim` -> [..., groups, K], the
    heads of each group summed in fp32 (x itself when groups == H)."""
    heads = x.shape[dim]
    if groups == heads:
        return x
    return x.unflatten(dim, (groups, heads // groups)).sum(dim + 1, dtype=torch.float32)


def next_pow2(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum) (tl.dot needs tile sides >= 16)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


@triton.jit
def heads_fastest(H):
    """program_id(0) of a grid (R * H,) as (row r (int64), head h): program r * H + h. The chunk kernels launch so,
    heads varying fastest, so that the heads of a chunk run side by side and share its q / k tiles (one group's)
    in L2."""
    pid = tl.program_id(0)
    return (pid // H).to(tl.int64), pid % H


@triton.jit
def pick(vec, idx, j):
    """vec[j] of a register vector (idx = arange over its length)."""
    return tl.sum(tl.where(idx == j, vec, 0.0), 0)
