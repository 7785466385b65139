"""The fused decode step: carry + transition + deposit + readout of all Fenwick levels in one launch.

One program owns one (sequence n, value head h, block of BV value columns) and walks the levels
l = 0..L-1 of its state once, holding a [K, BV] tile (the columns of a K x V state are independent,
also under the delta rule). For the token at absolute position p (spec section 4):

    carry       2^l | p            (l <= ctz p):  acc += S_l,  S_l <- 0
                l == ctz(p) + 1:                  S_l <- S_l + acc
    transition  Mamba-2:  S_l <- exp(g) S_l
                GLA:      S_l <- diag(exp(g)) S_l                          g per key channel (PER_CHANNEL)
                GDN:      S_l <- exp(g) (S_l - beta k (k^T S_l))          rank-1, O(K BV)
    deposit     S_0 <- S_0 + beta k v^T                                    (beta = 1 for Mamba-2)
    readout     o <- o + lambda_l S_l^T q,   finally o <- scale o

IN_PLACE (s_out is s_in) touches only the levels the position holds, as the state's definition has them (spec
section 4; loglinear.state.FenwickState): before the token, level 0 (p > 0) and each level l >= 1 with bit l - 1 of
p - 1 set; after it, level 0 and each level with bit l - 1 of p set. It reads the first set, writes the union (the
carry's merged levels as zeros, its target, the decayed held levels) and skips every other level, which must be
zero (a valid state; the zero-padded static buffers of CUDA-graph decoding are), so a step at position p moves
about 1 + popcount(p - 1) levels each way instead of max_levels. Out of place every level is read and written.
LAZY (in place, a decay-only transition: Mamba-2, GLA) stores level l as a tile T_l and a log-scale s_l (one per
head, or per head and key channel): S_l = diag(exp(s_l)) T_l. A level the token only decays (held before and after,
above the carry's target) keeps T_l and s_l <- s_l + g; a level l >= 1 the carry empties keeps T_l too and
s_l <- -inf (S_l = 0; the level is not held, so no step reads T_l before it is written again as a carry's target).
The step writes T only for level 0 and the carry's target (their s restart at 0): two tiles per token. The s
updates run in a second kernel (_log_scale_kernel) after the step, because every value block's program of a head
reads the same s.
FENWICK=False is the plain recurrence (no carry, lambda = 1) of use_log_linear=False models.
q, k are read from group h // (H // G); L2NORM normalises them in the kernel (x / sqrt(|x|^2 + 1e-6)).
The state is read and written once, (levels touched) * K * V * (bytes per element) per (sequence, head); a program
walks its levels one after another, so at batch 16 on an H200 the step is bound by that loop's latency rather than
by its bytes (docs/kernels.md, Decoding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loglinear.ops.triton.shared.launch import launch_options
from loglinear.variants import Variant

__all__ = ["fused_decode_step", "decode_backend"]


@triton.jit
def _level_roles(p, l):
    """Level l's part in the step of the token at position p (int64): held before it (the state after p tokens),
    held after it, merged by the carry (l <= ctz p), the carry's target (l == ctz(p) + 1)."""
    one = tl.full((), 1, tl.int64)
    bit = one << tl.maximum(l - 1, 0)  # level l >= 1 holds bit l - 1 of the position
    held_in = (p > 0) & ((l == 0) | (((p - 1) & bit) != 0))
    held_out = (l == 0) | ((p & bit) != 0)
    merge = (p > 0) & ((p & ((one << l) - 1)) == 0)
    into = (l > 0) & (p > 0) & ((p & (bit - 1)) == 0) & (merge == 0)
    return held_in, held_out, merge, into


@triton.jit
def _decode_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, lam_ptr, s_in_ptr, s_out_ptr, ls_ptr, pos_ptr, o_ptr,
    scale, H, G, K, V, L, lam_sn, lam_sh,
    BK: tl.constexpr, BV: tl.constexpr, FENWICK: tl.constexpr, HAS_BETA: tl.constexpr, PER_CHANNEL: tl.constexpr,
    L2NORM: tl.constexpr, IN_PLACE: tl.constexpr, LAZY: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    n = pid // H
    h = pid % H
    grp = h // (H // G)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    tile = mk[:, None] & mv[None, :]

    q = tl.load(q_ptr + (n * G + grp) * K + rk, mask=mk, other=0.0).to(ACC)
    k = tl.load(k_ptr + (n * G + grp) * K + rk, mask=mk, other=0.0).to(ACC)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    v = tl.load(v_ptr + (n * H + h) * V + rv, mask=mv, other=0.0).to(ACC)
    if PER_CHANNEL:  # one decay per row of the [K, BV] tile
        decay = tl.exp(tl.load(g_ptr + (n * H + h) * K + rk, mask=mk, other=0.0).to(ACC))[:, None]
    else:
        decay = tl.exp(tl.load(g_ptr + n * H + h).to(ACC))
    if HAS_BETA:
        beta = tl.load(beta_ptr + n * H + h).to(ACC)
    else:
        beta = 1.0
    deposit = (beta * k)[:, None] * v[None, :]
    p = tl.load(pos_ptr + n)  # int64

    acc = tl.zeros((BK, BV), dtype=ACC)
    o = tl.zeros((BV,), dtype=ACC)
    for l in range(0, L):
        offs = (((n * L + l) * H + h) * K + rk[:, None]) * V + rv[None, :]
        held_in, held_out, merge, into = _level_roles(p, l)
        read = (not IN_PLACE) | (not FENWICK) | held_in  # a plain state is read whatever its position
        if read | held_out:
            S = tl.load(s_in_ptr + offs, mask=tile & read, other=0.0).to(ACC)
            if LAZY:  # the level's state is the stored tile times exp(its log-scale)
                if PER_CHANNEL:
                    S = S * tl.exp(tl.load(ls_ptr + ((n * L + l) * H + h) * K + rk, mask=mk & read, other=0.0))[:, None]
                else:
                    S = S * tl.exp(tl.load(ls_ptr + (n * L + l) * H + h, mask=read, other=0.0))
            if FENWICK:
                moved = tl.where(merge, S, 0.0)
                S = tl.where(merge, 0.0, S + tl.where(into, acc, 0.0))
                acc = acc + moved
            if HAS_BETA:
                kS = tl.sum(k[:, None] * S, 0)
                S = decay * (S - beta * k[:, None] * kS[None, :])
            else:
                S = decay * S
            S = S + tl.where(l == 0, deposit, 0.0)
            if FENWICK:
                w = tl.load(lam_ptr + n * lam_sn + h * lam_sh + l).to(ACC)
            else:
                w = 1.0
            o = o + w * tl.sum(q[:, None] * S, 0)
            # lazy: a level held before the token keeps its stored tile (decayed: its log-scale adds g; emptied by
            # the carry: -inf); level 0 merges (p > 0) or is empty (p = 0)
            if (not LAZY) | (held_in == 0) | (l == 0):
                tl.store(s_out_ptr + offs, S.to(s_out_ptr.dtype.element_ty), mask=tile)
    tl.store(o_ptr + (n * H + h) * V + rv, (scale * o).to(o_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _log_scale_kernel(g_ptr, ls_ptr, pos_ptr, H, K, L, BK: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """Lazy levels after the step (one program per (sequence, head)): a level the token only decays adds g to its
    log-scale, a level l >= 1 the carry empties takes -inf, level 0 and the carry's target restart at 0 (their tiles
    were rewritten). Runs after the step kernel, whose programs of every value block read the old log-scales."""
    pid = tl.program_id(0)
    n = pid // H
    h = pid % H
    rk = tl.arange(0, BK)
    mk = rk < K
    p = tl.load(pos_ptr + n)
    if PER_CHANNEL:
        g = tl.load(g_ptr + (n * H + h) * K + rk, mask=mk, other=0.0).to(ls_ptr.dtype.element_ty)
    else:
        g = tl.load(g_ptr + n * H + h).to(ls_ptr.dtype.element_ty)
    for l in range(0, L):
        held_in, held_out, merge, into = _level_roles(p, l)
        kept = held_in & (merge == 0)  # level 0 merges (p > 0) or is empty (p = 0)
        reset = tl.where(merge & (l > 0), float("-inf"), 0.0)
        if held_in | held_out:
            if PER_CHANNEL:
                offs = ((n * L + l) * H + h) * K + rk
                ls = tl.load(ls_ptr + offs, mask=mk, other=0.0)
                tl.store(ls_ptr + offs, tl.where(kept, ls + g, reset), mask=mk)
            else:
                offs = (n * L + l) * H + h
                tl.store(ls_ptr + offs, tl.where(kept, tl.load(ls_ptr + offs) + g, reset))


def _block_v(K: int, V: int, rows: int) -> int:
    """Value columns per program: the [K, BV] fp32 tile stays within 8K elements, and narrower blocks
    (down to 16 columns) spread a small batch over more programs (~256) to keep the SMs streaming."""
    bv = max(1, min(triton.next_power_of_2(V), 8192 // triton.next_power_of_2(K), 64))
    while bv > 16 and rows * triton.cdiv(V, bv) < 256:
        bv //= 2
    return bv


def fused_decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
    level_scales: torch.Tensor | None, levels: torch.Tensor, positions: torch.Tensor, scale: float,
    *, fenwick: bool = True, l2norm_qk: bool = False, out: torch.Tensor | None = None,
    log_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch for one token per sequence (see loglinear.ops.decode.decode_step for the contract); with
    log_scales (lazy levels: [N, L, H] or [N, L, H, K], float32 or float64; in place) a second, small one updates them.

    q, k: [N, G, K]; v: [N, H, V]; g: [N, H] (a decay per head) or [N, H, K] (per key channel: GLA); beta: [N, H]
    (the delta rule) or None; level_scales: [N, H, >= L]; levels: [N, L, H, K, V]; positions: [N] int64.
    out: where the new levels go (levels itself: in place; a program reads each level's tile before it writes it,
    and no other program touches that tile; the levels positions[n] does not hold must then be zero, see the
    module docstring), else a new tensor.
    Returns o: [N, H, V] (v's dtype) and new levels (levels' dtype).
    """
    N, G, K = q.shape
    H, V = v.shape[1:]
    L = levels.shape[1]
    if levels.shape != (N, L, H, K, V):
        raise ValueError(f"levels must be [N, L, H, K, V] = [{N}, L, {H}, {K}, {V}], got {tuple(levels.shape)}")
    device = levels.device
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    if out is not None and not (levels.is_contiguous() and out.is_contiguous()):
        raise ValueError("levels and out must be contiguous for an in-place step")
    levels = levels.contiguous()
    positions = positions.to(device=device, dtype=torch.int64).contiguous()
    if fenwick:
        lam = level_scales
        if lam.shape[:2] != (N, H) or lam.shape[2] < L:
            raise ValueError(f"level_scales must be [N, H, >= L] = [{N}, {H}, >= {L}], got {tuple(lam.shape)}")
        if lam.stride(2) != 1:
            lam = lam.contiguous()
        lam_sn, lam_sh = lam.stride(0), lam.stride(1)
    else:
        lam, lam_sn, lam_sh = g, 0, 0
    beta_arg = beta.contiguous() if beta is not None else g
    out = torch.empty_like(levels) if out is None else out
    o = torch.empty(N, H, V, dtype=v.dtype, device=device)
    BV = _block_v(K, V, N * H)
    grid = (N * H, triton.cdiv(V, BV))
    lazy = log_scales is not None
    if lazy and (out is not levels or not fenwick or beta is not None or not log_scales.is_contiguous()):
        raise ValueError("log_scales needs a contiguous in-place log-linear step with a decay-only transition")
    BK, per_channel = triton.next_power_of_2(K), g.dim() == 3
    _decode_step_kernel[grid](
        q, k, v, g, beta_arg, lam, levels, out, log_scales if lazy else g, positions, o,
        float(scale), H, G, K, V, L, lam_sn, lam_sh,
        BK=BK, BV=BV, FENWICK=fenwick, HAS_BETA=beta is not None, PER_CHANNEL=per_channel,
        L2NORM=l2norm_qk, IN_PLACE=out is levels, LAZY=lazy,
        ACC=tl.float64 if levels.dtype == torch.float64 else tl.float32, **launch_options(_decode_step_kernel),
    )
    if lazy:
        _log_scale_kernel[(N * H,)](g, log_scales, positions, H, K, L, BK=BK, PER_CHANNEL=per_channel,
                                    **launch_options(_log_scale_kernel))
    return o, out


def decode_backend(
    variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor],
    level_scales: torch.Tensor | None, levels: torch.Tensor, positions: torch.Tensor, scale: float,
    *, fenwick: bool = True, l2norm_qk: bool = False, out: torch.Tensor | None = None,
    log_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode step the variants register (loglinear.ops.backends.Backend.decode). The kernel's compile-time
    switches come from the variant's gates: g [N, H] a scalar decay (Mamba-2) or [N, H, K] one per key channel
    (GLA), and a beta gate makes it the gated delta rule (Gated DeltaNet)."""
    return fused_decode_step(q, k, v, gates["g"], gates.get("beta"), level_scales, levels, positions, scale,
                             fenwick=fenwick, l2norm_qk=l2norm_qk, out=out, log_scales=log_scales)
