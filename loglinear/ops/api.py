"""The public ops: one generic entry point over the variant registry, and one named function per variant.

    attention(variant, q, k, v, gates, level_scales, ...)   any registered variant (loglinear.variants)
    log_linear_mamba2(q, k, v, g, level_scales, ...)        = attention("mamba2", ..., {"g": g}, ...)
    log_linear_gated_deltanet(q, k, v, g, beta, ...)        = attention("gated_deltanet", ..., {"g", "beta"}, ...)
    log_linear_gla(q, k, v, g, level_scales, ...)           = attention("gla", ..., {"g": g}, ...)  (g per channel)

Every call is validated (loglinear.inputs), then runs on the backend loglinear.ops.backends chooses, or on the
one-token decode step when it applies (one token per sequence after a state, no gradient needed). A NaN or an
infinity in the inputs spoils only the outputs at and after it, and every log-decay gate is floored (in torch
before the backend runs, or by a backend that floors them where it reads them; loglinear.ops.finite).

level_scales=None is the variant's plain linear attention (lambda = 1: plain Mamba-2 / SSD, Gated DeltaNet, GLA)
with a one-level state. A backend with a plain path runs it (the Mamba-2 and Gated DeltaNet kernels); elsewhere it
runs as lambda = 1 over the Fenwick levels, whose final levels are summed (with lambda = 1 only their sum is ever
read; loglinear.inputs.plain_over_levels).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from loglinear.inputs import OpInputs, check_bools, check_inputs, plain_over_levels
from loglinear.ops.backends import backend_for, select_backend, torch_chunk_backend
from loglinear.ops.decode import fused_decode_applies, op_decode_step
from loglinear.ops.finite import contained, finite_check, floor_log_decays
from loglinear.state import FenwickState
from loglinear.variants import GATED_DELTANET, GLA, MAMBA2, Variant, get

__all__ = ["attention", "log_linear_mamba2", "log_linear_gated_deltanet", "log_linear_gla"]


def _check_chunk_size(chunk_size: int) -> int:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool):
        raise TypeError(f"chunk_size must be an int (a power of two >= 1), got {type(chunk_size).__name__}")
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 1, got {chunk_size!r}")
    return chunk_size


def attention(
    variant: Variant | str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor],
    level_scales: torch.Tensor | None, *, scale: float | None = None, initial_state: FenwickState | None = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False,
    chunk_size: int = 64, backend: str | None = None,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Log-linear attention of any registered variant.

        o_t = scale * sum_{s<=t} lambda_t[level(t, s)] * (q_t^T P_{t,s} k~_s) * v_s    (P, k~: the variant's)

    q, k: [B, T, G, K]; v: [B, T, H, V] (H % G == 0); gates: the variant's per-token inputs {name: [B, T, H]}
    (a per-channel gate, GLA's g: [B, T, H, K]); level_scales: [B, T, H, L] = lambda, L >= levels needed for the
    positions covered, or None: plain (lambda = 1, the state one level [N, 1, H, K, V]); scale: default K ** -0.5;
    initial_state: FenwickState continuing the sequences (positions go on);
    cu_seqlens: [N+1] packs N sequences into B = 1; use_qk_l2norm: normalise q and k over K inside the op;
    chunk_size: any power of two; backend: "torch" | "triton" | None (LOGLINEAR_BACKEND if set, else triton on
    CUDA). Returns (o: [B, T, H, V] in v's dtype, the final state or None).

    A NaN or an infinity in k, v or a gate at token t makes the outputs of that head from t on, and its final
    state, NaN; one in q or level_scales only the output at t; all other outputs (and their gradients) are exactly
    those without it. A log-decay gate g = -inf is a hard reset (loglinear.ops.finite).
    """
    variant = get(variant)
    inp = check_inputs(variant, q, k, v, gates, level_scales, scale, initial_state, cu_seqlens)
    chunk_size = _check_chunk_size(chunk_size)
    check_bools(output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)
    name = select_backend(variant, q.device, backend)
    if fused_decode_applies(inp):
        return op_decode_step(floor_log_decays(inp), output_final_state, use_qk_l2norm, name)
    chosen = backend_for(variant, name)
    supported = chosen.supports(inp)
    backend_run = chosen.run if supported else torch_chunk_backend
    raw_gates = supported and chosen.takes_raw_log_decays
    if not raw_gates:
        inp = floor_log_decays(inp)
    if inp.plain and not (supported and chosen.plain):
        backend_run = plain_over_levels(backend_run)

    def run(call: OpInputs) -> tuple[torch.Tensor, FenwickState | None]:
        return backend_run(call, output_final_state, chunk_size, use_qk_l2norm)

    finite = finite_check(inp, raw_log_decays=raw_gates)
    o, state = run(replace(inp, report_finite=finite.report if finite is not None else None))
    if finite is None or finite():
        return o, state
    return contained(inp, run, output_final_state) or (o, state)


def log_linear_mamba2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, level_scales: torch.Tensor | None, *,
    scale: float | None = None, initial_state: FenwickState | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64, backend: str | None = None,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Log-linear Mamba-2 attention.

        o_t = scale * sum_{s<=t} lambda_t[level(t, s)] * exp(G_t - G_s) * (q_t . k_s) * v_s

    q, k: [B, T, G, K]; v: [B, T, H, V] (H % G == 0); g: [B, T, H] log-decay <= 0;
    level_scales: [B, T, H, L] = lambda, L >= levels needed for the positions covered, or None: plain Mamba-2
    (SSD, lambda = 1, a one-level state); scale: default K ** -0.5; initial_state: FenwickState continuing the
    sequences (positions go on);
    cu_seqlens: [N+1] packs N sequences into B = 1; backend: "torch" | "triton" | None (LOGLINEAR_BACKEND if set,
    else triton on CUDA). Returns (o: [B, T, H, V] in v's dtype, state or None).
    """
    return attention(MAMBA2, q, k, v, {"g": g}, level_scales, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                     backend=backend)


def log_linear_gated_deltanet(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    level_scales: torch.Tensor | None, *, scale: float | None = None, initial_state: FenwickState | None = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False,
    chunk_size: int = 64, backend: str | None = None,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Log-linear Gated DeltaNet attention.

        o_t = scale * sum_{s<=t} lambda_t[level(t, s)] * beta_s * (q_t^T P_{t,s} k_s) * v_s,
        P_{t,s} = A_t ... A_{s+1},  A_t = exp(g_t) (I - beta_t k_t k_t^T)

    Shapes as in log_linear_mamba2, plus beta: [B, T, H] in (0, 1). use_qk_l2norm normalises q and k
    over K inside the op.
    """
    return attention(GATED_DELTANET, q, k, v, {"g": g, "beta": beta}, level_scales, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, backend=backend)


def log_linear_gla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, level_scales: torch.Tensor | None, *,
    scale: float | None = None, initial_state: FenwickState | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64, backend: str | None = None,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Log-linear Gated Linear Attention (GLA): a log-decay per key channel.

        o_t = scale * sum_{s<=t} lambda_t[level(t, s)] * sum_k q_t[k] exp(G_t[k] - G_s[k]) k_s[k] * v_s,
        G = cumsum_t g (per channel);  the state decays as S <- diag(exp(g_t)) S

    q, k: [B, T, G, K]; v: [B, T, H, V] (H % G == 0); g: [B, T, H, K] log-decay <= 0 per value head and key
    channel (-inf: a hard reset of that channel); level_scales: [B, T, H, L] = lambda, L >= levels needed for the
    positions covered (None: plain GLA); other arguments as in log_linear_mamba2 (the Triton kernels run chunks
    of at most 64 tokens; the result does not depend on chunk_size). g equal over K is log_linear_mamba2.
    Returns (o: [B, T, H, V] in v's dtype, state or None).
    """
    return attention(GLA, q, k, v, {"g": g}, level_scales, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                     backend=backend)
