"""In-chunk part of log-linear Mamba-2 (levels 0..c), chunk-parallel: one program per (chunk, value head).

The chunks of all sequences are listed in one table: chunk n covers tokens [starts[n], starts[n] + C),
clipped at its sequence's end ends[n]; rows past the end read as 0 (g = 0) and are not written.
With G the chunk-local inclusive cumsum of g (intra.py has the block and its gradients):

    forward    O_intra = (Q K^T * Gamma * Lambda) V                                  (unscaled)
    backward   dQ = dS K,  dK = dS^T Q,  dV = scale * A^T dO,  dlambda_t[l] (l <= c)

The scans (mamba2_fwd.py, mamba2_bwd.py) then only carry the chunk levels: the forward scan adds the
readout to O_intra, the backward scans add the readout / deposit gradients to these buffers.

The gate's gradient needs no per-chunk term here. Every term of o (and of the final states' level
sums, apart from their own end-of-sequence factor) depends on the gates only through q_t e^{G_t} and
k_s e^{-G_s}, G the sequence's cumsum: the in-chunk block through exp(G_t - G_s), the readout through
Qt = e^{G_t} Q, the deposit through e^{G_l - G_s} k_s and the transitions e^{G_l} of the chunk
levels telescope into the same differences. So o(q e^d, k e^-d, G - d) = o for any per-token d, and

    dG_t = q_t . dq_t - k_t . dk_t  (+ the final states' term at the last token),   dg_t = sum_{u >= t} dG_u

holds for the in-chunk and the chunk-level parts separately: the scans form q.dq and k.dk on the sums
(in-chunk + chunk-level) of dq and dk, and the caller takes the reverse cumsum.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.common import interpreting
from loglinear.ops.triton.intra import (
    chunk_gates, intra_levels, intra_output, intra_score_grads, intra_scores, level_sums, level_weights,
)
from loglinear.ops.triton.mamba2_rows import load_qk_tiles, load_tile, store_tile

INTRA_RUNTIME_ARGS = ["H", "G", "L"]


def intra_launch_options() -> dict[str, int]:
    """num_warps / num_stages of the in-chunk kernels (no loop to pipeline); fixed under the interpreter."""
    if interpreting():
        return {"num_warps": 1, "num_stages": 1}
    return {"num_warps": 4, "num_stages": 1}


@triton.jit
def chunk_rows(starts, ends, C: tl.constexpr):
    """Chunk program_id(0): its first token t0 (int64), r = arange(C), the token indices t = t0 + r and
    whether each is inside its sequence."""
    n = tl.program_id(0)
    r = tl.arange(0, C)
    t0 = tl.load(starts + n).to(tl.int64)
    t = t0 + r
    return t0, r, t, t < tl.load(ends + n).to(tl.int64)


@triton.jit(do_not_specialize=INTRA_RUNTIME_ARGS)
def mamba2_intra_fwd_kernel(
    q, k, v, g, lam, oi, starts, ends,
    H, G, K, V, L,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """q, k: [tokens, G, K]; v: [tokens, H, V]; g: [tokens, H]; lam: [tokens, H, L]; starts, ends: [NC] int32.
    oi: [tokens, H, V] fp32 out, the unscaled in-chunk outputs.  Grid (NC, H)."""
    h = tl.program_id(1)
    t0, r, t, valid = chunk_rows(starts, ends, C)
    kk, vv = tl.arange(0, BK), tl.arange(0, BV)
    qc, kc = load_qk_tiles(q, k, t0, r, valid, h // (H // G), G, K, kk)
    vc = load_tile(v, t0, r, valid, h, H, V, vv)
    Gc, _ = chunk_gates(g, t, valid, h, H)
    acc = intra_output(qc, kc, vc, Gc, lam, t, valid, h, H, L, intra_levels(r, LOG_C), r[:, None] >= r[None, :],
                       LOG_C, PRECISION)
    store_tile(oi, acc, t0, r, valid, h, H, V, vv)


@triton.jit(do_not_specialize=INTRA_RUNTIME_ARGS)
def mamba2_intra_bwd_kernel(
    q, k, v, g, lam, do, dq, dk, dv, dlam, starts, ends, scale,
    H, G, K, V, L,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Inputs as the forward, do: [tokens, H, V]. Out (fp32, per value head, the scans add to them):
    dq, dk: [tokens, H, K]; dv: [tokens, H, V]; dlam: [tokens, H, L] (columns > c written as 0).  Grid (NC, H)."""
    h = tl.program_id(1)
    t0, r, t, valid = chunk_rows(starts, ends, C)
    kk, vv, ll = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BL)
    lev = intra_levels(r, LOG_C)
    causal = r[:, None] >= r[None, :]
    qc, kc = load_qk_tiles(q, k, t0, r, valid, h // (H // G), G, K, kk)
    vc = load_tile(v, t0, r, valid, h, H, V, vv)
    doc = load_tile(do, t0, r, valid, h, H, V, vv)
    Gc, _ = chunk_gates(g, t, valid, h, H)
    p, gamma = intra_scores(qc, kc, Gc, causal, PRECISION)
    d_a = intra_score_grads(doc, vc, causal, scale, PRECISION)
    store_tile(dlam, level_sums(d_a * p, lev, ll, LOG_C), t0, r, valid, h, H, L, ll)
    weights = level_weights(lam, t, valid, h, H, L, lev, causal, LOG_C)
    d_s = (d_a * gamma * weights).to(qc.dtype)
    store_tile(dq, tl.dot(d_s, kc, input_precision=PRECISION), t0, r, valid, h, H, K, kk)
    store_tile(dk, tl.dot(tl.trans(d_s), qc, input_precision=PRECISION), t0, r, valid, h, H, K, kk)
    d_v = tl.dot(tl.trans((p * weights).to(doc.dtype)), doc, input_precision=PRECISION) * scale
    store_tile(dv, d_v, t0, r, valid, h, H, V, vv)
