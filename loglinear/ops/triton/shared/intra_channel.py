"""The in-chunk block with a per-channel decay (GLA, spec section 6b): kernels over 16-row sub-chunks whose results
the chunk kernels read instead of forming the block themselves.

With G [C, K] the chunk-local inclusive cumsum of g per channel (written once per call by channel_cumsum_kernel),
M = dA * Lambda (dA = scale * dO V^T, s <= t), the in-chunk scores and the two products the backward needs are,
for s <= t,

    P[t, s]  = sum_k q_t[k] exp(G_t[k] - G_s[k]) k_s[k]
    dQ[t, k] = sum_s M[t, s] exp(G_t[k] - G_s[k]) k_s[k]
    dK[s, k] = sum_t M[t, s] exp(G_t[k] - G_s[k]) q_t[k]

(dlambda's in-chunk columns, sum over level(t, s) = l of dA P, are the chunk dq kernel's, which reads P as a scalar
gate's kernel forms it.)

exp(G_t - G_s) is never split as exp(G_t) exp(-G_s) over the chunk (that overflows for strong decays). A program
of sub-chunk i (rows iS .. iS + S - 1) splits it at a row of the sub-chunk:

  * keys before the sub-chunk (s < iS), at its first row n = iS (both factors <= 1):
        exp(G_t - G_s) = exp(G_t - G_n) exp(G_n - G_s):    P_i = (Q_i * exp(G_i - G_n)) (K * exp(G_n - G))^T
  * queries after the sub-chunk, at its last row e with a token (dK only; both factors <= 1):
        exp(G_t - G_s) = exp(G_t - G_e) exp(G_e - G_s):    dK_i += exp(G_e - G_i) * M[:, i]^T (Q * exp(G - G_e))
  * inside the sub-chunk (the diagonal block), one of two ways (sub_chunk_span):
      - short, G_n - G_e <= diagonal_span(dtype) on every channel of the block (30; 6 for fp16 operands): the
        same products also take the sub-chunk's own keys (and, for dK, its own queries), whose factors
        exp(G_n - G_s) and exp(G_t - G_e) are at most exp(span); P's entries above the diagonal (finite) are
        masked, M's are 0;
      - long (strong decays, hard resets): one row a at a time in fp32 (G_a loaded as a vector): key a's column
        reads exp(G_t - G_a) on the rows t >= a (P's column, dQ's terms), query a's row exp(G_a - G_s) on the rows
        s <= a (dK's terms); every exponent <= 0.

Programs load only their own rows and, for the products across sub-chunks, the chunk's [C, KB] tiles of k or q
and G, one block of KB key channels at a time (the backward kernels take their block from the grid): no program
scans. G is the cumsum of the floored gate max(g, FLOOR) (loglinear.ops.finite: a log-decay whose exp is 0, so a
hard reset g = -inf, or any g below it, gives a finite G), formed here from the raw g: no other kernel reads g but
chunk.mamba2_gate_grad_kernel, whose gradient is 0 where g <= FLOOR (it reads g only in chunks whose G reaches
the floor).

    channel_cumsum_kernel     G, fp32 [tokens, H, K]
    channel_scores_kernel     P, [tokens, H, C] in q's dtype (row t: its chunk's keys)   forward; kept for the backward
    channel_dq_kernel         the in-chunk dQ, [tokens, H, K] in q's dtype (summed in fp32)
    channel_dk_kernel         the in-chunk dK, [tokens, H, K] in q's dtype (summed in fp32)
"""

from __future__ import annotations

import triton
import triton.language as tl

from loglinear.ops.triton.shared.intra import FLOOR, intra_levels, level_weights
from loglinear.ops.triton.shared.tiles import load_row, load_tile, rows_within, store_tile

SUB_CHUNK = 16  # rows per sub-chunk: the smallest tl.dot tile
KEY_BLOCK = 64  # key channels per block (products with N = 32 miscompile in bf16 on Hopper, shared/heads.py)


@triton.jit
def diagonal_span(dtype: tl.constexpr):
    """The largest decay span (G_n - G_e) of a sub-chunk that takes its diagonal block in the products across
    sub-chunks, whose operands (in dtype) then carry factors up to exp(span) and down to exp(-span): 30 where the
    exponent range is fp32's (bf16, fp32); 6 for fp16, whose largest value is 65504 (e^6 ~ 403 keeps |k| up to ~160
    finite, e^-6 keeps q's scaled rows normal numbers)."""
    if dtype == tl.float16:
        return 6.0
    else:
        return 30.0


@triton.jit
def channel_gates(cum, t, valid, head, HEADS, K, kk):
    """G [C, BK] of a chunk's rows t from cum [tokens, HEADS, K] (the chunk-local inclusive cumsum per channel,
    fp32: channel_cumsum_kernel's) and Gl [BK], G at the chunk's last row with a token (rows without valid read
    G = 0; a chunk without tokens, as the scans' look-ahead past a sequence, has Gl = 0)."""
    G = tl.load(cum + (t * HEADS + head)[:, None] * K + kk[None, :], mask=valid[:, None] & (kk[None, :] < K),
                other=0.0)
    last = tl.max(tl.where(valid, t, -1), 0)  # the valid rows are one run of tokens (>= 0), after any front padding
    return G, tl.load(cum + (last * HEADS + head) * K + kk, mask=(kk < K) & (kk * 0 + last >= 0), other=0.0)


@triton.jit
def chunk_program(PER_CHUNK: tl.constexpr):
    """(p, u) with program_id(0) = p * PER_CHUNK + u: program u of chunk p. A chunk's programs are adjacent in
    launch order, so they run together and share the chunk's tiles (k or q, G) in L2."""
    pid = tl.program_id(0)
    return pid // PER_CHUNK, pid % PER_CHUNK


@triton.jit
def sub_chunk(starts, lows, ends, p, i, C: tl.constexpr, S: tl.constexpr):
    """Sub-chunk i of chunk p: the chunk's first token t0, its first token of the sequence lo and its end (int64;
    rows before lo are masked front padding), r = arange(C) and its rows' validity (lo <= t0 + r < end),
    rs = i S + arange(S) (the sub-chunk's rows in the chunk) and theirs."""
    t0 = tl.load(starts + p).to(tl.int64)
    lo = tl.load(lows + p).to(tl.int64)
    end = tl.load(ends + p).to(tl.int64)
    r = tl.arange(0, C)
    rs = i * S + tl.arange(0, S)
    return t0, lo, end, r, rows_within(r, t0, lo, end), rs, rows_within(rs, t0, lo, end)


@triton.jit
def sub_chunk_span(cum, t0, lo, end, i, h, H, K, kk, S: tl.constexpr, DT: tl.constexpr):
    """(G_n, G_e, short, long) of sub-chunk i on the channels kk: G at its first row n and its last row e with a
    token ([len(kk)] fp32 each, 0 when it has none); short: it has rows and G_n - G_e <= diagonal_span(DT) (DT: the
    products' operand dtype) on every channel, so its diagonal block can go through the products across sub-chunks
    (one exponent of each product then is up to G_n - G_e instead of <= 0); long: it has rows and is not short."""
    first = t0 + i * S
    last = tl.minimum(first + S, end) - 1
    G_n = load_row(cum, first, lo, end, h, H, K, kk).to(tl.float32)
    G_e = load_row(cum, last, lo, end, h, H, K, kk).to(tl.float32)
    span = tl.max(G_n - G_e, 0)
    limit = diagonal_span(DT)
    return G_n, G_e, (first < end) & (span <= limit), (first < end) & (span > limit)


@triton.jit(do_not_specialize=["H"])
def channel_cumsum_kernel(g, cum, starts, lows, ends, H, K, C: tl.constexpr, BK: tl.constexpr):
    """cum = G, the chunk-local inclusive cumsum of max(g, FLOOR) (NaN stays NaN) per channel of g [tokens, H, K],
    fp32 [tokens, H, K] (rows of every kernel chunk). Grid (NC, H)."""
    h = tl.program_id(1)
    t0, _, _, r, valid, _, _ = sub_chunk(starts, lows, ends, tl.program_id(0), 0, C, C)
    kk = tl.arange(0, BK)
    floored = tl.maximum(load_tile(g, t0, r, valid, h, H, K, kk).to(tl.float32), FLOOR,
                         propagate_nan=tl.PropagateNan.ALL)
    store_tile(cum, tl.cumsum(floored, 0), t0, r, valid, h, H, K, kk)


@triton.jit
def to_ref(x, cum, t0, r, rows, G_ref, h, H, K, kk, grp, GROUPS, AFTER: tl.constexpr):
    """x * exp(G - G_ref) (AFTER: rows after the reference row) or x * exp(G_ref - G) (rows before it), [len(r), KB]
    in x's dtype on the rows of r with ``rows`` (0 elsewhere); x [tokens, GROUPS, K] (q or k), G from cum. The
    exponents are <= 0 on rows on the named side, and at most a short sub-chunk's span on its own rows."""
    xr = load_tile(x, t0, r, rows, grp, GROUPS, K, kk)
    diff = load_tile(cum, t0, r, rows, h, H, K, kk) - G_ref[None, :]
    if not AFTER:
        diff = -diff
    return (xr.to(tl.float32) * tl.exp(tl.where(rows[:, None], diff, float("-inf")))).to(xr.dtype)


@triton.jit
def decays_at(Gs, G_a, ra, a, rows, LATER: tl.constexpr):
    """exp(G_t - G_a) on the sub-chunk's rows t >= a (LATER), or exp(G_a - G_s) on its rows s <= a; 0 elsewhere and
    when a is not one of its first ``rows`` (rows past the sequence hold no G). Gs: [S, KB] its rows' G; G_a: [KB]
    -> [S, KB] fp32."""
    if LATER:  # t >= a, t valid (so a is)
        x = tl.exp(tl.where((ra[:, None] >= a) & (ra[:, None] < rows), Gs - G_a[None, :], float("-inf")))
    else:  # s <= a, a valid (so s is)
        x = tl.exp(tl.where((ra[:, None] <= a) & ((ra[:, None] * 0 + a) < rows), G_a[None, :] - Gs, float("-inf")))
    return x


@triton.jit(do_not_specialize=["H", "G"])
def channel_scores_kernel(
    q, k, cum, scores, starts, lows, ends,
    H, G, K,
    C: tl.constexpr, S: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, PRECISION: tl.constexpr,
):
    """scores[t, h, s] = P[t, s] for the rows t of sub-chunk i of chunk p (chunk_program) and the keys s of their
    chunk (0 for s > t). q, k: [tokens, G, K]; cum: G [tokens, H, K] fp32; scores: [tokens, H, C] (q's dtype); starts,
    lows, ends: [NC] int32 (the chunk table). Grid (NC (C // S), H)."""
    h = tl.program_id(1)
    p, i = chunk_program(C // S)
    grp = h // (H // G)
    cols, ra = tl.arange(0, C), tl.arange(0, S)
    t0, lo, end, r, valid, rs, vs = sub_chunk(starts, lows, ends, p, i, C, S)
    kk = tl.arange(0, BK)
    _, _, short, long = sub_chunk_span(cum, t0, lo, end, i, h, H, K, kk, S, q.dtype.element_ty)
    keys = tl.where(short, (i + 1) * S, i * S)  # the keys the products reach: with the diagonal block if short
    p = tl.zeros([S, C], dtype=tl.float32)
    if (keys > 0) & (t0 + i * S < end):  # keys before the sub-chunk (its own if short), through its first row
        for kb in range(0, BK, KB):
            kb_kk = kb + tl.arange(0, KB)
            G_n = load_row(cum, t0 + i * S, lo, end, h, H, K, kb_kk).to(tl.float32)
            q_ref = to_ref(q, cum, t0, rs, vs, G_n, h, H, K, kb_kk, grp, G, True)
            k_ref = to_ref(k, cum, t0, r, valid & (r < keys), G_n, h, H, K, kb_kk, grp, G, False)
            p += tl.dot(q_ref, tl.trans(k_ref), input_precision=PRECISION)
    if long:  # the diagonal block column by column: key a, P[t, iS + a] = sum_k q_t exp(G_t - G_a) k_a, t >= a
        qs = load_tile(q, t0, rs, vs, grp, G, K, kk).to(tl.float32)
        Gs = load_tile(cum, t0, rs, vs, h, H, K, kk)
        for a in range(S):
            row = t0 + i * S + a
            k_a = load_row(k, row, lo, end, grp, G, K, kk).to(tl.float32)
            decay = decays_at(Gs, load_row(cum, row, lo, end, h, H, K, kk), ra, a, end - t0 - i * S, True)
            p += tl.where(cols[None, :] == i * S + a, tl.sum(qs * decay * k_a[None, :], 1)[:, None], 0.0)
    store_tile(scores, tl.where(cols[None, :] <= rs[:, None], p, 0.0), t0, rs, vs, h, H, C, cols)


@triton.jit
def m_block(do, v, lam, t0, q_rows, q_valid, k_rows, k_valid, scale, h, H, V, L, vv, LOG_C: tl.constexpr,
            PRECISION: tl.constexpr, PLAIN: tl.constexpr):
    """M = dA * Lambda on the queries q_rows x the keys k_rows of a chunk (in-chunk positions, [R] and [Q] with
    validity), fp32 [R, Q], 0 where key > query."""
    causal = q_rows[:, None] >= k_rows[None, :]
    do_q, v_k = load_tile(do, t0, q_rows, q_valid, h, H, V, vv), load_tile(v, t0, k_rows, k_valid, h, H, V, vv)
    d_a = tl.where(causal, tl.dot(do_q, tl.trans(v_k), input_precision=PRECISION) * scale, 0.0)
    levels = intra_levels(q_rows, k_rows, LOG_C)
    return d_a * level_weights(lam, t0 + q_rows, q_valid, h, H, L, levels, causal, LOG_C, PLAIN)


@triton.jit(do_not_specialize=["H", "G"])
def channel_dq_kernel(
    q, k, v, cum, lam, do, dq_in, starts, lows, ends, scale,
    H, G, K, V, L,
    C: tl.constexpr, S: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr, PLAIN: tl.constexpr,
):
    """dq_in = the in-chunk dQ of the queries of sub-chunk i of chunk p on key block kb ([tokens, H, K] in q's
    dtype, per value head; chunk_program: u = i * (BK // KB) + kb). v, do: [tokens, H, V]; lam: [tokens, H, L]
    (not read when PLAIN). Grid (NC (C // S) (BK // KB), H)."""
    h = tl.program_id(1)
    p, u = chunk_program((C // S) * (BK // KB))
    i, kb = u // (BK // KB), (u % (BK // KB)) * KB
    grp = h // (H // G)
    kk, vv, cols, ra = kb + tl.arange(0, KB), tl.arange(0, BV), tl.arange(0, C), tl.arange(0, S)
    t0, lo, end, r, valid, rs, vs = sub_chunk(starts, lows, ends, p, i, C, S)
    m = m_block(do, v, lam, t0, rs, vs, r, valid, scale, h, H, V, L, vv, LOG_C, PRECISION, PLAIN)  # [S, C]
    d_q = tl.zeros([S, KB], dtype=tl.float32)
    Gs = load_tile(cum, t0, rs, vs, h, H, K, kk)
    G_n, _, short, long = sub_chunk_span(cum, t0, lo, end, i, h, H, K, kk, S, k.dtype.element_ty)
    keys = tl.where(short, (i + 1) * S, i * S)  # with the diagonal block if short
    if (keys > 0) & (t0 + i * S < end):  # keys before the sub-chunk (its own if short), through its first row
        k_ref = to_ref(k, cum, t0, r, valid & (r < keys), G_n, h, H, K, kk, grp, G, False)
        to_query = tl.exp(tl.where(vs[:, None], Gs - G_n[None, :], float("-inf")))
        d_q = to_query * tl.dot(m.to(k_ref.dtype), k_ref, input_precision=PRECISION)
    if long:
        for a in range(S):  # key a of the sub-chunk: its column of M
            row = t0 + i * S + a
            m_col = tl.sum(tl.where(cols[None, :] == i * S + a, m, 0.0), 1)
            decay = decays_at(Gs, load_row(cum, row, lo, end, h, H, K, kk), ra, a, end - t0 - i * S, True)
            d_q += m_col[:, None] * decay * load_row(k, row, lo, end, grp, G, K, kk).to(tl.float32)[None, :]
    store_tile(dq_in, d_q, t0, rs, vs, h, H, K, kk)


@triton.jit(do_not_specialize=["H", "G"])
def channel_dk_kernel(
    q, k, v, cum, lam, do, dk_in, starts, lows, ends, scale,
    H, G, K, V, L,
    C: tl.constexpr, S: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr, PLAIN: tl.constexpr,
):
    """dk_in = the in-chunk dK of the keys of sub-chunk i of chunk p on key block kb ([tokens, H, K] in q's dtype,
    per value head; chunk_program: u = i * (BK // KB) + kb); arguments as channel_dq_kernel.
    Grid (NC (C // S) (BK // KB), H)."""
    h = tl.program_id(1)
    p, u = chunk_program((C // S) * (BK // KB))
    i, kb = u // (BK // KB), (u % (BK // KB)) * KB
    grp = h // (H // G)
    kk, vv, ra = kb + tl.arange(0, KB), tl.arange(0, BV), tl.arange(0, S)
    t0, lo, end, r, valid, rs, vs = sub_chunk(starts, lows, ends, p, i, C, S)
    m = m_block(do, v, lam, t0, r, valid, rs, vs, scale, h, H, V, L, vv, LOG_C, PRECISION, PLAIN)  # [C, S]
    d_k = tl.zeros([S, KB], dtype=tl.float32)
    Gs = load_tile(cum, t0, rs, vs, h, H, K, kk)
    _, G_e, short, long = sub_chunk_span(cum, t0, lo, end, i, h, H, K, kk, S, q.dtype.element_ty)
    queries = tl.where(short, i * S, (i + 1) * S)  # from the diagonal block on if short
    if t0 + queries < end:  # queries after the sub-chunk (its own if short), through its last row
        q_ref = to_ref(q, cum, t0, r, valid & (r >= queries), G_e, h, H, K, kk, grp, G, True)
        to_key = tl.exp(tl.where(vs[:, None], G_e[None, :] - Gs, float("-inf")))
        d_k = to_key * tl.dot(tl.trans(m.to(q_ref.dtype)), q_ref, input_precision=PRECISION)
    if long:
        for a in range(S):  # query a of the sub-chunk: its row of M
            row = t0 + i * S + a
            m_row = tl.sum(tl.where(r[:, None] == i * S + a, m, 0.0), 0)
            decay = decays_at(Gs, load_row(cum, row, lo, end, h, H, K, kk), ra, a, end - t0 - i * S, False)
            d_k += m_row[:, None] * decay * load_row(q, row, lo, end, grp, G, K, kk).to(tl.float32)[None, :]
    store_tile(dk_in, d_k, t0, rs, vs, h, H, K, kk)
