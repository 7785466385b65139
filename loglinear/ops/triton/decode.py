"""The fused decode step: carry + transition + deposit + readout of all Fenwick levels, level-parallel.

For the token at absolute position p (spec section 4), on each level l of a (sequence n, value head h) state:

    carry       2^l | p            (l <= ctz p):  acc += S_l,  S_l <- 0
                l == ctz(p) + 1:                  S_l <- S_l + acc
    transition  Mamba-2:  S_l <- exp(g) S_l
                GLA:      S_l <- diag(exp(g)) S_l                          g per key channel (PER_CHANNEL)
                GDN:      S_l <- exp(g) (S_l - beta k (k^T S_l))          rank-1, O(K BV)
    deposit     S_0 <- S_0 + beta k v^T                                    (beta = 1 for Mamba-2)
    readout     o <- scale sum_l lambda_l S_l^T q

Two launches (five with a key window, below). _decode_level_kernel: one program per (n, h, tile, group of LG
levels), the tile a [BKR, BV] block of the K x V state (the columns are independent, also under the delta rule; the
rows too for a decay-only transition, which takes blocks of ROW_BLOCK rows; the delta rule's k^T S needs all K
rows). For each level l of its group that takes a step of its own, a program moves the level's tile once: read,
transition, (l = 0) deposit, write, and its partial readout lambda_l S_l^T q over its rows into partial [N, H, L,
KB, V]. The carry belongs to the programs of level 0: they sum levels 0..ctz(p) (all held) into the target ctz(p) +
1 before rewriting level 0; the merged levels and the target take no step of their own, and a program none of whose
levels does returns at once. _decode_finish_kernel: one program per (n, h, FINISH_COLUMNS value columns) sums the
partial readouts of the levels written into o. The groups are independent programs, so the loads of different
levels are in flight together rather than one after another.

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
updates run in the finish kernel, after every program of the level kernel has read the old ones.
WINDOW (LAZY with the delta rule: Gated DeltaNet) adds the window of the last 2^WS_BITS tokens (keys [N, W, G, K],
betas, gates [N, W, H], values [N, W, H, V], the start [N]): level l's state is exp(s_l) R T_l, R the projections (I -
beta_i k_i k_i^T) of the window's tokens after w_l, the step that last wrote it (``_written``; loglinear.ops.decode has
the math). A level the token only decays (``_kept``) is read out as (R^T A_p^T q)^T exp(s_l + g) T_l, with no write; the
merged levels take their R before the carry sums them (``_project_tile``, Horner-wise: each token once), and at the
window's turn (p a multiple of W) every held level above the carry takes R and the token's transition in WY form and is
rewritten (``_turn_level``). In token form (``_tokens``: the block of levels 0..log2 W begins at or after the window's
start) those levels have no tiles: the window's tokens are read out by the query kernel's walk, and the turn folds them
into the carry's target (``_block_state``); before the first turn after the start they are tiles as above. Such a step
runs five launches: _decode_query_kernel forms the projected queries R^T A_p^T q once per (sequence, head), in token
form with the block's readout (level 0's partial readout), or at a turn the window's WY factor; the level kernel reads
out the kept levels (KEPT) in row blocks, as a decay-only step does, since their readout needs no k^T S; the level
kernel again, in whole columns, steps level 0 with the carry (in token form only the carry, at the turns);
_decode_turn_kernel, whose programs return at once between turns, rewrites the levels above the carry at a turn, in two
passes over row blocks; the finish kernel sums the readouts and writes the token into slot p mod W, after every reader
of the slot's old token. Level 0's pass and the turn each run on a side stream (ChainStreams; one stream on CPU) beside
the kept pass: the three touch disjoint levels, and the finish kernel waits for all three.
FENWICK=False is the plain recurrence (no carry, lambda = 1) of use_log_linear=False models: one level, whole
[K, BV] tiles, and (DIRECT) its programs write o themselves, with no finish kernel.
q, k are read from group h // (H // G); L2NORM normalises them in the kernel (x / sqrt(|x|^2 + 1e-6)).
The state is read and written once, (levels touched) * K * V * (bytes per element) per (sequence, head)
(docs/kernels.md, Decoding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from loglinear.ops.triton.shared.intra import bit_levels
from loglinear.ops.triton.shared.launch import launch, launch_options
from loglinear.ops.triton.shared.streams import ChainStreams
from loglinear.variants import Variant

if TYPE_CHECKING:
    from loglinear.ops.decode import KeyWindow

__all__ = ["fused_decode_step", "decode_backend"]


@triton.jit
def _level_roles(p, l):
    """Level l's part in the step of the token at position p (int64; l a scalar or a vector of levels): held before
    it (the state after p tokens), held after it, merged by the carry (l <= ctz p), the carry's target
    (l == ctz(p) + 1)."""
    one = tl.full((), 1, tl.int64)
    bit = one << tl.maximum(l - 1, 0)  # level l >= 1 holds bit l - 1 of the position
    started = (p + 0 * bit) > 0  # p > 0 in l's shape (TRITON_INTERPRET mistypes a scalar bool & a vector)
    held_in = started & ((l == 0) | (((p - 1) & bit) != 0))
    held_out = (l == 0) | ((p & bit) != 0)
    merge = started & ((p & ((one << l) - 1)) == 0)
    into = (l > 0) & started & ((p & (bit - 1)) == 0) & (merge == 0)
    return held_in, held_out, merge, into


@triton.jit
def _tile_ptr(s_ptr, n, l, h, H, K, V, L, rk, rv, NARROW: tl.constexpr):
    """Pointers to the [BKR, BV] tile (rows rk, columns rv) of level l, head h of sequence n in the levels
    [N, L, H, K, V]. Offsets in int64 (n is), NARROW: those within the level in int32. On the H200 at B = 16, 64K,
    int32 took the bf16 step from 69 to 60 us (Mamba-2) and from 80 to 65 us (GLA); the delta rule spilled with it
    (1.3-2.8x slower), and the plain step at B = 1 ran 10-30% slower: NARROW is for decay-only row blocks."""
    if NARROW:
        return s_ptr + ((n * L + l) * H + h) * K * V + (rk[:, None] * V + rv[None, :])
    return s_ptr + ((((n * L + l) * H + h) * K + rk[:, None]) * V + rv[None, :])


@triton.jit
def _load_level(s_ptr, ls_ptr, n, l, h, H, K, V, L, rk, rv, mk, tile, read,
                LAZY: tl.constexpr, PER_CHANNEL: tl.constexpr, ACC: tl.constexpr, NARROW: tl.constexpr):
    """Level l's state of (sequence n, head h): the [BKR, BV] tile, 0 where not ``read``; lazy: times exp(its
    log-scale), one per head or per key channel."""
    S = tl.load(_tile_ptr(s_ptr, n, l, h, H, K, V, L, rk, rv, NARROW), mask=tile & read, other=0.0).to(ACC)
    if LAZY:
        if PER_CHANNEL:
            S = S * tl.exp(tl.load(ls_ptr + ((n * L + l) * H + h) * K + rk, mask=mk & read, other=0.0))[:, None]
        else:
            S = S * tl.exp(tl.load(ls_ptr + (n * L + l) * H + h, mask=read, other=0.0))
    return S


@triton.jit
def _store_level(s_ptr, S, n, l, h, H, K, V, L, rk, rv, tile, NARROW: tl.constexpr):
    tl.store(_tile_ptr(s_ptr, n, l, h, H, K, V, L, rk, rv, NARROW), S.to(s_ptr.dtype.element_ty), mask=tile)


@triton.jit
def _transition(S, k, decay, beta, HAS_BETA: tl.constexpr):
    """S <- exp(g) S, diag(exp(g)) S (decay [BKR, 1]) or exp(g) (S - beta k (k^T S))."""
    if HAS_BETA:
        kS = tl.sum(k[:, None] * S, 0)
        S = S - beta * k[:, None] * kS[None, :]
    return decay * S


@triton.jit
def _window_start(p, m):
    """((p - 1) >> m) << m: the last step before the token at p whose position is a multiple of 2^m."""
    return ((p - 1) >> m) << m


@triton.jit
def _written(p, l, WS_BITS):
    """The position whose step last wrote level l (held before the token at p) with a key window of 2^WS_BITS
    tokens (loglinear.ops.decode.window_written)."""
    return _window_start(p, tl.minimum(tl.maximum(l - 1, 0), WS_BITS))


@triton.jit
def _tokens(p, e, WS_BITS):
    """Whether levels 0..log2 W of the state after p tokens are in token form: their block starts at or after the
    window's start e (loglinear.ops.decode.token_form)."""
    return _window_start(p, WS_BITS) >= e


@triton.jit
def _token_forms(ws_ptr, n, p, WS_BITS):
    """Whether levels 0..log2 W of sequence n are in token form before the token at p and after it (``_tokens``,
    the window's start read from ws [N])."""
    e = tl.load(ws_ptr + n)
    return _tokens(p, e, WS_BITS), _tokens(p + 1, e, WS_BITS)


@triton.jit
def _slot(i, WS_BITS):
    """Token i's slot in a key window of 2^WS_BITS tokens, i mod 2^WS_BITS (0 at the window's turns)."""
    return i & ((1 << WS_BITS) - 1)


@triton.jit
def _window_factor(wk_ptr, wb_ptr, n, i, h, H, G, grp, K, WS_BITS, rk, mk, ACC: tl.constexpr):
    """The key [BK] and beta of token i in the window (slot i mod 2^WS_BITS)."""
    slot = _slot(i, WS_BITS)
    k = tl.load(wk_ptr + (((n << WS_BITS) + slot) * G + grp) * K + rk, mask=mk, other=0.0).to(ACC)
    return k, tl.load(wb_ptr + ((n << WS_BITS) + slot) * H + h).to(ACC)


@triton.jit
def _window_rows(wk_ptr, n, p, rows, G, grp, K, WS_BITS):
    """Where the keys of the window's tokens p - W + 1 + rows start (row r of the WY factor at the turn p): [WP]
    pointers into keys [N, W, G, K]."""
    return wk_ptr + (((n << WS_BITS) + _slot(p + 1 + rows, WS_BITS)) * G + grp) * K


@triton.jit
def _wy_tile(wy_ptr, n, h, H, WS_BITS, rows):
    """Pointers to (sequence n, head h)'s WY factor [W, W] in wy [N, H, W, W], as a [WP, WP] tile, and its mask."""
    W = 1 << WS_BITS
    inside = (rows < W)[:, None] & (rows < W)[None, :]
    return wy_ptr + ((n * H + h) * W + rows[:, None]) * W + rows[None, :], inside


@triton.jit
def _project_tile(S, first, last, wk_ptr, wb_ptr, n, h, H, G, grp, K, WS_BITS, rk, mk, ACC: tl.constexpr):
    """A lazy level's pending projections on its tile: S <- (I - beta_i k_i k_i^T) S for the window's tokens
    i = first .. last, oldest first."""
    k_next, beta_next = _window_factor(wk_ptr, wb_ptr, n, first, h, H, G, grp, K, WS_BITS, rk, mk, ACC)
    for i in range(first, last + 1):
        k, beta = k_next, beta_next  # the next token's factors load during this one's (every slot is in bounds)
        k_next, beta_next = _window_factor(wk_ptr, wb_ptr, n, i + 1, h, H, G, grp, K, WS_BITS, rk, mk, ACC)
        S = S - beta * k[:, None] * tl.sum(k[:, None] * S, 0)[None, :]
    return S


@triton.jit
def _decode_query_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, lam_ptr, wk_ptr, wb_ptr, wv_ptr, wg_ptr, ws_ptr, pos_ptr,
                         xq_ptr, wy_ptr, part_ptr, H, G, K, V, L, KB, WS_BITS, lam_sn, lam_sh, BK: tl.constexpr,
                         WP: tl.constexpr, WP_BITS: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                         ACC: tl.constexpr):
    """One program per (sequence n, head h), before the level kernel (WP = 2^WP_BITS >= W rows for the window).
    Between the window's turns it forms the projected queries that the levels the token only decays read out with,
    xq[n, h, m] = R_m^T A_p^T q ([N, H, WS_BITS + 1, K]): A_p = I - beta k k^T the token's projection, R_m the
    product of the window's tokens w_m + 1 .. p - 1, w_m = _window_start(p, m) (``_written`` of the levels l with
    min(l - 1, WS_BITS) = m). One walk over the window, newest token first: x <- (I - beta_i k_i k_i^T) x for
    i = p - 1, p - 2, .., stored as xq[m] on reaching w_m + 1, so that x^T T_l = q^T A_p R_m T_l. A level program
    reads its row instead of walking the window itself (once per value block).
    In token form (``_tokens``) the same walk reads out the block's tokens b = w_WS_BITS .. p - 1 from the window:
    token i deposited beta_i k_i v_i^T and took the transitions of i + 1 .. p since, so its share of the readout is
    lambda[level(p, i)] exp(g_{i+1} + .. + g_p) beta_i (k_i . x) v_i with x the query projected through i + 1 .. p,
    the x the walk holds on reaching i (k_i . x is the projection's own product). With the token's own share
    lambda_0 beta (k . q) v it is level 0's partial readout (row block 0).
    At a turn it forms the window's WY factor instead (``_wy_factor``, wy [N, H, W, W]), with which the turn
    kernel rewrites the held levels, stores the token's key (normalised) as xq[n, h, 0] for the turn kernel, and in
    token form adds the token's own share. The window does not hold the token
    yet: the finish kernel writes it, after every reader of the slot's old token."""
    n = (tl.program_id(0) // H).to(tl.int64)
    h = tl.program_id(0) % H
    p = tl.load(pos_ptr + n)
    grp = h // (H // G)
    rk = tl.arange(0, BK)
    mk = rk < K
    k = _head_vector(k_ptr, (n * G + grp) * K, rk, mk, K, BK, L2NORM, ACC)
    beta = tl.load(beta_ptr + n * H + h).to(ACC)
    q = _head_vector(q_ptr, (n * G + grp) * K, rk, mk, K, BK, L2NORM, ACC)
    tokens = _tokens(p + 1, tl.load(ws_ptr + n), WS_BITS)
    kq = tl.sum(k * q, 0)
    rows = tl.arange(0, WP)
    shares = tl.zeros((WP,), dtype=ACC)  # the window tokens' readout shares by slot, before lambda
    if (p > 0) & (_slot(p, WS_BITS) == 0):  # the turn: every held level above the carry is rewritten
        _wy_factor(k, beta, wk_ptr, wb_ptr, wy_ptr, n, p, h, H, G, grp, K, WS_BITS, rk, mk, WP, ACC)
        tl.store(xq_ptr + (n * H + h) * (WS_BITS + 1) * K + rk, k, mask=mk)  # the turn's last key, as used
    elif p > 0:
        x = q - beta * k * kq
        i = p - 1  # the next token to apply
        log_decay = tl.load(g_ptr + n * H + h).to(ACC)  # g_{i+1} + .. + g_p
        k_next, beta_next = _window_factor(wk_ptr, wb_ptr, n, i, h, H, G, grp, K, WS_BITS, rk, mk, ACC)
        for m in range(0, WS_BITS + 1):
            for _ in range(0, i - _window_start(p, m)):
                k_i, beta_i = k_next, beta_next  # the next token's factors load during this one's
                k_next, beta_next = _window_factor(wk_ptr, wb_ptr, n, i - 1, h, H, G, grp, K, WS_BITS, rk, mk, ACC)
                kx = tl.sum(k_i * x, 0)
                shares = tl.where(rows == _slot(i, WS_BITS), tl.exp(log_decay) * beta_i * kx, shares)
                log_decay += tl.load(wg_ptr + ((n << WS_BITS) + _slot(i, WS_BITS)) * H + h).to(ACC)
                x = x - beta_i * k_i * kx
                i -= 1
            tl.store(xq_ptr + ((n * H + h) * (WS_BITS + 1) + m) * K + rk, x, mask=mk)
        # the block's first token, i = w_WS_BITS: its factors are the last ones loaded
        shares = tl.where(rows == _slot(i, WS_BITS), tl.exp(log_decay) * beta_next * tl.sum(k_next * x, 0), shares)
    if tokens:
        _block_readout(shares, beta * kq, p, v_ptr, wv_ptr, lam_ptr, part_ptr, n, h, H, V, L, KB, WS_BITS, lam_sn,
                       lam_sh, rows, WP, WP_BITS, BV, ACC)


@triton.jit
def _block_readout(shares, own, p, v_ptr, wv_ptr, lam_ptr, part_ptr, n, h, H, V, L, KB, WS_BITS, lam_sn, lam_sh,
                   rows, WP: tl.constexpr, WP_BITS: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr):
    """Level 0's partial readout in token form: sum over the window's slots s of lambda[level(p, i_s)] shares[s]
    v_{i_s} (the block's tokens i_s = b + s before p, b its first position) plus the token's own lambda_0 own v,
    stored in value blocks of BV into row block 0 of level 0 in partial [N, H, L, KB, V]."""
    before = rows < _slot(p, WS_BITS)  # the block's tokens before p (none at a turn)
    level = bit_levels((_slot(p, WS_BITS) ^ rows).to(tl.int32), WP_BITS)  # level(p, i_s): p xor i_s is below W
    lam = lam_ptr + n * lam_sn + h * lam_sh
    weights = tl.where(before, shares * tl.load(lam + level, mask=before, other=0.0).to(ACC), 0.0)
    own = own * tl.load(lam).to(ACC)
    slots = (n << WS_BITS) + rows
    for v0 in range(0, V, BV):
        rv = v0 + tl.arange(0, BV)
        mv = rv < V
        vw = tl.load(wv_ptr + (slots * H + h)[:, None] * V + rv[None, :], mask=before[:, None] & mv[None, :],
                     other=0.0).to(ACC)
        r = tl.sum(weights[:, None] * vw, 0) + own * tl.load(v_ptr + (n * H + h) * V + rv, mask=mv, other=0.0).to(ACC)
        tl.store(part_ptr + (n * H + h) * L * KB * V + rv, r, mask=mv)


@triton.jit
def _wy_factor(k, beta, wk_ptr, wb_ptr, wy_ptr, n, p, h, H, G, grp, K, WS_BITS, rk, mk, WP: tl.constexpr,
               ACC: tl.constexpr):
    """The window's WY factor at a turn, for the product of the W tokens' projections in position order (rows
    r = 0 .. W - 1: the tokens p - W + 1 + r, the last the token at p, whose key k and beta the caller has):

        A_{W-1} .. A_1 A_0 = I - K^T T K,   A_r = I - b_r k_r k_r^T,   T = (I + N)^{-1} diag(b),
        N = strictly lower part of diag(b) K K^T                         K: [W, K] the keys as rows

    (by induction over r: the r-th row of T K S is b_r k_r^T of the state after the tokens before r). T is lower
    triangular, formed row by row: row i of (I + N)^{-1} is e_i - sum_{j < i} N_ij (row j). Stored to wy
    [N, H, W, W]; WP >= W rows in registers."""
    rows = tl.arange(0, WP)
    W = 1 << WS_BITS
    earlier = rows < W - 1  # the window's tokens; row W - 1 is the token at p
    kw = tl.load(_window_rows(wk_ptr, n, p, rows, G, grp, K, WS_BITS)[:, None] + rk[None, :],
                 mask=earlier[:, None] & mk[None, :], other=0.0).to(ACC)
    kw = tl.where((rows == W - 1)[:, None], k[None, :], kw)
    slots = _slot(p + 1 + rows, WS_BITS)
    bw = tl.where(rows == W - 1, beta, tl.load(wb_ptr + ((n << WS_BITS) + slots) * H + h, mask=earlier,
                                               other=0.0).to(ACC))
    inv = tl.zeros((WP, WP), dtype=ACC)
    for i in range(0, W):
        ki = tl.sum(tl.where((rows == i)[:, None], kw, 0.0), 0)
        bi = tl.sum(tl.where(rows == i, bw, 0.0), 0)
        ni = tl.where(rows < i, bi * tl.sum(kw * ki[None, :], 1), 0.0)  # row i of N
        inv = tl.where((rows == i)[:, None], ((rows == i).to(ACC) - tl.sum(ni[:, None] * inv, 0))[None, :], inv)
    wy, inside = _wy_tile(wy_ptr, n, h, H, WS_BITS, rows)
    tl.store(wy, inv * bw[None, :], mask=inside)


@triton.jit
def _turn_level(s_ptr, ls_ptr, wk_ptr, wy_ptr, q_ptr, xq_ptr, lam_ptr, part_ptr, decay, n, l, h, p, vb, H, G, grp, K, V,
                L, KB, WS_BITS, lam_sn, lam_sh, BK: tl.constexpr, RB: tl.constexpr, BV: tl.constexpr, WP: tl.constexpr,
                L2NORM: tl.constexpr, ACC: tl.constexpr):
    """At the window's turn, held level l above the carry (its state exp(s_l) R T_l, R the tokens p - W + 1 .. p - 1:
    the step at p - W, the previous turn, last wrote it; the levels l <= log2 W merge at a turn) takes them and the
    token's own transition, S <- exp(g) (I - K^T T K) exp(s_l) T_l (``_wy_factor``: the W tokens' projections), is
    rewritten and read out, over the program's value columns vb * BV .. vb * BV + BV - 1 in two passes over blocks of
    RB rows: Y = T sum_b K_b S_b, then S_b <- exp(g) (S_b - K_b^T Y), stored, and its readout lambda_l S^T q summed
    into the partial readouts' row block 0. Three products instead of W - 1 rank-1 projections one after another,
    each a reduction across the program's warps."""
    rows = tl.arange(0, WP)
    keys = _window_rows(wk_ptr, n, p, rows, G, grp, K, WS_BITS)
    own_key = xq_ptr + (n * H + h) * (WS_BITS + 1) * K  # the query kernel's copy of the token's key
    rv = vb * BV + tl.arange(0, BV)
    Y = tl.zeros((WP, BV), dtype=ACC)
    for b in range(0, tl.cdiv(K, RB)):
        _, _, S, kb = _turn_block(s_ptr, ls_ptr, keys, own_key, n, l, h, H, K, V, L, WS_BITS, b, rows, rv, RB, ACC)
        Y += tl.dot(kb, S, input_precision="ieee")
    wy, inside = _wy_tile(wy_ptr, n, h, H, WS_BITS, rows)
    T = tl.load(wy, mask=inside, other=0.0)
    Y = tl.dot(T, Y, input_precision="ieee")
    r = tl.zeros((BV,), dtype=ACC)
    for b in range(0, tl.cdiv(K, RB)):
        rk, tile, S, kb = _turn_block(s_ptr, ls_ptr, keys, own_key, n, l, h, H, K, V, L, WS_BITS, b, rows, rv, RB,
                                      ACC)
        S = decay * (S - tl.dot(tl.trans(kb), Y, input_precision="ieee"))
        _store_level(s_ptr, S, n, l, h, H, K, V, L, rk, rv, tile, True)
        r += tl.sum(_head_vector(q_ptr, (n * G + grp) * K, rk, rk < K, K, BK, L2NORM, ACC)[:, None] * S, 0)
    w = tl.load(lam_ptr + n * lam_sn + h * lam_sh + l).to(ACC)
    tl.store(part_ptr + ((n * H + h) * L + l) * KB * V + rv, w * r, mask=rv < V)


@triton.jit
def _turn_block(s_ptr, ls_ptr, keys, own_key, n, l, h, H, K, V, L, WS_BITS, b, rows, rv, RB: tl.constexpr,
                ACC: tl.constexpr):
    """Row block b of the turn: its rows rk [RB] and [RB, BV] mask, level l's lazy state over them and the value
    columns rv, and the keys of the window's tokens p - W + 1 .. p over them [WP, RB] (the last the token's own, at
    own_key, which the window does not hold yet; rows past W 0)."""
    rk = b * RB + tl.arange(0, RB)
    tile = (rk < K)[:, None] & (rv < V)[None, :]
    S = _load_level(s_ptr, ls_ptr, n, l, h, H, K, V, L, rk, rv, rk < K, tile, True, True, False, ACC, True)
    W = 1 << WS_BITS
    kb = tl.load(keys[:, None] + rk[None, :], mask=(rows < W - 1)[:, None] & (rk < K)[None, :], other=0.0).to(ACC)
    own = tl.load(own_key + rk, mask=rk < K, other=0.0)
    return rk, tile, S, tl.where((rows == W - 1)[:, None], own[None, :], kb)


@triton.jit
def _readout(part_ptr, o_ptr, q, S, w, scale, n, l, h, kb, H, V, L, KB, rv, mv, DIRECT: tl.constexpr):
    """Level l's readout w S^T q over the program's rows: its row of the partial readouts [N, H, L, KB, V], or
    (DIRECT: one level, one row block) o itself."""
    r = w * tl.sum(q[:, None] * S, 0)
    if DIRECT:
        tl.store(o_ptr + (n * H + h) * V + rv, (scale * r).to(o_ptr.dtype.element_ty), mask=mv)
    else:
        tl.store(part_ptr + (((n * H + h) * L + l) * KB + kb) * V + rv, r, mask=mv)


@triton.jit
def _carry(k, decay, beta, lam_ptr, s_in_ptr, s_out_ptr, ls_ptr, wk_ptr, wb_ptr, wv_ptr, wg_ptr, part_ptr, o_ptr, q, p,
           tokens, scale, n, h, kb, H, G, grp, K, V, L, KB, WS_BITS, lam_sn, lam_sh, rk, rv, mk, mv, tile,
           BKR: tl.constexpr, BV: tl.constexpr, HAS_BETA: tl.constexpr,
           PER_CHANNEL: tl.constexpr, IN_PLACE: tl.constexpr, LAZY: tl.constexpr, WINDOW: tl.constexpr,
           DIRECT: tl.constexpr, ACC: tl.constexpr, NARROW: tl.constexpr):
    """The carry of the token at position p > 0 (run by level 0's programs, before they rewrite level 0): the sum
    of levels 0..ctz(p) (all held; WINDOW: each after its pending projections R_j, the tokens w_j + 1 .. p - 1,
    summed Horner-wise from the highest level down so that each of the window's tokens projects the running sum
    once: up to W - 1 projections, not one run per merged level; in token form ``_block_state``), emptied (lazy: by
    their log-scale, set in the finish kernel), goes into level c = ctz(p) + 1, which then takes the token's
    transition and its readout."""
    # levels 0..c-1 merge; counted over 64 levels whatever L (with 16 the carry ran 1.3-2.7x slower on the H200)
    _, _, merge, _ = _level_roles(p, tl.arange(0, 64))
    c = tl.sum((merge & (tl.arange(0, 64) < L)).to(tl.int32), 0)
    acc = tl.zeros((BKR, BV), dtype=ACC)
    held = tl.full((), 1, tl.int1)  # every merged level is held
    if tokens:
        acc = _block_state(acc, c, s_in_ptr, ls_ptr, wk_ptr, wb_ptr, wv_ptr, wg_ptr, n, h, p, H, G, grp, K, V, L,
                           WS_BITS, rk, rv, mk, mv, tile, ACC, NARROW)
    else:
        for i in range(0, c):
            j = i
            if WINDOW:  # Horner from the highest merged level down: each pending token projects the sum once
                j = c - 1 - i
            S = _load_level(s_in_ptr, ls_ptr, n, j, h, H, K, V, L, rk, rv, mk, tile, held, LAZY, PER_CHANNEL, ACC,
                            NARROW)
            acc += S
            if WINDOW:  # sum_j R_j S_j, R_j = tokens w_j + 1 .. p - 1: acc <- tokens w_j + 1 .. w_{j-1} of acc + S_j
                acc = _project_tile(acc, _written(p, j, WS_BITS) + 1, _written(p, j - 1, WS_BITS), wk_ptr, wb_ptr, n,
                                    h, H, G, grp, K, WS_BITS, rk, mk, ACC)
            if not LAZY:
                if j > 0:
                    _store_level(s_out_ptr, tl.zeros((BKR, BV), dtype=ACC), n, j, h, H, K, V, L, rk, rv, tile,
                                 NARROW)
    if c < L:  # in place the target is not held before the token: its stored tile is not read
        S = _load_level(s_in_ptr, ls_ptr, n, c, h, H, K, V, L, rk, rv, mk, tile, not IN_PLACE, LAZY,
                        PER_CHANNEL, ACC, NARROW)
        S = _transition(S + acc, k, decay, beta, HAS_BETA)
        _store_level(s_out_ptr, S, n, c, h, H, K, V, L, rk, rv, tile, NARROW)
        w = tl.load(lam_ptr + n * lam_sn + h * lam_sh + c).to(ACC)
        _readout(part_ptr, o_ptr, q, S, w, scale, n, c, h, kb, H, V, L, KB, rv, mv, DIRECT)


@triton.jit
def _block_state(acc, c, s_ptr, ls_ptr, wk_ptr, wb_ptr, wv_ptr, wg_ptr, n, h, p, H, G, grp, K, V, L, WS_BITS, rk, rv,
                 mk, mv, tile, ACC: tl.constexpr, NARROW: tl.constexpr):
    """The carry's sum at the window's turn p in token form, as of token p - 1: the merged levels above log2 W, last
    written by the previous turn's step p - W (each stored tile is its state then; its log-scale holds the decays
    since, which the tokens apply here), and the block's tokens b = p - W .. p - 1 from the window, oldest first:
    S <- exp(g_i) (I - beta_i k_i k_i^T) S + beta_i k_i v_i^T for i > b, on S_b = sum of the tiles + beta_b k_b v_b^T.
    acc: [BK, BV] zeros."""
    held = tl.full((), 1, tl.int1)
    for j in range(WS_BITS + 1, c):
        acc += _load_level(s_ptr, ls_ptr, n, j, h, H, K, V, L, rk, rv, mk, tile, held, False, False, ACC, NARROW)
    b = p - (1 << WS_BITS)
    for i in range(b, p):
        k_i, beta_i = _window_factor(wk_ptr, wb_ptr, n, i, h, H, G, grp, K, WS_BITS, rk, mk, ACC)
        slot = (n << WS_BITS) + _slot(i, WS_BITS)
        v_i = tl.load(wv_ptr + (slot * H + h) * V + rv, mask=mv, other=0.0).to(ACC)
        if i > b:
            acc = _transition(acc, k_i, tl.exp(tl.load(wg_ptr + slot * H + h).to(ACC)), beta_i, True)
        acc += (beta_i * k_i)[:, None] * v_i[None, :]
    return acc


@triton.jit
def _head_vector(x_ptr, base, rk, mk, K, BK: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr):
    """The rows rk of the K-vector at x_ptr + base; L2NORM divides by the whole vector's norm (x / sqrt(|x|^2 +
    1e-6))."""
    x = tl.load(x_ptr + base + rk, mask=mk, other=0.0).to(ACC)
    if L2NORM:
        full = tl.load(x_ptr + base + tl.arange(0, BK), mask=tl.arange(0, BK) < K, other=0.0).to(ACC)
        x = x / tl.sqrt(tl.sum(full * full, 0) + 1e-6)
    return x


@triton.jit
def _kept(p, l, WS_BITS, tokens):
    """Whether level l (taking a step of its own, in place, beside a key window of 2^WS_BITS tokens) keeps its tile:
    l >= 1, p not at the window's turn, and a tile: above log2 W where the block is in token form (``tokens``)."""
    kept = (l > 0) & ((_slot(p, WS_BITS) + 0 * l) != 0)  # in l's shape (as _level_roles' started)
    return kept & ((l > WS_BITS) | ((tokens + 0 * l) == 0))


@triton.jit
def _runs(p, l, L, WS_BITS, tokens, FENWICK: tl.constexpr, IN_PLACE: tl.constexpr, WINDOW: tl.constexpr,
          KEPT: tl.constexpr):
    """Whether level l (a scalar or a vector of levels) takes a step of its own: not the carry's merged levels or
    its target (level 0's step runs the carry), and in place not a level held neither before nor after. WINDOW:
    of those, the kept levels (KEPT; ``tokens``: the block before the token in token form) or level 0 (the levels
    above the carry at the window's turn are the turn kernel's)."""
    held_in, _, merge, into = _level_roles(p, l)
    runs = l < L
    if FENWICK:
        runs = runs & ((l == 0) | ((merge == 0) & (into == 0)))
        if IN_PLACE:
            runs = runs & ((l == 0) | held_in)
    if WINDOW:
        if KEPT:
            runs = runs & _kept(p, l, WS_BITS, tokens)
        else:
            runs = runs & (l == 0)
    return runs


@triton.jit
def _decode_level_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, lam_ptr, s_in_ptr, s_out_ptr, ls_ptr, wk_ptr, wb_ptr, wv_ptr, wg_ptr, ws_ptr,
    xq_ptr, pos_ptr, part_ptr, o_ptr, scale, H, G, K, V, L, KB, WS_BITS, lam_sn, lam_sh,
    BK: tl.constexpr, BKR: tl.constexpr, BV: tl.constexpr, LG: tl.constexpr, FENWICK: tl.constexpr,
    HAS_BETA: tl.constexpr, PER_CHANNEL: tl.constexpr, L2NORM: tl.constexpr, IN_PLACE: tl.constexpr,
    LAZY: tl.constexpr, WINDOW: tl.constexpr, KEPT: tl.constexpr, DIRECT: tl.constexpr, ACC: tl.constexpr,
):
    """Program (n * H + h, vb * (K / BKR) + kb, j): levels j * LG .. j * LG + LG - 1, their tiles of rows kb * BKR..
    and value columns vb * BV.. of sequence n, head h (the module docstring). KB: the row blocks of the partial
    readouts. WINDOW: KEPT selects the levels the token only decays (their readouts), else level 0 with the carry;
    in token form (the window's ``_tokens``) level 0 has no tile and the carry runs at the window's turns only."""
    n = (tl.program_id(0) // H).to(tl.int64)
    h = tl.program_id(0) % H
    vb = tl.program_id(1) // tl.cdiv(K, BKR)
    kb = tl.program_id(1) % tl.cdiv(K, BKR)
    l0 = tl.program_id(2) * LG
    p = tl.load(pos_ptr + n)  # int64
    tokens, tokens_after = False, False
    if WINDOW:
        tokens, tokens_after = _token_forms(ws_ptr, n, p, WS_BITS)
    if tl.sum(_runs(p, l0 + tl.arange(0, LG), L, WS_BITS, tokens, FENWICK, IN_PLACE, WINDOW, KEPT).to(tl.int32),
              0) == 0:
        return
    if WINDOW and not KEPT:  # token form: nothing between turns
        if tokens_after & ((p == 0) | (tokens & (_slot(p, WS_BITS) != 0))):
            return
    grp = h // (H // G)
    rk = kb * BKR + tl.arange(0, BKR)
    rv = vb * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    tile = mk[:, None] & mv[None, :]
    q = _head_vector(q_ptr, (n * G + grp) * K, rk, mk, K, BK, L2NORM, ACC)
    k = _head_vector(k_ptr, (n * G + grp) * K, rk, mk, K, BK, L2NORM, ACC)
    if PER_CHANNEL:  # one decay per row of the [BKR, BV] tile
        decay = tl.exp(tl.load(g_ptr + (n * H + h) * K + rk, mask=mk, other=0.0).to(ACC))[:, None]
    else:
        decay = tl.exp(tl.load(g_ptr + n * H + h).to(ACC))
    if HAS_BETA:
        beta = tl.load(beta_ptr + n * H + h).to(ACC)
    else:
        beta = 1.0
    NARROW: tl.constexpr = FENWICK and (KEPT or not HAS_BETA)  # row blocks: int32 offsets in a level (_tile_ptr)
    if FENWICK and not KEPT:
        if (l0 == 0) & (p > 0):  # the carry, before level 0 is rewritten: levels 0..ctz(p) move into ctz(p) + 1
            _carry(k, decay, beta, lam_ptr, s_in_ptr, s_out_ptr, ls_ptr, wk_ptr, wb_ptr, wv_ptr, wg_ptr, part_ptr,
                   o_ptr, q, p, tokens, scale, n, h, kb, H, G, grp, K, V, L, KB, WS_BITS, lam_sn, lam_sh, rk, rv, mk,
                   mv, tile, BKR, BV, HAS_BETA, PER_CHANNEL, IN_PLACE, LAZY, WINDOW, DIRECT, ACC, NARROW)
    for i in tl.static_range(LG):
        l = l0 + i
        runs = _runs(p, l, L, WS_BITS, tokens, FENWICK, IN_PLACE, WINDOW, KEPT)
        if WINDOW and not KEPT:  # in token form the window holds the token, not level 0
            runs = runs & (tokens_after == 0)
        if runs:
            if KEPT:
                _kept_readout(lam_ptr, s_in_ptr, ls_ptr, xq_ptr, part_ptr, o_ptr, decay, scale, n, l, h, kb, H, K,
                              V, L, KB, WS_BITS, lam_sn, lam_sh, rk, rv, mk, mv, tile, DIRECT, ACC, NARROW)
            else:
                _own_level(k, decay, beta, lam_ptr, v_ptr, s_in_ptr, s_out_ptr, ls_ptr, part_ptr, o_ptr, q, p,
                           scale, n, l, h, kb, H, K, V, L, KB, lam_sn, lam_sh, rk, rv, mk, mv, tile, FENWICK,
                           HAS_BETA, PER_CHANNEL, IN_PLACE, LAZY, DIRECT, ACC, NARROW)


@triton.jit
def _decode_turn_kernel(q_ptr, xq_ptr, g_ptr, lam_ptr, s_ptr, ls_ptr, wk_ptr, wy_ptr, pos_ptr, part_ptr, H, G, K, V, L,
                        KB, WS_BITS, lam_sn, lam_sh, BK: tl.constexpr, RB: tl.constexpr, BV: tl.constexpr,
                        LT: tl.constexpr, WP: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr):
    """Program (n * H + h, vb, j), beside the level kernel's passes, only at the window's turn (p a multiple of W):
    of the levels j * LT .. j * LT + LT - 1, those held above the carry (every level l >= 1 with a step of its own),
    each brought up to date and rewritten by ``_turn_level`` over value columns vb * BV .. vb * BV + BV - 1. The
    groups split a turning sequence's rewrite over programs: at random positions a batch of 16 has a sequence at its
    turn in most steps, and one program walking all its levels made that rewrite the step's longest chain
    (docs/kernels.md, Decoding)."""
    n = (tl.program_id(0) // H).to(tl.int64)
    h = tl.program_id(0) % H
    vb = tl.program_id(1)
    l0 = tl.program_id(2) * LT
    p = tl.load(pos_ptr + n)
    rl = l0 + tl.arange(0, LT)
    upper = _runs(p, rl, L, WS_BITS, False, True, True, False, False) & (rl > 0)
    if (p == 0) | (_slot(p, WS_BITS) != 0) | (tl.sum(upper.to(tl.int32), 0) == 0):
        return
    decay = tl.exp(tl.load(g_ptr + n * H + h).to(ACC))
    for i in tl.static_range(LT):
        l = l0 + i
        if _runs(p, l, L, WS_BITS, False, True, True, False, False) & (l > 0):
            _turn_level(s_ptr, ls_ptr, wk_ptr, wy_ptr, q_ptr, xq_ptr, lam_ptr, part_ptr, decay, n, l, h, p, vb, H, G,
                        h // (H // G), K, V, L, KB, WS_BITS, lam_sn, lam_sh, BK, RB, BV, WP, L2NORM, ACC)


@triton.jit
def _own_level(k, decay, beta, lam_ptr, v_ptr, s_in_ptr, s_out_ptr, ls_ptr, part_ptr, o_ptr, q, p, scale, n, l, h,
               kb, H, K, V, L, KB, lam_sn, lam_sh, rk, rv, mk, mv, tile, FENWICK: tl.constexpr,
               HAS_BETA: tl.constexpr, PER_CHANNEL: tl.constexpr, IN_PLACE: tl.constexpr, LAZY: tl.constexpr,
               DIRECT: tl.constexpr, ACC: tl.constexpr, NARROW: tl.constexpr):
    """Level l's own step: read, transition, (l = 0) deposit, write, readout; level 0 of a carrying token starts
    empty (its state moved into the target). Lazy, a level l >= 1 the token only decays keeps its tile."""
    held_in, _, merge, _ = _level_roles(p, l)
    if FENWICK:
        w = tl.load(lam_ptr + n * lam_sn + h * lam_sh + l).to(ACC)
    else:
        w = 1.0
    read = ((not IN_PLACE) | (not FENWICK) | held_in) & ((not FENWICK) | (merge == 0))
    S = _load_level(s_in_ptr, ls_ptr, n, l, h, H, K, V, L, rk, rv, mk, tile, read, LAZY, PER_CHANNEL, ACC, NARROW)
    S = _transition(S, k, decay, beta, HAS_BETA)
    if l == 0:
        v = tl.load(v_ptr + (n * H + h) * V + rv, mask=mv, other=0.0).to(ACC)
        S = S + (beta * k)[:, None] * v[None, :]
    if (not LAZY) | (l == 0):  # lazy: a level the token only decays keeps its tile (log-scale + g)
        _store_level(s_out_ptr, S, n, l, h, H, K, V, L, rk, rv, tile, NARROW)
    _readout(part_ptr, o_ptr, q, S, w, scale, n, l, h, kb, H, V, L, KB, rv, mv, DIRECT)


@triton.jit
def _kept_readout(lam_ptr, s_ptr, ls_ptr, xq_ptr, part_ptr, o_ptr, decay, scale, n, l, h, kb, H, K, V, L, KB, WS_BITS,
                  lam_sn, lam_sh, rk, rv, mk, mv, tile, DIRECT: tl.constexpr, ACC: tl.constexpr,
                  NARROW: tl.constexpr):
    """Between the window's turns, held level l above the carry keeps its tile: only its readout over the program's
    rows, with the projected query of _decode_query_kernel (x^T exp(s_l + g) T_l = q^T A_p R T_l exp(s_l + g))."""
    w = tl.load(lam_ptr + n * lam_sn + h * lam_sh + l).to(ACC)
    S = _load_level(s_ptr, ls_ptr, n, l, h, H, K, V, L, rk, rv, mk, tile, True, True, False, ACC, NARROW)
    x = tl.load(xq_ptr + ((n * H + h) * (WS_BITS + 1) + tl.minimum(l - 1, WS_BITS)) * K + rk, mask=mk, other=0.0)
    _readout(part_ptr, o_ptr, x, decay * S, w, scale, n, l, h, kb, H, V, L, KB, rv, mv, DIRECT)


@triton.jit
def _decode_finish_kernel(
    part_ptr, o_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ls_ptr, wk_ptr, wb_ptr, wv_ptr, wg_ptr, ws_ptr, pos_ptr, scale, H,
    G, K, V, L, KB, WS_BITS,
    BL: tl.constexpr, LC: tl.constexpr, BKB: tl.constexpr, BVO: tl.constexpr, BK: tl.constexpr,
    FENWICK: tl.constexpr, IN_PLACE: tl.constexpr, LAZY: tl.constexpr, PER_CHANNEL: tl.constexpr,
    WINDOW: tl.constexpr, L2NORM: tl.constexpr,
):
    """Program (sequence n * H + head h, value block): o over columns vb * BVO .. = scale * the sum of the partial
    readouts [L, KB, V] over the levels the step wrote (in place: those held after the token), LC levels' [KB, BVO]
    blocks at a time; lazy levels' log-scales after the step (value block 0's program): a level the token only
    decays adds g (restarts at 0 at the window's turn, which rewrote it), a level l >= 1 the carry empties takes
    -inf, level 0 and the carry's target restart at 0 (their tiles were rewritten). Runs after the level kernel,
    whose programs read the old log-scales. WINDOW: the token's key, beta, value and gate go into slot p mod W of
    the window, after every program that read the slot's old token; in token form levels 1..log2 W have no
    readout."""
    n = (tl.program_id(0) // H).to(tl.int64)
    h = tl.program_id(0) % H
    p = tl.load(pos_ptr + n)
    rv = tl.program_id(1) * BVO + tl.arange(0, BVO)
    o = tl.zeros((BVO,), dtype=part_ptr.dtype.element_ty)
    tokens, tokens_after = False, False
    if WINDOW:
        tokens, tokens_after = _token_forms(ws_ptr, n, p, WS_BITS)
        _window_token(k_ptr, v_ptr, g_ptr, beta_ptr, wk_ptr, wb_ptr, wv_ptr, wg_ptr, n, h, p, H, G, K, V, WS_BITS, rv,
                      BK, L2NORM)
    for l0 in range(0, L, LC):
        rr = tl.arange(0, LC * BKB)  # (level, row block) pairs
        rl = l0 + rr // BKB
        held_in, held_out, merge, into = _level_roles(p, rl)
        if not FENWICK:
            wrote = rl < L
        elif IN_PLACE:
            wrote = held_out & (rl < L)
        else:  # the levels 1..ctz(p) the carry empties have no readout
            wrote = ((merge == 0) | (rl == 0)) & (rl < L)
        wrote = wrote & (rr % BKB < KB)
        if WINDOW:  # level 0, the carry's target and the turn's levels: their readouts are in row block 0
            wrote = wrote & ((rr % BKB == 0) | (_kept(p, rl, WS_BITS, tokens) & held_in & held_out))
            wrote = wrote & ((rl == 0) | (rl > WS_BITS) | ((tokens_after + 0 * rl) == 0))
        part = tl.load(part_ptr + (((n * H + h) * L + rl) * KB + rr % BKB)[:, None] * V + rv[None, :],
                       mask=wrote[:, None] & (rv < V)[None, :], other=0.0)
        o += tl.sum(part, 0)
    tl.store(o_ptr + (n * H + h) * V + rv, (scale * o).to(o_ptr.dtype.element_ty), mask=rv < V)
    if LAZY:
        if tl.program_id(1) == 0:
            _log_scales_after(g_ptr, ls_ptr, n, h, p, H, K, L, WS_BITS, BL, BK, PER_CHANNEL, WINDOW)


@triton.jit
def _window_token(k_ptr, v_ptr, g_ptr, beta_ptr, wk_ptr, wb_ptr, wv_ptr, wg_ptr, n, h, p, H, G, K, V, WS_BITS, rv,
                  BK: tl.constexpr, L2NORM: tl.constexpr):
    """The token's slot p mod W of the window: its value over the program's columns rv; from value block 0's
    program its beta and gate, and (the group's first head) its key, normalised as the step uses it."""
    slot = (n << WS_BITS) + _slot(p, WS_BITS)
    v = tl.load(v_ptr + (n * H + h) * V + rv, mask=rv < V, other=0.0)
    tl.store(wv_ptr + (slot * H + h) * V + rv, v.to(wv_ptr.dtype.element_ty), mask=rv < V)
    if tl.program_id(1) == 0:
        tl.store(wb_ptr + slot * H + h, tl.load(beta_ptr + n * H + h).to(wb_ptr.dtype.element_ty))
        tl.store(wg_ptr + slot * H + h, tl.load(g_ptr + n * H + h).to(wg_ptr.dtype.element_ty))
        grp = h // (H // G)
        if h % (H // G) == 0:
            rk = tl.arange(0, BK)
            k = _head_vector(k_ptr, (n * G + grp) * K, rk, rk < K, K, BK, L2NORM, wk_ptr.dtype.element_ty)
            tl.store(wk_ptr + (slot * G + grp) * K + rk, k, mask=rk < K)


@triton.jit
def _log_scales_after(g_ptr, ls_ptr, n, h, p, H, K, L, WS_BITS, BL: tl.constexpr, BK: tl.constexpr,
                      PER_CHANNEL: tl.constexpr, WINDOW: tl.constexpr):
    """The lazy levels' log-scales [N, L, H] or [N, L, H, K] of (sequence n, head h) after the token at p (the finish
    kernel's docstring)."""
    rl = tl.arange(0, BL)
    l_in, l_out, l_merge, _ = _level_roles(p, rl)
    kept = l_in & (l_merge == 0)  # level 0 merges (p > 0) or is empty (p = 0)
    reset = tl.where(l_merge & (rl > 0), float("-inf"), 0.0)
    moved = (l_in | l_out) & (rl < L)
    if PER_CHANNEL:
        rk = tl.arange(0, BK)
        g = tl.load(g_ptr + (n * H + h) * K + rk, mask=rk < K, other=0.0).to(ls_ptr.dtype.element_ty)
        offs = ((n * L + rl[:, None]) * H + h) * K + rk[None, :]
        mask = moved[:, None] & (rk < K)[None, :]
        ls = tl.load(ls_ptr + offs, mask=mask, other=0.0)
        tl.store(ls_ptr + offs, tl.where(kept[:, None], ls + g[None, :], reset[:, None]), mask=mask)
    else:
        g = tl.load(g_ptr + n * H + h).to(ls_ptr.dtype.element_ty)
        offs = (n * L + rl) * H + h
        ls = tl.load(ls_ptr + offs, mask=moved, other=0.0)
        if WINDOW:  # the window's turn rewrote every level
            kept = kept & _kept(p, rl, WS_BITS, False)  # in token form levels 1..log2 W too (their tiles unread)
        tl.store(ls_ptr + offs, tl.where(kept, ls + g, reset), mask=moved)


def _tile(K: int, V: int, rows: int, itemsize: int, split_rows: bool) -> tuple[int, int]:
    """(BKR, BV): the rows and value columns of one program's tile of a level. split_rows (a transition that keeps
    the rows independent: not the delta rule) cuts the K rows into blocks of ROW_BLOCK, so that more, smaller
    programs are in flight. The [K, BV] column block stays within 32 KB of stored levels (8K fp32 or 16K 16-bit
    elements; more spilled on the H200), the delta rule's within 8K elements whatever the levels' dtype (its tile
    is projected in fp32 registers: 16K bf16 elements spilled 756 bytes under triton 3.6 for sm_90), and narrower
    blocks (down to 16 columns) spread a small batch over more programs (~256 per level) to keep the SMs
    streaming."""
    BK = triton.next_power_of_2(K)
    bkr = min(BK, ROW_BLOCK) if split_rows else BK
    held = itemsize if split_rows else max(itemsize, 4)  # bytes per element of the tile a program holds
    bv = max(1, min(triton.next_power_of_2(V), 32768 // (BK * held), 64))
    while bv > 16 and rows * triton.cdiv(K, bkr) * triton.cdiv(V, bv) < 256:
        bv //= 2
    return bkr, bv


ROW_BLOCK = 32  # rows of a program's tile where the transition keeps the rows independent
DOT_MIN = 16  # tl.dot's smallest tile side: the turn's products pad their row blocks, columns and window to it
FINISH_COLUMNS = 128  # value columns of one finish program (a wider V takes several)
FINISH_TILE = 8192  # partial readouts a finish program sums per step of its loop over levels (more spilled)
PROGRAM_BYTES = 16384  # stored level bytes one program of the level kernel steps, at least one tile


def _levels_per_program(tile_bytes: int, BL: int, delta: bool) -> int:
    """Levels one program steps (a power of two, at most BL): PROGRAM_BYTES of tiles, so that a buffer with more
    levels than the position holds (CUDA-graph decoding's max_levels) launches fewer programs that exit at once
    (B = 16, 64K, 22 levels, the same position in every sequence on the H200: 75 -> 56 us in fp32 and 62 -> 40 us
    in bf16 against one level per program). The delta rule takes one: triton 3.6 fails to compile its unrolled
    levels."""
    if delta:
        return 1
    return max(1, min(BL, PROGRAM_BYTES // tile_bytes))


def fused_decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
    level_scales: torch.Tensor | None, levels: torch.Tensor, positions: torch.Tensor, scale: float,
    *, fenwick: bool = True, l2norm_qk: bool = False, out: torch.Tensor | None = None,
    log_scales: torch.Tensor | None = None, window: "KeyWindow | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (see loglinear.ops.decode.decode_step for the contract): the level kernel, then the
    finish kernel (unless one level in whole tiles), which sums the readouts and, with log_scales (lazy levels:
    [N, L, H] or [N, L, H, K], float32 or float64; in place), updates them, and the delta rule's window (keys
    [N, W, G, K], betas [N, W, H] in the compute dtype, W a power of two) with the token.

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
    lazy = log_scales is not None
    if lazy and (out is not levels or not fenwick or (beta is not None) != (window is not None)
                 or not log_scales.is_contiguous()):
        raise ValueError("log_scales needs a contiguous in-place log-linear step, and a window with the delta rule")
    parts = (window.keys, window.betas, window.values, window.gates, window.start) if window is not None else (g,) * 5
    if not all(x.is_contiguous() for x in parts):
        raise ValueError("the window's tensors must be contiguous")
    wk, wb, wv, wg, ws = parts
    ws_bits = window.size.bit_length() - 1 if window is not None else 0
    acc = torch.float64 if levels.dtype == torch.float64 else torch.float32
    BK, per_channel = triton.next_power_of_2(K), g.dim() == 3
    acc_tl = tl.float64 if acc == torch.float64 else tl.float32
    BL = triton.next_power_of_2(L)

    def tile(split_rows: bool) -> tuple[int, int]:
        return _tile(K, V, N * H, levels.element_size(), split_rows=split_rows)

    def levels_pass(BKR: int, BV: int, delta: bool, kept: bool, KB: int, partial: torch.Tensor,
                    num_levels: int) -> None:
        LG = _levels_per_program(BKR * BV * levels.element_size(), BL, delta=delta)
        launch(_decode_level_kernel, (N * H, triton.cdiv(V, BV) * triton.cdiv(K, BKR), triton.cdiv(num_levels, LG)),
            q, k, v, g, beta_arg, lam, levels, out, log_scales if lazy else g, wk, wb, wv, wg, ws, xq, positions,
            partial, o,
            float(scale), H, G, K, V, L, KB, ws_bits, lam_sn, lam_sh,
            BK=BK, BKR=BKR, BV=BV, LG=LG, FENWICK=fenwick, HAS_BETA=beta is not None, PER_CHANNEL=per_channel,
            L2NORM=l2norm_qk, IN_PLACE=out is levels, LAZY=lazy, WINDOW=window is not None, KEPT=kept,
            DIRECT=partial is o, ACC=acc_tl, **launch_options(_decode_level_kernel, state_tile=BKR * BV),
        )

    delta = beta is not None
    if window is None:  # one pass; a decay-only transition keeps the rows independent: row blocks
        BKR, BV = tile(fenwick and not delta)
        KB = triton.cdiv(K, BKR)
        direct = L == 1 and KB == 1 and not lazy  # one level, one row block: its program writes o, no second launch
        partial = o if direct else torch.empty(N, H, L, KB, V, dtype=acc, device=device)
        xq = g
        levels_pass(BKR, BV, delta, False, KB, partial, L)
    else:  # the kept levels' readouts in row blocks (no k^T S), level 0 and the carry in whole columns, the turn
        BKR, BV = tile(True)
        KB = triton.cdiv(K, BKR)
        partial = torch.empty(N, H, L, KB, V, dtype=acc, device=device)
        xq = torch.empty(N, H, ws_bits + 1, K, dtype=acc, device=device)  # the kept levels' projected queries
        wy = torch.empty(N, H, window.size, window.size, dtype=acc, device=device)  # the turn's WY factor
        WP = max(window.size, DOT_MIN)
        launch(_decode_query_kernel, (N * H,),
            q, k, v, g, beta_arg, lam, wk, wb, wv, wg, ws, positions, xq, wy, partial, H, G, K, V, L, KB, ws_bits,
            lam_sn, lam_sh, BK=BK, WP=WP, WP_BITS=WP.bit_length() - 1,
            BV=min(triton.next_power_of_2(V), FINISH_COLUMNS), L2NORM=l2norm_qk, ACC=acc_tl,
            **launch_options(_decode_query_kernel),
        )
        # three passes over disjoint levels side by side: level 0's carry programs (up to W - 1 projections of the
        # merged levels one after another) and the turn (whose programs return at once between turns) each on a side
        # stream, the kept levels' short row-block programs on the current one
        carry, turn = ChainStreams(device), ChainStreams(device, lane=1)
        with carry.chain():
            levels_pass(*tile(False), True, False, KB, partial, 1)  # level 0's programs only
        # groups of levels as the kept pass's: short chains at a turn, few programs returning at once between turns
        BVT, LT = max(BV, DOT_MIN), _levels_per_program(BKR * BV * levels.element_size(), BL, delta=False)
        with turn.chain():
            launch(_decode_turn_kernel, (N * H, triton.cdiv(V, BVT), triton.cdiv(L, LT)),
                q, xq, g, lam, levels, log_scales, wk, wy, positions, partial, H, G, K, V, L, KB, ws_bits, lam_sn,
                lam_sh, BK=BK, RB=max(BKR, DOT_MIN), BV=BVT, LT=LT, WP=WP, L2NORM=l2norm_qk, ACC=acc_tl,
                **launch_options(_decode_turn_kernel),
            )
        levels_pass(BKR, BV, False, True, KB, partial, L)
        carry.hand_over()
        turn.hand_over()
    if partial is not o:
        BKB, BVO = triton.next_power_of_2(KB), min(triton.next_power_of_2(V), FINISH_COLUMNS)
        launch(_decode_finish_kernel, (N * H, triton.cdiv(V, BVO)),
            partial, o, k, v, g, beta_arg, log_scales if lazy else partial, wk, wb, wv, wg, ws, positions,
            float(scale), H, G, K, V, L, KB, ws_bits,
            BL=BL, LC=max(1, min(BL, FINISH_TILE // (BKB * BVO))), BKB=BKB, BVO=BVO, BK=BK, FENWICK=fenwick,
            IN_PLACE=out is levels, LAZY=lazy, PER_CHANNEL=per_channel, WINDOW=window is not None, L2NORM=l2norm_qk,
            **launch_options(_decode_finish_kernel),
        )
    return o, out


def decode_backend(
    variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor],
    level_scales: torch.Tensor | None, levels: torch.Tensor, positions: torch.Tensor, scale: float,
    *, fenwick: bool = True, l2norm_qk: bool = False, out: torch.Tensor | None = None,
    log_scales: torch.Tensor | None = None, window: "KeyWindow | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode step the variants register (loglinear.ops.backends.Backend.decode). The kernel's compile-time
    switches come from the variant's gates: g [N, H] a scalar decay (Mamba-2) or [N, H, K] one per key channel
    (GLA), and a beta gate makes it the gated delta rule (Gated DeltaNet)."""
    return fused_decode_step(q, k, v, gates["g"], gates.get("beta"), level_scales, levels, positions, scale,
                             fenwick=fenwick, l2norm_qk=l2norm_qk, out=out, log_scales=log_scales, window=window)
