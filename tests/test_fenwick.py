import random

import pytest
import torch

from loglinear import fenwick

SPEC_T16 = """
0
1 0
2 2 0
2 2 1 0
3 3 3 3 0
3 3 3 3 1 0
3 3 3 3 2 2 0
3 3 3 3 2 2 1 0
4 4 4 4 4 4 4 4 0
4 4 4 4 4 4 4 4 1 0
4 4 4 4 4 4 4 4 2 2 0
4 4 4 4 4 4 4 4 2 2 1 0
4 4 4 4 4 4 4 4 3 3 3 3 0
4 4 4 4 4 4 4 4 3 3 3 3 1 0
4 4 4 4 4 4 4 4 3 3 3 3 2 2 0
4 4 4 4 4 4 4 4 3 3 3 3 2 2 1 0
"""


def test_level_matrix_matches_spec_table():
    rows = [list(map(int, line.split())) for line in SPEC_T16.strip().splitlines()]
    expected = torch.tensor([r + [0] * (16 - len(r)) for r in rows])
    assert torch.equal(fenwick.level_matrix(16), expected)


def test_bit_length_matches_python():
    rng = random.Random(0)
    xs = [0, 1, 2, 3, 2**31, 2**40 + 5, 2**62] + [rng.randrange(2**62) for _ in range(200)]
    got = fenwick.bit_length(torch.tensor(xs)).tolist()
    assert got == [x.bit_length() for x in xs]
    with pytest.raises(TypeError, match="integer"):
        fenwick.bit_length(torch.tensor([1.0]))


def test_bucket_sizes_and_emptiness():
    # level l >= 1 of query t is non-empty iff bit l-1 of t is 1, and then holds 2^(l-1) keys
    for t in range(1, 70):
        lev = fenwick.level(t, torch.arange(t)).tolist()
        for l in range(1, 9):
            count = lev.count(l)
            assert count == ((t >> (l - 1)) & 1) * 2 ** (l - 1)


@pytest.mark.parametrize("n,expected", [(1, 1), (2, 2), (3, 3), (4, 3), (5, 4), (16, 5), (17, 6), (2**20, 21)])
def test_levels_needed(n, expected):
    assert fenwick.levels_needed(n) == expected
    if n > 1:
        assert int(fenwick.level_matrix(min(n, 64)).max()) + 1 <= expected


def test_levels_needed_rejects_zero():
    with pytest.raises(ValueError, match="n >= 1"):
        fenwick.levels_needed(0)


def test_intra_chunk_levels_are_one_cached_table():
    """The chunk path reads the in-chunk levels on every call: built once per chunk size and device (the same
    tensor again), equal to the level matrix of one aligned chunk, int64 on the device asked for."""
    for C in (1, 16, 64):
        table = fenwick.intra_chunk_levels(C, device="cpu")
        assert table is fenwick.intra_chunk_levels(C) and table.device.type == "cpu"
        assert table.dtype == torch.int64 and torch.equal(table, fenwick.level_matrix(C))


@pytest.mark.parametrize("C", [1, 2, 4, 8, 16])
def test_chunk_decomposition(C):
    """Inside a chunk: the CxC pattern; across chunks: a single level c+1+floor(log2(tc^sc)) per chunk pair,
    with the reader/writer/reset rule of the chunk-level scan."""
    c = fenwick.chunk_bits(C)
    T = 8 * C + 3
    lev = fenwick.level_matrix(T)
    intra = fenwick.intra_chunk_levels(C)
    for t in range(T):
        for s in range(t + 1):
            tc, sc = t // C, s // C
            if tc == sc:
                assert lev[t, s] == intra[t % C, s % C]
            else:
                j = (tc ^ sc).bit_length() - 1
                assert lev[t, s] == fenwick.chunk_level_to_token_level(j, C) == c + 1 + j
                assert fenwick.chunk_reads(tc, j) and fenwick.chunk_writes(sc, j)
                # sc and tc share an aligned block of 2^(j+1) chunks: no reset between them
                assert not any(fenwick.chunk_resets_after(x, j) for x in range(sc, tc))


def test_chunk_bits_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        fenwick.chunk_bits(48)


def test_carry_is_a_binary_counter():
    """Simulating the spec's carry (count[l] == 2^l moves level l up) gives target ctz(p)+1."""
    counts = [0] * 12
    for p in range(1, 600):
        counts[0] += 1  # token p-1 sits at level 0
        moved_to = 0
        l = 0
        while counts[l] == 2**l:
            counts[l + 1] += counts[l]
            counts[l] = 0
            moved_to = l + 1
            l += 1
        assert moved_to == int(fenwick.carry_target(p)) == fenwick.ctz(p) + 1
    assert int(fenwick.carry_target(0)) == 0


def test_last_query_masks_are_the_buckets_of_the_last_query():
    """Row l marks the keys s <= e of the chunk whose level for query e is l (fenwick.level), nothing else."""
    for C in (1, 2, 8, 64):
        for e in {0, C // 3, C - 1}:
            masks = fenwick.last_query_masks(e, C, torch.float64, "cpu")
            expected = torch.zeros(masks.shape, dtype=torch.float64)
            for s in range(e + 1):
                expected[int(fenwick.level(e, s)), s] = 1.0
            assert torch.equal(masks, expected), (C, e)


def test_last_query_masks_built_under_inference_mode_serve_autograd():
    """The cache outlives the call that built it: masks first asked for under inference mode are normal tensors."""
    fenwick._LAST_QUERY.cache_clear()  # built here, under inference mode
    with torch.inference_mode():
        masks = fenwick.last_query_masks(5, 16, torch.float32, "cpu")
    x = torch.randn(16, 3, requires_grad=True)
    (masks @ x).sum().backward()  # saves masks for x's gradient
    assert torch.equal(x.grad, masks.sum(0)[:, None].expand(16, 3))


def test_incoming_levels_route_each_bucket_by_the_definition():
    """Token t of the first chunk reads incoming in-chunk bucket m at level max(m, level(c0 C + t, position))."""
    for C, position in ((8, 0), (8, 5), (8, 13), (64, 1000), (1, 3)):
        idx = fenwick.incoming_levels(position, C, "cpu")
        c0, c = position // C, C.bit_length() - 1
        for t in range(C):
            for m in range(c + 1):
                assert idx[t, m] == max(m, int(fenwick.level(c0 * C + t, position))), (C, position, t, m)


def test_bucket_floor_reads_uncarried_buckets_where_the_carry_puts_them():
    """Bucket m of a state whose carry past its position is not formed is read at max(m, bucket_floor): where the
    carried state (levels below carry_level summed into it) has the same bucket, read at incoming_levels. Positions
    at 0 or inside a chunk (carry_level <= c)."""
    for C, position in ((8, 0), (8, 5), (8, 12), (8, 13), (16, 40), (64, 1000)):
        target = fenwick.carry_level(position)
        assert target == int(fenwick.carry_target(position))
        idx, c0 = fenwick.incoming_levels(position, C, "cpu"), position // C
        for t in range(C):
            floor = fenwick.bucket_floor(c0 * C + t, position)
            for m in range(C.bit_length()):
                assert max(m, floor) == idx[t, max(m, target)], (C, position, t, m)


def test_tables_of_several_rows_stack_the_rows_tables():
    """A tuple of queries (positions) gives one table per row, each the single query's (position's)."""
    es, positions = (0, 5, 15, 5), (0, 37, 1000, 16)
    rows = fenwick.last_query_masks(es, 16, torch.float32, "cpu")
    assert torch.equal(rows, torch.stack([fenwick.last_query_masks(e, 16, torch.float32, "cpu") for e in es]))
    rows = fenwick.incoming_levels(positions, 16, "cpu")
    assert torch.equal(rows, torch.stack([fenwick.incoming_levels(p, 16, "cpu") for p in positions]))
