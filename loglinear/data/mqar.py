"""Multi-query associative recall (MQAR), Zoology-style, generated offline from a seeded torch.Generator.

An example of length T over a vocabulary of size V:

    k_1 v_1 k_2 v_2 ... k_n v_n | x x k_3 x x x k_1 x ... k_2 x

The context holds n key-value pairs: keys drawn without replacement from [1, V/2), values from [V/2, V).
The query region (T - 2n tokens, seen as (T - 2n) / 2 slots of two tokens) re-queries every key exactly
once, at slot i drawn without replacement with probability p(i) ~ a * i^(a-1) (a = power_a < 1
favours early slots, i.e. queries soon after the context, as in Zoology). The target at a query key's position
is its value (the next token to predict); every other target is -100. Filler tokens are random (or 0 with
random_non_queries=False).
"""

from __future__ import annotations

import torch

from loglinear.inputs import IGNORE_INDEX

__all__ = ["mqar_batch", "query_targets", "IGNORE_INDEX"]


def _check(seq_len: int, num_kv_pairs: int, vocab_size: int) -> None:
    if seq_len % 2:
        raise ValueError(f"seq_len must be even, got {seq_len}")
    if num_kv_pairs < 1 or 4 * num_kv_pairs > seq_len:
        raise ValueError(f"num_kv_pairs must be in [1, seq_len / 4] = [1, {seq_len // 4}], got {num_kv_pairs}")
    if vocab_size // 2 - 1 < num_kv_pairs:
        raise ValueError(f"vocab_size {vocab_size} too small for {num_kv_pairs} distinct keys in [1, vocab/2)")


def _distinct(n: int, k: int, low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k] int64: k distinct integers from [low, high) per row, uniformly (Floyd's algorithm over the rows
    at once, then a random order): O(k) draws per row instead of O(high - low)."""
    span, rows = high - low, torch.arange(n)
    taken = torch.zeros(n, span, dtype=torch.bool)
    out = torch.empty(n, k, dtype=torch.int64)
    for i, j in enumerate(range(span - k, span)):
        t = torch.randint(0, j + 1, (n,), generator=gen)
        t = torch.where(taken[rows, t], j, t)
        taken[rows, t] = True
        out[:, i] = t
    order = torch.rand(n, k, generator=gen).argsort(dim=1)
    return out.gather(1, order) + low


def query_targets(targets: torch.Tensor, num_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query positions of MQAR targets [N, T] and their values, padded to num_queries (>= every row's
    count) per row: (positions [N, num_queries], values [N, num_queries], -100 in the padding). Lets a loss
    read the LM head at these positions only (a gather of fixed shape, no host sync)."""
    is_query = (targets != IGNORE_INDEX).to(torch.int8)
    positions = is_query.argsort(dim=1, descending=True, stable=True)[:, :num_queries]
    return positions, targets.gather(1, positions)


def mqar_batch(
    num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int = 8192, *, seed: int,
    power_a: float = 0.01, random_non_queries: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate MQAR examples. Returns (inputs [N, T] int64, targets [N, T] int64 with -100 = ignore)."""
    _check(seq_len, num_kv_pairs, vocab_size)
    gen = torch.Generator().manual_seed(seed)
    n, kv = num_examples, num_kv_pairs
    keys = _distinct(n, kv, 1, vocab_size // 2, gen)
    values = _distinct(n, kv, vocab_size // 2, vocab_size, gen)
    context = torch.stack([keys, values], dim=2).reshape(n, 2 * kv)

    slots = (seq_len - 2 * kv) // 2
    i = torch.arange(1, slots + 1, dtype=torch.float64)
    p = power_a * i.pow(power_a - 1)
    slot = torch.multinomial(p.expand(n, slots), kv, replacement=False, generator=gen)  # [N, kv]
    query_pos = 2 * kv + 2 * slot

    if random_non_queries:
        inputs = torch.randint(0, vocab_size, (n, seq_len), generator=gen)
    else:
        inputs = torch.zeros(n, seq_len, dtype=torch.int64)
    inputs[:, : 2 * kv] = context
    inputs.scatter_(1, query_pos, keys)
    targets = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.int64)
    targets.scatter_(1, query_pos, values)
    return inputs, targets
