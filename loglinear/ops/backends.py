"""Backends of the ops, and the one place that chooses among them.

A backend runs a validated call (loglinear.inputs.OpInputs) of one variant:

    run(inputs, output_final_state, chunk_size, use_qk_l2norm) -> (o [B, T, H, V], FenwickState or None)
    supports(inputs) -> bool        False: this call runs on the torch backend instead (dtype, head size, device)
    plain: bool                     run takes plain calls (inputs.level_scales None) itself; otherwise the op
                                    runs them as lambda = 1 over the Fenwick levels (loglinear.ops.api)
    takes_raw_log_decays: bool      run takes the log-decay gates as the caller gave them: it floors them where it
                                    reads them, and checks a per-channel one for NaN and +inf, reporting its peak
                                    to inputs.report_finite when set (the op's finite check reads the others);
                                    otherwise the op floors them in torch first (loglinear.ops.finite)
    decode(variant, q, k, v, gates, level_scales, levels, positions, scale, *, fenwick, l2norm_qk, out, log_scales)
                                    its one-token step (loglinear.ops.decode), or None: the torch step

"torch" (the chunkwise PyTorch path, any device, autograd) serves every variant; "triton" (fused kernels, CUDA;
CPU tensors under TRITON_INTERPRET=1) is registered per variant by loglinear.ops.triton. The choice: the
``backend=`` argument of the op if given, else LOGLINEAR_BACKEND if set, else triton on CUDA where the variant
registered it, else torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from loglinear.inputs import OpInputs, run_segments
from loglinear.ops.torch_chunk import chunk_scan
from loglinear.state import FenwickState
from loglinear.variants import Variant

__all__ = ["Backend", "BACKEND_NAMES", "register_backend", "select_backend", "backend_for", "torch_chunk_backend"]

BACKEND_NAMES = ("torch", "triton")
Run = Callable[[OpInputs, bool, int, bool], tuple[torch.Tensor, FenwickState | None]]


@dataclass(frozen=True)
class Backend:
    """A registered backend of one variant (see the module docstring)."""

    run: Run
    supports: Callable[[OpInputs], bool] = lambda inputs: True
    decode: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    plain: bool = False
    takes_raw_log_decays: bool = False


def torch_chunk_backend(
    inp: OpInputs, output_final_state: bool, chunk_size: int, use_qk_l2norm: bool,
) -> tuple[torch.Tensor, FenwickState | None]:
    """The torch backend: the Fenwick chunk scan over the variant's chunk form, segment by segment."""
    form = inp.variant.form

    def core(q, k, v, gates, lam, scale, levels, position):
        return chunk_scan(form, q, k, v, gates, lam, scale, levels, position, chunk_size)

    return run_segments(inp, core, output_final_state, l2norm_qk=use_qk_l2norm)


_TORCH = Backend(torch_chunk_backend)
_REGISTERED: dict[tuple[str, str], Backend] = {}


def register_backend(variant: str, name: str, backend: Backend) -> None:
    """Make ``backend`` available as ``name`` ("triton") for the variant named ``variant``."""
    if name not in BACKEND_NAMES or name == "torch":
        raise ValueError(f"backend name must be one of {BACKEND_NAMES[1:]}, got {name!r}")
    _REGISTERED[variant, name] = backend


def _available(variant: Variant) -> list[str]:
    return ["torch"] + [name for (v, name) in _REGISTERED if v == variant.name]


def select_backend(variant: Variant, device: torch.device, backend: str | None = None) -> str:
    """The backend a call of ``variant`` on ``device`` uses (see the module docstring)."""
    forced, what = (backend, "backend") if backend is not None else (os.environ.get("LOGLINEAR_BACKEND"),
                                                                      "LOGLINEAR_BACKEND")
    if forced:
        if forced not in BACKEND_NAMES:
            raise ValueError(f"{what} must be 'torch' or 'triton', got {forced!r}")
        if forced not in _available(variant):
            raise ValueError(f"backend {forced!r} is not available for {variant.name} (have {_available(variant)})")
        return forced
    return "triton" if device.type == "cuda" and (variant.name, "triton") in _REGISTERED else "torch"


def backend_for(variant: Variant, name: str) -> Backend:
    """The Backend called ``name`` (from select_backend) of ``variant``."""
    return _TORCH if name == "torch" else _REGISTERED[variant.name, name]
