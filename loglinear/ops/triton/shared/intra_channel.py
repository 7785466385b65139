"""The in-chunk block with a per-channel decay (GLA, spec section 6b), in the stable sub-chunk form.

With G [C, K] the chunk-local inclusive cumsum of g per channel, the in-chunk scores and the two products the
backward needs are, for s <= t,

    P[t, s]  = sum_k q_t[k] exp(G_t[k] - G_s[k]) k_s[k]                      (raw scores; A = P * Lambda)
    dQ[t, k] = sum_s M[t, s] exp(G_t[k] - G_s[k]) k_s[k]                     (M = dA * Lambda)
    dK[s, k] = sum_t M[t, s] exp(G_t[k] - G_s[k]) q_t[k]

exp(G_t - G_s) is never split as exp(G_t) exp(-G_s) over the chunk (that overflows for strong decays). The chunk
is cut into sub-chunks of S tokens; b(t) is the first row of t's sub-chunk, Gw the cumsum restarted at each
sub-chunk (Gw_t = G_t - G_{b(t)-1}, <= 0):

  * s before t's sub-chunk (s < b(t) = i S): reference r = i S - 1, the row before the sub-chunk,

        exp(G_t - G_s) = exp(Gw_t) * exp(G_r - G_s)          both exponents <= 0

    so for every query sub-chunk i one product of Q~ = q * exp(Gw) with K~_i = k * exp(G_r - G) (rows s < i S),
    kept on the rows of sub-chunk i;
  * s in t's sub-chunk: exactly, column by column: for a = 0 .. S-1 every row t reads the key c(t) = b(t) + a
    (rows gathered from memory, the running sum W_a = Gw_{c(t)}), with exp(Gw_t - W_a[t]) for c(t) <= t.

Cost per chunk: C K (C/S + S) exponentials and C/S - 1 [C, C] x [C, K] products per product kind; the
sub-chunk size S is about sqrt(C) (sub_chunk_size). All exponents are <= 0, so no decay overflows; a hard reset
(g = -inf) reaches the kernels floored to a finite log-decay whose exp is 0 (loglinear.ops.finite).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.shared.tiles import load_tile


@triton.jit
def channel_gates(g, t, valid, head, HEADS, K, kk, C: tl.constexpr, S: tl.constexpr):
    """From g [tokens, HEADS, K]: G [C, BK] the chunk-local inclusive cumsum per channel, Gw [C, BK] the same
    restarted at every sub-chunk of S rows, and Gl [BK] = G at the chunk's end; fp32 (rows past eos: g = 0)."""
    gc = tl.load(g + (t * HEADS + head)[:, None] * K + kk[None, :], mask=valid[:, None] & (kk[None, :] < K),
                 other=0.0).to(tl.float32)
    G = tl.cumsum(gc, 0)
    r = tl.arange(0, C)
    before = tl.zeros_like(G)
    for i in tl.static_range(1, C // S):
        before = tl.where(r[:, None] >= i * S, sub_chunk_ref(G, r, i, S)[None, :], before)
    return G, G - before, tl.sum(gc, 0)


@triton.jit
def sub_chunk_ref(G, r, i, S: tl.constexpr):
    """G at row i S - 1, the row before sub-chunk i -> [BK]."""
    return tl.sum(tl.where(r[:, None] == i * S - 1, G, 0.0), 0)


@triton.jit
def channel_block(qc, kc, m, k, g, t0, r, valid, grp, GROUPS, h, H, K, kk, G, Gw,
                  C: tl.constexpr, S: tl.constexpr, PRECISION: tl.constexpr, DQ: tl.constexpr, DK: tl.constexpr):
    """The raw scores P [C, C] fp32 (0 above the diagonal) and, with DQ, dQ [C, BK] fp32, with DK, dK [C, BK] fp32
    (module docstring), from q, k [C, BK] (qc, kc), M [C, C] fp32 (m; 0 above the diagonal; unread without DQ
    and DK), the gates of channel_gates, and k [tokens, GROUPS, K] / g [tokens, H, K] in memory (the diagonal
    sub-blocks' key rows); r = arange(C), the chunk's rows from t0. Unrequested gradients come back as 0."""
    cols = r
    first = (r // S) * S  # b(t)
    p = tl.zeros([C, C], dtype=tl.float32)
    d_q = tl.zeros(qc.shape, dtype=tl.float32)
    d_k = tl.zeros(qc.shape, dtype=tl.float32)
    q_dec = tl.exp(Gw)
    q_t = (qc.to(tl.float32) * q_dec).to(qc.dtype)
    for i in tl.static_range(1, C // S):  # keys before the query's sub-chunk, against the row before it
        ref = sub_chunk_ref(G, r, i, S)
        k_dec = tl.exp(tl.where(r[:, None] < i * S, ref[None, :] - G, float("-inf")))
        k_t = (kc.to(tl.float32) * k_dec).to(kc.dtype)
        rows = (r >= i * S) & (r < (i + 1) * S)
        p += tl.where(rows[:, None], tl.dot(q_t, tl.trans(k_t), input_precision=PRECISION), 0.0)
        if DQ:
            d_q += tl.where(rows[:, None], tl.dot(m.to(kc.dtype), k_t, input_precision=PRECISION), 0.0)
        if DK:
            m_i = tl.where(rows[:, None], m, 0.0).to(qc.dtype)
            d_k += k_dec * tl.dot(tl.trans(m_i), q_t, input_precision=PRECISION)
    d_q *= q_dec
    run = tl.zeros(qc.shape, dtype=tl.float32)  # W_a = Gw at row c(t) = b(t) + a
    for a in range(S):  # the diagonal sub-blocks, one key per sub-chunk at a time
        key = first + a
        reads = valid & (key <= r)  # only rows at or after their key use it (c(t) may lie past the sequence)
        run += load_tile(g, t0, key, reads, h, H, K, kk).to(tl.float32)
        decay = tl.exp(tl.where(reads[:, None], Gw - run, float("-inf")))
        k_row = load_tile(k, t0, key, reads, grp, GROUPS, K, kk).to(tl.float32)
        at_key = cols[None, :] == key[:, None]
        p = tl.where(at_key, tl.sum(qc.to(tl.float32) * decay * k_row, 1)[:, None], p)
        if DQ:
            d_q += tl.sum(tl.where(at_key, m, 0.0), 1)[:, None] * decay * k_row
        if DK:  # every row's term goes to its key row c(t): a sum over each sub-chunk's rows
            terms = tl.sum(tl.where(at_key, m, 0.0), 1)[:, None] * decay * qc.to(tl.float32)
            d_k += tl.dot(tl.trans(at_key.to(tl.float32)), terms, input_precision=PRECISION)
    return p, d_q, d_k
