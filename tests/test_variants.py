"""The variant registry is the only thing the op stack reads: a variant defined outside the package (ungated
DeltaNet, A_t = I - beta_t k_t k_t^T, built from Gated DeltaNet's pieces with g = 0) and registered at run time
runs through the generic op, both references, the decode step, the stateful mixer call and the custom op, and
agrees with them."""

import pytest
import torch

from helpers import assert_close, make_inputs
from loglinear import reference as R
from loglinear.ops import attention, custom_ops
from loglinear.ops.stateful import fenwick_attention
from loglinear.variants import GATED_DELTANET, REGISTRY, Gate, Variant, get
from loglinear.variants import gated_deltanet as gdn


def _gated(gates: dict) -> dict:
    return {"g": torch.zeros_like(gates["beta"]), "beta": gates["beta"]}


DELTANET = Variant(
    name="deltanet", title="DeltaNet", gates=(Gate("beta", "in (0, 1)"),),
    form=lambda q, k, v, beta: gdn.GatedDeltaNetForm(q, k, v, torch.zeros_like(beta), beta),
    transfer_matrix=lambda q, k, gates: gdn.transfer_matrix(q, k, _gated(gates)),
    transition=lambda S, k, gates: gdn.transition(S, k, _gated(gates)),
    deposit_key=gdn.deposit_key,
    shard_transition=lambda k, gates, chunk_size: gdn.shard_transition(k, _gated(gates), chunk_size),
    matrix_transition=True,
    sample_gates=lambda B, T, H, K, **kw: {"beta": GATED_DELTANET.sample_gates(B, T, H, K, **kw)["beta"]},
)


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setitem(REGISTRY, DELTANET.name, DELTANET)


def _args(T: int, start: int = 0, B: int = 2) -> dict:
    x = make_inputs(B=B, T=T, G=1, H=2, K=4, V=3, start=start, generator=torch.Generator().manual_seed(T + start))
    return {"q": x["q"], "k": x["k"], "v": x["v"], "gates": {"beta": x["beta"]}, "level_scales": x["level_scales"]}


def test_lookup():
    assert get("deltanet") is DELTANET and get(DELTANET) is DELTANET
    with pytest.raises(ValueError, match="variant must be one of .*'deltanet'"):
        get("rwkv")


def test_gates_must_be_the_variants():
    x = _args(5)
    with pytest.raises(ValueError, match=r"deltanet's per-token inputs beta \[B, T, H\] \(in \(0, 1\)\), got \['g'\]"):
        attention(DELTANET, **(x | {"gates": {"g": x["gates"]["beta"]}}))
    with pytest.raises(ValueError, match="got list"):
        attention("gated_deltanet", **(x | {"gates": [x["gates"]["beta"]]}))


def test_op_matches_both_references_with_gradients():
    x = _args(21)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if n != "gates"}
    beta = x["gates"]["beta"].clone().requires_grad_()
    o, _ = attention("deltanet", **leaves, gates={"beta": beta}, chunk_size=4, use_qk_l2norm=True)
    assert_close(o, R.materialized(DELTANET, **x, use_qk_l2norm=True), 1e-12, "op vs materialized")
    assert_close(o, R.recurrent(DELTANET, **x, use_qk_l2norm=True)[0], 1e-12, "op vs recurrent")
    o.square().sum().backward()
    ref = {n: t.clone().requires_grad_() for n, t in x.items() if n != "gates"}
    rbeta = x["gates"]["beta"].clone().requires_grad_()
    R.materialized(DELTANET, **ref, gates={"beta": rbeta}, use_qk_l2norm=True).square().sum().backward()
    for n in leaves:
        assert_close(leaves[n].grad, ref[n].grad, 1e-10, f"d{n}")
    assert_close(beta.grad, rbeta.grad, 1e-10, "dbeta")


def test_states_continue_and_decode():
    x = _args(13)
    head = {n: t[:, :12] for n, t in x.items() if n != "gates"} | {"gates": {"beta": x["gates"]["beta"][:, :12]}}
    tail = {n: t[:, 12:] for n, t in x.items() if n != "gates"} | {"gates": {"beta": x["gates"]["beta"][:, 12:]}}
    _, state = attention(DELTANET, **head, output_final_state=True, chunk_size=4)
    o, final = attention(DELTANET, **tail, initial_state=state, output_final_state=True)  # the one-token step
    o_ref, final_ref = R.recurrent(DELTANET, **x, output_final_state=True)
    assert_close(o[:, 0], o_ref[:, 12], 1e-12, "decoded token")
    assert_close(final.levels, final_ref.with_levels(final.num_levels).levels, 1e-12, "state")


def test_plain_mixer_call_and_custom_op():
    x = _args(9)
    plain = fenwick_attention("deltanet", x["q"], x["k"], x["v"], [x["gates"]["beta"]], None, None, None, None,
                              0.5, 4, 21, False)[0]
    ones = torch.ones_like(x["level_scales"])
    assert_close(plain, attention(DELTANET, **(x | {"level_scales": ones}), scale=0.5)[0], 1e-12, "plain = lambda 1")
    compiled = custom_ops.attention(DELTANET, **x, chunk_size=4)
    assert_close(compiled, attention(DELTANET, **x)[0], 1e-12, "custom op")
