"""Log-linear Gated DeltaNet on Triton kernels: the chunk-local stage and the fused Fenwick delta scan.

Composition, per group of rows that start at the same absolute position p0 (spec section 5):

  1. align chunks to absolute positions (front-pad p0 mod C identity tokens), chunk everything;
  2. chunk_local   (gated_deltanet_local):  o_intra (levels 0..c), qt, W~, K~, u, decay per chunk;
  3. incoming state: carried past p0; its levels <= c are buckets inside the first chunk (read by
     query t at level max(l, bit_length(t XOR p0)), and folded into the chunk-level state that the
     first chunk's cascade fills), its levels > c seed the chunk-level states;
  4. fenwick_delta_scan (gated_deltanet_scan): every chunk-level state in one pass, o_inter;
  5. o = scale (o_intra + o_inter); the final state splits the last chunk into token-level buckets.

Gradients flow through every stage (both kernels have Triton backwards; the glue is torch autograd), so
q, k, v, g, beta, level_scales and the initial state all get them. run_segments does the GQA expansion,
the optional q/k L2 normalisation, varlen and per-row start positions (one launch set per segment).
"""

from __future__ import annotations

import os

import torch

from loglinear.fenwick import bit_length, carry_target, chunk_bits, levels_needed
from loglinear.inputs import OpInputs, run_segments
from loglinear.ops.torch_chunk.forms import GatedDeltaNetForm
from loglinear.ops.torch_chunk.scan import _carry_past, _chunked, _final_levels, _level_scales_at, _pad_time
from loglinear.ops.triton.common import interpreting
from loglinear.ops.triton.gated_deltanet_common import dot_dtype
from loglinear.ops.triton.gated_deltanet_local import chunk_local
from loglinear.ops.triton.gated_deltanet_scan import fenwick_delta_scan
from loglinear.state import FenwickState

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Opt-in (LOGLINEAR_BACKEND=triton) until a device run has checked these kernels against the torch path:
# their first device run (v0) failed to launch (shared memory); v1 is verified by compiling for sm_90 only.
DEFAULT_ON_CUDA = False
MAX_K = 256  # the scan keeps K whole in a tile


def kernel_chunk_size(chunk_size: int, dtype: torch.dtype, K: int) -> int:
    """The kernels' chunk: >= 16 (tl.dot tiles); at most 64 for bf16/fp16 operands, 32 for fp32 (16 when
    K > 128), so that the scan's [C, K] tiles fit the sm_90 shared memory (checked by compiling for sm_90
    with triton 3.6). The result does not depend on it."""
    cap = 64 if dot_dtype(dtype) != torch.float32 else (32 if K <= 128 else 16)
    return min(max(chunk_size, 16), cap)


def _merge_targets(c0: int, N: int) -> list[int]:
    """Cascade target ctz(chunk + 1) after each chunk but the last (-1: no cascade).  [N]."""
    chunks = torch.arange(c0 + 1, c0 + N, dtype=torch.int64)
    return (carry_target(chunks) - 1).tolist() + [-1]


def gated_deltanet_core(
    q, k, v, g, beta, lam, scale: float, levels: torch.Tensor | None, position: int, chunk_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sharing the start ``position``.  q, k: [b, T, H, K]; v: [b, T, H, V]; g, beta: [b, T, H];
    lam: [b, T, H, L]; levels: [b, Ls, H, K, V] or None; dtype: the caller's dtype (sets the kernels'
    operand dtype).  Returns o: [b, T, H, V] and the final levels [b, max(Ls, levels_needed(end)), H, K, V]."""
    C = kernel_chunk_size(chunk_size, dtype, q.shape[-1])
    c = chunk_bits(C)
    b, T, H, K = q.shape
    V = v.shape[-1]
    front = position % C
    Tp = -(-(front + T) // C) * C
    N, c0, end = Tp // C, position // C, position + T
    pad = lambda x: _chunked(_pad_time(x, front, Tp - front - T), C)  # noqa: E731
    qc, kc, vc, gc, bc, lc = pad(q), pad(k), pad(v), pad(g), pad(beta), pad(lam)
    lam_intra = torch.nn.functional.pad(lc, (0, max(0, c + 1 - lc.shape[-1])))[..., : c + 1]
    o, qt, wt, kt, u, decay = chunk_local(qc, kc, vc, gc, bc, lam_intra, dtype)

    J = max((end - 1) // C, 1).bit_length()
    partial = None
    if levels is not None:
        levels = _carry_past(levels, position) if position > 0 else levels
        J = max(J, levels.shape[1] - c - 1)
        levels = torch.nn.functional.pad(levels, (0, 0, 0, 0, 0, 0, 0, max(0, c + 1 + J - levels.shape[1])))
        partial = levels[:, : c + 1].transpose(1, 2)  # [b, H, c+1, K, V]
        h0 = levels[:, c + 1 :].transpose(1, 2)  # [b, H, J, K, V]
        pos = c0 * C + torch.arange(C, device=q.device)
        idx = torch.maximum(torch.arange(c + 1, device=q.device)[None, :], bit_length(pos ^ position)[:, None])
        weights = _level_scales_at(lc[:, :, 0], idx)  # [b, H, C, c+1]
        if N > 1:
            # The first chunk's cascade moves its transitioned buckets into chunk level m0. Seeding h_m0
            # with them instead is the same, except that chunk 0 would also read them at level c+1+m0:
            # take that read off the weights.
            m0 = int(carry_target(c0 + 1)) - 1
            weights = weights - _level_scales_at(lc[:, :, 0], torch.full((C, 1), c + 1 + m0, device=q.device))
            h0 = h0 + torch.nn.functional.one_hot(torch.tensor(m0), J).to(h0)[:, None, None] * partial.sum(2, True)
        first = torch.einsum("bhtm,bhtk,bhmkv->bhtv", weights, qt[:, :, 0].to(o.dtype), partial.to(o.dtype))
        o = torch.cat([o[:, :, :1] + first[:, :, None], o[:, :, 1:]], dim=2)
    else:
        h0 = None

    lam_inter = _level_scales_at(lc, (c + 1 + torch.arange(J, device=q.device)).expand(C, -1))
    flat = lambda x: x.reshape(b * H, Tp, x.shape[-1])  # noqa: E731
    o_inter, hN = fenwick_delta_scan(
        flat(qt), flat(wt), flat(kt), flat(u), decay.reshape(b * H, N), flat(lam_inter),
        None if h0 is None else h0.reshape(b * H, J, K, V), _merge_targets(c0, N),
    )
    o = (o + o_inter.view(b, H, N, C, V)).movedim(1, 3).reshape(b, Tp, H, V)[:, front : front + T] * scale

    tail = lambda x: x[:, :, -1:].contiguous()  # noqa: E731  (a copy: a view would keep all of x alive)
    last = GatedDeltaNetForm(tail(qc), tail(kc), tail(vc), tail(gc), tail(bc))
    H_levels = list(hN.view(b, H, J, K, V).to(q.dtype).unbind(2))
    final = _final_levels(last, H_levels, partial if N == 1 else None, position, end, c0 + N - 1, 1, C, c)
    n_final = max(levels_needed(end), levels.shape[1] if levels is not None else 0)
    final = torch.nn.functional.pad(final, (0, 0, 0, 0, 0, 0, 0, max(0, n_final - final.shape[1])))[:, :n_final]
    return o.to(q.dtype), final


def triton_backend(
    inp: OpInputs, output_final_state: bool, chunk_size: int, use_qk_l2norm: bool,
) -> tuple[torch.Tensor, FenwickState | None]:
    """The registered "triton" backend of log_linear_gated_deltanet (CUDA, or CPU under TRITON_INTERPRET=1).

    float64 inputs, K > 256, and CPU tensors without the interpreter go to the torch chunk path; so does
    every call that did not ask for this backend (LOGLINEAR_BACKEND=triton) while DEFAULT_ON_CUDA is False."""
    dtype = inp.v.dtype
    opted_in = DEFAULT_ON_CUDA or os.environ.get("LOGLINEAR_BACKEND") == "triton"
    if dtype not in SUPPORTED_DTYPES or inp.q.dtype not in SUPPORTED_DTYPES or inp.q.shape[-1] > MAX_K or (
        inp.q.device.type != "cuda" and not interpreting()
    ) or not opted_in:
        from loglinear.ops.api import _BACKENDS

        return _BACKENDS["gated_deltanet"]["torch"](inp, output_final_state, chunk_size, use_qk_l2norm)

    def core(q, k, v, g, beta, lam, scale, levels, position):
        return gated_deltanet_core(q, k, v, g, beta, lam, scale, levels, position, chunk_size, dtype)

    return run_segments(inp, core, output_final_state, l2norm_qk=use_qk_l2norm)
