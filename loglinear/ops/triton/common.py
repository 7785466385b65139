"""Pieces shared by the fused Triton kernels of every variant.

How a variant plugs in (mamba2_fwd.py / mamba2_bwd.py are the worked example):

  * Sequences are ranges ``[bos[n], eos[n])`` of one flat token axis (a dense batch is flattened, varlen
    is already flat); range n starts at the absolute, chunk-aligned chunk index ``chunk0[n]``. One program
    handles one (sequence, value head) and walks its chunks; q/k are read from group ``h // (H // G)``
    (no expanded copies).
  * ``load_rows`` / ``store_rows`` move a chunk of C tokens of a [tokens, heads, D] tensor (rows past
    ``eos`` read as 0, so padding tokens have g = 0: identity transitions); ``load_column`` reads one
    level of lambda for the chunk.
  * The chunk-level Fenwick states of all levels live in one fp32 buffer [N, J, H, K, V] (levels.py):
    the forward cascade (read every live level, decay lazily, merge at ctz(chunk + 1)) and its transpose
    (split, decay, accumulate reads) are jit helpers; a variant supplies only what a chunk reads from a
    level (its readout GEMM), what it deposits, and its transition (a scalar decay for Mamba-2, folded
    into the lazy per-level log-decays).
  * ``intra_levels`` / ``level_weights`` (intra.py) build the in-chunk level mask Lambda[t, s].
  * ``launch_options`` picks num_warps / num_stages, with one fixed config under TRITON_INTERPRET=1 (no device
    queries, no autotune benchmarking on CPU tensors).
  * ``run_padded`` runs a backend's kernels on heads zero-padded to ``min_head_dim`` (bf16/fp16 on CUDA: 64).
  * ``device_table`` puts a small index table built from Python values on the device without a synchronising
    copy; ``table_cache`` memoises the functions that build them (a bounded LRU keyed by their arguments), so
    that steady-state calls copy nothing from the host.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loglinear.inputs import OpInputs
from loglinear.state import FenwickState

__all__ = [
    "SCAN_RUNTIME_ARGS", "MAX_CHUNK_LEVELS", "interpreting", "alloc", "next_pow2", "dot_precision",
    "launch_options", "set_poison", "split_block", "load_rows", "store_rows", "load_column", "pick",
    "load_chunk_qk", "min_head_dim", "pad_head_dims", "run_padded", "device_table", "table_cache", "TABLE_CACHE_SIZE",
]

_POISON = False

# Scan kernels take these as plain runtime ints (no recompile per sequence length or head count);
# K and V stay specialised (their divisibility gives vectorised loads).
SCAN_RUNTIME_ARGS = ["tokens", "H", "G", "L", "J"]
MAX_CHUNK_LEVELS = 32  # decay-vector length of the scans: T up to 2^32 chunks
HALF_MIN_HEAD_DIM = 64  # narrowest K / V the bf16/fp16 kernels run at on CUDA (min_head_dim)
FORCE_MIN_HEAD_DIM: int | None = None  # tests: pad heads to this width on any device and dtype
TABLE_CACHE_SIZE = 64  # entries of each table_cache: distinct shapes / positions a run cycles through

Fn = TypeVar("Fn", bound=Callable)


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


def device_table(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (a Python sequence, nested for more dims, or a CPU tensor) as a ``dtype`` tensor on ``device``.
    On CUDA it is staged in pinned memory and copied without blocking the host (the caching host allocator
    keeps the pinned block until the copy has run), so it does not synchronise as a pageable copy does."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def table_cache(maxsize: int = TABLE_CACHE_SIZE) -> Callable[[Fn], Fn]:
    """Decorator: memoise a function of hashable arguments (ints, tuples, dtypes, devices) that builds small
    host or device tables (functools.lru_cache, at most maxsize entries, least recently used dropped).
    The cached results are shared between calls: callers must not modify them."""
    return functools.lru_cache(maxsize=maxsize)


def group_sum(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    """Gradients per value head -> per q/k group: x [..., H, K] with H on `dim` -> [..., groups, K], the
    heads of each group summed in fp32 (x itself when groups == H)."""
    heads = x.shape[dim]
    if groups == heads:
        return x
    return x.unflatten(dim, (groups, heads // groups)).sum(dim + 1, dtype=torch.float32)


def split_block(block: int) -> int:
    """The block a kernel splits a K or V tile of side ``block`` into (halves, >= 16 for tl.dot)."""
    return max(16, block // 2)


def next_pow2(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum) (tl.dot needs tile sides >= 16)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep fp32 products (no tf32); bf16/fp16 products accumulate in fp32 anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_options(block_k: int, block_v: int) -> dict[str, int]:
    """num_warps / num_stages for a one-program-per-(sequence, head, block) scan kernel.

    Fixed under the interpreter; on the GPU, 4 warps up to a [128, 32] fp32 state tile, 8 above."""
    if interpreting():
        return {"num_warps": 1, "num_stages": 1}
    return {"num_warps": 8 if block_k * block_v > 128 * 32 else 4, "num_stages": 2}


def min_head_dim(dtype: torch.dtype, device: torch.device) -> int:
    """The narrowest K and V the kernels get for operands of ``dtype`` on ``device`` (narrower heads are
    zero-padded up to it by run_padded; 0: no padding).

    bf16/fp16 on CUDA: 64. Measured 2026-11-29 on an H200 with torch 2.11 / triton 3.6
    (``bench_ops.py --check``, B = 64, T = 256, H = G = 1, against the torch chunk path): with a head dim
    below 64 (tile sides 16 / 32) the 16-bit kernels miscompute, Mamba-2 at K = 64, V = 32 gives NaN dk /
    dg and dv 0.3 off, Gated DeltaNet at K = 16, V = 32 dk / dg / dbeta 5-7e-2 off; fp32, and bf16 with
    K, V >= 64, are fine. fla guards a related Hopper miscompile (wgmma with N = 32) below triton 3.7.1;
    not yet measured on newer triton or other GPUs, so the rule holds for every CUDA run.
    FORCE_MIN_HEAD_DIM (tests: the padded path on CPU under the interpreter) overrides the rule."""
    if FORCE_MIN_HEAD_DIM is not None:
        return FORCE_MIN_HEAD_DIM
    return HALF_MIN_HEAD_DIM if dtype in (torch.bfloat16, torch.float16) and device.type == "cuda" else 0


def pad_head_dims(inp: OpInputs, K: int, V: int) -> OpInputs:
    """inp with q, k [B, T, G, K0] zero-padded to K columns, v [B, T, H, V0] to V, the initial state's
    levels [N, L, H, K0, V0] to [N, L, H, K, V] (F.pad: the gradients come back sliced; scale stays).

    Exact for both variants: zero q / k columns add nothing to any q.k, k.k or row norm (GDN's l2norm),
    so the padded state rows see the identity transition (GDN: (I - beta k k^T) is the identity there)
    and no deposit; zero v columns deposit nothing; both stay 0 and feed only o's / the state's padded
    columns, which run_padded drops."""
    state = inp.initial_state
    if state is not None:
        levels = state.levels
        state = FenwickState(F.pad(levels, (0, V - levels.shape[-1], 0, K - levels.shape[-2])), state.positions)
    widen = lambda x, n: F.pad(x, (0, n - x.shape[-1]))  # noqa: E731
    return dataclasses.replace(inp, q=widen(inp.q, K), k=widen(inp.k, K), v=widen(inp.v, V), initial_state=state)


Kernels = Callable[[OpInputs], tuple[torch.Tensor, FenwickState | None]]


def run_padded(inp: OpInputs, minimum: int, kernels: Kernels) -> tuple[torch.Tensor, FenwickState | None]:
    """kernels(inp) -> (o [B, T, H, V], final state or None), with K and V below ``minimum`` zero-padded up
    to it (pad_head_dims) and o and the state's levels [N, L, H, K, V] sliced back to the caller's K, V."""
    K, V = inp.q.shape[-1], inp.v.shape[-1]
    if min(K, V) >= minimum:
        return kernels(inp)
    o, state = kernels(pad_head_dims(inp, max(K, minimum), max(V, minimum)))
    if state is not None:
        state = FenwickState(state.levels[..., :K, :V].contiguous(), state.positions)
    return o[..., :V].contiguous(), state


@triton.jit
def load_rows(ptr, t, valid, head, HEADS, D, cols, BD: tl.constexpr):
    """x[t, head, :D] of a contiguous [tokens, HEADS, D] tensor for the C token indices t -> [C, BD] (0 outside)."""
    offs = (t * HEADS + head)[:, None] * D + cols[None, :]
    return tl.load(ptr + offs, mask=valid[:, None] & (cols[None, :] < D), other=0.0)


@triton.jit
def load_chunk_qk(q, k, t, valid, grp, G, K, kk, BK: tl.constexpr):
    """The chunk's q and k rows of group grp (full width BK) from [tokens, G, K] tensors -> [C, BK] each (0 outside)."""
    qc = load_rows(q, t, valid, grp, G, K, kk, BK)
    kc = load_rows(k, t, valid, grp, G, K, kk, BK)
    return qc, kc


@triton.jit
def store_rows(ptr, x, t, valid, head, HEADS, D, cols):
    """x[t, head, :D] = x (rows with valid, columns < D)."""
    offs = (t * HEADS + head)[:, None] * D + cols[None, :]
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < D))


@triton.jit
def load_column(ptr, t, valid, head, HEADS, L, level):
    """lambda[t, head, level] of a [tokens, HEADS, L] tensor -> [C] fp32 (0 for level >= L or invalid rows).

    Per-level loads measured faster than one [C, L] tile plus register column picks (NOTES.md, v1)."""
    ok = valid & ((t * 0 + level) < L)
    return tl.load(ptr + (t * HEADS + head) * L + level, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def pick(vec, idx, j):
    """vec[j] of a register vector (idx = arange over its length)."""
    return tl.sum(tl.where(idx == j, vec, 0.0), 0)
