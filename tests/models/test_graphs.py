"""Decoding through static buffers (FenwickCache(cuda_graph=True)): the in-place step that a CUDA graph replays
gives the ordinary cached forward's logits and states, in generate() and by hand, with padding, beam
reordering, a multi-token call between steps, and the level cap. On the CPU the static step runs without a graph;
on CUDA the same step is captured (benchmarks/bench_decode.py checks it on the GPU)."""

import pytest
import torch

from helpers import assert_close
from loglinear.models import FenwickCache
from loglinear.layers.mixer import StaticState
from loglinear.models.graphs import DecodeGraph
from loglinear.models.modeling import CACHE_KEY
from test_models import NAMES, VARIANTS, left_padded, make_model


@torch.no_grad()
def _decode(model, ids, mask, cache, steps: int) -> tuple[torch.Tensor, FenwickCache]:
    """Prefill ids, then ``steps`` greedy one-token calls: logits [B, steps + 1, vocab] of the last token of each."""
    out = model(ids, attention_mask=mask, use_cache=True, **{CACHE_KEY: cache})
    logits = [out.logits[:, -1:]]
    for _ in range(steps):
        nxt = logits[-1].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        logits.append(model(nxt, attention_mask=mask, use_cache=True, **{CACHE_KEY: cache}).logits)
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize("variant,ll", VARIANTS)
def test_static_steps_equal_the_cached_forward(variant, ll):
    """Static (graphed) steps give the ordinary cache's logits and states; log-linear layers keep their levels
    lazily, Gated DeltaNet's with a key window (of 4 tokens here: the steps cross its turns at 8, 12, 16 and 20)."""
    model = make_model(variant, ll)
    ids, mask = left_padded([9, 5, 7], 9)
    expected, plain = _decode(model, ids, mask, FenwickCache(2), 11)  # crosses positions 16 (a 5-level carry)
    got, static = _decode(model, ids, mask, FenwickCache(2, cuda_graph=True, key_window=4), 11)
    assert_close(got, expected, 1e-12, "static-step logits")
    assert isinstance(static.graph, DecodeGraph)
    assert static.positions.tolist() == plain.positions.tolist() == [20, 16, 18]
    for a, b in zip(static.states, plain.states):
        assert a.num_levels == (model.config.max_levels if ll else 1)  # the static buffers
        assert_close(a.levels[:, : b.num_levels], b.levels, 1e-12, "levels")
        assert not a.levels[:, b.num_levels :].any()
        assert_close(a.conv, b.conv, 1e-12, "conv state")
    delta_rule = model.model.layers[0].mixer.variant.delta_rule
    for buf in static.graph.buffers:  # log-linear layers: levels beside their log-decays
        assert (buf.log_scales is not None) == ll and (buf.window is not None) == (ll and delta_rule)
        assert not ll or buf.log_scales.any(), "no level was kept lazily"
        assert buf.window is None or buf.window.betas.shape[1] == 4 and buf.window.betas.all()


@pytest.mark.parametrize("variant", NAMES)
def test_generate_with_static_steps(variant, monkeypatch):
    """generate() with static steps gives the ordinary cache's tokens, and its steps never multiply a lazy layer's
    levels out (only a reader of the cache's levels does)."""
    model = make_model(variant, True)
    ids, mask = left_padded([8, 5], 8)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    cache = FenwickCache(2, cuda_graph=True)
    multiplied = []
    real = StaticState.level_states
    monkeypatch.setattr(StaticState, "level_states",
                        lambda self, positions: multiplied.append(1) or real(self, positions))
    assert torch.equal(model.generate(ids, **{CACHE_KEY: cache}, **kw), model.generate(ids, **kw))
    assert cache.graph is not None and cache.positions.tolist() == [13, 10]
    assert not multiplied, "a graphed step multiplied the levels out"
    assert cache.num_levels() == model.config.max_levels and not multiplied
    cache.states[0].levels
    assert multiplied


@torch.no_grad()
@pytest.mark.parametrize("variant", NAMES)
def test_beam_search_and_outside_changes_reload_the_buffers(variant):
    model = make_model(variant, True)
    ids, mask = left_padded([6, 4], 6)
    kw = dict(attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False)
    assert torch.equal(model.generate(ids, **{CACHE_KEY: FenwickCache(2, cuda_graph=True)}, **kw),
                       model.generate(ids, **kw))
    # a multi-token call between steps runs the ordinary forward; the next step copies its states back in
    ids = torch.randint(1, 40, (2, 12))
    caches = [FenwickCache(2), FenwickCache(2, cuda_graph=True)]
    outs = []
    for cache in caches:  # under no_grad (as generate() runs): the static step needs no gradients
        logits = [model(ids[:, :4], use_cache=True, cache=cache).logits]
        logits.append(model(ids[:, 4:5], use_cache=True, cache=cache).logits)
        logits.append(model(ids[:, 5:9], use_cache=True, cache=cache).logits)
        for t in range(9, 12):
            logits.append(model(ids[:, t : t + 1], use_cache=True, cache=cache).logits)
        outs.append(torch.cat(logits, 1))
    assert_close(outs[1], outs[0], 1e-12, "mixed calls")
    assert caches[1].graph.owns(caches[1])


def test_inference_mode():
    model = make_model("gla", True)
    ids, mask = left_padded([6, 3], 6)
    with torch.no_grad():
        expected, _ = _decode(model, ids, mask, FenwickCache(2), 4)
    with torch.inference_mode():
        got, cache = _decode(model, ids, mask, FenwickCache(2, cuda_graph=True), 4)
    assert_close(got, expected, 1e-12, "inference-mode logits")
    assert cache.graph.owns(cache)


def test_padded_step_and_gradients_take_the_ordinary_forward():
    model = make_model("mamba2", True)
    ids, mask = left_padded([5, 5], 5)
    cache = FenwickCache(2, cuda_graph=True)
    step_mask = torch.cat([mask, torch.tensor([[1], [0]])], 1)  # row 1 has no token in this step
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, cache=cache)
        model(ids[:, :1], attention_mask=step_mask, use_cache=True, cache=cache)
    assert cache.graph is None and cache.positions.tolist() == [6, 5]
    with torch.enable_grad():
        loss = model(ids[:, :1], use_cache=True, cache=cache).logits.sum()
    loss.backward()
    assert cache.graph is None and model.lm_head.weight.grad is not None


@torch.no_grad()
def test_level_cap_and_bad_arguments():
    model = make_model("gated_deltanet", True, max_levels=3)  # 4 tokens per sequence
    cache = FenwickCache(2, cuda_graph=True)
    ids = torch.randint(1, 40, (1, 4))
    model(ids[:, :3], use_cache=True, cache=cache)
    model(ids[:, 3:4], use_cache=True, cache=cache)
    with pytest.raises(ValueError, match="max_levels"):
        model(ids[:, 3:4], use_cache=True, cache=cache)
    with pytest.raises(TypeError, match="cuda_graph must be a bool"):
        FenwickCache(2, cuda_graph=1)
    with pytest.raises(ValueError, match="num_layers"):
        FenwickCache(0)
    with pytest.raises(ValueError, match="level_dtype must be None, torch.float32 or torch.bfloat16"):
        FenwickCache(2, cuda_graph=True, level_dtype=torch.float16)
    with pytest.raises(ValueError, match="pass cuda_graph=True"):
        FenwickCache(2, level_dtype=torch.bfloat16)
    for bad in (3, 1, 0, 4.0, True, 64):
        with pytest.raises(ValueError, match=r"key_window must be None or a power of two in \[2, 32\]"):
            FenwickCache(2, cuda_graph=True, key_window=bad)
    with pytest.raises(ValueError, match="key_window sets the static buffers"):
        FenwickCache(2, key_window=8)


@torch.no_grad()
@pytest.mark.parametrize("variant,ll", VARIANTS)
def test_bfloat16_static_levels(variant, ll):
    """level_dtype=torch.bfloat16 keeps lazy layers' static levels in bf16 (rounded when written; Gated DeltaNet's
    also at the turns of a 4-token key window here): logits within bf16 rounding of the float32 cache's over steps
    across carries. Plain layers, which rewrite their level every token, refuse it."""
    model = make_model(variant, ll)
    ids, mask = left_padded([9, 5, 7], 9)
    cache = FenwickCache(2, cuda_graph=True, level_dtype=torch.bfloat16, key_window=4)
    if not ll:
        with pytest.raises(ValueError, match="needs lazy levels"):
            _decode(model, ids, mask, cache, 2)
        return
    expected, plain = _decode(model, ids, mask, FenwickCache(2), 11)
    got, cache = _decode(model, ids, mask, cache, 11)
    assert all(buf.levels.dtype == torch.bfloat16 for buf in cache.graph.buffers)
    assert_close(got, expected, 2e-2, "bf16 static levels")
    for a, b in zip(cache.states, plain.states):
        assert_close(a.levels[:, : b.num_levels], b.levels, 2e-2, "bf16 levels multiplied out")
