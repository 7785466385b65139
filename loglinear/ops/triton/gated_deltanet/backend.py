"""Log-linear Gated DeltaNet on Triton kernels: the chunk-local stage and the Fenwick delta scan.

Composition, per group of rows that start at the same absolute position p0 (spec section 5):

  1. chunks aligned to absolute positions: p0 mod C identity tokens in front (Chunking; the kernels read
     the op's [b, T, G|H, D] tensors with the padding as masks, q/k from group h // (H / G));
  2. chunk_local_segments (local.py):  o_intra (levels 0..c), qt, W~, K~, u, decay per chunk, launched by the
     scan segment by segment (its producers run beside the chain);
  3. incoming state (torch_chunk.chunk_levels_from): at an aligned p0, carried past it into the chunk levels;
     otherwise its levels <= c are buckets inside the first chunk, read by query t at level
     max(l, ctz(p0) + 1, bit_length(t XOR p0)) (the carry past p0 is never formed: _first_reads) and summed into
     the chunk level that the first chunk's cascade fills; its levels > c seed the chunk-level states;
  4. fenwick_delta_scan (scan.py): every live chunk-level state in one pass, and
     o = scale (o_intra + readouts) written in [b, T, H, V];
  5. the final state splits the last chunk into token-level buckets.

Gradients flow through every stage (the kernels have Triton backwards; the glue is torch autograd), so
q, k, v, g, beta, level_scales and the initial state all get them. Every call runs on the op's tensors as
they are (run_segments with as_given: no fp32 copies, no q/k expansion; with use_qk_l2norm the chunk-local
kernels normalise q/k rows themselves), one launch set per segment: the whole call when its rows start at one
position, else per packed sequence or per group of rows at one position; packed sequences of similar lengths run
as the rows of one call, each padded at its end (_run_rows), where that changes nothing the call returns. The
log-decay g arrives raw (the backend is registered with Backend.takes_raw_log_decays): the kernels floor it where
they load it (local.py), the final state's torch form floors its last chunk (floor_log_decay).

A plain call (level_scales None: plain Gated DeltaNet, lambda = 1, a one-level state) runs the same kernels on a
one-level schedule (_plain_core): chunks from each row's first token (a plain state continues at any position),
lambda = 1 in the chunks (the chunk-local kernels' PLAIN switch: no lambda read, no dlambda written), one chunk
level that every chunk, the last one too, cascades into, seeded with the incoming state; the scan's final state is
the plain state. The scan is the log-linear one: the schedule is data.
"""

from __future__ import annotations

import torch

from loglinear.fenwick import bucket_floor, carry_target, chunk_bits, chunk_level_to_token_level, ctz, levels_needed
from loglinear.inputs import OpInputs, expand_groups, l2norm, run_segments
from loglinear.ops.finite import floor_log_decay
from loglinear.ops.torch_chunk import chunk_levels_from, chunked, final_levels, pad_time
from loglinear.ops.triton.gated_deltanet.chunking import Chunking, chunk_cap
from loglinear.ops.triton.gated_deltanet.local import chunk_local_segments
from loglinear.ops.triton.gated_deltanet.scan import fenwick_delta_scan
from loglinear.ops.triton.shared.common import interpreting
from loglinear.ops.triton.shared.heads import min_head_dim, run_padded
from loglinear.ops.triton.shared.placement import place, placement, take
from loglinear.ops.triton.shared.rules import dot_dtype, kernel_chunk_size
from loglinear.state import FenwickState
from loglinear.tables import device_table, table_cache
from loglinear.variants.gated_deltanet import GatedDeltaNetForm

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_K = 256  # the scan keeps K whole in a tile
ROWS_PADDING = 1.5  # packed sequences run as padded rows of one batch while that adds at most this many tokens


@table_cache()
def _plain_targets(N: int) -> tuple[int, ...]:
    """Every chunk, the last one too, cascades into the one chunk level.  [N]; cached like _merge_targets."""
    return (0,) * N


@table_cache()
def _merge_targets(c0: int, N: int) -> tuple[int, ...]:
    """Cascade target ctz(chunk + 1) after each chunk but the last (-1: no cascade).  [N]; cached (one tuple
    object per (c0, N): the scan's schedule cache then finds it by identity)."""
    chunks = torch.arange(c0 + 1, c0 + N, dtype=torch.int64)
    return (*(carry_target(chunks) - 1).tolist(), -1)


def _inter_level_scales(lam: torch.Tensor, ch: Chunking, c: int, J: int) -> torch.Tensor:
    """lambda of the chunk levels c+1 .. c+J for every token of the padded chunks: lam [b, T, H, L] ->
    [b H, Tp, J] fp32 (0 on padding tokens and for levels >= L, which only padding tokens would read)."""
    part = lam[..., c + 1 : c + 1 + J].transpose(1, 2)  # [b, H, T, <= J]
    out = torch.zeros(ch.b, ch.H, ch.Tp, J, dtype=torch.float32, device=lam.device)
    out[:, :, ch.front : ch.front + ch.T, : part.shape[-1]] = part
    return out.view(ch.BH, ch.Tp, J)


def _last_chunk(x: torch.Tensor, ch: Chunking, norm: bool = False) -> torch.Tensor:
    """The last chunk of x [b, T, G|H, *] as [b, H, 1, C, *] fp32 (zero-padded like the kernels, groups expanded;
    norm: its rows l2norm'd, as the kernels do for q and k)."""
    start = ch.Tp - ch.C - ch.front  # token index of the chunk's first row (< 0: front padding)
    part = x[:, max(start, 0):].float()
    part = l2norm(part) if norm else part
    front = max(-start, 0)
    return chunked(expand_groups(pad_time(part, front, ch.C - front - part.shape[1]), ch.H), ch.C)


@table_cache()
def _first_reads(position: int, C: int, L: int, seeded: bool, device: torch.device) -> torch.Tensor:
    """[C, L, c+1] fp32: lam_t select[t] = the weights of chunk 0's reads of the incoming in-chunk levels m as the
    state holds them (the carry past ``position`` not formed: it keeps their sum), select[t, l, m] = [l = read(t, m)]
    - [seeded][l = c + 1 + m0] for levels l < L (the others read 0), read(t, m) = max(m, fenwick.bucket_floor of
    token c0 C + t). seeded: the levels' sum also seeds chunk level m0 = ctz(c0 + 1), which chunk 0 reads at
    c + 1 + m0 (a call of more than one chunk). Cached (read-only)."""
    c, c0 = chunk_bits(C), position // C
    floors = [bucket_floor(c0 * C + t, position) for t in range(C)]
    kernel = chunk_level_to_token_level(ctz(c0 + 1), C)
    select = [[[float(lev == max(m, floors[t])) - float(seeded and lev == kernel) for m in range(c + 1)]
               for lev in range(L)] for t in range(C)]
    with torch.inference_mode(False):
        return device_table(select, torch.float32, device)


def _incoming_state(
    levels: torch.Tensor, position: int, ch: Chunking, J: int, lc0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The incoming state at position 0 or a position inside a chunk: levels [b, Ls, H, K, V] fp32
    (Ls <= c + 1 + J).  Returns its in-chunk levels (<= c, as the state holds them) [b, H, c+1, K, V] with the weights
    [b, H, C, c+1] fp32 of the first chunk's reads of them (_first_reads; the scan adds that readout to the first
    chunk's o) and the chunk-level seeds h0 [b H, J, K, V].  lc0: lambda of the first chunk [b, H, C, L]."""
    b, H, C, N = ch.b, ch.H, ch.C, ch.N
    K, V, c = levels.shape[-2], levels.shape[-1], chunk_bits(C)
    select = _first_reads(position, C, lc0.shape[-1], N > 1, levels.device)
    weights = (lc0.float().unsqueeze(-1) * select).sum(-2)  # [b, H, C, c+1]; exact (no TF32 product)
    if N > 1:
        # The first chunk's cascade moves its transitioned buckets into chunk level m0. Seeding h_m0 with them
        # instead is the same (the carry keeps their sum), except that chunk 0 would also read them at level
        # c+1+m0: the weights take that read off.
        m0 = ctz(position // C + 1)
        h0, in_chunk = chunk_levels_from(levels, (c,) * b, (m0,) * b, C, J, in_chunk=tuple(range(b)))
    else:
        padded = torch.nn.functional.pad(levels, (0, 0, 0, 0, 0, 0, 0, c + 1 + J - levels.shape[1]))
        in_chunk, h0 = padded[:, : c + 1], padded[:, c + 1 :]
    return in_chunk.transpose(1, 2), weights, h0.transpose(1, 2).reshape(b * H, J, K, V)


def gated_deltanet_core(
    q, k, v, g, beta, lam, scale: float, levels: torch.Tensor | None, position: int, chunk_size: int,
    dtype: torch.dtype, qk_l2norm: bool = False, final: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows sharing the start ``position``.  q, k: [b, T, G, K] (G divides H); v: [b, T, H, V]; g, beta: [b, T, H];
    lam: [b, T, H, L] (any float dtypes); levels: [b, Ls, H, K, V] fp32 or None; dtype: the caller's dtype (the
    kernels' operand dtype and o's); qk_l2norm: q and k are l2norm'd in the chunk-local kernels (and in the
    last chunk's torch form), not here.  Returns o: [b, T, H, V] in dtype and the final levels
    [b, max(Ls, levels_needed(end)), H, K, V] fp32 (final; else None, and nothing of them is computed)."""
    if lam is None:
        return _plain_core(q, k, v, g, beta, scale, levels, chunk_size, dtype, qk_l2norm, final)
    b, T, _, K = q.shape
    H = v.shape[2]
    C = kernel_chunk_size(chunk_size, chunk_cap(dtype, K))
    c = chunk_bits(C)
    ch = Chunking(b, T, H, position % C, C)
    N, c0, end = ch.N, position // C, position + T
    n_in = levels.shape[1] if levels is not None else 0
    (o_intra, qt, wt, kt, u, decay), produce = chunk_local_segments(q, k, v, g, beta, lam, ch, dtype, qk_l2norm)

    J = max((end - 1) // C, 1).bit_length()
    partial = h0 = seeds = first = None
    if levels is not None and position > 0 and ch.front == 0:  # aligned: the carry cleared the in-chunk levels
        target = ctz(position) + 1  # chunk levels below target - c - 1 are cleared: never seeded
        J = max(J, levels.shape[1] - c - 1, target - c)
        rows = levels.shape[0]
        h0, _ = chunk_levels_from(levels, (target,) * rows, (target - c - 1,) * rows, C, J)
        h0 = h0.transpose(1, 2).reshape(ch.BH, J, K, v.shape[-1])
        seeds = ((1 << J) - 1) & ~((1 << (target - c - 1)) - 1)
    elif levels is not None:
        J = max(J, levels.shape[1] - c - 1)
        n0 = min(T, C - ch.front)  # the first chunk's tokens: only they read the in-chunk buckets
        lc0 = chunked(pad_time(lam[:, :n0], ch.front, C - ch.front - n0), C)[:, :, 0]  # [b, H, C, L]
        partial, weights, h0 = _incoming_state(levels, position, ch, J, lc0)  # every chunk level may be nonzero
        first = (weights.flatten(0, 1), partial.flatten(0, 1))

    o, hN = fenwick_delta_scan(
        qt, wt, kt, u, decay, _inter_level_scales(lam, ch, c, J), h0, o_intra, _merge_targets(c0, N), ch, scale,
        dtype, final, seeds, first, produce,
    )
    if not final:
        return o, None
    return o, _final_state(q, k, v, g, beta, hN, partial if N == 1 else None, ch, position, J, qk_l2norm, n_in)


def _plain_core(
    q, k, v, g, beta, scale: float, levels: torch.Tensor | None, chunk_size: int, dtype: torch.dtype,
    qk_l2norm: bool, final: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gated_deltanet_core of a plain call (module docstring): levels [b, 1, H, K, V] fp32 or None -> o [b, T, H, V]
    in dtype and the final state [b, 1, H, K, V] fp32 (final; else None)."""
    b, T, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    C = kernel_chunk_size(chunk_size, chunk_cap(dtype, K))
    ch = Chunking(b, T, H, 0, C)
    one = torch.ones((), dtype=torch.float32, device=q.device)
    (o_intra, qt, wt, kt, u, decay), produce = chunk_local_segments(q, k, v, g, beta, None, ch, dtype, qk_l2norm)
    h0 = None if levels is None else levels.transpose(1, 2).reshape(b * H, 1, K, V)
    o, hN = fenwick_delta_scan(qt, wt, kt, u, decay, one.expand(b * H, ch.Tp, 1), h0, o_intra, _plain_targets(ch.N),
                               ch, scale, dtype, final, produce=produce)
    return o, (hN.view(b, H, 1, K, V).transpose(1, 2) if final else None)


def _final_state(
    q, k, v, g, beta, hN: torch.Tensor, partial: torch.Tensor | None, ch: Chunking, position: int, J: int,
    qk_l2norm: bool, n_in: int,
) -> torch.Tensor:
    """The final levels [b, max(levels_needed(end), n_in), H, K, V] fp32, the width every backend returns: the last
    chunk split into token-level buckets (the torch path's form; q, k, v, g, beta as in gated_deltanet_core) and
    the chunk-level states hN [b H, J, K, V]; partial [b, H, c+1, K, V]: the incoming in-chunk buckets when the
    call is one chunk (else None); n_in: the incoming state's levels (0 without one: a state keeps its width).
    The chunk levels above that width hold no token (zeros) and are dropped."""
    b, H, C, K, V = ch.b, ch.H, ch.C, hN.shape[-2], hN.shape[-1]
    c, c0, end = chunk_bits(C), position // C, position + ch.T
    last = GatedDeltaNetForm(_last_chunk(q, ch, qk_l2norm), _last_chunk(k, ch, qk_l2norm), _last_chunk(v, ch),
                             floor_log_decay(_last_chunk(g, ch)), _last_chunk(beta, ch))
    H_levels = list(hN.view(b, H, J, K, V).unbind(2))
    final = final_levels(last, H_levels, partial, position, end, c0 + ch.N - 1, 1, C, c)
    n_final = max(levels_needed(end), n_in)
    return torch.nn.functional.pad(final, (0, 0, 0, 0, 0, 0, 0, max(0, n_final - final.shape[1])))[:, :n_final]


def supports(inp: OpInputs) -> bool:
    """Do the kernels take this call? bf16/fp16/fp32 q and v, K <= MAX_K, on CUDA (CPU tensors under the
    interpreter). The dispatcher (loglinear.ops.backends) sends the others (float64, K > 256, CPU without
    TRITON_INTERPRET) to the torch chunk path."""
    dtypes = inp.v.dtype in SUPPORTED_DTYPES and inp.q.dtype in SUPPORTED_DTYPES
    return dtypes and inp.q.shape[-1] <= MAX_K and (inp.q.device.type == "cuda" or interpreting())


def backend(
    inp: OpInputs, output_final_state: bool, chunk_size: int, use_qk_l2norm: bool,
) -> tuple[torch.Tensor, FenwickState | None]:
    """The registered "triton" backend of Gated DeltaNet (CUDA, or CPU under TRITON_INTERPRET=1) on
    inputs it supports; heads narrower than min_head_dim run zero-padded."""
    dtype = inp.v.dtype
    minimum = min_head_dim(dot_dtype(dtype), inp.q.device)
    return run_padded(inp, minimum, lambda x: _run_kernels(x, output_final_state, chunk_size, use_qk_l2norm))


def _run_kernels(
    inp: OpInputs, output_final_state: bool, chunk_size: int, use_qk_l2norm: bool,
) -> tuple[torch.Tensor, FenwickState | None]:
    """backend on the kernels, in v's dtype: (o [B, T, H, V], final state or None)."""
    dtype = inp.v.dtype

    def core(q, k, v, gates, lam, scale, levels, position, qk_l2norm=False):
        """gated_deltanet_core; the final levels only for output_final_state (else None: run_segments carries
        nothing between segments, each starts from its own incoming state)."""
        return gated_deltanet_core(q, k, v, gates["g"], gates["beta"], lam, scale, levels, position, chunk_size,
                                   dtype, qk_l2norm, output_final_state)

    if _as_rows(inp, output_final_state):
        return _run_rows(inp, core, output_final_state, use_qk_l2norm)
    return run_segments(inp, core, output_final_state, l2norm_qk=use_qk_l2norm, as_given=True)


def _as_rows(inp: OpInputs, output_final_state: bool) -> bool:
    """Do the packed sequences of a varlen call run as rows of one batch, each padded at its end to the longest
    (_run_rows), instead of a launch set each? Sequences of one length from states at one position (or none): they
    are a batch. Otherwise, when the padding adds at most ROWS_PADDING times the tokens and changes nothing the call
    returns: a plain call (its one-level state stays as it is through identity tokens; any states), or a log-linear
    one from no state without a final state (padding past a sequence's end would move its final levels through
    later carries)."""
    if inp.bounds is None or len(inp.bounds) < 3:
        return False
    lengths = [b - a for a, b in zip(inp.bounds, inp.bounds[1:])]
    state = inp.initial_state
    if len(set(lengths)) == 1 and (state is None or len(set(state.positions.tolist())) == 1):
        return True
    if not inp.plain and (state is not None or output_final_state):
        return False
    return len(lengths) * max(lengths) <= ROWS_PADDING * sum(lengths)


def _run_rows(inp: OpInputs, core, output_final_state: bool, use_qk_l2norm: bool
              ) -> tuple[torch.Tensor, FenwickState | None]:
    """The packed sequences of a varlen call (_as_rows) as rows [N, T_max] of one core call, each padded at its end
    with zero tokens (q = k = v = 0, g = beta = lambda = 0: the identity transition, depositing and reading
    nothing; their outputs dropped): one scatter per input for all sequences (one autograd node each) and one
    gather for o."""
    lengths = tuple(b - a for a, b in zip(inp.bounds, inp.bounds[1:]))
    N, T = len(lengths), max(lengths)
    at = placement(tuple(inp.bounds), T, inp.q.device)

    def rows(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else place(x[0], at).view(N, T, *x.shape[2:])

    state = inp.initial_state
    # the rows' one position (a plain call's chunks start at each row's first token, wherever its state is)
    position = int(state.positions[0]) if state is not None and not inp.plain else 0
    o, levels = core(rows(inp.q), rows(inp.k), rows(inp.v), {name: rows(x) for name, x in inp.gates.items()},
                     rows(inp.level_scales), inp.scale, state.levels.float() if state is not None else None, position,
                     qk_l2norm=use_qk_l2norm)
    o = take(o.flatten(0, 1), at)[None].to(inp.v.dtype).contiguous()
    if not output_final_state:
        return o, None
    start = state.positions if state is not None else torch.zeros(N, dtype=torch.int64)
    return o, FenwickState(levels.contiguous(), start + torch.tensor(lengths))
