"""LevelScales: lambda = act(Ls * W_lambda x), its gradients from the recomputing backward, and what it keeps."""

import pytest
import torch

from loglinear.layers.levels import LEVEL_ACTIVATIONS, LevelScales, _Recomputed


def _direct(layer: LevelScales, x: torch.Tensor) -> torch.Tensor:
    """The formula with autograd through every op (what the recomputing backward must equal)."""
    logits = layer.proj(x).float().reshape(*x.shape[:-1], layer.num_heads, layer.max_levels)
    return LEVEL_ACTIVATIONS[layer.activation][0](layer.level_scale.float() * logits)


@pytest.mark.parametrize("activation", sorted(LEVEL_ACTIVATIONS))
def test_gradients_equal_the_formula(activation):
    torch.manual_seed(0)
    layer = LevelScales(16, 3, 5, activation)
    with torch.no_grad():
        layer.level_scale.uniform_(0.5, 1.5)
    x = torch.randn(7, 16, requires_grad=True)
    grad = torch.randn(7, 3, 5)
    lam = layer(x)
    ref = _direct(layer, x)
    assert torch.equal(lam, ref)
    got = torch.autograd.grad(lam, (x, layer.proj.weight, layer.level_scale), grad)
    want = torch.autograd.grad(ref, (x, layer.proj.weight, layer.level_scale), grad)
    for a, b, name in zip(got, want, ("x", "W_lambda", "Ls")):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("activation", sorted(LEVEL_ACTIVATIONS))
def test_gradcheck_and_double_backward(activation):
    torch.manual_seed(1)
    logits = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    level_scale = torch.rand(2, 3, dtype=torch.float64).add(0.5).requires_grad_()

    def fn(logits: torch.Tensor, level_scale: torch.Tensor) -> torch.Tensor:
        return _Recomputed.apply(logits, level_scale, activation)

    assert torch.autograd.gradcheck(fn, (logits, level_scale))
    assert torch.autograd.gradgradcheck(fn, (logits, level_scale))


def test_keeps_only_the_projection_for_backward():
    """Under bf16 autocast the layer saves the bf16 projection output, not the fp32 product or activation input."""
    layer = LevelScales(32, 4, 6)
    x = torch.randn(64, 32, requires_grad=True)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lam = layer(x)
    assert lam.dtype == torch.float32
    per_token = [(shape, dtype) for shape, dtype in saved if shape[:1] == (64,) and shape[-1] == 6]
    assert per_token == [((64, 4, 6), torch.bfloat16)], per_token
