"""Heads narrower than min_head_dim run zero-padded on both Triton backends (bf16/fp16 on CUDA: 64).

The padded path is forced on CPU (heads.FORCE_MIN_HEAD_DIM; fp32 under TRITON_INTERPRET=1) and checked
against the float64 recurrent references: outputs, the final state and every gradient (q, k, v, g, beta,
level_scales, initial state) under random cotangents, with every kernel output poisoned with NaN first.
"""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from helpers import compare_with_reference, gla_inputs, make_inputs
from loglinear import FenwickState, log_linear_gated_deltanet, log_linear_gla, log_linear_mamba2
from loglinear import reference as R
from loglinear.ops import api
from loglinear.ops.triton.shared import common, heads
from loglinear.variants import GLA

pytestmark = pytest.mark.interpreter
MIN_HEAD_DIM = 64  # forced on CPU: the GPU's width


@dataclass(frozen=True)
class Case:
    op: Callable
    reference: Callable
    names: tuple[str, ...]  # the op's tensor arguments
    tol: float  # o and final state, fp32 kernels vs float64 (as in test_triton_<variant>.py)
    grad_tol: float


def _gla_recurrent(q, k, v, g, level_scales, **kw):
    return R.recurrent(GLA, q, k, v, {"g": g}, level_scales, **kw)


VARIANTS = {
    "mamba2": Case(log_linear_mamba2, R.log_linear_mamba2_recurrent, ("q", "k", "v", "g", "level_scales"),
                      3e-5, 3e-5),
    "gated_deltanet": Case(log_linear_gated_deltanet, R.log_linear_gated_deltanet_recurrent,
                              ("q", "k", "v", "g", "beta", "level_scales"), 2e-5, 2e-4),
    "gla": Case(log_linear_gla, _gla_recurrent, ("q", "k", "v", "g", "level_scales"), 3e-5, 1e-4),
}


@pytest.fixture(autouse=True)
def padded_kernels(monkeypatch):
    """The kernels (no torch fallback) with outputs poisoned, heads padded to MIN_HEAD_DIM; records the
    widths (K, V) the kernels got."""
    monkeypatch.setenv("LOGLINEAR_BACKEND", "triton")
    monkeypatch.setattr(heads, "FORCE_MIN_HEAD_DIM", MIN_HEAD_DIM)
    widths = []
    pad = heads.pad_head_dims
    monkeypatch.setattr(heads, "pad_head_dims", lambda inp, K, V: widths.append((K, V)) or pad(inp, K, V))

    def fail(*args, **kwargs):
        raise AssertionError("the triton backend fell back to the torch path")

    monkeypatch.setattr(api, "torch_chunk_backend", fail)
    common.set_poison(True)
    yield widths
    common.set_poison(False)


def _state(positions: list[int], H: int, K: int, V: int) -> FenwickState:
    n_levels = max(positions).bit_length() + 2
    return FenwickState(0.3 * torch.randn(len(positions), n_levels, H, K, V, dtype=torch.float64),
                        torch.tensor(positions))


def _compare(variant: Case, x: dict, state: FenwickState | None, cu_seqlens: torch.Tensor | None, **kw) -> None:
    """The fp32 kernels vs the float64 reference: o, final state, and the gradients of every input."""
    compare_with_reference(
        lambda xs, st: variant.op(**xs, initial_state=st, output_final_state=True, cu_seqlens=cu_seqlens,
                                  chunk_size=16, **kw),
        lambda xs, st: variant.reference(**xs, initial_state=st, output_final_state=True, cu_seqlens=cu_seqlens,
                                         **kw),
        {n: x[n] for n in variant.names}, state, tol=variant.tol, grad_tol=variant.grad_tol,
    )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "B, T, G, H, K, V, positions, cu, padded",
    [
        (2, 41, 1, 2, 8, 12, [5, 32], None, (64, 64)),  # both axes padded, T not a multiple of the chunk, states
        #                                                 at an unaligned and an aligned position
        (1, 70, 1, 2, 8, 5, [17, 0, 48], [0, 3, 40, 70], (64, 64)),  # cu_seqlens with states
        (1, 45, 1, 2, 72, 12, [21], None, (72, 64)),  # only V padded
        (1, 30, 1, 1, 8, 66, None, None, (64, 66)),  # only K padded
    ],
)
def test_padded_heads_match_reference(padded_kernels, variant, B, T, G, H, K, V, positions, cu, padded):
    if variant == "gla" and K >= MIN_HEAD_DIM:
        pytest.skip("only V padded: nothing of GLA's per-channel gate changes (the K cases cover it)")
    start = max(positions or [0])
    x = gla_inputs(B, T, G, H, K, V, start=start) if variant == "gla" else make_inputs(B, T, G, H, K, V, start=start)
    state = _state(positions, H, K, V) if positions else None
    _compare(VARIANTS[variant], x, state, torch.tensor(cu) if cu else None)
    assert padded_kernels == [padded]


@pytest.mark.parametrize("positions", [[5, 5]])
def test_padded_heads_with_qk_l2norm(padded_kernels, positions):
    """Gated DeltaNet's in-op q/k normalisation (in the chunk-local kernels) sees the zero columns."""
    x = make_inputs(2, 33, 1, 2, K=8, V=4, start=max(positions or [0]))
    x["q"], x["k"] = 3 * x["q"], 3 * x["k"]
    state = _state(positions, 2, 8, 4) if positions else None
    _compare(VARIANTS["gated_deltanet"], x, state, None, use_qk_l2norm=True)
    assert padded_kernels == [(64, 64)]


def test_wide_heads_run_unpadded(padded_kernels):
    x = make_inputs(1, 20, 1, 1, K=64, V=70)
    _compare(VARIANTS["mamba2"], x, None, None)
    assert padded_kernels == []


@pytest.mark.parametrize("variant, B, T, G, H, K, V, positions, cu", [
    ("gla", 2, 21, 1, 2, 8, 100, [5, 32], None),  # K padded to 64: two slices of 50, each padded to 64
    ("mamba2", 2, 21, 1, 2, 8, 150, [5, 32], None),  # three slices of 50
    ("mamba2", 1, 40, 2, 4, 8, 70, [17, 0, 21], [0, 3, 20, 40]),  # two slices of 35, G < H, packed sequences
])
def test_wide_values_run_in_slices(padded_kernels, monkeypatch, variant, B, T, G, H, K, V, positions, cu):
    """Mamba-2 / GLA values wider than the state tile the kernels take (VALUE_SLICE, here 64 x 64 elements) run in
    equal slices, each padded where narrower than min_head_dim: o, the final state (joined along V) and every
    gradient (summed over the slices for q, k, g, lambda) against the float64 reference."""
    from loglinear.ops.triton.mamba2 import backend

    monkeypatch.setattr(backend, "VALUE_SLICE", {4: (64 * 64, 512), 2: (64 * 64, 512)})
    widths = []
    kernels = backend._run_kernels
    monkeypatch.setattr(backend, "_run_kernels", lambda inp, *a: widths.append(inp.v.shape[-1]) or kernels(inp, *a))
    start = max(positions)
    x = gla_inputs(B, T, G, H, K, V, start=start) if variant == "gla" else make_inputs(B, T, G, H, K, V, start=start)
    state = _state(positions, H, K, V)
    _compare(VARIANTS[variant], x, state, torch.tensor(cu) if cu else None)
    n = -(-V // 64)
    assert widths == [64] * n and padded_kernels == [(64, 64)] * n  # each slice padded to 64


def test_value_slices_rule():
    """The widest value slice: a state tile of 128 x 256 elements for 16-bit operands, 128 x 128 for fp32, over K
    padded to a power of two, and at most 256 value columns (fp32: 128)."""
    from loglinear.ops.triton.mamba2.backend import value_slice

    assert [value_slice(torch.bfloat16, K) for K in (64, 128, 130, 256)] == [256, 256, 128, 128]
    assert [value_slice(torch.float32, K) for K in (32, 64, 128, 256)] == [128, 128, 128, 64]


def test_keys_past_256_run_on_the_torch_path():
    """The Mamba-2 / GLA kernels take keys up to MAX_K = 256 (the dispatcher sends wider ones to the torch path)."""
    from loglinear.inputs import check_inputs
    from loglinear.ops.triton.mamba2 import backend
    from loglinear.variants import MAMBA2

    def call(K):
        x = make_inputs(1, 4, 1, 1, K, 8)
        return check_inputs(MAMBA2, x["q"].float(), x["k"].float(), x["v"].float(), {"g": x["g"].float()},
                            x["level_scales"].float(), None, None, None)

    assert backend.supports(call(256)) and not backend.supports(call(257))


@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_inputs_still_name_the_argument(variant):
    """Validation runs before the padding: the error names the caller's argument and its shape."""
    inputs = gla_inputs(1, 20, 1, 2, 8, 5) if variant == "gla" else make_inputs(1, 20, 1, 2, K=8, V=5)
    x = {n: inputs[n] for n in VARIANTS[variant].names}
    with pytest.raises(ValueError, match=r"initial_state.levels must be .*\[1, L, 2, 8, 5\]"):
        VARIANTS[variant].op(**x, initial_state=_state([3], 2, 8, 4))
    with pytest.raises(ValueError, match=r"k must match q's shape \(1, 20, 1, 8\)"):
        VARIANTS[variant].op(**(x | {"k": x["k"][..., :6]}))


def test_the_rule(monkeypatch):
    """64 for 16-bit operands on CUDA (triton 3.6 / Hopper miscomputes narrower bf16 tiles), else no padding."""
    monkeypatch.setattr(heads, "FORCE_MIN_HEAD_DIM", None)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert heads.min_head_dim(torch.bfloat16, cuda) == heads.min_head_dim(torch.float16, cuda) == 64
    assert heads.min_head_dim(torch.float32, cuda) == heads.min_head_dim(torch.bfloat16, cpu) == 0
