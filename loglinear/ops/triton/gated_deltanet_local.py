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
``chunk_local_torch`` is the differentiable torch form (used for the backward by recomputation),
``chunk_local_triton`` the fused forward kernel (one program per chunk and head; the triangular inverse
by repeated squaring, T_g = (I - A)(I + A^2)(I + A^4)...(I + A^(C/2)), exact because A^C = 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loglinear.fenwick import chunk_bits, intra_chunk_levels
from loglinear.ops.triton.common import alloc, dot_precision, interpreting, next_pow2

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
def _chunk_local_kernel(
    q, k, v, g, beta, lam, o, qt, wt, kt, u, decay,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, NLEV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """One chunk of one head.  q, k: [BH*N, C, K]; v: [BH*N, C, V]; g, beta: [BH*N, C] fp32;
    lam: [BH*N, C, NLEV] fp32 (levels 0..c); outputs o: [BH*N, C, V] fp32, qt, wt, kt: [BH*N, C, K]
    and u: [BH*N, C, V] in the operand dtype, decay: [BH*N] fp32."""
    pid = tl.program_id(0).to(tl.int64)
    rc = tl.arange(0, C)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    mk = rk[None, :] < K
    mv = rv[None, :] < V
    ck = (pid * C + rc)[:, None] * K + rk[None, :]
    cv = (pid * C + rc)[:, None] * V + rv[None, :]
    q_c = tl.load(q + ck, mask=mk, other=0.0)
    k_c = tl.load(k + ck, mask=mk, other=0.0)
    v_c = tl.load(v + cv, mask=mv, other=0.0)
    b_c = tl.load(beta + pid * C + rc)
    G = tl.cumsum(tl.load(g + pid * C + rc), axis=0)
    G_last = tl.sum(tl.where(rc == C - 1, G, 0.0), axis=0)
    causal = rc[:, None] >= rc[None, :]
    strict = rc[:, None] > rc[None, :]
    gamma = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
    eye = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)

    kk = tl.dot(k_c, tl.trans(k_c), input_precision=PREC)
    A = tl.where(strict, b_c[:, None] * gamma * kk, 0.0)
    # T_g = (I + A)^-1 = (I - A) prod_r (I + A^(2^r)), r = 1 .. c-1
    Tg = eye - A
    P = A
    for _ in tl.static_range(1, NLEV - 1):
        P = tl.dot(P, P, input_precision=PREC)
        Tg = Tg + tl.dot(Tg, P, input_precision=PREC)

    e = tl.exp(G)
    dt = q_c.dtype
    u_c = tl.dot(Tg.to(dt), (b_c[:, None] * v_c).to(dt), input_precision=PREC)
    w_c = tl.dot(Tg.to(dt), (b_c[:, None] * e[:, None] * k_c).to(dt), input_precision=PREC)
    qk = tl.dot(q_c, tl.trans(k_c), input_precision=PREC) * gamma
    # Lambda[t, s] = lam_t[bit_length(t XOR s)]; bit_length(x) = #{b : 2^b <= x}
    x = rc[:, None] ^ rc[None, :]
    lev = tl.zeros([C, C], dtype=tl.int32)
    for bit in tl.static_range(NLEV - 1):
        lev += (x >= (1 << bit)).to(tl.int32)
    lam_c = tl.zeros([C, C], dtype=tl.float32)
    for level in tl.static_range(NLEV):
        lam_l = tl.load(lam + (pid * C + rc) * NLEV + level)
        lam_c += tl.where(lev == level, lam_l[:, None], 0.0)
    M = tl.dot(qk.to(dt), Tg.to(dt), input_precision=PREC) * b_c[None, :] * tl.where(causal, lam_c, 0.0)
    o_c = tl.dot(M.to(dt), v_c, input_precision=PREC)
    q_t = e[:, None] * q_c - tl.dot(qk.to(dt), w_c.to(dt), input_precision=PREC)
    k_t = tl.exp(G_last - G)[:, None] * k_c
    tl.store(o + cv, o_c, mask=mv)
    tl.store(u + cv, u_c.to(u.dtype.element_ty), mask=mv)
    tl.store(qt + ck, q_t.to(qt.dtype.element_ty), mask=mk)
    tl.store(wt + ck, w_c.to(wt.dtype.element_ty), mask=mk)
    tl.store(kt + ck, k_t.to(kt.dtype.element_ty), mask=mk)
    tl.store(decay + pid, tl.exp(G_last))


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
        K=K, V=V, C=C, NLEV=nlev, BK=BK, BV=BV, PREC=dot_precision(dt),
        num_warps=1 if interpreting() else (4 if BK <= 64 else 8),
    )
    shape = lambda x: x.view(b, H, N, *x.shape[1:])  # noqa: E731
    return shape(o), shape(qt), shape(wt), shape(kt), shape(u), decay.view(b, H, N)


class ChunkLocal(torch.autograd.Function):
    """Forward by the fused kernel, backward by recomputing chunk_local_torch under autograd (fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, lam, dtype):
        ctx.save_for_backward(q, k, v, g, beta, lam)
        return chunk_local_triton(q, k, v, g, beta, lam, dtype)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().float().requires_grad_() for x in ctx.saved_tensors]
        with torch.enable_grad():
            outs = chunk_local_torch(*inputs)
        pairs = [(o, gr) for o, gr in zip(outs, grads) if gr is not None]
        dx = torch.autograd.grad([o for o, _ in pairs], inputs, [gr.float() for _, gr in pairs], allow_unused=True)
        dx = [None if d is None else d.to(x.dtype) for d, x in zip(dx, ctx.saved_tensors)]
        return (*dx, None)


def chunk_local(q, k, v, g, beta, lam, dtype: torch.dtype) -> LocalOut:
    """The chunk-local stage with gradients (see ChunkLocal); shapes as chunk_local_torch."""
    return ChunkLocal.apply(q, k, v, g, beta, lam, dtype)

