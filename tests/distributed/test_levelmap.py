"""The boundary-map algebra of context parallelism, in one process against the public op (float64).

A shard's map x -> mat . route_d(x) + local must reproduce the op's final state from any (junk) incoming
state; composing maps must reproduce the op over the concatenated shards; the adjoint maps must be the
transposes. These catch errors in route depths and transition products that the 2- and 4-rank runs
cannot reach (there, composites of two non-constant maps are never applied)."""

from __future__ import annotations

import pytest
import torch

import loglinear
from helpers import assert_close, make_inputs
from loglinear.distributed.levelmap import LevelMap, compose, route, route_adjoint
from loglinear.inputs import l2norm
from loglinear.variants import GATED_DELTANET, MAMBA2
from loglinear.fenwick import bit_length
from loglinear.state import FenwickState

CHUNK = 4


def _final(variant: str, x: dict, levels: torch.Tensor, position: int) -> torch.Tensor:
    state = FenwickState(levels, torch.full((levels.shape[0],), position))
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "level_scales") if variant != "mamba2" or n != "beta"]
    op = loglinear.log_linear_mamba2 if variant == "mamba2" else loglinear.log_linear_gated_deltanet
    extra = {"use_qk_l2norm": True} if variant == "gated_deltanet" else {}
    _, final = op(*args, initial_state=state, output_final_state=True, chunk_size=CHUNK, **extra)
    return final.with_levels(levels.shape[1]).levels


def _shard_map(variant: str, x: dict, p0: int, L: int) -> LevelMap:
    B, T, H, V = x["v"].shape
    K = x["q"].shape[-1]
    local = _final(variant, x, torch.zeros(B, L, H, K, V, dtype=torch.float64), p0)
    if variant == "mamba2":
        mat = MAMBA2.shard_transition(x["k"], {"g": x["g"]}, CHUNK)
    else:
        mat = GATED_DELTANET.shard_transition(l2norm(x["k"]), {"g": x["g"], "beta": x["beta"]}, CHUNK)
    depth = bit_length(torch.full((B,), p0 + T - 1) ^ (p0 - 1))
    return LevelMap(local, mat, depth)


def _apply(m: LevelMap, x: torch.Tensor) -> torch.Tensor:
    return m.linear(x, adjoint=False) + m.offset


@pytest.mark.parametrize("variant", ["mamba2", "gated_deltanet"])
@pytest.mark.parametrize("start, cuts", [(1, [1, 7, 8, 19]), (6, [6, 3, 13, 1]), (13, [5, 16, 2, 11])])
def test_shard_maps_reproduce_and_compose(variant, start, cuts):
    gen = torch.Generator().manual_seed(start)
    T = sum(cuts)
    x = make_inputs(B=2, T=T, G=1, H=2, K=4, V=3, start=start, generator=gen)
    B, L, H, K, V = 2, x["level_scales"].shape[-1], 2, 4, 3
    junk = lambda: torch.randn(B, L, H, K, V, dtype=torch.float64, generator=gen)  # noqa: E731
    bounds = [0] + torch.tensor(cuts).cumsum(0).tolist()
    maps = []
    for a, b in zip(bounds, bounds[1:]):
        shard = {n: t[:, a:b] for n, t in x.items()}
        m = _shard_map(variant, shard, start + a, L)
        s = junk()
        assert_close(_apply(m, s), _final(variant, shard, s, start + a), what=f"shard [{a}, {b}) map")
        maps.append(m)
    s = junk()
    expected = _final(variant, x, s, start)
    left = compose(compose(compose(maps[3], maps[2], False), maps[1], False), maps[0], False)
    right = compose(maps[3], compose(maps[2], compose(maps[1], maps[0], False), False), False)
    balanced = compose(compose(maps[3], maps[2], False), compose(maps[1], maps[0], False), False)
    for name, m in (("left", left), ("right", right), ("balanced", balanced)):
        assert_close(_apply(m, s), expected, what=f"{name}-folded composite")

    # adjoints: <y, E(x)> = <E^T(y), x> for one shard and for the composite (adjoint maps compose reversed)
    y = junk()
    lin = lambda m: LevelMap(torch.zeros_like(m.offset), m.mat, m.depth)  # noqa: E731
    adj = lambda m: LevelMap(torch.zeros_like(m.offset), m.mat.mT, m.depth)  # noqa: E731
    adj_composite = compose(compose(compose(adj(maps[0]), adj(maps[1]), True), adj(maps[2]), True), adj(maps[3]), True)
    for fwd, bwd in ((lin(maps[1]), adj(maps[1])), (lin(balanced), adj_composite)):
        lhs = (y * fwd.linear(s, adjoint=False)).sum()
        rhs = (bwd.linear(y, adjoint=True) * s).sum()
        assert_close(lhs[None], rhs[None], what="adjoint map")


def test_route_adjoint_is_the_transpose():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, 6, 2, 3, 4, dtype=torch.float64, generator=gen)
    depth = torch.tensor([0, 2, 5])
    assert_close((y * route(x, depth)).sum()[None], (route_adjoint(y, depth) * x).sum()[None], what="route^T")
    merged = route(x, depth)
    assert_close(merged[1, 2], x[1, :3].sum(0), what="levels 0..d merge into d")
    assert float(merged[1, :2].abs().sum()) == 0.0 and torch.equal(merged[1, 3:], x[1, 3:])


@pytest.mark.parametrize("start, T", [(0, 1), (5, 1), (0, 37), (13, 50), (64, 64), (7, 130)])
def test_mamba2_local_state_closed_form(start, T):
    """The O(T K V) state of a shard entered with zeros equals the op's final state."""
    x = make_inputs(B=2, T=T, G=1, H=2, K=4, V=3, start=start, generator=torch.Generator().manual_seed(T))
    L = x["level_scales"].shape[-1]
    expected = _final("mamba2", x, torch.zeros(2, L, 2, 4, 3, dtype=torch.float64), start)
    k = x["k"].expand(-1, -1, 2, -1)  # the one q/k group read by both value heads
    local = MAMBA2.local_state(k, x["v"], {"g": x["g"]}, start, L)
    assert_close(local, expected, what="closed-form local state")
