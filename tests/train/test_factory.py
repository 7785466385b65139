"""The model factory: every architecture builds, maps [B, T] ids to [B, T, V] logits, and is seeded."""

import pytest
import torch

from loglinear.train.factory import ARCHS, build_model, count_parameters, family, is_log_linear
from loglinear.variants import REGISTRY


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_builds_and_runs(arch):
    model = build_model(arch, vocab_size=50, d_model=32, n_layers=2, seed=0)
    x = torch.randint(0, 50, (2, 19))
    logits = model(input_ids=x, use_cache=False).logits
    assert logits.shape == (2, 19, 50) and torch.isfinite(logits).all()
    again = build_model(arch, vocab_size=50, d_model=32, n_layers=2, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    listed = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert count_parameters(model) == listed - 50 * 32  # the LM head is tied to the embedding: counted once
    if arch != "transformer":
        assert model.config.use_log_linear == is_log_linear(arch)


def test_names_and_errors():
    assert ARCHS[:5] == ("transformer", "mamba2", "ll_mamba2", "gated_deltanet", "ll_gated_deltanet")
    assert [family(a) for a in ARCHS] == ["transformer"] + [name for name in REGISTRY for _ in range(2)]
    with pytest.raises(ValueError, match="arch must be one of"):
        build_model("rwkv", vocab_size=10, d_model=8, n_layers=1)
    with pytest.raises(ValueError, match="d_model = 30 must be a multiple of the Transformer's heads n_heads = 4"):
        build_model("transformer", vocab_size=10, d_model=30, n_layers=1, n_heads=4)


def test_log_linear_and_plain_differ_only_by_levels():
    ll = build_model("ll_mamba2", vocab_size=50, d_model=32, n_layers=1, seed=0)
    plain = build_model("mamba2", vocab_size=50, d_model=32, n_layers=1, seed=0)
    assert 0 < count_parameters(ll) - count_parameters(plain) < 0.1 * count_parameters(plain)
