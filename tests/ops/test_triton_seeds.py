"""The seeded first chunks' reads of a state inside a chunk (loglinear/ops/triton/mamba2/seeds.py, kernels under
TRITON_INTERPRET=1): add_seed_reads' output and seed_read_grads' gradients against autograd through the formula
written with the levels the torch path reads (fenwick.incoming_levels), in float64. The op-level tests
(test_triton_mamba2.py, test_triton_gla.py) check the reads inside whole calls against the float64 references."""

import pytest
import torch

from loglinear.fenwick import chunk_bits, ctz, incoming_levels
from loglinear.inputs import expand_groups
from loglinear.ops.triton.mamba2.seeds import FLOOR, add_seed_reads, first_chunks, seed_read_grads

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("triton_kernels")]

C, L = 8, 5  # c = 3, M = 4 in-chunk levels; L = 5 lambda levels: a kernel level c + 1 + m0 >= 5 reads 0
# the call's tokens [0, 9). Sequence 0: tokens [0, 6) from position 5 (chunk 0: rows 5..7 held, m0 = 0, kernel
# level 4); sequence 1: tokens [6, 9) from position 11 (chunk 1: rows 3..5 held, m0 = 1, kernel level 5 >= L)
STARTS, ENDS, POSITIONS = (-5, 3), (6, 9), (5, 11)
TOKENS = 9


def _held(r):
    """The held rows of seeded chunk r."""
    return [t for t in range(C) if POSITIONS[r] % C <= t < ENDS[r] - STARTS[r]]


def _reference(o, q, g, lam, levels, scale):
    """o plus the module docstring's reads, one token and level at a time (autograd takes its gradients)."""
    H, c = lam.shape[1], chunk_bits(C)
    out = [o[t] for t in range(TOKENS)]
    for r, p in enumerate(POSITIONS):
        rows = _held(r)
        idx = [STARTS[r] + t for t in rows]
        decay = torch.exp(g[idx].clamp_min(FLOOR).cumsum(0))
        qt = expand_groups(q[idx][None], H)[0] * (decay if g.dim() == 3 else decay[..., None])  # [rows, H, K]
        incoming, target, kernel = incoming_levels(p, C, "cpu"), ctz(p) + 1, c + 1 + ctz(p // C + 1)
        for i, t in enumerate(rows):
            for m in range(c + 1):
                read = int(incoming[t, max(m, target)])
                w = (lam[idx[i], :, read] if read < L else 0) - (lam[idx[i], :, kernel] if kernel < L else 0)
                out[idx[i]] = out[idx[i]] + scale * w[:, None] * torch.einsum("hk,hkv->hv", qt[i], levels[r, m])
    return torch.stack(out)


def _gate_grad(terms, g):
    """dg from the gate's terms q.dq [tokens, H(, K)]: their reverse cumsum over each sequence's held rows, 0 where
    g <= FLOOR (what the kernels' gate gradient forms from them)."""
    dg = torch.zeros_like(terms)
    for r in range(len(POSITIONS)):
        idx = [STARTS[r] + t for t in _held(r)]
        dg[idx] = terms[idx].flip(0).cumsum(0).flip(0)
    return torch.where(g <= FLOOR, 0.0, dg)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("K, V, fp32_block", [(3, 2, None), (5, 3, 2)])
def test_seed_reads_are_the_formula_and_its_gradients(per_channel, K, V, fp32_block, monkeypatch):
    """o, and the gradients of q (a group of two heads), g (scalar and per channel, one entry below the floor),
    lambda and the levels under a random cotangent: the kernels against autograd through the formula in float64,
    the key and value whole or in blocks of fp32_block columns (fp32 operands' FP32_BLOCK; each last block partial).
    The gradients are added to buffers that already hold values (the kernels' own), and the tokens no seeded chunk
    holds keep theirs."""
    from loglinear.ops.triton.mamba2 import seeds

    if fp32_block is not None:
        monkeypatch.setattr(seeds, "FP32_BLOCK", fp32_block)
        sizes = seeds.kernel_sizes(torch.float32, K, V, C)
        assert [sizes[n] for n in ("BK", "NKB", "BV", "NVB")] == [2, 3, 2, 2]
    gen = torch.Generator().manual_seed(0)
    H, G = 2, 1
    chunks = first_chunks(STARTS, ENDS, POSITIONS, C, torch.device("cpu"))
    o = torch.randn(TOKENS, H, V, generator=gen)
    q = torch.randn(TOKENS, G, K, generator=gen)
    g = -torch.rand(TOKENS, H, *((K,) if per_channel else ()), generator=gen)
    g[STARTS[0] + 6, 1] = -1e4  # below the floor: no gradient there
    lam = torch.rand(TOKENS, H, L, generator=gen)
    levels = torch.randn(len(POSITIONS), chunk_bits(C) + 1, H, K, V, generator=gen)
    exact = [x.double().requires_grad_() for x in (o, q, g, lam, levels)]
    got = o.clone()
    add_seed_reads(got, q, g, lam, levels, chunks, 0.7)
    want = _reference(*exact, 0.7)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    d_o = torch.randn(want.shape, generator=gen)
    wanted = dict(zip(("q", "g", "lam", "levels"), torch.autograd.grad(want, exact[1:], d_o.double())))
    before = dict(dq=torch.randn(TOKENS, H, K, generator=gen), qdq=torch.randn(g.shape, generator=gen),
                  dlam=torch.randn(lam.shape, generator=gen))
    after = {name: x.clone() for name, x in before.items()}
    d_levels = seed_read_grads(d_o, q, g, lam, levels, chunks, 0.7, after["dq"], after["qdq"], after["dlam"])
    added = {name: after[name] - before[name] for name in before}
    held = sorted(STARTS[r] + t for r in range(len(POSITIONS)) for t in _held(r))
    assert set(held) < set(range(TOKENS))  # tokens 3..5 are no seeded chunk's: their rows must stay
    got_grads = dict(q=added["dq"].sum(1, keepdim=True), g=_gate_grad(added["qdq"], g), lam=added["dlam"],
                     levels=d_levels)
    for name, b in wanted.items():
        assert b.abs().sum() > 0, name  # every gradient is exercised
        torch.testing.assert_close(got_grads[name], b.float(), rtol=1e-5, atol=1e-5, msg=lambda m: f"d{name}: {m}")
    assert (wanted["g"][STARTS[0] + 6, 1] == 0).all()  # the floored entry
    untouched = sorted(set(range(TOKENS)) - set(held))
    for name, x in added.items():
        assert (x[untouched] == 0).all(), name
