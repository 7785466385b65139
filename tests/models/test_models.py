"""The Hugging Face models: cached decoding reproduces the full forward, generate() equals argmax decoding
without a cache, padding and packing, save/load, the cache's size, the loss, the level cap, configs."""

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from helpers import assert_close
from loglinear.fenwick import levels_needed
from loglinear.models import (
    FenwickCache,
    LogLinearGatedDeltaNetConfig,
    LogLinearGatedDeltaNetForCausalLM,
    LogLinearGLAConfig,
    LogLinearGLAForCausalLM,
    LogLinearMamba2Config,
    LogLinearMamba2ForCausalLM,
)
from loglinear.models.modeling import CACHE_KEY

VOCAB = 40


def make_model(variant: str, use_log_linear: bool, **overrides):
    torch.manual_seed(7)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_heads=2, use_log_linear=use_log_linear,
                  chunk_size=4, eos_token_id=None, pad_token_id=0, initializer_range=0.2) | overrides
    if variant == "mamba2":
        model = LogLinearMamba2ForCausalLM(LogLinearMamba2Config(state_size=6, **common))
    elif variant == "gla":
        model = LogLinearGLAForCausalLM(LogLinearGLAConfig(gate_low_rank_dim=4, **common))
    else:
        model = LogLinearGatedDeltaNetForCausalLM(LogLinearGatedDeltaNetConfig(**common))
    return model.double().eval()


NAMES = ("mamba2", "gated_deltanet", "gla")
VARIANTS = [(v, ll) for v in NAMES for ll in (True, False)]


def left_padded(lengths: list[int], T: int):
    ids = torch.randint(1, VOCAB, (len(lengths), T))
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
    return ids * mask, mask


@pytest.mark.parametrize("variant,ll", VARIANTS)
def test_cached_decoding_reproduces_full_logits(variant, ll):
    model = make_model(variant, ll)
    ids, mask = left_padded([14, 9, 12], 14)
    full = model(ids, attention_mask=mask, use_cache=False).logits
    out = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True)
    logits, cache = [out.logits], out[CACHE_KEY]
    assert isinstance(cache, FenwickCache)
    for t in range(5, 14):
        out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], use_cache=True, **{CACHE_KEY: cache})
        logits.append(out.logits)
        cache = out[CACHE_KEY]
    real = mask.bool()
    assert_close(torch.cat(logits, 1)[real], full[real], 1e-12, "cached logits")
    assert cache.positions.tolist() == [14, 9, 12]


@pytest.mark.parametrize("variant,ll", VARIANTS)
def test_greedy_generate_equals_argmax_without_cache(variant, ll):
    model = make_model(variant, ll)
    ids, mask = left_padded([8, 5], 8)
    lengths = []
    hook = model.model.register_forward_pre_hook(lambda m, args, kw: lengths.append(args[0].shape[1]),
                                                 with_kwargs=True)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    hook.remove()
    assert lengths == [8, 1, 1, 1, 1], "generate must prefill once and then feed one token per step"
    cache = out[CACHE_KEY]
    assert isinstance(cache, FenwickCache) and cache.positions.tolist() == [12, 9]
    cur, cur_mask = ids, mask
    for _ in range(5):
        nxt = model(cur, attention_mask=cur_mask, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        cur, cur_mask = torch.cat([cur, nxt], 1), torch.cat([cur_mask, torch.ones_like(nxt)], 1)
    assert torch.equal(out.sequences, cur)


def test_beam_search_reorders_the_cache():
    model = make_model("gated_deltanet", True)
    ids, mask = left_padded([6, 4], 6)
    kw = dict(attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


@pytest.mark.parametrize("variant,ll", VARIANTS)
def test_padding_and_packing_equal_per_sequence_runs(variant, ll):
    model = make_model(variant, ll)
    lengths = [7, 3, 5]
    ids, mask = left_padded(lengths, 7)
    padded = model(ids, attention_mask=mask, use_cache=False).logits
    packed_ids = torch.cat([ids[b, mask[b].bool()] for b in range(3)])[None]
    cu = torch.tensor([0, 7, 10, 15])
    packed = model(packed_ids, cu_seqlens=cu, use_cache=False).logits
    for b, n in enumerate(lengths):
        single = model(ids[b : b + 1, 7 - n:], use_cache=False).logits[0]
        assert_close(padded[b, 7 - n:], single, 1e-12, f"padded row {b}")
        assert_close(packed[0, cu[b] : cu[b + 1]], single, 1e-12, f"packed seq {b}")


def test_loss_from_labels_and_packed_boundaries():
    model = make_model("mamba2", True)
    ids = torch.randint(1, VOCAB, (2, 9))
    out = model(ids, labels=ids, use_cache=False)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    assert_close(out.loss, expected, 1e-12, "loss")
    cu = torch.tensor([0, 4, 9])
    packed = model(ids[:1], labels=ids[:1], cu_seqlens=cu, use_cache=False)
    per_seq = [model(ids[:1, a:b], use_cache=False).logits for a, b in [(0, 4), (4, 9)]]
    tokens = torch.cat([torch.nn.functional.cross_entropy(lg[0, :-1], ids[0, a + 1 : b], reduction="none")
                        for lg, (a, b) in zip(per_seq, [(0, 4), (4, 9)])])
    assert_close(packed.loss, tokens.mean(), 1e-12, "packed loss skips the boundary")


@pytest.mark.parametrize("variant,ll", VARIANTS)
def test_cache_size_after_n_tokens(variant, ll):
    model = make_model(variant, ll)
    ids = torch.randint(1, VOCAB, (2, 17))
    mixer = model.model.layers[0].mixer
    out = model(ids[:, :1], use_cache=True)
    cache = out[CACHE_KEY]
    for n in range(2, 18):
        cache = model(ids[:, n - 1 : n], use_cache=True, **{CACHE_KEY: cache})[CACHE_KEY]
        assert cache.get_seq_length() == n
        assert cache.num_levels() == (levels_needed(n) if ll else 1)
    H, K, V = cache[0].levels.shape[2:]
    conv = 0 if mixer.conv is None else mixer.conv.in_channels * (mixer.conv.kernel_size[0] - 1)
    per_layer = 2 * (cache.num_levels() * H * K * V + conv) * 8  # float64 model, batch 2
    assert cache.nbytes() == 2 * per_layer
    assert cache.num_levels() == (6 if ll else 1)  # 17 tokens: ceil(log2 17) + 1


@pytest.mark.parametrize("variant", NAMES)
@pytest.mark.parametrize("tie", [False, True])
def test_save_and_load_round_trip(tmp_path, variant, tie):
    model = make_model(variant, True, tie_word_embeddings=tie)
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == f"loglinear_{variant}" and config.use_log_linear and config.max_levels == 21
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert type(loaded) is type(model)
    for (name, p), (name2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert name == name2 and torch.equal(p, p2), name
    assert (loaded.lm_head.weight is loaded.model.embeddings.weight) == tie
    ids = torch.randint(1, VOCAB, (2, 6))
    assert torch.equal(model(ids, use_cache=False).logits, loaded(ids, use_cache=False).logits)
    backbone = AutoModel.from_pretrained(tmp_path, dtype=torch.float64)
    assert_close(backbone(ids).last_hidden_state, model.model(ids).last_hidden_state, 0, "backbone")


def test_level_cap_raises_clearly():
    model = make_model("gated_deltanet", True, max_levels=3)
    ids = torch.randint(1, VOCAB, (1, 5))
    model(ids[:, :4], use_cache=False)
    with pytest.raises(ValueError, match="max_levels"):
        model(ids, use_cache=False)
    assert LogLinearMamba2Config().max_levels == 21  # default: 2^20 tokens


def test_config_validation():
    with pytest.raises(ValueError, match="max_levels"):
        LogLinearMamba2Config(max_levels=0)
    with pytest.raises(ValueError, match="chunk_size"):
        LogLinearGatedDeltaNetConfig(chunk_size=48)
    with pytest.raises(ValueError, match="hidden_size"):
        LogLinearGatedDeltaNetConfig(hidden_size=0)
    model = make_model("mamba2", False, intermediate_size=0)
    assert model.model.layers[0].mlp is None and not model.config.use_log_linear
    assert model.model.layers[0].mixer.level_scales is None


def test_plain_and_log_linear_differ_only_in_lambda():
    plain, ll = make_model("mamba2", False), make_model("mamba2", True)
    extra = {n for n, _ in ll.named_parameters()} - {n for n, _ in plain.named_parameters()}
    assert extra and all("level_scales" in n for n in extra)
    assert {n for n, _ in plain.named_parameters()} <= {n for n, _ in ll.named_parameters()}


def test_cache_selection_and_limits():
    model = make_model("mamba2", True)
    ids = torch.randint(1, VOCAB, (3, 6))
    cache = model(ids, use_cache=True)[CACHE_KEY]
    full = [cache[i].levels.clone() for i in range(len(cache))]
    cache.batch_select_indices(torch.tensor([2, 0]))
    assert cache.positions.tolist() == [6, 6] and torch.equal(cache[0].levels, full[0][[2, 0]])
    nxt = torch.randint(1, VOCAB, (3, 1))
    picked = model(nxt[[2, 0]], use_cache=True, **{CACHE_KEY: cache}).logits
    whole = model(torch.cat([ids, nxt], 1), use_cache=False).logits[[2, 0], -1:]
    assert_close(picked, whole, 1e-12, "selected rows continue")
    with pytest.raises(NotImplementedError, match="cannot drop tokens"):
        cache.crop(-1)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0


@pytest.mark.parametrize("config_cls,kwargs,match", [
    (LogLinearMamba2Config, {"n_groups": 0}, "n_groups must be a positive int, got 0"),
    (LogLinearMamba2Config, {"num_heads": 4, "n_groups": 3}, "num_heads = 4 must be a multiple of n_groups = 3"),
    (LogLinearMamba2Config, {"state_size": 0}, "state_size must be a positive int, got 0"),
    (LogLinearMamba2Config, {"expand": 0}, "head_dim must be a positive int, got 0"),
    (LogLinearGatedDeltaNetConfig, {"head_dim": 0}, "head_dim must be a positive int, got 0"),
    (LogLinearGatedDeltaNetConfig, {"hidden_size": 2, "num_heads": 4}, "hidden_size = 2 must be a multiple of"),
    (LogLinearGatedDeltaNetConfig, {"expand_v": -1}, r"expand_v must give a value head dim .* got expand_v = -1"),
    (LogLinearGatedDeltaNetConfig, {"intermediate_size": -1}, "intermediate_size must be an int >= 0 .* got -1"),
    (LogLinearGatedDeltaNetConfig, {"norm_eps": -1.0}, "norm_eps must be a finite number > 0, got -1.0"),
    (LogLinearMamba2Config, {"norm_eps": 0.0}, "norm_eps must be a finite number > 0, got 0.0"),
    (LogLinearGatedDeltaNetConfig, {"time_step_min": 1.0, "time_step_max": 0.1}, "time_step_min <= time_step_max"),
    (LogLinearMamba2Config, {"time_step_floor": 0.0}, "time_step_floor > 0"),
    (LogLinearGatedDeltaNetConfig, {"vocab_size": 10, "pad_token_id": 10},
     r"pad_token_id must be None or in \[0, vocab_size = 10\), got 10"),
    (LogLinearGLAConfig, {"hidden_size": 24, "num_heads": 8}, r"expand_k must give a width .* num_heads = 8"),
    (LogLinearGLAConfig, {"head_dim": 64}, r"head_dim of GLA is int\(hidden_size \* expand_k\) / num_heads = 32"),
    (LogLinearGLAConfig, {"gate_low_rank_dim": 0}, "gate_low_rank_dim must be a positive int, got 0"),
    (LogLinearGLAConfig, {"gate_logit_normalizer": float("inf")}, "gate_logit_normalizer must be a finite number > 0"),
])
def test_invalid_config_fields(config_cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        config_cls(**kwargs)


def test_bad_forward_inputs():
    model = make_model("gated_deltanet", True)
    ids = torch.randint(1, VOCAB, (2, 5))
    with pytest.raises(TypeError, match="input_ids must be an int32/int64 tensor .* torch.float32"):
        model(ids.float())
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\], got shape \(5,\)"):
        model(ids[0])
    D = model.config.hidden_size
    with pytest.raises(ValueError, match=rf"inputs_embeds must be \[B, T, hidden_size = {D}\], got \(2, 5, {D + 1}\)"):
        model(inputs_embeds=torch.randn(2, 5, D + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"labels must be \[B, T\] = \[2, 5\] like the logits, got shape \(2, 3\)"):
        model(ids, labels=ids[:, :3])
    with pytest.raises(TypeError, match="cache must be a FenwickCache .* got Tensor"):
        model(ids, cache=torch.zeros(3), use_cache=True)
    layers = model.config.num_hidden_layers
    with pytest.raises(ValueError,
                       match=f"cache holds {layers + 1} layers, the model has num_hidden_layers = {layers}"):
        model(ids, cache=FenwickCache(layers + 1), use_cache=True)


@pytest.mark.parametrize("variant", NAMES)
def test_token_ids_out_of_range_are_refused(variant):
    """Token ids outside the vocabulary, and labels outside it other than -100, raise a ValueError naming them
    (the lookup and the loss never read past their tables: on CUDA a device-side assert); a refused call with a
    cache leaves the cache as it was; -100 labels are ignored as before."""
    model = make_model(variant, True)
    ids = torch.randint(1, VOCAB, (2, 5))
    for bad in (VOCAB, -1):
        with pytest.raises(ValueError, match=f"input_ids must be in \\[0, {VOCAB}\\), got {bad}"):
            model(ids.index_put((torch.tensor([1]), torch.tensor([3])), torch.tensor(bad)))
    labels = ids.clone()
    labels[0, 2] = VOCAB + 3
    with pytest.raises(ValueError, match=f"labels must be in \\[0, {VOCAB}\\) or -100, got {VOCAB + 3}"):
        model(ids, labels=labels)
    labels[0, 2] = -100
    assert torch.isfinite(model(ids, labels=labels).loss)
    out = model(ids, use_cache=True)
    cache = out[CACHE_KEY]
    before = [(s.levels.clone(), s.positions.clone()) for s in cache.states]
    with pytest.raises(ValueError, match="input_ids must be in"):
        model(torch.full((2, 1), VOCAB), cache=cache, use_cache=True)
    for (levels, positions), s in zip(before, cache.states):
        assert torch.equal(levels, s.levels) and torch.equal(positions, s.positions)
    step = model(ids[:, :1], cache=cache, use_cache=True).logits
    assert_close(step, model(torch.cat([ids, ids[:, :1]], 1)).logits[:, -1:], 1e-10, "after the refused step")
