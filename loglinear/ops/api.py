"""Public ops and backend dispatch.

Backends: "torch" (the chunkwise PyTorch path, any device, autograd) and "triton" (fused kernels, CUDA;
CPU tensors run them under TRITON_INTERPRET=1). Default: triton on CUDA where a variant registered it,
torch otherwise. LOGLINEAR_BACKEND=torch|triton forces one.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Callable

import torch

from loglinear.inputs import OpInputs, check_inputs, run_segments
from loglinear.ops.decode import fused_decode_applies, op_decode_step
from loglinear.ops.torch_chunk import GatedDeltaNetForm, Mamba2Form, chunk_scan
from loglinear.state import FenwickState

__all__ = ["log_linear_mamba2", "log_linear_gated_deltanet", "register_backend", "select_backend"]

Backend = Callable[[OpInputs, bool, int, bool], tuple[torch.Tensor, FenwickState | None]]
_BACKENDS: dict[str, dict[str, Backend]] = {"mamba2": {}, "gated_deltanet": {}}
_SUPPORTS: dict[str, dict[str, Callable[[OpInputs], bool]]] = {"mamba2": {}, "gated_deltanet": {}}


def register_backend(variant: str, name: str, fn: Backend, supports: Callable[[OpInputs], bool] | None = None) -> None:
    """Make ``fn(inputs, output_final_state, chunk_size, use_qk_l2norm)`` available as backend ``name``.
    ``supports(inputs)`` says whether fn takes a call (default: every call); calls it refuses run on "torch"."""
    _BACKENDS[variant][name] = fn
    _SUPPORTS[variant][name] = supports or (lambda inp: True)


def _backend(variant: str, inp: OpInputs) -> Backend:
    """The selected backend, or torch when the selected one does not support ``inp``."""
    name = select_backend(variant, inp.q.device)
    return _BACKENDS[variant][name if _SUPPORTS[variant][name](inp) else "torch"]


def select_backend(variant: str, device: torch.device) -> str:
    """The backend a call on ``device`` uses: LOGLINEAR_BACKEND if set, else triton on CUDA when registered."""
    forced = os.environ.get("LOGLINEAR_BACKEND")
    if forced:
        if forced not in ("torch", "triton"):
            raise ValueError(f"LOGLINEAR_BACKEND must be 'torch' or 'triton', got {forced!r}")
        if forced not in _BACKENDS[variant]:
            raise ValueError(f"backend {forced!r} is not available for {variant} (have {sorted(_BACKENDS[variant])})")
        return forced
    return "triton" if device.type == "cuda" and "triton" in _BACKENDS[variant] else "torch"


def _torch_backend(form, inp: OpInputs, output_final_state: bool, chunk_size: int, use_qk_l2norm: bool):
    core = lambda q, k, v, g, beta, lam, scale, levels, position: chunk_scan(  # noqa: E731
        form, q, k, v, g, beta, lam, scale, levels, position, chunk_size
    )
    return run_segments(inp, core, output_final_state, l2norm_qk=use_qk_l2norm)


register_backend("mamba2", "torch", partial(_torch_backend, Mamba2Form))
register_backend("gated_deltanet", "torch", partial(_torch_backend, GatedDeltaNetForm))


def _check_chunk_size(chunk_size: int) -> int:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool):
        raise TypeError(f"chunk_size must be an int (a power of two >= 1), got {type(chunk_size).__name__}")
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 1, got {chunk_size!r}")
    return chunk_size


def log_linear_mamba2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, level_scales: torch.Tensor, *,
    scale: float | None = None, initial_state: FenwickState | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Log-linear Mamba-2 attention.

        o_t = scale * sum_{s<=t} lambda_t[level(t, s)] * exp(G_t - G_s) * (q_t . k_s) * v_s

    q, k: [B, T, G, K]; v: [B, T, H, V] (H % G == 0); g: [B, T, H] log-decay <= 0;
    level_scales: [B, T, H, L] = lambda, L >= levels needed for the positions covered;
    scale: default K ** -0.5; initial_state: FenwickState continuing the sequences (positions go on);
    cu_seqlens: [N+1] packs N sequences into B = 1. Returns (o: [B, T, H, V] in v's dtype, state or None).
    """
    inp = check_inputs(q, k, v, g, None, level_scales, scale, initial_state, cu_seqlens, has_beta=False)
    chunk_size = _check_chunk_size(chunk_size)
    if fused_decode_applies(inp):
        return op_decode_step(inp, output_final_state, False)
    backend = _backend("mamba2", inp)
    return backend(inp, output_final_state, chunk_size, False)


def log_linear_gated_deltanet(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    level_scales: torch.Tensor, *, scale: float | None = None, initial_state: FenwickState | None = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Log-linear Gated DeltaNet attention.

        o_t = scale * sum_{s<=t} lambda_t[level(t, s)] * beta_s * (q_t^T P_{t,s} k_s) * v_s,
        P_{t,s} = A_t ... A_{s+1},  A_t = exp(g_t) (I - beta_t k_t k_t^T)

    Shapes as in log_linear_mamba2, plus beta: [B, T, H] in (0, 1). use_qk_l2norm normalises q and k
    over K inside the op.
    """
    inp = check_inputs(q, k, v, g, beta, level_scales, scale, initial_state, cu_seqlens, has_beta=True)
    chunk_size = _check_chunk_size(chunk_size)
    if fused_decode_applies(inp):
        return op_decode_step(inp, output_final_state, use_qk_l2norm)
    backend = _backend("gated_deltanet", inp)
    return backend(inp, output_final_state, chunk_size, use_qk_l2norm)
