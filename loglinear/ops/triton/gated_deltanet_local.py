"""Chunk-local algebra of log-linear Gated DeltaNet (the WY/UT form, spec section 5), per chunk of C tokens.

Inside a chunk (G = local cumsum of g, Gamma[t, s] = exp(G_t - G_s) for s <= t, e = exp(G)):

    A     = strict_lower(beta_t Gamma[t, s] (k_t . k_s))
    T_g   = (I + A)^-1                                   unit lower triangular
    u     = T_g (beta * V)                               pseudo-values
    W~    = T_g (beta * e * K)
    QK    = tril(Q K^T) * Gamma
    qt    = e * Q - QK W~                                readout queries of the incoming states
    o     = ((QK T_g) * beta_s * Lambda) V               Lambda[t, s] = lambda_t[bit_length(t XOR s)]
    K~    = exp(G_last - G) * K,  decay = exp(G_last)    the chunk's transition h <- decay h - K~^T (W~ h)

This is what loglinear.ops.torch_chunk.forms.GatedDeltaNetForm computes, arranged for the kernels:
``chunk_local_torch`` is the differentiable torch form (the tests' reference), ``chunk_local_triton`` the
fused forward kernel and ``chunk_local_triton_bwd`` the fused backward (one program per chunk and head;
the triangular inverse by repeated squaring, T_g = (I - A)(I + A^2)(I + A^4)...(I + A^(C/2)), exact
because A^C = 0; the backward recomputes the forward's [C, C] blocks instead of storing them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loglinear.fenwick import chunk_bits, intra_chunk_levels
from loglinear.ops.triton.common import alloc, dot_precision, interpreting, next_pow2
from loglinear.ops.triton.intra import decay_matrix, intra_levels, level_weights

def dot_dtype(dtype: torch.dtype) -> torch.dtype:
    """Operand dtype of the kernels' products: bf16/fp16 stay, everything else runs in fp32.
    (Triton 3.9's interpreter multiplies bf16 operands as raw bits, so it gets fp32 operands.)"""
    low = (torch.float16,) if interpreting() else (torch.bfloat16, torch.float16)
    return dtype if dtype in low else torch.float32


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
def _chunk_setup(q, k, v, g, beta, lam, pid, C: tl.constexpr, K, V, LOG_C: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, PREC: tl.constexpr):
    """Loads one chunk and builds what both directions need: q, k [C, BK], v [C, BV] (input dtype), beta, G,
    Gamma, the level mask Lambda (causal), T_g and tril(Q K^T) * Gamma (fp32)."""
    rc = tl.arange(0, C)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    rows = pid * C + rc
    q_c = tl.load(q + rows[:, None] * K + rk[None, :], mask=rk[None, :] < K, other=0.0)
    k_c = tl.load(k + rows[:, None] * K + rk[None, :], mask=rk[None, :] < K, other=0.0)
    v_c = tl.load(v + rows[:, None] * V + rv[None, :], mask=rv[None, :] < V, other=0.0)
    b_c = tl.load(beta + rows)
    G = tl.cumsum(tl.load(g + rows), axis=0)
    causal = rc[:, None] >= rc[None, :]
    gamma = decay_matrix(G, causal)
    lev = intra_levels(rc, LOG_C)
    lam_c = level_weights(lam, rows, rc < C, 0, 1, LOG_C + 1, lev, causal, LOG_C)
    kk = tl.dot(k_c, tl.trans(k_c), input_precision=PREC)
    A = tl.where(rc[:, None] > rc[None, :], b_c[:, None] * gamma * kk, 0.0)
    # T_g = (I + A)^-1 = (I - A) prod_r (I + A^(2^r)), r = 1 .. c-1  (A is nilpotent: A^C = 0)
    Tg = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0) - A
    P = A
    for _ in tl.static_range(1, LOG_C):
        P = tl.dot(P, P, input_precision=PREC)
        Tg = Tg + tl.dot(Tg, P, input_precision=PREC)
    qk = tl.dot(q_c, tl.trans(k_c), input_precision=PREC) * gamma
    return q_c, k_c, v_c, b_c, G, gamma, lev, lam_c, kk, Tg, qk


@triton.jit
def _chunk_local_kernel(
    q, k, v, g, beta, lam, o, qt, wt, kt, u, decay,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """One chunk of one head.  q, k: [BH*N, C, K]; v: [BH*N, C, V]; g, beta: [BH*N, C] fp32;
    lam: [BH*N, C, c+1] fp32 (levels 0..c); outputs o: [BH*N, C, V] fp32, qt, wt, kt: [BH*N, C, K]
    and u: [BH*N, C, V] in the operand dtype, decay: [BH*N] fp32."""
    pid = tl.program_id(0).to(tl.int64)
    q_c, k_c, v_c, b_c, G, gamma, lev, lam_c, kk, Tg, qk = _chunk_setup(
        q, k, v, g, beta, lam, pid, C, K, V, LOG_C, BK, BV, PREC)
    rc = tl.arange(0, C)
    rows = pid * C + rc
    ck = rows[:, None] * K + tl.arange(0, BK)[None, :]
    cv = rows[:, None] * V + tl.arange(0, BV)[None, :]
    mk = tl.arange(0, BK)[None, :] < K
    mv = tl.arange(0, BV)[None, :] < V
    G_last = tl.sum(tl.where(rc == C - 1, G, 0.0), axis=0)
    e = tl.exp(G)
    dt = q_c.dtype
    u_c = tl.dot(Tg.to(dt), (b_c[:, None] * v_c).to(dt), input_precision=PREC)
    w_c = tl.dot(Tg.to(dt), (b_c[:, None] * e[:, None] * k_c).to(dt), input_precision=PREC)
    M = tl.dot(qk.to(dt), Tg.to(dt), input_precision=PREC) * b_c[None, :] * lam_c
    o_c = tl.dot(M.to(dt), v_c, input_precision=PREC)
    q_t = e[:, None] * q_c - tl.dot(qk.to(dt), w_c.to(dt), input_precision=PREC)
    k_t = tl.exp(G_last - G)[:, None] * k_c
    tl.store(o + cv, o_c, mask=mv)
    tl.store(u + cv, u_c.to(u.dtype.element_ty), mask=mv)
    tl.store(qt + ck, q_t.to(qt.dtype.element_ty), mask=mk)
    tl.store(wt + ck, w_c.to(wt.dtype.element_ty), mask=mk)
    tl.store(kt + ck, k_t.to(kt.dtype.element_ty), mask=mk)
    tl.store(decay + pid, tl.exp(G_last))


@triton.jit
def _chunk_local_bwd_kernel(
    q, k, v, g, beta, lam, do, dqt, dwt, dkt, du, ddecay,
    dq, dk, dv, dg, dbeta, dlam,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """Gradients of one chunk (the forward is recomputed in fp32).  Upstream: do, du: [BH*N, C, V];
    dqt, dwt, dkt: [BH*N, C, K]; ddecay: [BH*N] (fp32).  Outputs (fp32): dq, dk: [BH*N, C, K];
    dv: [BH*N, C, V]; dg, dbeta: [BH*N, C]; dlam: [BH*N, C, c+1].  With P = (QK T_g) * beta_s * Lambda,
    dP = do V^T and, backwards through the forward's lines (shapes [C, C] unless noted):

        dM = dP * beta_s * Lambda;  dLambda = dP * M * beta_s;  dbeta_s += colsum(dP * M * Lambda)
        dQK = dM T^T - dqt W~^T;   dT = QK^T dM + dW T(bk)^T + du (bv)^T,  dW = dwt - QK^T dqt
        dA = -T^T dT T^T (strict lower);  dKK = dA * beta_t * Gamma;  dGamma = dQK * QKraw + dA * beta_t * KK
        dk = dQK^T-ish terms + (dKK + dKK^T) k + beta e T^T dW + f dkt;  dG from e, K~, decay and Gamma;
        dg = reverse cumsum of dG.
    """
    pid = tl.program_id(0).to(tl.int64)
    q_c, k_c, v_c, b_c, G, gamma, lev, lam_c, kk, Tg, qk = _chunk_setup(
        q, k, v, g, beta, lam, pid, C, K, V, LOG_C, BK, BV, PREC)
    q_c, k_c, v_c = q_c.to(tl.float32), k_c.to(tl.float32), v_c.to(tl.float32)
    rc = tl.arange(0, C)
    rows = pid * C + rc
    ck = rows[:, None] * K + tl.arange(0, BK)[None, :]
    cv = rows[:, None] * V + tl.arange(0, BV)[None, :]
    mk = tl.arange(0, BK)[None, :] < K
    mv = tl.arange(0, BV)[None, :] < V
    causal = rc[:, None] >= rc[None, :]
    strict = rc[:, None] > rc[None, :]
    G_last = tl.sum(tl.where(rc == C - 1, G, 0.0), axis=0)
    e = tl.exp(G)
    f = tl.exp(G_last - G)
    bk = (b_c * e)[:, None] * k_c
    bv = b_c[:, None] * v_c
    w_c = tl.dot(Tg, bk, input_precision=PREC)
    M = tl.dot(qk, Tg, input_precision=PREC)

    do_c = tl.load(do + cv, mask=mv, other=0.0)
    du_c = tl.load(du + cv, mask=mv, other=0.0)
    dqt_c = tl.load(dqt + ck, mask=mk, other=0.0)
    dwt_c = tl.load(dwt + ck, mask=mk, other=0.0)
    dkt_c = tl.load(dkt + ck, mask=mk, other=0.0)
    dP = tl.where(causal, tl.dot(do_c, tl.trans(v_c), input_precision=PREC), 0.0)
    P = M * b_c[None, :] * lam_c
    dv_c = tl.dot(tl.trans(P), do_c, input_precision=PREC)
    dLam = dP * M * b_c[None, :]
    for level in tl.static_range(LOG_C + 1):
        tl.store(dlam + rows * (LOG_C + 1) + level, tl.sum(tl.where(lev == level, dLam, 0.0), axis=1))
    dM = dP * b_c[None, :] * lam_c
    db = tl.sum(dP * M * lam_c, axis=0)
    # qt = e q - QK W~;  M = QK T
    dQK = tl.dot(dM, tl.trans(Tg), input_precision=PREC) - tl.dot(dqt_c, tl.trans(w_c), input_precision=PREC)
    dW = dwt_c - tl.dot(tl.trans(qk), dqt_c, input_precision=PREC)
    dT = tl.dot(tl.trans(qk), dM, input_precision=PREC) + tl.dot(dW, tl.trans(bk), input_precision=PREC)
    dT += tl.dot(du_c, tl.trans(bv), input_precision=PREC)
    de = tl.sum(dqt_c * q_c, axis=1)
    dq_c = e[:, None] * dqt_c
    # QK = (q k^T) * Gamma
    dQKraw = dQK * gamma
    dGamma = tl.where(causal, dQK * tl.dot(q_c, tl.trans(k_c), input_precision=PREC), 0.0)
    dq_c += tl.dot(dQKraw, k_c, input_precision=PREC)
    dk_c = tl.dot(tl.trans(dQKraw), q_c, input_precision=PREC)
    # W~ = T bk, u = T bv
    dbk = tl.dot(tl.trans(Tg), dW, input_precision=PREC)
    dbv = tl.dot(tl.trans(Tg), du_c, input_precision=PREC)
    sbk = tl.sum(dbk * k_c, axis=1)
    dk_c += (b_c * e)[:, None] * dbk
    db += e * sbk + tl.sum(dbv * v_c, axis=1)
    de += b_c * sbk
    dv_c += b_c[:, None] * dbv
    # T = (I + A)^-1;  A = strict(beta_t Gamma KK)
    dA = -tl.dot(tl.trans(Tg), tl.dot(dT, tl.trans(Tg), input_precision=PREC), input_precision=PREC)
    dA = tl.where(strict, dA, 0.0)
    db += tl.sum(dA * gamma * kk, axis=1)
    dGamma += dA * b_c[:, None] * kk
    dKK = dA * b_c[:, None] * gamma
    dk_c += tl.dot(dKK + tl.trans(dKK), k_c, input_precision=PREC)
    # K~ = f k, decay = exp(G_last), e = exp(G), Gamma = exp(G_t - G_s)
    dk_c += f[:, None] * dkt_c
    skt = f * tl.sum(dkt_c * k_c, axis=1)
    dG_last = tl.sum(skt, axis=0) + tl.load(ddecay + pid) * tl.exp(G_last)
    dGg = dGamma * gamma
    dG = de * e - skt + tl.sum(dGg, axis=1) - tl.sum(dGg, axis=0) + tl.where(rc == C - 1, dG_last, 0.0)
    dg_c = tl.sum(dG, axis=0) - tl.cumsum(dG, axis=0) + dG
    tl.store(dq + ck, dq_c, mask=mk)
    tl.store(dk + ck, dk_c, mask=mk)
    tl.store(dv + cv, dv_c, mask=mv)
    tl.store(dg + rows, dg_c)
    tl.store(dbeta + rows, db)


def chunk_local_triton(q, k, v, g, beta, lam, dtype: torch.dtype) -> LocalOut:
    """The fused kernel; shapes as chunk_local_torch. q/k/v are read and qt/wt/kt/u written in the operand
    dtype of ``dtype`` (bf16/fp16 stay, else fp32); o_intra and decay are fp32."""
    b, H, N, C, K = q.shape
    V = v.shape[-1]
    nlev = chunk_bits(C) + 1
    dt = dot_dtype(dtype)
    flat = lambda x, d: x.reshape(b * H * N, *x.shape[3:]).to(d).contiguous()  # noqa: E731
    qf, kf, vf = flat(q, dt), flat(k, dt), flat(v, dt)
    gf, bf, lf = flat(g, torch.float32), flat(beta, torch.float32), flat(lam, torch.float32)
    nan = lambda *s, d=dt: alloc(s, d, q.device)  # noqa: E731
    M = b * H * N
    o, u = nan(M, C, V, d=torch.float32), nan(M, C, V)
    qt, wt, kt = nan(M, C, K), nan(M, C, K), nan(M, C, K)
    decay = nan(M, d=torch.float32)
    BK, BV = next_pow2(K), next_pow2(V)
    _chunk_local_kernel[(M,)](
        qf, kf, vf, gf, bf, lf, o, qt, wt, kt, u, decay,
        K=K, V=V, C=C, LOG_C=nlev - 1, BK=BK, BV=BV, PREC=dot_precision(dt),
        num_warps=1 if interpreting() else (4 if BK <= 64 else 8),
    )
    shape = lambda x: x.view(b, H, N, *x.shape[1:])  # noqa: E731
    return shape(o), shape(qt), shape(wt), shape(kt), shape(u), decay.view(b, H, N)


def chunk_local_triton_bwd(q, k, v, g, beta, lam, do, dqt, dwt, dkt, du, ddecay, dtype: torch.dtype):
    """Gradients of chunk_local for the upstream gradients of its six outputs (None = 0).
    Returns dq, dk, dv, dg, dbeta, dlam (fp32, shapes of the inputs)."""
    b, H, N, C, K = q.shape
    V = v.shape[-1]
    nlev = lam.shape[-1]
    dt = dot_dtype(dtype)
    M = b * H * N
    flat = lambda x, d: x.reshape(M, *x.shape[3:]).to(d).contiguous()  # noqa: E731
    up = lambda x, like: flat(torch.zeros_like(like) if x is None else x, torch.float32)  # noqa: E731
    f32 = torch.float32
    outs = [alloc((M, C, K), f32, q.device), alloc((M, C, K), f32, q.device), alloc((M, C, V), f32, q.device),
            alloc((M, C), f32, q.device), alloc((M, C), f32, q.device), alloc((M, C, nlev), f32, q.device)]
    BK, BV = next_pow2(K), next_pow2(V)
    _chunk_local_bwd_kernel[(M,)](
        flat(q, dt), flat(k, dt), flat(v, dt), flat(g, f32), flat(beta, f32), flat(lam, f32),
        up(do, v), up(dqt, q), up(dwt, q), up(dkt, q), up(du, v), up(ddecay, g[..., 0]).view(M), *outs,
        K=K, V=V, C=C, LOG_C=nlev - 1, BK=BK, BV=BV, PREC=dot_precision(dt),
        num_warps=1 if interpreting() else 8,
    )
    return tuple(x.view(b, H, N, *x.shape[1:]) for x in outs)


class ChunkLocal(torch.autograd.Function):
    """The chunk-local stage: fused forward kernel, fused backward kernel (recomputes the forward)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, lam, dtype):
        ctx.save_for_backward(q, k, v, g, beta, lam)
        ctx.dtype = dtype
        return chunk_local_triton(q, k, v, g, beta, lam, dtype)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        dx = chunk_local_triton_bwd(*saved, *grads, ctx.dtype)
        return (*[d.to(x.dtype) for d, x in zip(dx, saved)], None)


def chunk_local(q, k, v, g, beta, lam, dtype: torch.dtype) -> LocalOut:
    """The chunk-local stage with gradients (see ChunkLocal); shapes as chunk_local_torch."""
    return ChunkLocal.apply(q, k, v, g, beta, lam, dtype)

