"""The zero-token layouts of packed sequences (loglinear.ops.triton.shared.placement): values, gradients, and that
neither direction adds into an element twice."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loglinear.ops.triton.shared.placement import place, placement, take

BOUNDS = (0, 5, 6, 13)  # three packed sequences of 5, 1 and 7 tokens


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _reference_slots(bounds, width):
    """The layout written out: per slot, the packed token it holds or None."""
    slots = []
    for a, b in zip(bounds, bounds[1:]):
        slots += list(range(a, b)) + [None] * (width - (b - a))
    return slots


@pytest.mark.parametrize("width", [7, 12])
def test_place_and_take_move_each_token_once(width):
    at = placement(BOUNDS, width, torch.device("cpu"))
    slots = _reference_slots(BOUNDS, width)
    assert at.size == len(slots) == 3 * width
    x = torch.randn(BOUNDS[-1], 2, 3, dtype=torch.float64, requires_grad=True)
    y = place(x, at)
    expected = torch.stack([x[s] if s is not None else torch.zeros(2, 3, dtype=x.dtype) for s in slots])
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    torch.testing.assert_close(take(y, at), x, rtol=0, atol=0)
    torch.autograd.gradcheck(lambda t: place(t, at), (x,))
    z = torch.randn(at.size, 2, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: take(t, at), (z,))


def test_place_and_take_add_nothing_twice():
    """A 16-bit index_add (atomics) cost more than the kernels in a padded call: the round trip and its backward
    copy and gather only."""
    at = placement(BOUNDS, 8, torch.device("cpu"))
    x = torch.randn(BOUNDS[-1], 4, dtype=torch.bfloat16, requires_grad=True)
    with _Ops() as mode:
        (take(place(x, at) * 2, at).float().sum()).backward()
    assert not {"index_add", "index_put", "scatter_add"} & set(mode.ops), mode.ops
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
