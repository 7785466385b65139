"""Chunk-local algebra of log-linear Gated DeltaNet (the WY/UT form, spec section 5), per chunk of C tokens.

Inside a chunk (G = local cumsum of g, Gamma[t, s] = exp(G_t - G_s) for s <= t, e = exp(G); the kernels take the
op's raw log-decay g and read it as max(g, FLOOR), giving dg = 0 where g <= FLOOR, loglinear.ops.finite):

    A     = strict_lower(beta_t Gamma[t, s] (k_t . k_s))
    T_g   = (I + A)^-1                                   unit lower triangular
    u     = T_g (beta * V)                               pseudo-values
    W~    = T_g (beta * e * K)
    QK    = tril(Q K^T) * Gamma
    qt    = e * Q - QK W~                                readout queries of the incoming states
    o     = ((QK T_g) * beta_s * Lambda) V               Lambda[t, s] = lambda_t[bit_length(t XOR s)]
    K~    = exp(G_last - G) * K,  decay = exp(G_last)    the chunk's transition h <- decay h - K~^T (W~ h)

This is what loglinear.ops.torch_chunk.forms.GatedDeltaNetForm computes, arranged for the kernels:
``chunk_local_torch`` is the differentiable torch form (the tests' reference), ``chunk_local_segments`` the kernels
inside one autograd.Function, one program per chunk and head each (the last: per chunk and HP heads of a group):

    _chunk_inverse_kernel        T_g (unit_lower_inverse: doubling solved diagonal blocks, fp32)
    _chunk_local_kernel          qt, W~, K~, u, o, decay from T_g; keeps QK for the backward
    _chunk_local_bwd_cc_kernel   the [C, C] gradients from T_g, QK, W~ and u read back (no q, k: dA through
                                 W~ = T bk and u = T bv instead of dT), dV, dLambda; hands dQK, dA, dbk = T^T dW
                                 and the q/k-free parts of dG, dbeta to
    _chunk_local_bwd_k_kernel    dQ, dK summed over the program's heads, the terms of dg and dbeta with q and k
                                 (through K K^T, formed once per program), dg, dbeta.

The kernels
read the op's layouts (q, k: [b, T, G, K] of group h // (H / G); v: [b, T, H, V]; g, beta: [b, T, H];
lambda: [b, T, H, L]) with the chunk alignment (Chunking) as masks: no padded, expanded or flattened
copies, and the backward writes the gradients in those layouts.

With NORM (the op's use_qk_l2norm) the kernels that read q and k normalise their rows themselves, as
loglinear.inputs.l2norm does:

    r_t   = rsqrt(sum_k x[t, k]^2 + eps)   (fp32, from the loaded rows: a first pass over the K blocks, or
                                           the sums of a loop that reads them anyway)
    x_n   = r_t x_t

so everything above uses q_n, k_n (the kernels' dq, dk are the gradients w.r.t. them). The row factors are
not applied to the [C, K] tiles but joined with the factors the rows already get: the Grams' rows and
columns (Q_n K_n^T = diag(r_q) Q K^T diag(r_k)), e, f and beta e in the forward (qt = e r_q q - ..., K~ =
f r_k k, W~ = T (beta e r_k k)), the row sums of the [C, C] backward, and the columns / rows of dQK, dKK
in the key backward (dQ_n = e dqt + (dQK Gamma) diag(r_k) K, ...). After the group sum the norm's backward
dx = r (dx_n - x_n <x_n, dx_n>) runs in torch (l2norm_backward; [b, T, G, K]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loglinear.fenwick import chunk_bits, intra_chunk_levels
from loglinear.inputs import L2NORM_EPS, l2norm_backward
from loglinear.ops.triton.gated_deltanet.chunking import FP32_DOT, Chunking, FillChunks, chunk_tokens
from loglinear.ops.triton.shared.common import alloc, group_sum, next_pow2
from loglinear.ops.triton.shared.intra import (
    FLOOR, chunk_gates, decay_matrix, intra_levels, level_weights, store_level_sums,
)
from loglinear.ops.triton.shared.launch import group_parts, launch, launch_options
from loglinear.ops.triton.shared.rules import dot_dtype, dot_precision
from loglinear.ops.triton.shared.tiles import load_tile, store_tile

LocalOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def chunk_local_torch(q, k, v, g, beta, lam) -> LocalOut:
    """q, k: [b, H, N, C, K]; v: [b, H, N, C, V]; g, beta: [b, H, N, C]; lam: [b, H, N, C, c+1] (levels 0..c).

    Returns o_intra [b, H, N, C, V], qt, wt, kt [b, H, N, C, K], u [b, H, N, C, V], decay [b, H, N]."""
    C = q.shape[-2]
    G = torch.cumsum(g, dim=-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    gamma = torch.exp(torch.where(causal, G[..., :, None] - G[..., None, :], -torch.inf))
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    A = torch.tril(beta[..., :, None] * gamma * (k @ k.transpose(-1, -2)), diagonal=-1)
    Tg = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    e = torch.exp(G)[..., None]
    u = Tg @ (beta[..., None] * v)
    wt = Tg @ (beta[..., None] * e * k)
    qk = (q @ k.transpose(-1, -2)) * gamma
    lev = intra_chunk_levels(C, device=q.device)
    Lam = torch.gather(lam, -1, lev.expand(*lam.shape[:-1], C)) * causal
    o = ((qk @ Tg) * beta[..., None, :] * Lam) @ v
    qt = e * q - qk @ wt
    kt = torch.exp(G[..., -1:] - G)[..., None] * k
    return o, qt, wt, kt, u, torch.exp(G[..., -1])


@triton.jit
def _quarter(rc, s: tl.constexpr):
    """[C, C] mask of the lower-left quarters (second half rows, first half columns) of every 2^(s+1)-block."""
    lower = (((rc[:, None] >> s) % 2) == 1) & (((rc[None, :] >> s) % 2) == 0)
    return lower & ((rc[:, None] >> (s + 1)) == (rc[None, :] >> (s + 1)))


@triton.jit
def unit_lower_inverse(A, C: tl.constexpr, PREC: tl.constexpr = "tf32x3"):
    """(I + A)^-1 of a strictly lower triangular A: [C, C] fp32, by doubling solved diagonal blocks: when the
    diagonal blocks of size b are inverted (T block diagonal), every block of size 2b is finished by its
    lower-left quarter T21 = -T22 A21 T11 (block forward substitution):

        T <- T - T (A_q T),   A_q = A on the (second half rows, first half columns) of every 2b-block

    The 2 x 2 blocks are exact without products (T = I - A_q at b = 1); then log2(C) - 1 steps of two
    dependent [C, C] products at precision PREC (3xTF32: fp32-level error; the kernels pass TF32 for
    bf16/fp16 operands). Every entry formed is an entry of the inverse of a diagonal block, O(1) for the
    delta rule, so the error stays at the products' level. Summing powers of
    A instead (repeated squaring, (I - A)(I + A^2)...) is not stable: for near-parallel keys (early in
    training) the entries of A^16, A^32 grow like binomial coefficients (1e10 at C = 64) and their
    cancellation in tf32/bf16 products loses every digit (NaN). (Row-by-row forward substitution is as
    exact but takes C - 1 dependent steps, each two [C, C] reductions across warps.)"""
    rc = tl.arange(0, C)
    T = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0) - tl.where(_quarter(rc, 0), A, 0.0)
    for s in tl.static_range(1, 7):  # block sizes 2^s = 2, 4, ..., C / 2 (C <= 128)
        if (1 << s) < C:
            X = tl.dot(tl.where(_quarter(rc, s), A, 0.0), T, input_precision=PREC)
            T = T - tl.dot(T, X, input_precision=PREC)
    return T


@triton.jit
def _chunk_program(T, front, Tp, H, NG, n0, NS, C: tl.constexpr, HP: tl.constexpr = 1):
    """A chunk-local program's chunk n and head row bh (= batch row * H + head) on a grid (NS * BH / HP,) over the
    chunks n0 .. n0 + NS - 1 of every row and the heads in units of HP (HP consecutive heads of one q/k group):
    program (row * NS + n - n0) * (H / HP) + unit, heads_fastest's order (decoded in int32 here: the int64 row
    costs the [C, C] backward ~25 B more spills). Returns n, bh, its first token t0 and valid [C] (chunk_tokens),
    head h (the unit's first), q/k group, chunk rows rc [C] and the first row of the chunk in the [BH, Tp, *]
    stage tensors (tiles of those: load_tile(x, row0, rc, rc < C, 0, 1, D, cols))."""
    pid = tl.program_id(0)
    i, head = pid // (H // HP), pid % (H // HP) * HP
    n = n0 + i % NS
    bh = (i // NS * H + head).to(tl.int64)
    t0, rc, valid, h = chunk_tokens(n, bh, T, front, H, C)
    return n, bh, t0, valid, h, h // (H // NG), rc, bh * Tp + n * C


@triton.jit
def _row_norms(x, t0, valid, grp, NG, K, eps, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
               NORM: tl.constexpr):
    """[C] fp32: r_t = rsqrt(sum_k x[t, k]^2 + eps) of the chunk's rows of q or k [tokens, NG, K] (group grp)
    when NORM (loglinear.inputs.l2norm; one pass over the NK column blocks of BK), else 1."""
    r = tl.full([C], 1.0, tl.float32)
    rc = tl.arange(0, C)
    if NORM:
        ss = tl.zeros([C], dtype=tl.float32)
        for kb in range(NK):
            kc = kb * BK + tl.arange(0, BK)
            x_b = load_tile(x, t0, rc, valid, grp, NG, K, kc).to(tl.float32)
            ss += tl.sum(x_b * x_b, axis=1)
        r = tl.rsqrt(ss + eps)
    return r


@triton.jit
def _gram(x, rx, k, rk, t0, valid, grp, NG, K, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
          PREC: tl.constexpr, dt: tl.constexpr, NORM: tl.constexpr):
    """X K^T [C, C] fp32 of the chunk's rows of x, k [tokens, NG, K] (group grp), in NK column blocks of BK
    (operands in dt); when NORM of the rows scaled by rx, rk: the product's rows and columns scaled instead."""
    acc = tl.zeros([C, C], dtype=tl.float32)
    rc = tl.arange(0, C)
    for kb in range(NK):
        kc = kb * BK + tl.arange(0, BK)
        k_b = load_tile(k, t0, rc, valid, grp, NG, K, kc).to(dt)
        x_b = load_tile(x, t0, rc, valid, grp, NG, K, kc).to(dt)
        acc += tl.dot(x_b, tl.trans(k_b), input_precision=PREC)
    if NORM:
        acc = acc * rx[:, None] * rk[None, :]
    return acc


@triton.jit
def _chunk_gates(g, beta, tok, valid, h, H, C: tl.constexpr):
    """beta [C], G [C] (local cumsum of max(g, FLOOR), shared/intra.chunk_gates), Gamma [C, C] and the causal mask
    [C, C], fp32."""
    rc = tl.arange(0, C)
    causal = rc[:, None] >= rc[None, :]
    b_c = tl.load(beta + tok * H + h, mask=valid, other=0.0).to(tl.float32)
    G = chunk_gates(g, tok, valid, h, H)[0]
    return b_c, G, decay_matrix(G, causal), causal


@triton.jit
def _chunk_levels(lam, tok, valid, h, H, L, causal, C: tl.constexpr, LOG_C: tl.constexpr, PLAIN: tl.constexpr):
    """Lambda [C, C] fp32 (causal) of levels 0..c from lam [tokens, H, L]; 1 when PLAIN (lambda = 1, lam not read:
    every product it scales is causal already)."""
    if PLAIN:
        return tl.full([C, C], 1.0, tl.float32)
    r = tl.arange(0, C)
    return level_weights(lam, tok, valid, h, H, L, intra_levels(r, r, LOG_C), causal, LOG_C, False)


@triton.jit
def _chunk_inverse_kernel(
    k, g, beta, tg,
    T, front, Tp, H, NG, eps, n0, NS,
    K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, PREC: tl.constexpr, NORM: tl.constexpr,
):
    """Chunk n of head bh (grid NS * BH over the chunks n0 .., _chunk_program): T_g = (I + A)^-1 of
    A = strict_lower(beta_t Gamma[t, s] (k_t . k_s)) (unit_lower_inverse; k row-normalised when NORM) -> tg:
    [BH, Tp, C] in the operand dtype (row t of the chunk: T_g[t, :]).
    Read by the forward and the backward; alone in its kernel so its dependent products run at a few
    programs per SM (few registers) instead of inside the register-heavy chunk kernels."""
    _, _, t0, valid, h, grp, rc, row0 = _chunk_program(T, front, Tp, H, NG, n0, NS, C)
    tok = t0 + rc
    b_c, _, gamma, _ = _chunk_gates(g, beta, tok, valid, h, H, C)
    r_k = _row_norms(k, t0, valid, grp, NG, K, eps, C, BK, NK, NORM)
    kk = _gram(k, r_k, k, r_k, t0, valid, grp, NG, K, C, BK, NK, PREC, tg.dtype.element_ty, NORM)
    A = tl.where(rc[:, None] > rc[None, :], b_c[:, None] * gamma * kk, 0.0)
    store_tile(tg, unit_lower_inverse(A, C, PREC), row0, rc, rc < C, 0, 1, C, rc)


@triton.jit
def _chunk_local_kernel(
    q, k, v, g, beta, lam, tg, o, qt, wt, kt, u, qkg, decay,
    T, front, Tp, N, H, NG, L, eps, n0, NS,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, NV: tl.constexpr, PREC: tl.constexpr, NORM: tl.constexpr, PLAIN: tl.constexpr,
):
    """Chunk n of head bh (grid NS * BH over the chunks n0 .., _chunk_program).  Inputs in the op's layouts (any
    float dtype; module docstring) and T_g (tg: [BH, Tp, C], _chunk_inverse_kernel); outputs o: [BH, Tp, V] fp32,
    qt, wt, kt: [BH, Tp, K] and u: [BH, Tp, V] in the operand dtype, decay: [BH, N] fp32, and for the backward QK
    (qkg: [BH, Tp, C], operand dtype). K and V are walked in blocks; q and k row-normalised when NORM."""
    n, bh, t0, valid, h, grp, rc, row0 = _chunk_program(T, front, Tp, H, NG, n0, NS, C)
    tok = t0 + rc
    dt = qt.dtype.element_ty
    b_c, G, gamma, causal = _chunk_gates(g, beta, tok, valid, h, H, C)
    r_q = _row_norms(q, t0, valid, grp, NG, K, eps, C, BK, NK, NORM)
    r_k = _row_norms(k, t0, valid, grp, NG, K, eps, C, BK, NK, NORM)
    qkd = (_gram(q, r_q, k, r_k, t0, valid, grp, NG, K, C, BK, NK, PREC, dt, NORM) * gamma).to(dt)
    store_tile(qkg, qkd, row0, rc, rc < C, 0, 1, C, rc)
    lam_c = _chunk_levels(lam, tok, valid, h, H, L, causal, C, LOG_C, PLAIN)
    Tgd = load_tile(tg, row0, rc, rc < C, 0, 1, C, rc)
    G_last = tl.sum(tl.where(rc == C - 1, G, 0.0), axis=0)
    e = tl.exp(G)
    f = tl.exp(G_last - G)
    P = (tl.dot(qkd, Tgd, input_precision=PREC) * b_c[None, :] * lam_c).to(dt)
    for kb in range(NK):  # q_n = r_q q, k_n = r_k k: the row factors join e, f, beta e
        kc = kb * BK + tl.arange(0, BK)
        q_b = load_tile(q, t0, rc, valid, grp, NG, K, kc).to(dt).to(tl.float32)
        k_b = load_tile(k, t0, rc, valid, grp, NG, K, kc).to(dt).to(tl.float32)
        w_b = tl.dot(Tgd, ((b_c * e * r_k)[:, None] * k_b).to(dt), input_precision=PREC)
        store_tile(wt, w_b, row0, rc, rc < C, 0, 1, K, kc)
        q_t = (e * r_q)[:, None] * q_b - tl.dot(qkd, w_b.to(dt), input_precision=PREC)
        store_tile(qt, q_t, row0, rc, rc < C, 0, 1, K, kc)
        store_tile(kt, (f * r_k)[:, None] * k_b, row0, rc, rc < C, 0, 1, K, kc)
    for vb in range(NV):
        vc = vb * BV + tl.arange(0, BV)
        v_b = load_tile(v, t0, rc, valid, h, H, V, vc).to(dt)
        u_b = tl.dot(Tgd, (b_c[:, None] * v_b.to(tl.float32)).to(dt), input_precision=PREC)
        store_tile(u, u_b, row0, rc, rc < C, 0, 1, V, vc)
        store_tile(o, tl.dot(P, v_b, input_precision=PREC), row0, rc, rc < C, 0, 1, V, vc)
    tl.store(decay + bh * N + n, tl.exp(G_last))


@triton.jit
def _dot(a, b, dt: tl.constexpr, PREC: tl.constexpr):
    """a @ b with operands in dt (the backward's products take the operand dtype; fp32 accumulation)."""
    return tl.dot(a.to(dt), b.to(dt), input_precision=PREC)


@triton.jit
def _cc_tile(ptr, i, rc, C: tl.constexpr):
    """[C, C] block i of a chunk's scratch (row-major blocks of C x C)."""
    return ptr + i * C * C + rc[:, None] * C + rc[None, :]


@triton.jit
def _chunk_local_bwd_cc_kernel(
    v, g, beta, lam, tg, qkg, wt, u, do, dqt, dwt, du,
    dv, dlam, scratch, dGp, dbp, dbk, Gs,
    T, front, Tp, N, H, L,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, NV: tl.constexpr, PREC: tl.constexpr, PLAIN: tl.constexpr,
):
    """Backward, part 1, chunk n of head bh: everything of [C, C] size from the forward's T_g, QK, W~ and u
    (tg, qkg, wt, u; no q or k: with NORM they carry the row factors already), dV and dLambda.  Upstream:
    do: [BH, Tp, V] fp32, du: [BH, Tp, V], dqt, dwt: [BH, Tp, K] (operand dtype).  Outputs (valid tokens
    only, any float dtype): dv: [b, T, H, V], dlam: [b, T, H, L] (levels 0..c); for part 2: scratch
    [BH N, 2, C, C] (operand dtype) = dQK * Gamma, dA * Gamma, dGp and dbp [BH, Tp] fp32 (the parts of dG
    and dbeta without q and k), dbk = T^T dW [BH, Tp, K] (operand dtype; the gradient of bk) and the chunk-local
    cumsum G [BH, Tp] fp32.
    With P = (QK T) * beta_s * Lambda, M = QK T, QK = (Q K^T) * Gamma, bk = beta e K, bv = beta V, so that
    W~ = T bk and u = T bv:

        dP = do V^T;  dV = P^T do + beta dbv, dbv = T^T du;  dLambda = dP * M * beta_s;  dM = dP * beta_s * Lambda
        dQK = dM T^T - dqt W~^T;   dW = dwt - QK^T dqt;   dbk = T^T dW
        dA = -T^T dT T^T (strict lower), dT = QK^T dM + dW bk^T + du bv^T, taken as
        dA = -(M^T (dM T^T) + dbk W~^T + dbv u^T)      (no [C, C] dT, no products with T after the loops)
        dbp = rowsum(dbv * V) + colsum(dP * M * Lambda);  dGp = rowsum(dGg) - colsum(dGg), dGg = dQK * QK
    (the terms of dA * beta_t * A with K K^T, and those of dbk and dqt, are part 2's).
    """
    n, bh, t0, valid, h, _, rc, row0 = _chunk_program(T, front, Tp, H, 1, 0, N, C)
    tok = t0 + rc
    dt = dqt.dtype.element_ty  # the operand dtype: qt's gradient comes in qt's dtype
    causal = rc[:, None] >= rc[None, :]
    b_c = tl.load(beta + tok * H + h, mask=valid, other=0.0).to(tl.float32)
    Tg = load_tile(tg, row0, rc, rc < C, 0, 1, C, rc)
    qk = load_tile(qkg, row0, rc, rc < C, 0, 1, C, rc)
    M = tl.dot(qk, Tg, input_precision=PREC)
    P = (M * b_c[None, :] * _chunk_levels(lam, tok, valid, h, H, L, causal, C, LOG_C, PLAIN)).to(dt)
    # values: dP, dV and dbv u^T of dA, from u = T bv
    dP = tl.zeros([C, C], dtype=tl.float32)
    X = tl.zeros([C, C], dtype=tl.float32)  # -dA
    db = tl.zeros([C], dtype=tl.float32)
    for vb in range(NV):
        vc = vb * BV + tl.arange(0, BV)
        v_b = load_tile(v, t0, rc, valid, h, H, V, vc).to(dt)
        do_b = load_tile(do, row0, rc, rc < C, 0, 1, V, vc).to(dt)
        dbv = tl.dot(tl.trans(Tg), load_tile(du, row0, rc, rc < C, 0, 1, V, vc), input_precision=PREC)
        dP += tl.dot(do_b, tl.trans(v_b), input_precision=PREC)
        X += _dot(dbv, tl.trans(load_tile(u, row0, rc, rc < C, 0, 1, V, vc)), dt, PREC)
        db += tl.sum(dbv * v_b.to(tl.float32), axis=1)
        store_tile(dv, tl.dot(tl.trans(P), do_b, input_precision=PREC) + b_c[:, None] * dbv, t0, rc, valid, h, H, V, vc)
    dPM = tl.where(causal, dP, 0.0) * M
    if not PLAIN:
        store_level_sums(dlam, dPM * b_c[None, :], tok, valid, h, H, L, LOG_C)
    lam_c = _chunk_levels(lam, tok, valid, h, H, L, causal, C, LOG_C, PLAIN)  # again: not live in the value loop
    db += tl.sum(dPM * lam_c, axis=0)
    dQK = _dot(tl.where(causal, dP, 0.0) * b_c[None, :] * lam_c, tl.trans(Tg), dt, PREC)
    X += _dot(tl.trans(M), dQK, dt, PREC)
    # keys: qt = e q - QK W~,  W~ = T bk (the forward's wt)
    for kb in range(NK):
        kc = kb * BK + tl.arange(0, BK)
        dqt_b = load_tile(dqt, row0, rc, rc < C, 0, 1, K, kc)
        w_b = load_tile(wt, row0, rc, rc < C, 0, 1, K, kc)
        dW_b = load_tile(dwt, row0, rc, rc < C, 0, 1, K, kc).to(tl.float32)
        dW_b -= tl.dot(tl.trans(qk), dqt_b, input_precision=PREC)
        dQK -= tl.dot(dqt_b, tl.trans(w_b), input_precision=PREC)
        dbk_b = _dot(tl.trans(Tg), dW_b, dt, PREC).to(dt)
        store_tile(dbk, dbk_b, row0, rc, rc < C, 0, 1, K, kc)
        X += tl.dot(dbk_b, tl.trans(w_b), input_precision=PREC)
    # QK = QKraw * Gamma, A = strict(beta_t Gamma KK): Gamma's factors of dQK and dA (part 2 adds beta_t, KK)
    G = chunk_gates(g, tok, valid, h, H)[0]
    tl.store(Gs + row0 + rc, G)
    gamma = decay_matrix(G, causal)
    dGg = tl.where(causal, dQK * qk.to(tl.float32), 0.0)
    tl.store(dGp + row0 + rc, tl.sum(dGg, axis=1) - tl.sum(dGg, axis=0))
    tl.store(dbp + row0 + rc, db)
    out = scratch + (bh * N + n) * 2 * C * C
    tl.store(_cc_tile(out, 0, rc, C), (dQK * gamma).to(dt))
    tl.store(_cc_tile(out, 1, rc, C), tl.where(rc[:, None] > rc[None, :], -X * gamma, 0.0).to(dt))


@triton.jit
def _chunk_local_bwd_k_kernel(
    q, k, g, beta, dqt, dkt, ddecay, scratch, dGp, dbp, dbk, Gs,
    dq, dk, dg, dbeta,
    T, front, Tp, N, H, NG, eps,
    K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, HP: tl.constexpr, PREC: tl.constexpr,
    NORM: tl.constexpr,
):
    """Backward, part 2, chunk n of the HP value heads h0 .. h0 + HP - 1 of one q/k group: dQ and dK summed over
    those heads, and per head the terms of dG and dbeta with q and k, from part 1's scratch (dQK * Gamma,
    dA * Gamma), dGp, dbp, dbk and G (Gs).  Upstream: dqt, dkt: [BH, Tp, K] (operand dtype), ddecay: [BH, N].  Outputs
    (valid tokens only, any float dtype): dq, dk: [b, T, H / HP, K] (the program's sums; w.r.t. the
    row-normalised q_n, k_n when NORM), dg: [b, T, H] (reverse cumsum of dG, 0 where g <= FLOOR), dbeta:
    [b, T, H].  With more than one key block, dGp and dbp carry each head's sums from one block to the next (in
    place).  Per head (Q, K: q_n, k_n with NORM; DQ = dQK * Gamma, DA = dA * Gamma, KK = K K^T):

        dQ_h = e dqt + DQ K;   dK_h = DQ^T Q + (beta_t DA) K + (beta_t DA)^T K + beta e dbk + f dkt
        rho = rowsum(DA * KK),  kappa = colsum(beta_t DA * KK);  sbk = rowsum(dbk * K),  de = rowsum(dqt * Q) + beta sbk
        dbeta = dbp + rho + e sbk;   dG = dGp + e de + beta rho - kappa - f rowsum(dkt * K) + [last] dG_last

    The [C, C] factors of the products are the same for every head of a group, so they are summed over the heads
    first (SQ = sum DQ, SA = sum beta_t DA) and each key block takes three products per program, not four per head:

        sum_h dQ_h = sum_h e dqt + SQ K;   sum_h dK_h = SQ^T Q + (SA + SA^T) K + sum_h (beta e dbk + f dkt)

    Two loops over the heads: their [C, C] tiles (SQ, SA; rho and kappa into dbp, dGp in place), then per key
    block one pass in which each head's [C, BK] tiles of dqt, dbk, dkt are loaded together, their elementwise
    terms go into the block's dQ, dK sums and their row sums (linear in each block's part) into that head's dbeta
    and dG, finished in the last block (dbp, dGp carry them between blocks); the block's products follow the pass.
    """
    n, bh0, t0, valid, h0, grp, rc, row0 = _chunk_program(T, front, Tp, H, NG, 0, N, C, HP)
    tok = t0 + rc
    dt = dqt.dtype.element_ty
    # q_n = r_q q, k_n = r_k k: the row factors scale the [C, C] factors' columns / rows and the row sums
    r_q = _row_norms(q, t0, valid, grp, NG, K, eps, C, BK, NK, NORM)
    r_k = _row_norms(k, t0, valid, grp, NG, K, eps, C, BK, NK, NORM)
    kk = _gram(k, r_k, k, r_k, t0, valid, grp, NG, K, C, BK, NK, PREC, dt, NORM)
    SQ = tl.zeros([C, C], dtype=tl.float32)
    SA = tl.zeros([C, C], dtype=tl.float32)
    for e in tl.range(HP, disable_licm=True):  # no tile of the loop body lives across heads
        at = row0 + e * Tp + rc
        src = scratch + ((bh0 + e) * N + n) * 2 * C * C
        b_c = tl.load(beta + tok * H + h0 + e, mask=valid, other=0.0).to(tl.float32)
        DA = tl.load(_cc_tile(src, 1, rc, C)).to(tl.float32)
        bDA = b_c[:, None] * DA
        SQ += tl.load(_cc_tile(src, 0, rc, C)).to(tl.float32)
        SA += bDA
        rho = tl.sum(DA * kk, axis=1)
        tl.store(dbp + at, tl.load(dbp + at) + rho)
        tl.store(dGp + at, tl.load(dGp + at) + b_c * rho - tl.sum(bDA * kk, axis=0))
    pq = (SQ * r_k[None, :]).to(dt)  # DQ K_n
    pqt = (SQ * r_q[:, None]).to(dt)  # DQ^T Q_n
    pa = ((SA + tl.trans(SA)) * r_k[None, :]).to(dt)  # (beta_t DA + (beta_t DA)^T) K_n
    tl.debug_barrier()  # the key blocks read the dGp, dbp rows that other threads of the program stored
    for kb in tl.static_range(NK):
        kc = kb * BK + tl.arange(0, BK)
        q_b = load_tile(q, t0, rc, valid, grp, NG, K, kc).to(dt)
        k_b = load_tile(k, t0, rc, valid, grp, NG, K, kc).to(dt)
        dq_b = tl.zeros([C, BK], dtype=tl.float32)  # the heads' elementwise terms (the products follow the loop)
        dk_b = tl.zeros([C, BK], dtype=tl.float32)
        for e in tl.range(HP, disable_licm=True):
            h = h0 + e
            first = row0 + e * Tp  # the head's chunk in the [BH, Tp, *] stage tensors
            at = first + rc
            G, G_last = tl.load(Gs + at), tl.load(Gs + first + C - 1)
            ev, f = tl.exp(G), tl.exp(G_last - G)
            b_c = tl.load(beta + tok * H + h, mask=valid, other=0.0).to(tl.float32)
            dqt_b = load_tile(dqt, first, rc, rc < C, 0, 1, K, kc).to(tl.float32)
            dkt_b = load_tile(dkt, first, rc, rc < C, 0, 1, K, kc).to(tl.float32)
            dbk_b = load_tile(dbk, first, rc, rc < C, 0, 1, K, kc).to(tl.float32)
            db = tl.load(dbp + at)
            dG = tl.load(dGp + at)
            dq_b += ev[:, None] * dqt_b
            dk_b += (b_c * ev)[:, None] * dbk_b + f[:, None] * dkt_b
            # this block's share of the row sums (each a sum over key channels)
            sbk = tl.sum(dbk_b * k_b.to(tl.float32), axis=1) * r_k
            skt = tl.sum(dkt_b * k_b.to(tl.float32), axis=1) * f * r_k
            de = tl.sum(dqt_b * q_b.to(tl.float32), axis=1) * r_q + b_c * sbk
            db += ev * sbk
            # K~ = f k and the cascade's decay exp(G_last): row C - 1 of dG takes the sum over K~'s rows
            dG += ev * de - skt + tl.where(rc == C - 1, tl.sum(skt, axis=0), 0.0)
            if kb < NK - 1:  # carried to the next key block
                tl.store(dbp + at, db)
                tl.store(dGp + at, dG)
            else:
                tl.store(dbeta + tok * H + h, db, mask=valid)
                dG += tl.where(rc == C - 1, tl.load(ddecay + (bh0 + e) * N + n).to(tl.float32) * tl.exp(G_last), 0.0)
                dg_c = tl.sum(dG, axis=0) - tl.cumsum(dG, axis=0) + dG  # reverse cumsum of dG; 0 where g was floored
                floored = tl.load(g + tok * H + h, mask=valid, other=0.0).to(tl.float32) <= FLOOR
                tl.store(dg + tok * H + h, tl.where(floored, 0.0, dg_c), mask=valid)
        dq_b += tl.dot(pq, k_b, input_precision=PREC)
        dk_b += tl.dot(tl.trans(pqt), q_b, input_precision=PREC) + tl.dot(pa, k_b, input_precision=PREC)
        store_tile(dq, dq_b, t0, rc, valid, h0 // HP, H // HP, K, kc)
        store_tile(dk, dk_b, t0, rc, valid, h0 // HP, H // HP, K, kc)
        if kb < NK - 1:
            tl.debug_barrier()  # the next block reads the dGp, dbp rows that other threads of the program stored


def _meta(ch: Chunking, K: int, V: int, G: int, L: int | None, dt: torch.dtype, norm: bool) -> dict:
    """Runtime sizes and constexprs of the chunk-local kernels: V in blocks of <= 64 columns; K in blocks of
    kernel_meta's choice, at most BK_MAX (64 for fp32 operands: wider fp32 tiles spill KBs); norm: q/k rows
    normalised in the kernels (NORM, with l2norm's eps); L None: a plain call (PLAIN: lambda = 1, no lambda read,
    no dlambda written); fp32: the launches' (launch_options), not a kernel argument."""
    BV = min(64, next_pow2(V))
    return dict(
        T=ch.T, front=ch.front, Tp=ch.Tp, N=ch.N, H=ch.H, NG=G, L=L or 1, eps=L2NORM_EPS, PLAIN=L is None,
        K=K, V=V, C=ch.C, LOG_C=chunk_bits(ch.C), BV=BV, NV=triton.cdiv(V, BV),
        PREC=dot_precision(dt, FP32_DOT),
        NORM=norm, BK_MAX=64 if dt == torch.float32 else 128, fp32=dt == torch.float32,
    )


# per kernel: the widest key block (sm_90, triton 3.6, benchmarks/profiling/compile_sm90.py; warps and stages:
# shared/launch.py). Whole 128-column key blocks halve the inverse's Gram products (16-bit operands only); the
# forward and the [C, C] backward take 64 (at 128 the forward spills 256 B at 4 warps; the [C, C] backward at 4
# warps ran 4.0 ms at 64 against 4.4 at 128 on the H200 at 32K); the key backward 32 when a program sums a group's
# heads (at 4 warps, against 128 at 8: plain Gated DeltaNet 15.11 ms forward + backward at 32K against 15.42 on the
# H200, 17.54 against 17.76 on an H100) and the whole key, ONE_HEAD_KEY_BLOCK, with one head per program (G = H,
# the training models' K = 64: 6.24-6.28 ms plain against 6.30-6.49 at 32) (benchmarks/profiling/tune_gdn_local.py
# times other choices on a GPU).
KEY_BLOCK = {"_chunk_inverse_kernel": 128, "_chunk_local_kernel": 64, "_chunk_local_bwd_cc_kernel": 64,
             "_chunk_local_bwd_k_kernel": 32}
ONE_HEAD_KEY_BLOCK = 128


def kernel_meta(kernel, meta: dict) -> dict:
    """The entries of _meta that kernel takes, and its key block BK (NK blocks): KEY_BLOCK's, or for the key
    backward with one head per program (meta's HP = 1) ONE_HEAD_KEY_BLOCK; at most BK_MAX and the key's width."""
    one_head = kernel is _chunk_local_bwd_k_kernel and meta["HP"] == 1
    BK = min(ONE_HEAD_KEY_BLOCK if one_head else KEY_BLOCK[kernel.__name__], meta["BK_MAX"], next_pow2(meta["K"]))
    return {n: x for n, x in dict(meta, BK=BK, NK=triton.cdiv(meta["K"], BK)).items() if n in kernel.arg_names}


def _launch(kernel, ch: Chunking, meta: dict, *tensors: torch.Tensor, chunks: tuple[int, int] | None = None,
            HP: int = 1) -> None:
    """kernel over the chunks i0 .. i1 - 1 (chunks; None: all) of every head row, heads varying fastest in units of
    HP (_chunk_program)."""
    i0, i1 = chunks or (0, ch.N)
    launch(kernel, ((i1 - i0) * ch.BH // HP,), *tensors, **kernel_meta(kernel, dict(meta, n0=i0, NS=i1 - i0, HP=HP)),
           **launch_options(kernel, fp32=meta["fp32"]))


class ChunkLocal(torch.autograd.Function):
    """The chunk-local stage: the inverse kernel (T_g, kept for the backward), the fused forward kernel, and
    two backward kernels (they recompute the other [C, C] blocks from the op's tensors, which the forward
    saves as they are: no copies; q and k in the operand dtype, a cast only where they come in wider: the
    kernels would round them there anyway).  norm: q and k are row-normalised in the kernels (module
    docstring); the backward applies the norm's gradient to the kernels' group-summed dq_n, dk_n.  lam None: a
    plain call (lambda = 1; the kernels take g in its place and never read it, and lam gets no gradient).
    The forward allocates the outputs and appends to ``launches`` the function that fills them for the chunks
    i0 .. i1 - 1 of every row (chunk_local_segments): it launches no kernel itself."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, lam, ch: Chunking, dtype: torch.dtype, norm: bool, launches: list[FillChunks]):
        K, V, G, L = q.shape[-1], v.shape[-1], q.shape[2], None if lam is None else lam.shape[-1]
        dt, dev, BH, Tp = dot_dtype(dtype), q.device, ch.BH, ch.Tp
        ctx.qk_dtypes = q.dtype, k.dtype
        q, k = q.to(dt), k.to(dt)
        o, u = alloc((BH, Tp, V), torch.float32, dev), alloc((BH, Tp, V), dt, dev)
        qt, wt, kt = (alloc((BH, Tp, K), dt, dev) for _ in range(3))
        tg, qkg = alloc((BH, Tp, ch.C), dt, dev), alloc((BH, Tp, ch.C), dt, dev)
        decay = alloc((BH, ch.N), torch.float32, dev)
        meta = _meta(ch, K, V, G, L, dt, norm)

        def fill(i0: int, i1: int) -> None:
            _launch(_chunk_inverse_kernel, ch, meta, k, g, beta, tg, chunks=(i0, i1))
            _launch(_chunk_local_kernel, ch, meta, q, k, v, g, beta, g if lam is None else lam, tg, o, qt, wt, kt, u,
                    qkg, decay, chunks=(i0, i1))

        launches.append(fill)
        ctx.save_for_backward(q, k, v, g, beta, lam, tg, qkg, wt, u)  # wt, u: the scan keeps them anyway
        ctx.ch, ctx.dt, ctx.norm = ch, dt, norm
        return o, qt, wt, kt, u, decay

    @staticmethod
    def backward(ctx, do, dqt, dwt, dkt, du, ddecay):
        q, k, v, g, beta, lam, tg, qkg, wt, u = ctx.saved_tensors
        ch, dt = ctx.ch, ctx.dt
        b, T, G, K = q.shape
        plain = lam is None  # the [C, C] kernel neither reads lam nor writes dlam: g and dv hold their places
        H, V, L, dev = ch.H, v.shape[-1], None if plain else lam.shape[-1], q.device
        like = [((ch.BH, ch.Tp, V), torch.float32), *[((ch.BH, ch.Tp, K), dt)] * 3, ((ch.BH, ch.Tp, V), dt),
                ((ch.BH, ch.N), torch.float32)]
        up = [torch.zeros(s, dtype=d, device=dev) if x is None else x.contiguous()
              for x, (s, d) in zip((do, dqt, dwt, dkt, du, ddecay), like)]
        f32 = torch.float32
        # written once, in the inputs' dtypes; dq, dk as the key backward's sums over HP heads of a q/k group
        # (group_parts; summed over each group below)
        HP, dq = group_parts(ch.BH // H * ch.N, (b, T), H, G, K, dt, dev)
        dk = alloc(dq.shape, dq.dtype, dev)
        dv, dg, dbeta = alloc(v.shape, v.dtype, dev), alloc(g.shape, g.dtype, dev), alloc(beta.shape, beta.dtype, dev)
        dlam = None if plain else torch.zeros_like(lam)  # levels > c: the scan's part
        scratch = alloc((ch.BH * ch.N, 2, ch.C, ch.C), dt, dev)
        dGp, dbp, Gs = (alloc((ch.BH, ch.Tp), f32, dev) for _ in range(3))
        dbk = alloc((ch.BH, ch.Tp, K), dt, dev)
        do, dqt, dwt, dkt, du, ddecay = up
        meta = _meta(ch, K, V, G, L, dt, ctx.norm)
        _launch(_chunk_local_bwd_cc_kernel, ch, meta, v, g, beta, g if plain else lam, tg, qkg, wt, u, do, dqt, dwt,
                du, dv, dv if plain else dlam, scratch, dGp, dbp, dbk, Gs)
        _launch(_chunk_local_bwd_k_kernel, ch, meta, q, k, g, beta, dqt, dkt, ddecay, scratch, dGp, dbp, dbk, Gs, dq,
                dk, dg, dbeta, HP=HP)
        dq, dk = group_sum(dq, G, 2), group_sum(dk, G, 2)
        if ctx.norm:
            dq, dk = l2norm_backward(q, dq), l2norm_backward(k, dk)
        dtypes = (*ctx.qk_dtypes, v.dtype, g.dtype, beta.dtype)
        grads = [d.to(x) for d, x in zip((dq, dk, dv, dg, dbeta), dtypes)]
        return (*grads, None if plain else dlam.to(lam.dtype), None, None, None, None)


def chunk_local_segments(
    q, k, v, g, beta, lam, ch: Chunking, dtype: torch.dtype, qk_l2norm: bool = False,
) -> tuple[LocalOut, FillChunks]:
    """The chunk-local stage with gradients (see ChunkLocal), its kernels left to the caller: returns the outputs
    and fill(i0, i1), which fills them for the chunks i0 .. i1 - 1 of every row, on the current stream. The
    outputs are not filled until fill has covered every chunk (fenwick_delta_scan's produce does it, segment by
    segment beside the chain).  q, k: [b, T, G, K]; v: [b, T, H, V]; g, beta: [b, T, H]; lam: [b, T, H, L], or None
    for a plain call (lambda = 1) (any float dtypes, contiguous); ch: their chunking; dtype sets the operand dtype
    (dot_dtype); qk_l2norm: the kernels use l2norm(q), l2norm(k) (gradients w.r.t. q, k). Outputs: o_intra
    [BH, Tp, V] fp32, qt, wt, kt [BH, Tp, K] and u [BH, Tp, V] (operand dtype), decay [BH, N] fp32:
    chunk_local_torch's outputs of the padded chunks, flattened."""
    launches: list[FillChunks] = []
    lam = None if lam is None else lam.contiguous()
    out = ChunkLocal.apply(*(x.contiguous() for x in (q, k, v, g, beta)), lam, ch, dtype, qk_l2norm, launches)
    return out, launches[0]
