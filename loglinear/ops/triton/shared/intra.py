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

import triton
import triton.language as tl

from loglinear.ops.triton.shared.tiles import load_column


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
    """Lambda [C, C] fp32 from lambda [tokens, HEADS, L] (levels 0..c); the causal mask when PLAIN (lambda = 1)."""
    if PLAIN:
        return causal.to(tl.float32)
    weights = tl.zeros(lev.shape, dtype=tl.float32)
    for level in tl.static_range(LOG_C + 1):
        col = load_column(lam, t, valid, head, HEADS, L, level)
        weights = tl.where(lev == level, col[:, None], weights)
    return tl.where(causal, weights, 0.0)


@triton.jit
def chunk_gates(g, t, valid, head, HEADS):
    """G [C] = chunk-local inclusive cumsum of g[t, head] and Gl = G at the chunk's end (scalar), fp32,
    from g [tokens, HEADS] (rows past eos read g = 0)."""
    gc = tl.load(g + t * HEADS + head, mask=valid, other=0.0).to(tl.float32)
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
def level_sums(x, lev, ll, LOG_C: tl.constexpr):
    """[C, BL]: column l <= c holds sum_s x[t, s] over level(t, s) = l; the other columns 0 (ll = arange(BL))."""
    out = tl.zeros([x.shape[0], ll.shape[0]], dtype=tl.float32)
    for level in tl.static_range(LOG_C + 1):
        col = tl.sum(tl.where(lev == level, x, 0.0), 1)
        out = tl.where(ll[None, :] == level, col[:, None], out)
    return out
