"""Head shapes the kernels run at: narrow heads zero-padded up to the width they compute correctly at (run_padded),
wide values in slices whose state tiles fit an SM (run_value_slices)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from loglinear.inputs import OpInputs
from loglinear.state import FenwickState

HALF_MIN_HEAD_DIM = 64  # narrowest K / V the bf16/fp16 kernels run at on CUDA (min_head_dim)
FORCE_MIN_HEAD_DIM: int | None = None  # tests: pad heads to this width on any device and dtype

Kernels = Callable[[OpInputs], tuple[torch.Tensor, FenwickState | None]]


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


def _widen(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., D] zero-padded to [..., n]."""
    return F.pad(x, (0, n - x.shape[-1]))


def pad_head_dims(inp: OpInputs, K: int, V: int) -> OpInputs:
    """inp with q, k [B, T, G, K0] zero-padded to K columns, v [B, T, H, V0] to V, a per-channel gate
    [B, T, H, K0] (GLA's g) to K, the initial state's levels [N, L, H, K0, V0] to [N, L, H, K, V] (F.pad: the
    gradients come back sliced; scale stays).

    Exact for every variant: zero q / k columns add nothing to any q.k, k.k or row norm (GDN's l2norm),
    so the padded state rows see the identity transition (GDN: (I - beta k k^T) is the identity there; a
    padded channel's log-decay 0 keeps it as it is) and no deposit; zero v columns deposit nothing; both stay 0
    and feed only o's / the state's padded columns, which run_padded drops."""
    state = inp.initial_state
    if state is not None:
        levels = state.levels
        state = FenwickState(F.pad(levels, (0, V - levels.shape[-1], 0, K - levels.shape[-2])), state.positions)
    gates = {gate.name: _widen(inp.gates[gate.name], K) if gate.per_channel else inp.gates[gate.name]
             for gate in inp.variant.gates}
    return dataclasses.replace(inp, q=_widen(inp.q, K), k=_widen(inp.k, K), v=_widen(inp.v, V), gates=gates,
                               initial_state=state)


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


def run_value_slices(inp: OpInputs, width: int, kernels: Kernels) -> tuple[torch.Tensor, FenwickState | None]:
    """kernels(inp) -> (o [B, T, H, V], final state or None) on the value columns in ceil(V / width) slices of equal
    width (within one column), o and the final state's levels [N, L, H, K, V] joined again along V.

    Exact for every variant: a value column of o and of the state depends on q, k, the gates, lambda and that column
    of v and of the initial state alone (each variant's transition acts on the key side of the state: a decay, a
    per-key decay, (I - beta k k^T)); the gradients of the inputs every slice reads sum over the slices through
    autograd. Each slice runs the key-side work (q k^T, the gates' sums) again."""
    V = inp.v.shape[-1]
    if V <= width:
        return kernels(inp)
    state, n = inp.initial_state, -(-V // width)
    outs, finals = [], []
    for i in range(n):
        part = slice(i * V // n, (i + 1) * V // n)
        init = None if state is None else FenwickState(state.levels[..., part].contiguous(), state.positions)
        o, final = kernels(dataclasses.replace(inp, v=inp.v[..., part].contiguous(), initial_state=init))
        outs.append(o)
        finals.append(final)
    if finals[0] is None:
        return torch.cat(outs, -1), None
    return torch.cat(outs, -1), FenwickState(torch.cat([f.levels for f in finals], -1), finals[0].positions)
