"""Fenwick level arithmetic for log-linear attention (spec section 2).

Positions are 0-based and absolute within a sequence. The prefix of query ``t`` is cut into buckets:

    level(t, t) = 0
    level(t, s) = bit_length(t XOR s)            for s < t

Level l >= 1 of query t is non-empty iff bit l-1 of t is set, and then holds 2^(l-1) keys.

With chunks of C = 2^c tokens (t = tc*C + tl, s = sc*C + sl):

    level(t, s) = bit_length(tl XOR sl)                  same chunk   (levels 0..c)
    level(t, s) = c + 1 + floor(log2(tc XOR sc))         other chunk  (chunk-level j <-> token level c+1+j)

so every off-diagonal chunk pair carries a single level. For chunk-level j, chunk tc *reads* if bit j
of tc is 1, *writes* if bit j is 0, and the level's running state resets after every aligned block of
2^(j+1) chunks. Equivalently (the cascade used by our kernels and the decoder), going from query
position p-1 to p, levels 0..ctz(p) merge into level ctz(p)+1: a binary counter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loglinear.tables import keyed_tables

__all__ = [
    "bit_length",
    "level",
    "level_matrix",
    "levels_needed",
    "chunk_bits",
    "intra_chunk_levels",
    "chunk_level_to_token_level",
    "chunk_reads",
    "chunk_writes",
    "chunk_resets_after",
    "carry_target",
    "carry_level",
    "bucket_floor",
    "carry",
    "carry_into",
    "held_levels",
    "last_query_masks",
    "incoming_levels",
    "ctz",
    "trailing_zeros",
]


def bit_length(x: torch.Tensor) -> torch.Tensor:
    """Elementwise ``int.bit_length`` of a non-negative integer tensor (exact for int64)."""
    if x.dtype.is_floating_point or x.dtype == torch.bool:
        raise TypeError(f"bit_length expects an integer tensor, got dtype {x.dtype}")
    y = x.to(torch.int64)
    out = torch.zeros_like(y)
    for shift in (32, 16, 8, 4, 2, 1):
        high = (y >> shift) > 0
        out = out + high.to(torch.int64) * shift
        y = torch.where(high, y >> shift, y)
    return out + (y > 0).to(torch.int64)


def level(t: torch.Tensor | int, s: torch.Tensor | int) -> torch.Tensor:
    """Fenwick level of key position ``s`` for query position ``t`` (broadcasting, s <= t assumed)."""
    t = torch.as_tensor(t, dtype=torch.int64)
    s = torch.as_tensor(s, dtype=torch.int64)
    return bit_length(t ^ s)


def level_matrix(n: int, start: int = 0, device: torch.device | None = None) -> torch.Tensor:
    """Levels of all (query, key) pairs of positions start..start+n-1: ``[n, n]`` int64, 0 above the diagonal."""
    pos = torch.arange(start, start + n, device=device)
    lev = level(pos[:, None], pos[None, :])
    return torch.tril(lev)


def levels_needed(n: int) -> int:
    """Number of levels that queries at positions 0..n-1 can touch: ceil(log2 n) + 1 (1 for n = 1)."""
    if n < 1:
        raise ValueError(f"levels_needed expects n >= 1 positions, got {n}")
    return (n - 1).bit_length() + 1


def chunk_bits(chunk_size: int) -> int:
    """c = log2 C for a power-of-two chunk size C."""
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 1, got {chunk_size}")
    return chunk_size.bit_length() - 1


def intra_chunk_levels(chunk_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Levels inside an aligned chunk: ``[C, C]`` int64, bit_length(tl XOR sl) below the diagonal, 0 above (None:
    on the CPU). Cached (read-only): every chunk-path call reads it, and forming it takes some fifty device ops."""
    chunk_bits(chunk_size)
    return _INTRA((chunk_size,), torch.int64, torch.device("cpu" if device is None else device))


def chunk_level_to_token_level(j: int, chunk_size: int) -> int:
    """Chunk-level j (between chunks) is token level log2(C) + 1 + j."""
    return chunk_bits(chunk_size) + 1 + j


def chunk_reads(chunk: int, j: int) -> bool:
    """Query chunk ``chunk`` has a non-empty chunk-level-j bucket iff bit j of ``chunk`` is 1."""
    return bool((chunk >> j) & 1)


def chunk_writes(chunk: int, j: int) -> bool:
    """Chunk ``chunk`` contributes its keys to the chunk-level-j bucket of later chunks iff bit j is 0."""
    return not chunk_reads(chunk, j)


def chunk_resets_after(chunk: int, j: int) -> bool:
    """The chunk-level-j running state resets after the last chunk of each aligned block of 2^(j+1)."""
    return (chunk + 1) % (1 << (j + 1)) == 0


def ctz(n: int) -> int:
    """Count of trailing zero bits of a positive Python int (host-side: no tensor)."""
    return (n & -n).bit_length() - 1


def trailing_zeros(x: torch.Tensor) -> torch.Tensor:
    """Count of trailing zero bits of a positive int64 tensor (ctz)."""
    x = torch.as_tensor(x, dtype=torch.int64)
    return bit_length(x & -x) - 1


def carry_target(position: torch.Tensor | int) -> torch.Tensor:
    """When token ``position`` (> 0) arrives, levels 0..ctz(position) merge into level ctz(position) + 1.

    Returns that target level (the binary-counter carry of spec section 4); 0 for position 0 (no carry).
    """
    p = torch.as_tensor(position, dtype=torch.int64)
    return torch.where(p > 0, trailing_zeros(torch.clamp(p, min=1)) + 1, torch.zeros_like(p))


def carry_level(position: int) -> int:
    """carry_target of one host-side position (a Python int): ctz(position) + 1, 0 for position 0."""
    return ctz(position) + 1 if position else 0


def bucket_floor(token: int, position: int) -> int:
    """The lowest level at which ``token`` reads the in-chunk buckets of a state at ``position`` whose carry past
    the position is not formed: bucket m is read at max(m, bucket_floor), bucket_floor = max(bit_length(token XOR
    position), carry_level(position)) (the carry would sum the buckets below carry_level into that one)."""
    return max((token ^ position).bit_length(), carry_level(position))


def carry(levels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Apply the carry for a new token at ``positions[n]`` of each sequence n: levels 0..ctz(p) are added
    into level ctz(p)+1 and cleared (nothing for p = 0).

    levels: [N, L, ...] level states with L > ctz(p) + 1 for every p > 0; positions: [N] int64.
    Returns a new tensor of levels' shape (differentiable; no in-place update).
    """
    return carry_into(levels, carry_target(positions).to(levels.device))


def carry_into(levels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The carry with each row's target given (carry_target of its position, 0: the row is unchanged): levels
    below target[n] are added into level target[n] and cleared (set to 0).

    levels: [N, L, ...] with L > every target; target: [N] int64 on levels' device. Returns a new tensor of
    levels' shape (differentiable), masks over the level axis: the same ops for any number of rows.
    """
    lev = torch.arange(levels.shape[1], device=levels.device)
    shape = tuple(levels.shape[:2]) + (1,) * (levels.dim() - 2)
    below = (lev[None, :] < target[:, None]).view(shape)
    into = ((lev[None, :] == target[:, None]) & (target[:, None] > 0)).view(shape)
    merged = torch.where(below | into, levels, 0.0).sum(1, keepdim=True)
    return torch.where(below, 0.0, torch.where(into, merged, levels))


def held_levels(positions: torch.Tensor, num_levels: int) -> torch.Tensor:
    """Which levels a state after ``positions[n]`` tokens holds: level 0 (p > 0) and each level l >= 1 with bit l - 1
    of p - 1 set (the buckets of the last query, p - 1; every other level is empty).

    positions: [N] int64 -> [N, num_levels] bool (on positions' device).
    """
    p = torch.as_tensor(positions, dtype=torch.int64)[:, None]
    lev = torch.arange(num_levels, device=p.device)[None, :]
    bit = (torch.clamp(p - 1, min=0) >> torch.clamp(lev - 1, min=0)) & 1
    return (p > 0) & ((lev == 0) | (bit == 1))


_INTRA = keyed_tables(lambda C: level_matrix(C).tolist(), 64)
def _last_query(e: int, C: int) -> list[list[float]]:
    return [[float(s <= e and (s ^ e).bit_length() == l) for s in range(C)] for l in range(chunk_bits(C) + 1)]


def _incoming(position: int, C: int) -> list[list[int]]:
    return [[max(m, ((position // C * C + t) ^ position).bit_length()) for m in range(chunk_bits(C) + 1)]
            for t in range(C)]


def _per_row(build: Callable[[int, int], list]) -> Callable[[int | tuple[int, ...], int], list]:
    """build(x, C) for one int x, or for each x of a tuple (a table per row, stacked)."""
    return lambda x, C: [build(y, C) for y in x] if isinstance(x, tuple) else build(x, C)


_LAST_QUERY = keyed_tables(_per_row(_last_query), 512)
_INCOMING = keyed_tables(_per_row(_incoming), 512)


def last_query_masks(e: int | tuple[int, ...], C: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The in-chunk buckets of query e of an aligned chunk of C = 2^c tokens: [c + 1, C] in ``dtype``, row l is 1 at
    the positions s <= e with bit_length(s XOR e) = l, else 0; a tuple of queries e: [len(e), c + 1, C], one per row.
    Cached (read-only): a final state's last chunk would otherwise cost some forty small device ops per sequence."""
    return _LAST_QUERY((e, C), dtype, torch.device(device))


def incoming_levels(position: int | tuple[int, ...], C: int, device: torch.device | str) -> torch.Tensor:
    """Where the first chunk of a call continuing a state at ``position`` reads that state's in-chunk buckets:
    [C, c + 1] int64, entry [t, m] = max(m, bit_length((c0 C + t) XOR position)) for token c0 C + t of the chunk
    (c0 = position // C), the level at which it reads incoming bucket m; a tuple of positions: [len(position), C,
    c + 1], one per row. Cached (read-only)."""
    return _INCOMING((position, C), torch.int64, torch.device(device))
