"""The seeded first chunks' reads of a state inside a chunk (loglinear/ops/triton/mamba2/seeds.py): SeedReads'
written-out gradients against autograd through the same formula, and its select table against the levels the
torch path reads (fenwick.incoming_levels). The op-level tests (test_triton_mamba2.py, test_triton_gla.py) check
the reads themselves against the float64 references."""

import pytest
import torch

from loglinear.fenwick import chunk_bits, ctz, incoming_levels
from loglinear.inputs import expand_groups
from loglinear.ops.triton.mamba2.seeds import FLOOR, SeedReads, first_chunks

C, L = 8, 5  # c = 3, M = 4 in-chunk levels; L = 5 lambda levels: a kernel level c + 1 + m0 >= 5 reads 0
# sequence 0: tokens [0, 6) from position 5 (chunk 0, m0 = 0, kernel level 4); sequence 1: tokens [6, 9) from
# position 11 (chunk 1, m0 = 1, kernel level 5 >= L), ending inside its first chunk
STARTS, ENDS, POSITIONS = (-5, 3), (6, 9), (5, 11)


def _reference(q, g, lam, levels, chunks, scale):
    """The module docstring's correction in plain torch ops (autograd takes its gradients)."""
    H = lam.shape[2]
    held = chunks.held.view(*chunks.held.shape, *(1,) * (g.dim() - 2))
    decay = torch.exp(torch.where(held, g.clamp_min(FLOOR), 0.0).cumsum(1))
    qt = expand_groups(q, H) * (decay if decay.dim() == 4 else decay[..., None])
    w = lam @ chunks.select
    terms = torch.einsum("rthm,rthk,rmhkv->rthv", w, qt, levels) * scale
    return terms.flatten(0, 1).index_select(0, chunks.taken)


@pytest.mark.parametrize("per_channel", [False, True])
def test_seed_reads_gradients_are_autograds(per_channel):
    """Outputs and the gradients of q (a group of two heads), g (scalar and per channel, one entry at the floor),
    lambda and the levels under a random cotangent: SeedReads equals autograd through the formula."""
    gen = torch.Generator().manual_seed(0)
    H, G, K, V = 2, 1, 3, 2
    chunks = first_chunks(STARTS, ENDS, POSITIONS, C, L, torch.device("cpu"))
    R, M = len(POSITIONS), chunk_bits(C) + 1
    q = torch.randn(R, C, G, K, generator=gen)
    g = -torch.rand(R, C, H, *((K,) if per_channel else ()), generator=gen)
    g[0, 6, 1] = -1e4  # below the floor: no gradient there
    lam = torch.rand(R, C, H, L, generator=gen)
    levels = torch.randn(R, M, H, K, V, generator=gen)
    leaves = [x.requires_grad_() for x in (q, g, lam, levels)]
    got = SeedReads.apply(q, g, lam, levels, chunks, 0.7)
    want = _reference(q, g, lam, levels, chunks, 0.7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    d_terms = torch.randn(want.shape, generator=gen)
    wanted = torch.autograd.grad(want, leaves, d_terms)
    for a, b, name in zip(torch.autograd.grad(got, leaves, d_terms), wanted, ("q", "g", "lam", "levels")):
        assert b.abs().sum() > 0, name  # every gradient is exercised
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"d{name}: {m}")
    assert (wanted[1][0, 6, 1] == 0).all()  # the floored entry


def test_select_reads_the_carried_buckets_levels():
    """select's +1 entries are the levels the torch path reads the carried buckets at (incoming_levels of bucket
    max(m, ctz(p) + 1)), its -1 entry the kernels' level c + 1 + m0 (none when that is >= L), on the held rows."""
    chunks = first_chunks(STARTS, ENDS, POSITIONS, C, L, torch.device("cpu"))
    c = chunk_bits(C)
    for r, (p, a, b) in enumerate(zip(POSITIONS, STARTS, ENDS)):
        incoming, target, kernel = incoming_levels(p, C, "cpu"), ctz(p) + 1, c + 1 + ctz(p // C + 1)
        for t in range(C):
            for m in range(c + 1):
                want = torch.zeros(L + 8)  # room for levels >= L, cut below
                if p % C <= t < b - a:
                    want[int(incoming[t, max(m, target)])] += 1
                    want[kernel] -= 1
                torch.testing.assert_close(chunks.select[r, t, :, m], want[:L])
