"""One decoding step: a single new token per sequence against its Fenwick state (spec section 4).

For the token at absolute position p of each sequence, on level states S[0..L-1] (each K x V):

  1. carry       levels 0..ctz(p) merge into level ctz(p)+1 (p > 0)           (a binary counter)
  2. transition  S <- A_t S on every level (variant.transition: Mamba-2 exp(g) S; GDN exp(g) (S - beta k (k^T S));
                 GLA diag(exp(g)) S)
  3. deposit     S[0] += k~ v^T  (variant.deposit_key: k for Mamba-2, beta k for GDN)
  4. readout     o = scale * sum_l lambda[l] S[l]^T q

In place (out=levels), the fused kernel touches only the levels position p holds before or after the token
(level 0 and one level per set bit of p - 1, resp. p; loglinear.state.FenwickState defines them): every other
level must be zero, as in a valid state and in the zero-padded static buffers of CUDA-graph decoding, so a step
moves about 1 + popcount(p - 1) levels each way, whatever the buffer's size. Otherwise both steps run every level.

Lazy levels (``log_scales``, in place, for a variant whose transition only scales: Mamba-2, GLA): level l's state
is levels[:, l] * exp(log_scales[:, l]) (one log-scale per head, or per head and key channel). A level the token
only decays (held before and after, above the carry's target) keeps its stored tile and adds g to its log-scale; a
level l >= 1 the carry empties keeps its tile and takes log-scale -inf (state 0); the step rewrites only level 0 and
the carry's target (their log-scales reset to 0), so it reads the held levels once and writes two. CUDA-graph
decoding keeps its buffers this way.

Lazy levels of the delta rule (GDN: A_t = exp(g_t) (I - beta_t k_t k_t^T)) add a ``KeyWindow``: the keys, betas, values
and log-decays of the last W tokens (token i in slot i % W). Level l's state is exp(log_scales[:, l]) R T_l, T_l its
stored tile and R = (I - beta_{p-1} k_{p-1} k_{p-1}^T) ... (I - beta_{w+1} k_{w+1} k_{w+1}^T) the projections of the
tokens after the one whose step last wrote it, w. A level is rewritten when it is level 0, the carry's target, or when p
is a multiple of W (the window's turn: every held level is brought up to date), so p - 1 - w < W and

    w = ((p - 1) >> m) << m,   m = min(max(l - 1, 0), log2 W)        (``window_written``)

(the last carry into level l, or the window's last turn). The readout of a level the token only decays applies the
projections to the query instead of the tile, q' = R^T A_p^T q: the step reads the held levels once and writes two,
as for a decay-only transition, with W K-vectors per level in the query's path. A merged level's tile takes its
projections before the carry sums it. Zero betas are identities: a window of zeros beside exact levels (log-scales
0) is a valid lazy state at any position.

Token form. Levels 0..log2 W of the state after p tokens hold the tokens of one block, b = ((p - 1) >> log2 W)
<< log2 W .. p - 1 (``block_start``; level(p - 1, i) <= log2 W exactly there). Once a block begins at or after the
window's ``start`` (the position of the last exact load; ``token_form``), those levels have no tiles: the window
holds the block's tokens, the step reads them out from there (token i's share lambda[level(p, i)] exp(g_{i+1} + ..
+ g_p) beta_i (k_i . x_i) v_i, x_i the query projected through i + 1 .. p) and writes no tile between turns, and the
turn at b + W sums the whole block into the carry's target, token by token, beside the merged tiles above log2 W
(each written by the previous turn). Between the load and the first turn after it, the levels 0..log2 W keep the tiles
they were loaded with and change as above.

The plain recurrence (use_log_linear=False models) is the same step on one level without the carry and
with lambda = 1. The GDN update is rank-1: O(K V) per level, never a K x K matrix.

``decode_step`` runs the chosen backend's fused step (loglinear.ops.backends: the Triton kernel on CUDA, or
with backend "triton" under TRITON_INTERPRET=1) and this file's PyTorch step otherwise.
``fused_decode_applies`` / ``op_decode_step`` put the step behind the public ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loglinear.fenwick import bit_length, carry, carry_target, held_levels, levels_needed
from loglinear.inputs import OpInputs, check_bools, check_decode_inputs, expand_groups, l2norm, needs_grad
from loglinear.ops.backends import backend_for, select_backend
from loglinear.state import FenwickState
from loglinear.variants import GATED_DELTANET, Variant, get

__all__ = ["KEY_WINDOW", "MAX_KEY_WINDOW", "KeyWindow", "block_start", "decode_step", "decode_step_torch",
           "decayed_only", "emptied_levels", "fused_decode_applies", "key_window_size_ok", "lazy_level_states",
           "op_decode_step", "token_form", "window_written"]


KEY_WINDOW = 16  # tokens of the delta rule's window in CUDA-graph decoding's buffers (loglinear.layers.mixer)
MAX_KEY_WINDOW = 32  # the fused step holds the window's keys in registers: 64 spilled (compiled for sm_90)


def key_window_size_ok(size: object) -> bool:
    """Is ``size`` a key window's length: an int, a power of two in [2, MAX_KEY_WINDOW]?"""
    return (isinstance(size, int) and not isinstance(size, bool) and 2 <= size <= MAX_KEY_WINDOW
            and not size & (size - 1))


@dataclass
class KeyWindow:
    """The delta rule's last W tokens of N sequences beside lazy levels, and where they stand for levels
    0..log2 W (the token form; module docstring).

    keys:   [N, W, G, K], as the step uses them (normalised with l2norm_qk), in the step's compute dtype
    betas:  [N, W, H], values: [N, W, H, V], gates: [N, W, H] (the log-decays g), the same dtype
    start:  [N] int64, the position at which the levels were last loaded exact: a block of W tokens that begins at
            or after it is in token form
    Token i sits in slot i % W; each step writes its own. W is a power of two in [2, MAX_KEY_WINDOW].
    """

    keys: torch.Tensor
    betas: torch.Tensor
    values: torch.Tensor
    gates: torch.Tensor
    start: torch.Tensor

    @property
    def size(self) -> int:
        return self.keys.shape[1]

    @classmethod
    def empty_at(cls, positions: torch.Tensor, size: int, G: int, H: int, K: int, V: int,
                 dtype: torch.dtype) -> "KeyWindow":
        """A window of zeros (zero betas: identities) beside exact levels after ``positions`` [N] tokens (start =
        positions), on the positions' device."""
        N, device = positions.shape[0], positions.device
        zeros = lambda *shape: torch.zeros(N, size, *shape, dtype=dtype, device=device)  # noqa: E731
        return cls(zeros(G, K), zeros(H), zeros(H, V), zeros(H), positions.to(torch.int64).clone())

    def load_at(self, positions: torch.Tensor) -> None:
        """Empty the window beside exact levels after ``positions`` [N] tokens."""
        for x in (self.keys, self.betas, self.values, self.gates):
            x.zero_()
        self.start.copy_(positions)

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.keys, self.betas, self.values, self.gates, self.start))


def block_start(positions: torch.Tensor, size: int) -> torch.Tensor:
    """The first position of the block of ``size`` tokens that levels 0..log2 size of the state after
    ``positions`` tokens hold, ((p - 1) >> log2 size) << log2 size (-size for p = 0)."""
    bits = size.bit_length() - 1
    return ((positions - 1) >> bits) << bits


def token_form(positions: torch.Tensor, window: KeyWindow) -> torch.Tensor:
    """Whether levels 0..log2 W of the state after ``positions`` [N] tokens are in token form -> [N] bool."""
    return block_start(positions, window.size) >= window.start.to(positions.device)


def _compute_dtype(levels_dtype: torch.dtype) -> torch.dtype:
    """The step computes in float64 for float64 levels, else in float32 (16-bit levels are stored, not computed in)."""
    return torch.float64 if levels_dtype == torch.float64 else torch.float32


def lazy_level_states(levels: torch.Tensor, log_scales: torch.Tensor, window: KeyWindow | None = None,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
    """The states of lazy levels: levels [N, L, H, K, V] times exp(log_scales), [N, L, H] (one per head) or
    [N, L, H, K] (one per key channel), and with the delta rule's window the pending projections of its tokens and,
    in token form, levels 0..log2 W from its tokens (positions: [N], each sequence's tokens so far)
    -> [N, L, H, K, V] in the promoted dtype (a new tensor)."""
    scales = torch.exp(log_scales)
    states = levels * (scales[..., None] if log_scales.dim() == 4 else scales[..., None, None])
    if window is None:
        return states
    positions = positions.to(levels.device)
    return _block_levels(_project_levels(states, window, positions), window, positions)


def decayed_only(positions: torch.Tensor, num_levels: int) -> torch.Tensor:
    """The levels the token at ``positions[n]`` only decays: held before it and above the carry's target (level 0,
    the target and the levels the carry empties change otherwise).  positions: [N] -> [N, num_levels] bool."""
    lev = torch.arange(num_levels, device=positions.device)
    return held_levels(positions, num_levels) & (lev[None, :] > carry_target(positions).to(positions.device)[:, None])


def emptied_levels(positions: torch.Tensor, num_levels: int) -> torch.Tensor:
    """The levels l >= 1 the carry of the token at ``positions[n]`` empties: 1..ctz(p) (none for p = 0; level 0
    merges too, and takes the token's deposit).  positions: [N] -> [N, num_levels] bool."""
    lev = torch.arange(num_levels, device=positions.device)
    return (lev[None, :] >= 1) & (lev[None, :] < carry_target(positions).to(positions.device)[:, None])


def window_written(positions: torch.Tensor, num_levels: int, size: int) -> torch.Tensor:
    """The position whose step last wrote each level held before the token at ``positions[n]``, with a key window of
    ``size`` tokens (module docstring): ((p - 1) >> m) << m, m = min(max(l - 1, 0), log2 size); meaningless for a
    level not held.  positions: [N] -> [N, num_levels] int64."""
    lev = torch.arange(num_levels, device=positions.device)
    m = torch.clamp(lev - 1, min=0, max=size.bit_length() - 1)[None, :]
    return ((positions[:, None] - 1) >> m) << m


def _project_levels(S: torch.Tensor, window: KeyWindow, positions: torch.Tensor) -> torch.Tensor:
    """Lazy levels' pending projections: each level l of S [N, L, H, K, V] (its tile times exp(log-scale)) takes
    (I - beta_i k_i k_i^T) for the tokens i = w_l + 1 .. p - 1 of the window, oldest first (module docstring)."""
    N, L, H = S.shape[:3]
    size = window.size
    written = window_written(positions, L, size)
    keys = expand_groups(window.keys.to(S.dtype), H)  # [N, W, H, K]
    rows = torch.arange(N, device=S.device)
    for age in range(size - 1, 0, -1):
        i = positions - age
        slot = i % size
        k, beta = keys[rows, slot], window.betas[rows, slot].to(S.dtype)  # [N, H, K], [N, H]
        pending = ((i[:, None] > written) & (i[:, None] >= 0)).to(S.dtype)  # [N, L]
        kS = torch.einsum("nhk,nlhkv->nlhv", k, S)
        S = S - (pending[:, :, None] * beta[:, None])[..., None, None] * k[:, None, :, :, None] * kS[:, :, :, None]
    return S


def _block_levels(S: torch.Tensor, window: KeyWindow, positions: torch.Tensor) -> torch.Tensor:
    """Levels 0..log2 W of S [N, L, H, K, V] where they are in token form: the window's tokens
    b = block_start(p) .. p - 1, token t deposited into level bit_length((p - 1) xor t) after the transitions of the
    tokens before it, exp(g_t) (I - beta_t k_t k_t^T) on every level (the window is the delta rule's: Gated
    DeltaNet's transition and deposit; module docstring)."""
    N, L, H, K, V = S.shape
    size, dtype = window.size, S.dtype
    low = min(L, size.bit_length())
    tokens = token_form(positions, window)
    first = block_start(positions, size)
    keys = expand_groups(window.keys.to(dtype), H)  # [N, W, H, K]
    rows, lev = torch.arange(N, device=S.device), torch.arange(low, device=S.device)
    block = S.new_zeros(N, low, H, K, V)
    for age in range(size - 1, -1, -1):
        t = positions - 1 - age
        active = (tokens & (t >= first)).to(dtype)  # [N]
        slot = t % size
        k, v = keys[rows, slot], window.values[rows, slot].to(dtype)  # [N, H, K], [N, H, V]
        gates = {"g": window.gates[rows, slot].to(dtype), "beta": window.betas[rows, slot].to(dtype)}  # [N, H]
        moved = GATED_DELTANET.transition(block, k, gates)
        block = block + active[:, None, None, None, None] * (moved - block)
        into = (lev[None, :] == bit_length((positions - 1) ^ t)[:, None]).to(dtype) * active[:, None]  # [N, low]
        deposit = GATED_DELTANET.deposit_key(k, gates)[..., None] * v[:, :, None, :]  # [N, H, K, V]
        block = block + into[:, :, None, None, None] * deposit[:, None]
    held = tokens[:, None, None, None, None]
    return torch.cat([torch.where(held, block, S[:, :low]), S[:, low:]], dim=1)


def decode_step_torch(
    variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor],
    level_scales: torch.Tensor | None, levels: torch.Tensor, positions: torch.Tensor, scale: float,
    *, fenwick: bool = True, l2norm_qk: bool = False, out: torch.Tensor | None = None,
    log_scales: torch.Tensor | None = None, window: KeyWindow | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch step; arguments as in ``decode_step``."""
    dtype, H = _compute_dtype(levels.dtype), v.shape[1]
    q, k = q.to(dtype), k.to(dtype)
    if l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    group_keys = k
    q, k = expand_groups(q[:, None], H)[:, 0], expand_groups(k[:, None], H)[:, 0]
    gates = {name: x.to(dtype) for name, x in gates.items()}
    stored = levels.to(dtype)
    state = stored if log_scales is None else lazy_level_states(stored, log_scales, window, positions)
    S = carry(state, positions) if fenwick else state
    S = variant.transition(S, k, gates)
    deposit = variant.deposit_key(k, gates)[..., None] * v.to(dtype)[:, :, None, :]
    S = torch.cat([S[:, :1] + deposit[:, None], S[:, 1:]], dim=1)
    readout = (S * q[:, None, :, :, None]).sum(3)  # [N, L, H, V]
    if fenwick:
        readout = readout * level_scales[..., : S.shape[1]].to(dtype).transpose(1, 2)[..., None]
    o = (scale * readout.sum(1)).to(v.dtype)
    if log_scales is not None:  # held levels keep their tiles: decayed ones add g, emptied ones take -inf
        kept, emptied = decayed_only(positions, levels.shape[1]), emptied_levels(positions, levels.shape[1])
        unchanged = kept | emptied
        if window is not None:  # the window's turn rewrites the held levels; the token takes its slot
            rows, slot = torch.arange(len(positions), device=positions.device), positions % window.size
            kept = kept & ~((slot == 0) & (positions > 0))[:, None]
            low = torch.arange(levels.shape[1], device=positions.device) < window.size.bit_length()
            unchanged = kept | emptied | (token_form(positions + 1, window)[:, None] & low[None, :])
            for x, new in ((window.keys, group_keys), (window.betas, gates["beta"]), (window.values, v),
                           (window.gates, gates["g"])):
                x[rows, slot] = new.to(x.dtype)
        g = gates[variant.gates[0].name][:, None]  # [N, 1, H] or [N, 1, H, K]
        per_scale = (*kept.shape, *(1,) * (log_scales.dim() - 2))
        reset = torch.where(emptied.view(per_scale), float("-inf"), 0.0)
        log_scales.copy_(torch.where(kept.view(per_scale), log_scales + g, reset))
        S = torch.where(unchanged.view(*kept.shape, 1, 1, 1), stored, S)
    return (o, S.to(levels.dtype)) if out is None else (o, out.copy_(S))


def _on_device(positions: torch.Tensor, device: torch.device) -> torch.Tensor:
    """positions on ``device``; from the host via pinned memory and an async copy (no stream sync per step)."""
    if positions.device == device:
        return positions
    if device.type == "cuda":
        return positions.pin_memory().to(device, non_blocking=True)
    return positions.to(device)


def decode_step(
    variant: Variant | str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor],
    level_scales: torch.Tensor | None, levels: torch.Tensor, positions: torch.Tensor, scale: float,
    *, fenwick: bool = True, l2norm_qk: bool = False, backend: str | None = None, out: torch.Tensor | None = None,
    log_scales: torch.Tensor | None = None, window: KeyWindow | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence.

    q, k: [N, G, K]; v: [N, H, V]; gates: the variant's per-token inputs {name: [N, H]}, a per-channel one [N, H, K]
    (Mamba-2: g; GDN: g, beta; GLA: g [N, H, K]);
    level_scales: [N, H, >= L] (unused when fenwick=False); levels: [N, L, H, K, V], L covering the
    positions (fenwick: L >= levels_needed(p + 1)); positions: [N] int64, the token's absolute position;
    backend: as in the public ops; out: where the new levels go, [N, L, H, K, V] like levels (``levels`` itself:
    in place; the levels positions[n] does not hold must then be zero), else a new tensor; log_scales: lazy levels
    (module docstring), in place only and for a variant with lazy levels (``variant.lazy_levels``): [N, L, H], or
    [N, L, H, K] for a per-channel gate, float32 (float64 for float64 levels), updated in place; the levels may then
    be bfloat16 (rounded when written); window: the delta rule's KeyWindow beside lazy levels (required with
    log_scales for it, else None), updated in place. Returns o: [N, H, V]
    in v's dtype and the new levels [N, L, H, K, V] in levels' dtype (stored lazily with log_scales). Nothing here
    reads a device tensor on the host: with positions on the levels' device and ``out`` given, the step can be
    captured in a CUDA graph (loglinear.models.graphs).
    """
    variant = get(variant)
    check_bools(fenwick=fenwick, l2norm_qk=l2norm_qk)
    check_decode_inputs(variant, q, k, v, gates, level_scales, levels, positions, fenwick=fenwick)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if out is not None and (out.shape != levels.shape or out.dtype != levels.dtype or out.device != levels.device):
        raise ValueError(f"out must be like levels ({tuple(levels.shape)}, {levels.dtype}, {levels.device}), "
                         f"got {tuple(out.shape)}, {out.dtype}, {out.device}")
    if log_scales is not None:
        _check_log_scales(variant, levels, out, fenwick, log_scales)
    _check_window(variant, q, levels, log_scales, window)
    positions = _on_device(positions, levels.device)
    step = backend_for(variant, select_backend(variant, levels.device, backend)).decode or decode_step_torch
    return step(variant, q, k, v, gates, level_scales, levels, positions, scale, fenwick=fenwick, l2norm_qk=l2norm_qk,
                out=out, log_scales=log_scales, window=window)


def _check_window(variant: Variant, q: torch.Tensor, levels: torch.Tensor, log_scales: torch.Tensor | None,
                  window: object) -> None:
    if window is None:
        if log_scales is not None and variant.delta_rule:
            raise ValueError(f"log_scales: {variant.title}'s lazy levels need their KeyWindow (window=...)")
        return
    if not isinstance(window, KeyWindow):
        raise TypeError(f"window must be a KeyWindow or None, got {type(window).__name__}")
    if not variant.delta_rule or log_scales is None:
        raise ValueError(f"window: only the delta rule's lazy levels (with log_scales) take a KeyWindow; "
                         f"{variant.title} {'has none' if not variant.delta_rule else 'got log_scales=None'}")
    (N, G, K), (H, V), size = q.shape, levels.shape[2::2], window.size
    dtype = _compute_dtype(levels.dtype)
    for name, shape, want in (("keys", (N, size, G, K), dtype), ("betas", (N, size, H), dtype),
                              ("values", (N, size, H, V), dtype), ("gates", (N, size, H), dtype),
                              ("start", (N,), torch.int64)):
        x = getattr(window, name)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype != want or x.device != levels.device:
            got = f"{list(x.shape)} {x.dtype} {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"window.{name} must be {list(shape)}, {want}, on {levels.device}; got {got}")
    if not key_window_size_ok(size):
        raise ValueError(f"window size W must be a power of two in [2, {MAX_KEY_WINDOW}], got {size}")


def _check_log_scales(variant: Variant, levels: torch.Tensor, out: torch.Tensor | None, fenwick: bool,
                      log_scales: object) -> None:
    if not isinstance(log_scales, torch.Tensor):
        raise TypeError(f"log_scales must be a tensor or None, got {type(log_scales).__name__}")
    if not variant.lazy_levels:
        raise ValueError(f"log_scales: {variant.title}'s levels are rewritten every token (pass log_scales=None)")
    if out is not levels or not fenwick:
        raise ValueError("log_scales needs an in-place log-linear step (out=levels, fenwick=True)")
    N, L, H, K = levels.shape[:4]
    shape = (N, L, H, K) if variant.gates[0].per_channel else (N, L, H)
    dtype = _compute_dtype(levels.dtype)
    if tuple(log_scales.shape) != shape or log_scales.dtype != dtype or log_scales.device != levels.device:
        raise ValueError(f"log_scales must be {list(shape)}, {dtype} (the step's compute dtype for {levels.dtype} "
                         f"levels), on {levels.device}; got {list(log_scales.shape)} {log_scales.dtype} "
                         f"{log_scales.device}")


def fused_decode_applies(inp: OpInputs) -> bool:
    """A public-op call the one-token step serves: one token per sequence, a state, and no gradient needed
    (the step has no backward). ``decode_step`` then runs the fused kernel on the triton backend and the
    PyTorch step elsewhere (cheaper on the CPU than a chunk padded to C tokens)."""
    if inp.initial_state is None:
        return False
    one_each = inp.q.shape[1] == 1 if inp.bounds is None else inp.q.shape[1] == len(inp.bounds) - 1
    return one_each and not needs_grad(inp.q, inp.k, inp.v, *inp.gates.values(), inp.level_scales,
                                       inp.initial_state.levels)


def op_decode_step(inp: OpInputs, output_final_state: bool, use_qk_l2norm: bool,
                   backend: str | None = None) -> tuple[torch.Tensor, FenwickState | None]:
    """The public op's T == 1 path: validated inputs in the op's layout -> (o [B, T, H, V], state)."""
    squeeze = 0 if inp.bounds is not None else 1
    take = lambda x: x.squeeze(squeeze)  # noqa: E731
    state = inp.initial_state
    if not inp.plain:
        state = state.with_levels(levels_needed(state.max_position + 1))
    dtype = torch.float64 if torch.float64 in (inp.q.dtype, inp.v.dtype) else torch.float32
    gates = {name: take(x) for name, x in inp.gates.items()}
    o, levels = decode_step(
        inp.variant, take(inp.q), take(inp.k), take(inp.v), gates,
        take(inp.level_scales) if not inp.plain else None, state.levels.to(dtype), state.positions, inp.scale,
        fenwick=not inp.plain, l2norm_qk=use_qk_l2norm, backend=backend,
    )
    o = o.unsqueeze(squeeze)
    return o, (FenwickState(levels, state.positions + 1) if output_final_state else None)
