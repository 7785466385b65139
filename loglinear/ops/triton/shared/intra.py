"""In-chunk pieces (levels 0..c of an aligned chunk of C = 2^c tokens).

    level(t, s) = bit_length(tl XOR sl)                       (tl, sl: positions inside the chunk)
    Lambda[t, s] = lambda_t[level(t, s)]  for s <= t, else 0
    Gamma[t, s]  = exp(G_t - G_s)         for s <= t, else 0  (G: chunk-local inclusive cumsum of g)

The in-chunk block and its gradients with a scalar gate (Mamba-2; a per-channel gate's raw scores P and products
come from intra_channel.py, the rest is shared):

    P = Q K^T * Gamma,   A = P * Lambda,   O = A V
    dA = scale * dO V^T (s <= t),   dS = dA * Gamma * Lambda,   dlambda_t[l] = sum_{s: level(t,s) = l} dA * P
    dQ = dS K,   dK = dS^T Q,   dV = scale * A^T dO
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loglinear.ops.finite import LOG_DECAY_FLOOR

# the log-decay floor of the kernels, which compute in fp32: g is read as max(g, FLOOR) (NaN stays NaN), whose
# gradient is 0 where g <= FLOOR (loglinear.ops.finite)
FLOOR = tl.constexpr(LOG_DECAY_FLOOR[torch.float32])


@triton.jit
def intra_levels(rows, cols, LOG_C: tl.constexpr):
    """[len(rows), len(cols)] int32 levels bit_length(t XOR s) of the in-chunk positions t in rows, s in cols."""
    return bit_levels(rows[:, None] ^ cols[None, :], LOG_C)


@triton.jit
def bit_levels(x, LOG_C: tl.constexpr):
    """bit_length(x) elementwise for 0 <= x < 2^LOG_C (int32, any shape)."""
    lev = tl.zeros_like(x)
    for b in tl.static_range(LOG_C):
        lev += ((x >> b) > 0).to(tl.int32)
    return lev


@triton.jit
def level_weights(lam, t, valid, head, HEADS, L, lev, causal, LOG_C: tl.constexpr, PLAIN: tl.constexpr):
    """Lambda [C, C] fp32 from lambda [tokens, HEADS, L] (levels 0..c): each row's in-chunk lambdas as one tile,
    gathered along the row by level (one gather instead of a masked pass per level); the causal mask when PLAIN
    (lambda = 1)."""
    if PLAIN:
        return causal.to(tl.float32)
    cols = tl.arange(0, 8 << (LOG_C >> 3))  # levels 0..c, padded to a power of two
    rows = tl.load(lam + (t[:, None] * HEADS + head) * L + cols[None, :],
                   mask=valid[:, None] & (cols[None, :] < L) & (cols[None, :] <= LOG_C), other=0.0)
    return tl.where(causal, tl.gather(rows.to(tl.float32), lev, 1), 0.0)


@triton.jit
def chunk_gates(g, t, valid, head, HEADS):
    """G [C] = chunk-local inclusive cumsum of max(g[t, head], FLOOR) and Gl = G at the chunk's end (scalar), fp32,
    from the raw gate g [tokens, HEADS] (rows past eos read g = 0)."""
    gc = tl.maximum(tl.load(g + t * HEADS + head, mask=valid, other=0.0).to(tl.float32), FLOOR,
                    propagate_nan=tl.PropagateNan.ALL)
    return tl.cumsum(gc, 0), tl.sum(gc, 0)


@triton.jit
def decay_matrix(G, causal):
    """Gamma [C, C] = exp(G_t - G_s) below the diagonal (no overflow: masked before exp)."""
    return tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))


@triton.jit
def intra_scores(qc, kc, Gc, causal, PRECISION: tl.constexpr):
    """P = Q K^T * Gamma and Gamma, both [C, C] fp32, from q, k [C, BK] and the chunk-local gates G [C]."""
    gamma = decay_matrix(Gc, causal)
    return tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * gamma, gamma


@triton.jit
def intra_output(p, vc, lam, t, valid, head, HEADS, L, lev, causal,
                 LOG_C: tl.constexpr, PRECISION: tl.constexpr, PLAIN: tl.constexpr):
    """O = (P * Lambda) V, unscaled -> [C, BV] fp32 (P [C, C] the raw scores; v [C, BV]; Lambda = 1: PLAIN)."""
    if not PLAIN:
        p *= level_weights(lam, t, valid, head, HEADS, L, lev, causal, LOG_C, PLAIN)
    return tl.dot(p.to(vc.dtype), vc, input_precision=PRECISION)


@triton.jit
def intra_score_grads(doc, vc, causal, scale, PRECISION: tl.constexpr):
    """dA = scale * dO V^T on and below the diagonal, 0 above -> [C, C] fp32 (dO, v [C, BV])."""
    return tl.where(causal, tl.dot(doc, tl.trans(vc), input_precision=PRECISION) * scale, 0.0)


@triton.jit
def store_level_sums(dlam, x, t, valid, head, HEADS, L, LOG_C: tl.constexpr):
    """dlam[t, head, l] = sum_s x[t, s] over level(t, s) = l for the in-chunk levels l = 0..c (< L), from x [C, C]
    fp32 over the chunk's positions in rows and columns (C >= 8; t: the rows' tokens); dlam: [tokens, HEADS, L].

    Through 8-column blocks: level(t, s) = 3 + bit_length((t >> 3) XOR (s >> 3)) outside t's own block, so levels
    4..c are masked row sums of the block sums [C, C / 8], and levels 0..3 of the row's own block [C, 8] (bit_length
    of (t & 7) XOR (s & 7)); each column is stored as it is."""
    C: tl.constexpr = x.shape[0]
    r = tl.arange(0, C)
    x3 = tl.reshape(x, [C, C // 8, 8])
    bb = tl.arange(0, C // 8)
    jj = tl.arange(0, 8)
    blocks = tl.sum(x3, 2)
    own = (r[:, None] >> 3) == bb[None, :]
    inner = tl.sum(tl.where(own[:, :, None], x3, 0.0), 1)
    x_in = (r[:, None] & 7) ^ jj[None, :]
    x_out = (r[:, None] >> 3) ^ bb[None, :]
    for level in tl.static_range(LOG_C + 1):
        if level <= 3:
            sel = (x_in == 0) if level == 0 else ((x_in >> (level - 1)) == 1)
            col = tl.sum(tl.where(sel, inner, 0.0), axis=1)
        else:
            col = tl.sum(tl.where((x_out >> (level - 4)) == 1, blocks, 0.0), axis=1)
        tl.store(dlam + (t * HEADS + head) * L + level, col, mask=valid & (t * 0 + level < L))
