"""torch.compile: the attention is one custom-op node (loglinear::fenwick_attention) with autograd, so a
compiled layer runs with fullgraph=True and a compiled model trains and decodes without graph breaks.
The aot_eager backend (dynamo capture + AOT autograd on fake tensors) keeps this fast on 2 CPU cores."""

import pytest
import torch
import torch._dynamo.testing

from helpers import assert_close, make_inputs, mamba2_args
from loglinear import log_linear_gated_deltanet, log_linear_mamba2
from loglinear.layers import LogLinearGatedDeltaNet, LogLinearMamba2
from loglinear.models import LogLinearGatedDeltaNetConfig, LogLinearGatedDeltaNetForCausalLM
from loglinear.models.modeling import CACHE_KEY
from loglinear.ops import custom_ops
from loglinear.variants import GATED_DELTANET, MAMBA2


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph_ops(backend: torch._dynamo.testing.CompileCounterWithBackend) -> set[str]:
    return {str(node.target) for gm in backend.graphs for node in gm.graph.nodes if node.op == "call_function"}


@pytest.mark.parametrize("cls, ll", [(LogLinearMamba2, False), (LogLinearGatedDeltaNet, True)])
def test_layer_compiles_fullgraph_for_training_and_decoding(cls, ll):
    """A log-linear and a plain layer (the plain one on the one-level state) of two variants; every variant's
    layer calls the same custom op."""
    torch.manual_seed(0)
    layer = cls(12, 2, head_dim=4, use_log_linear=ll, chunk_size=4)
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    x = torch.randn(2, 9, 12, requires_grad=True)
    y, _ = layer(x)
    yc, _ = compiled(x)
    assert "loglinear.fenwick_attention.default" in _graph_ops(backend)
    assert_close(yc, y, 1e-6, "compiled forward")
    gy = torch.randn_like(y)
    params = [x, *layer.parameters()]
    for g, gc in zip(torch.autograd.grad(y, params, gy), torch.autograd.grad(yc, params, gy)):
        assert_close(gc, g, 1e-5, "compiled gradient")
    with torch.no_grad():
        _, state = layer(x[:, :5], output_state=True)
        _, state_c = compiled(x[:, :5], output_state=True)
        for t in range(5, 7):
            y, state = layer(x[:, t : t + 1], state=state, output_state=True)
            yc, state_c = compiled(x[:, t : t + 1], state=state_c, output_state=True)
            assert_close(yc, y, 1e-6, "compiled step")
    assert state_c.num_levels == (layer.max_levels if ll else 1)  # static shapes under compile
    assert_close(state_c.levels[:, : state.num_levels], state.levels, 1e-6, "compiled state")


@pytest.mark.slow
def test_model_trains_and_decodes_without_graph_breaks():
    torch.manual_seed(0)
    config = LogLinearGatedDeltaNetConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_heads=2,
                                          chunk_size=4, eos_token_id=None)
    model = LogLinearGatedDeltaNetForCausalLM(config)
    compiled = torch.compile(model, backend="aot_eager")
    ids = torch.randint(0, 30, (2, 10))
    loss, loss_c = model(ids, labels=ids, use_cache=False).loss, compiled(ids, labels=ids, use_cache=False).loss
    assert_close(loss_c, loss, 1e-6, "loss")
    params = list(model.parameters())
    for g, gc in zip(torch.autograd.grad(loss, params), torch.autograd.grad(loss_c, params)):
        assert_close(gc, g, 1e-5, "gradient")
    model.eval()
    with torch.no_grad():
        out, out_c = model(ids[:, :6], use_cache=True), compiled(ids[:, :6], use_cache=True)
        for t in range(6, 8):
            kw, kw_c = {CACHE_KEY: out[CACHE_KEY]}, {CACHE_KEY: out_c[CACHE_KEY]}
            out, out_c = (model(ids[:, t : t + 1], use_cache=True, **kw),
                          compiled(ids[:, t : t + 1], use_cache=True, **kw_c))
            assert_close(out_c.logits, out.logits, 1e-6, "decode logits")
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


@pytest.mark.parametrize("gdn", [False, True])
def test_stateless_custom_ops_match_public_ops_and_pass_opcheck(gdn):
    x = make_inputs(2, 6, 1, 2)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    variant = GATED_DELTANET if gdn else MAMBA2
    gates = {n: leaves[n] for n in variant.gate_names}
    if gdn:
        ref, _ = log_linear_gated_deltanet(**leaves, use_qk_l2norm=True, chunk_size=4)
    else:
        ref, _ = log_linear_mamba2(**mamba2_args(leaves), chunk_size=4)
    out = custom_ops.attention(variant, leaves["q"], leaves["k"], leaves["v"], gates, leaves["level_scales"],
                               use_qk_l2norm=gdn, chunk_size=4)
    assert_close(out, ref, 1e-14, "custom op")
    used = mamba2_args(leaves) if not gdn else leaves
    gy = torch.randn_like(ref)
    for g, gc in zip(torch.autograd.grad(ref, list(used.values()), gy),
                     torch.autograd.grad(out, list(used.values()), gy)):
        assert_close(gc, g, 1e-12, "custom op gradient")
    args = (variant.name, x["q"], x["k"], x["v"], [x[n] for n in variant.gate_names],
            x["level_scales"], None, None, None, 0.5, 4, 21, False, gdn)
    torch.library.opcheck(custom_ops.fenwick_attention_op, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
