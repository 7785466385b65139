"""Triton log-linear Mamba-2 kernels (TRITON_INTERPRET=1 on CPU tensors) vs the float64 references.

Every case checks outputs, the final state and every gradient (q, k, v, g, level_scales, initial
state levels) under random cotangents, with every kernel output buffer poisoned with NaN first.
"""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from triton.runtime.interpreter import InterpretedFunction

from helpers import assert_close, compare_with_reference, large_writes, make_inputs, mamba2_args
from loglinear import FenwickState, log_linear_gla, log_linear_mamba2
from loglinear import reference as R
from loglinear.fenwick import ctz
from loglinear.ops.api import attention
from loglinear.ops.backends import select_backend
from loglinear.ops.triton.mamba2 import backend as M
from loglinear.variants import GLA, MAMBA2

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("triton_kernels")]
FP32_TOL = 3e-5


def _random_state(n_seq, positions, H, K, V, extra_levels=1):
    n_levels = max(p for p in positions).bit_length() + 1 + extra_levels
    return FenwickState(torch.randn(n_seq, n_levels, H, K, V, dtype=torch.float64), torch.tensor(positions))


def _close_or_tiny(actual, expected, tol, what):
    """Relative error below tol, measured against max(||expected||, 1): a gradient that is exactly 0 in
    the reference (dg at T = 1: the gate only scales an empty state) must come out as rounding noise."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual - expected).norm() / max(expected.norm().item(), 1.0)
    assert err <= tol, f"{what}: error {err:.3e} > {tol:.1e}"


def _compare(x, *, dtype=torch.float32, state=None, cu_seqlens=None, chunk_size=16, tol=FP32_TOL):
    """Run kernels (in ``dtype``) and the float64 recurrent reference; compare o, state and all grads."""
    compare_with_reference(
        lambda xs, st: log_linear_mamba2(**xs, initial_state=st, output_final_state=True, cu_seqlens=cu_seqlens,
                                         chunk_size=chunk_size),
        lambda xs, st: R.log_linear_mamba2_recurrent(**xs, initial_state=st, output_final_state=True,
                                                     cu_seqlens=cu_seqlens),
        x, state, tol=tol, dtype=dtype, grad_close=_close_or_tiny,
    )


# One token: every output is a single q.k, which random inputs now and then make cancel (|q.k| << sum |q_i k_i|),
# so that fp32 misses the relative tolerance on the kernels' correct result; with B = 2 and G = 2 four independent
# products share the norm-wise error (a B = 1, G = 1 draw fails about once in several hundred).
@pytest.mark.parametrize(
    "B, T, G, H, K, V",
    [
        (2, 1, 2, 4, 8, 5),  # one token (B = 2, G = 2: above)
        (2, 37, 1, 2, 16, 16),  # T not a multiple of the chunk, B > 1
        (1, 64, 2, 4, 8, 5),  # aligned T, GQA (G < H), K/V not powers of two
        (1, 100, 1, 3, 16, 8),  # more chunk levels
        (1, 50, 2, 2, 40, 40),  # K, V split over two programs each (partially masked blocks)
    ],
)
def test_kernels_match_reference(no_torch_path, B, T, G, H, K, V):
    _compare(mamba2_args(make_inputs(B, T, G, H, K, V)))


def _plain(x):
    """Inputs of a plain call: no level_scales."""
    return {n: t for n, t in x.items() if n != "level_scales"}


def _compare_plain(x, *, state=None, cu_seqlens=None, dtype=torch.float32, tol=FP32_TOL):
    """The plain kernels (level_scales None) against the float64 plain reference, o / state / every gradient."""
    compare_with_reference(
        lambda xs, st: log_linear_mamba2(**xs, level_scales=None, initial_state=st, output_final_state=True,
                                         cu_seqlens=cu_seqlens, chunk_size=16),
        lambda xs, st: R.log_linear_mamba2_recurrent(**xs, level_scales=None, initial_state=st,
                                                     output_final_state=True, cu_seqlens=cu_seqlens),
        _plain(x), state, tol=tol, dtype=dtype, grad_close=_close_or_tiny,
    )


@pytest.mark.parametrize(
    "B, T, G, H, K, V, start",
    [
        (2, 1, 2, 4, 8, 5, 0),  # one token (B = 2, G = 2: see test_kernels_match_reference)
        (2, 37, 2, 4, 16, 16, 0),  # T not a multiple of the chunk, B > 1, G < H
        (2, 50, 1, 2, 40, 24, 13),  # a state at an unaligned position; K, V split over programs
    ],
)
def test_plain_kernels_match_reference(no_torch_path, B, T, G, H, K, V, start):
    """Plain Mamba-2 (level_scales None) on the one-level kernels: never the levels, never the torch path."""
    plain = torch.randn(B, 1, H, K, V, dtype=torch.float64)
    state = FenwickState(plain, torch.full((B,), start)) if start else None
    _compare_plain(mamba2_args(make_inputs(B, T, G, H, K, V)), state=state)


def test_plain_varlen_with_states(monkeypatch, no_torch_path):
    """Packed sequences from states at any position; the deposit kernel's rows in programs of 16 (K = 40: three, the
    last partly masked), every chunk's deposit (each sequence's last one goes into its final state)."""
    monkeypatch.setattr(M, "DEPOSIT_ROWS", 16)
    cu = torch.tensor([0, 3, 40, 70])
    state = FenwickState(torch.randn(3, 1, 2, 40, 24, dtype=torch.float64), torch.tensor([17, 0, 48]))
    _compare_plain(mamba2_args(make_inputs(1, 70, 1, 2, 40, 24)), cu_seqlens=cu, state=state)


def test_split_state_rows_with_state(no_torch_path):
    """The reverse scans' states cut into blocks of K rows (three, the last partly masked) with a state."""
    x = mamba2_args(make_inputs(1, 45, 1, 2, 40, 24, start=21))
    _compare(x, state=_random_state(1, [21], 2, 40, 24))


def test_deposit_blocks(monkeypatch, no_torch_path):
    """The deposit kernel's merged blocks of four chunks (chunk 16: sequences of 10, 2 and 8 chunks, so two, none and
    one merged block; each sequence's last block through the scan), its K rows in programs of 16 (K = 40: three, the
    last partly masked; the other tests run whole rows)."""
    monkeypatch.setattr(M, "DEPOSIT_ROWS", 16)
    _compare(mamba2_args(make_inputs(1, 300, 1, 2, 40, 24)), cu_seqlens=torch.tensor([0, 150, 181, 300]))


def test_deposit_blocks_with_states(no_torch_path):
    """Merged blocks after a state: the first block through the scan whether the state's chunk (5, 8, 0) is aligned
    to it or not, the blocks after it merged by the deposit kernel."""
    x = mamba2_args(make_inputs(1, 420, 1, 2, 16, 8))
    _compare(x, cu_seqlens=torch.tensor([0, 150, 300, 420]), state=_random_state(3, [80, 128, 0], 2, 16, 8))


@pytest.mark.parametrize("G, H, heads, plain", [(1, 4, 4, False), (1, 4, 2, True), (2, 8, 2, False),
                                                 (2, 8, 4, True)])
def test_group_heads_summed_in_the_kernels(G, H, heads, plain, monkeypatch, no_torch_path):
    """dq / dk summed over ``heads`` value heads per program inside the dq and dk / dv kernels: a whole group per
    program (its sum in q's dtype) or part of one (fp32 parts summed after), with the gate's gradient from the
    per-head terms (q.dQ from dlambda's columns, k.dK = v.dV); varlen, states at aligned and unaligned positions."""
    from loglinear.ops.triton.shared import launch

    monkeypatch.setattr(launch, "heads_per_program", lambda rows, H, G, per_head=False: 1 if per_head else heads)
    cu = torch.tensor([0, 37, 100])
    x = mamba2_args(make_inputs(1, 100, G, H, 16, 8))
    if plain:
        state = FenwickState(torch.randn(2, 1, H, 16, 8, dtype=torch.float64), torch.tensor([5, 0]))
        _compare_plain(x, cu_seqlens=cu, state=state)
    else:
        _compare(x, cu_seqlens=cu, state=_random_state(2, [48, 21], H, 16, 8))


@pytest.mark.parametrize("plain", [False, True])
def test_group_heads_by_the_launch_rule(plain, monkeypatch, no_torch_path):
    """The backend's own choice with every launch asking for whole groups (CHUNK_PROGRAMS 1): the dk / dv kernel (and
    the plain dq kernel) sum a group of 3 heads per program, the log-linear dq kernel stays per head."""
    from loglinear.ops.triton.shared import launch

    monkeypatch.setattr(launch, "CHUNK_PROGRAMS", 1)
    x = mamba2_args(make_inputs(2, 45, 2, 6, 16, 8))
    if plain:
        _compare_plain(x)
    else:
        _compare(x, state=_random_state(2, [32, 32], 6, 16, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_initial_reads_convert_and_flag_levels_in_one_pass(dtype, monkeypatch):
    """What the chunk kernels read of the initial levels (one kernel over them, blocks of 16 of a level's 70
    elements, the last partial): the levels from plan.first_level on in q's dtype (fp32: h0 itself), and a flag per
    level that is 1 where any element is nonzero, NaN included and -0.0 not; a level below plan.first_level is
    neither flagged nor converted, whatever it holds."""
    from types import SimpleNamespace

    monkeypatch.setattr(M, "INITIAL_READS_BLOCK", 16)
    h0 = torch.zeros(2, 4, 2, 5, 7)
    h0[0, 0] = 1.0  # below the first level
    h0[0, 2, -1, -1, -1] = 3.0  # the last element: the last, partial block
    h0[0, 3, 1, 0, 0] = float("nan")
    h0[1, 1] = -0.0
    h0[1, 2] = torch.randn(2, 5, 7)
    h0[1, 3, 0, 2, 3] = -2.5  # one element in a middle block
    read, held = M._initial_reads(h0, torch.zeros(1, dtype=dtype), SimpleNamespace(has_init=True, first_level=1))
    assert held.dtype == torch.int8 and held.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert read.dtype == dtype and (read is h0) == (dtype == torch.float32)
    got, want = read[:, 1:].float(), h0[:, 1:]
    assert torch.equal(got.isnan(), want.isnan())  # within one ulp of q's dtype (the interpreter truncates)
    assert ((got - want).abs() <= want.abs() * 2**-7).logical_or(want.isnan()).all()


def test_register_cap_on_the_general_build_only(monkeypatch):
    """On a GPU a kernel with max_registers launches with ptxas's cap (maxnreg) on its general build; its per-channel
    build (another warp count) and kernels without one get none, and the interpreter's fixed config never does."""
    from loglinear.ops.triton.shared import launch

    kernel = M.mamba2_initial_grad_kernel
    config = launch.LAUNCH[kernel.__name__]
    assert config.max_registers is not None
    assert "maxnreg" not in launch.launch_options(kernel)  # interpreted
    with monkeypatch.context() as gpu:
        gpu.setattr(launch, "interpreting", lambda: False)
        assert launch.launch_options(kernel) == {"num_warps": config.num_warps, "num_stages": config.num_stages,
                                                 "maxnreg": config.max_registers}
        assert launch.launch_options(kernel, per_channel=True) == dict(zip(("num_warps", "num_stages"),
                                                                           config.channel))
        assert "maxnreg" not in launch.launch_options(M.mamba2_chunk_fwd_kernel)


def test_wide_blocks_take_at_most_two_stages(monkeypatch):
    """On a GPU a kernel whose key or value block is wider than 128 takes at most two pipeline stages on any path
    (plain Gated DeltaNet's chains at three stages of K = 256 tiles need 300 KB of shared memory, an H100 / H200 SM
    has 227 KB), its warps and register cap kept; blocks up to 128 keep the table's stages."""
    from loglinear.ops.triton.gated_deltanet import scan
    from loglinear.ops.triton.shared import launch

    with monkeypatch.context() as gpu:
        gpu.setattr(launch, "interpreting", lambda: False)
        chain = scan._scan_fwd_kernel
        assert launch.launch_options(chain, plain=True, block=128) == {"num_warps": 4, "num_stages": 3}
        assert launch.launch_options(chain, plain=True, block=256) == {"num_warps": 4, "num_stages": 2}
        assert launch.launch_options(chain, block=256) == launch.launch_options(chain, block=128)
        capped = launch.launch_options(M.mamba2_level_grad_kernel, block=256)
        assert capped == {"num_warps": 4, "num_stages": 2, "maxnreg": 168}
        assert launch.launch_options(M.mamba2_level_grad_kernel, block=64)["num_stages"] == 3


@pytest.mark.parametrize("plain", [False, True])
def test_dkv_launch_follows_the_path(plain, monkeypatch, no_torch_path):
    """On a GPU the dk / dv kernel takes its plain-path launch on the plain path only, the per-channel one with
    a per-channel gate, and its fp32 one for fp32 operands on the general path only (launch_options' choice); the
    backend asks for the plan's path and its operands' dtype."""
    from loglinear.ops.triton.shared import launch

    config = launch.LAUNCH["mamba2_chunk_bwd_dkv_kernel"]
    kernel, keys = M.mamba2_chunk_bwd_dkv_kernel, ("num_warps", "num_stages")
    with monkeypatch.context() as gpu:
        gpu.setattr(launch, "interpreting", lambda: False)
        assert launch.launch_options(kernel) == dict(zip(keys, (config.num_warps, config.num_stages)))
        assert launch.launch_options(kernel, plain=True) == dict(zip(keys, config.plain))
        assert launch.launch_options(kernel, per_channel=True, plain=plain) == dict(zip(keys, config.channel))
        assert launch.launch_options(kernel, fp32=True) == dict(zip(keys, config.fp32))
        assert launch.launch_options(kernel, plain=True, fp32=True) == dict(zip(keys, config.plain))
        assert config.plain != (config.num_warps, config.num_stages) != config.fp32
    asked = []

    def options(kernel, state_tile=0, per_channel=False, plain=False, fp32=False, block=0):
        asked.append((kernel.__name__, plain, fp32, block))
        return launch.launch_options(kernel, state_tile, per_channel, plain, fp32, block)

    monkeypatch.setattr(M, "launch_options", options)
    x = mamba2_args(make_inputs(1, 40, 1, 2, 16, 8))
    for dtype, tol in ((torch.float32, FP32_TOL), (torch.float16, 5e-3)):
        if plain:
            _compare_plain(x, dtype=dtype, tol=tol)
        else:
            _compare(x, dtype=dtype, tol=tol)
        assert ("mamba2_chunk_bwd_dkv_kernel", plain, dtype == torch.float32, 16) in asked  # max(K, V) = 16


def test_kernel_modules_are_importable_by_path():
    """The backend modules by their dotted paths (the package's registrations do not shadow them)."""
    import inspect

    import loglinear.ops.triton.gated_deltanet.backend as gdn
    import loglinear.ops.triton.mamba2.backend as mamba2

    assert inspect.ismodule(mamba2) and inspect.ismodule(gdn)
    assert mamba2.LONG_READS == M.LONG_READS


def test_heads_per_program_keeps_the_programs_in_flight():
    from loglinear.ops.triton.shared import launch

    assert launch.heads_per_program(1024, 48, 1) == 48  # 32K at B = 2: a whole group per program
    assert launch.heads_per_program(1024, 48, 1, per_head=True) == 1
    assert launch.heads_per_program(128, 48, 1) == 6  # 1024 programs of 6 heads
    assert launch.heads_per_program(16, 48, 1) == 1  # too few chunks: one head each
    assert launch.heads_per_program(512, 48, 4) == 12  # a group of 12, 2048 programs
    assert launch.heads_per_program(512, 12, 4) == 3  # groups of 3 heads, 2048 programs
    assert launch.heads_per_program(128, 12, 4) == 1  # 3 per program would leave 512


@pytest.mark.parametrize("positions, budget", [([64, 48], None), ([64, 48], 1), ([64, 128], None)])
def test_initial_levels_in_segments_and_empty(positions, budget, monkeypatch, no_torch_path):
    """The initial levels' gradients from their readers summed over several programs per level (runs of 2 chunks:
    up to 4 per level here; states at two aligned positions whose levels have 1 to 7 readers), or over one program
    per level (budget 1: no room for partial sums); at [64, 128] the carries cleared chunk levels 0 and 1 of both
    states (the programs start at level 2); and all-zero levels (a state a call leaves holds only its position's
    bits), which the readouts skip: outputs, dlambda columns (written as 0) and every level's gradient still
    exact."""
    monkeypatch.setattr(M, "INITIAL_READERS", 2)
    if budget is not None:
        monkeypatch.setattr(M, "INITIAL_GRAD_BYTES", budget)
    state = _random_state(2, positions, 2, 8, 5)
    state.levels[0, 5] = 0  # chunk level 0 of sequence 0 (16-token chunks: token level 5)
    state.levels[1, 6:] = 0  # sequence 1: every chunk level above 0
    _compare(mamba2_args(make_inputs(2, 100, 1, 2, 8, 5, start=max(positions))), state=state)


@pytest.mark.parametrize("positions", [[32, 48], [5, 64], [0, 3]])
def test_continuation_from_state(positions):
    """States at aligned and unaligned positions (also 0), junk in every level; gradients reach the state."""
    B, T, H, K, V = 2, 41, 2, 8, 5
    x = mamba2_args(make_inputs(B, T, 1, H, K, V, start=max(positions)))
    _compare(x, state=_random_state(B, positions, H, K, V))


def test_varlen_with_states():
    cu = torch.tensor([0, 3, 40, 70])
    x = mamba2_args(make_inputs(1, 70, 1, 2, 8, 5, start=48))
    _compare(x, cu_seqlens=cu, state=_random_state(3, [17, 0, 48], 2, 8, 5))


def test_states_inside_a_chunk_start_the_kernels_front_padded(monkeypatch):
    """Sequences continuing from states inside a chunk run on the kernels from their first chunk's start,
    front-padded: (37, 20 tokens) twice, (37, 5 tokens: the sequence ends in its first chunk), (5, 25), (0, 20: a
    state at position 0) beside (48, 20) at a chunk boundary; outputs, final states and gradients against the
    reference. And with the kernels stubbed, a forward + backward takes as many torch ops at those positions as with
    every unaligned sequence at 37 (one batch of ops whatever the positions, the tables cached per layout)."""
    cu = torch.tensor([0, 20, 40, 45, 70, 90, 110])
    x = mamba2_args(make_inputs(1, 110, 1, 2, 8, 5, start=48))
    _compare(x, cu_seqlens=cu, state=_random_state(6, [37, 37, 37, 5, 0, 48], 2, 8, 5))
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, **kwargs: None)

    def ops(positions: list[int]) -> int:
        leaves = {n: t.float().requires_grad_() for n, t in x.items()}
        state = _random_state(6, positions, 2, 8, 5)
        state = FenwickState(state.levels.float().requires_grad_(), state.positions)
        with _CountOps() as mode:
            o, final = log_linear_mamba2(**leaves, initial_state=state, output_final_state=True, cu_seqlens=cu,
                                         chunk_size=16)
            (o.sum() + final.levels.sum()).backward()
        return mode.ops

    counts = [[ops(p) for p in ([37, 37, 37, 37, 37, 48], [37, 37, 37, 5, 0, 48])] for _ in range(2)][1]
    assert counts[1] == counts[0], counts


@pytest.mark.slow
def test_many_chunk_levels_varlen_with_states():
    """Deeper cascades (up to 2^5 chunks of 16): merged levels read by many later chunks, an initial state
    at an unaligned position read at several levels, and a sequence starting at 0, in one varlen call."""
    cu = torch.tensor([0, 300, 529])
    x = mamba2_args(make_inputs(1, 529, 1, 2, 16, 8, start=200))
    _compare(x, cu_seqlens=cu, state=_random_state(2, [200, 0], 2, 16, 8))


def test_varlen_without_states(no_torch_path):
    cu = torch.tensor([0, 1, 17, 50, 51])
    _compare(mamba2_args(make_inputs(1, 51, 2, 4, 8, 8)), cu_seqlens=cu)


def test_single_token_steps_continue_exactly():
    """Prefill then one-token steps equals one pass (the decode path of the kernels)."""
    x = mamba2_args(make_inputs(1, 20, 1, 2, 8, 5, dtype=torch.float32))
    full, full_state = log_linear_mamba2(**x, output_final_state=True, chunk_size=16)
    cut = lambda a, b: {n: t[:, a:b] for n, t in x.items()}  # noqa: E731
    o, st = log_linear_mamba2(**cut(0, 17), output_final_state=True, chunk_size=16)
    outs = [o]
    for t in range(17, 20):
        o, st = log_linear_mamba2(**cut(t, t + 1), initial_state=st, output_final_state=True, chunk_size=16)
        outs.append(o)
    assert_close(torch.cat(outs, 1).double(), full.double(), FP32_TOL, "steps")
    assert_close(st.levels.double(), full_state.levels.double(), FP32_TOL, "state")


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_precision_inputs(no_torch_path, dtype, tol):
    _compare(mamba2_args(make_inputs(1, 40, 1, 2, 16, 16)), dtype=dtype, tol=tol)


@pytest.mark.parametrize("name, plain", [("mamba2", False), ("mamba2", True), ("gla", False)])
def test_qk_l2norm_through_the_generic_op(no_torch_path, name, plain):
    """attention(..., use_qk_l2norm=True) on these kernels normalises q and k as the reference does (q, k scaled
    x3 so that the normalisation shows), from a state and with every gradient."""
    gen = torch.Generator().manual_seed(0)
    x = make_inputs(2, 37, 1, 2, 16, 8, generator=gen, start=21)
    x = {"q": 3 * x["q"], "k": 3 * x["k"], "v": x["v"], **({} if plain else {"level_scales": x["level_scales"]}),
         "g": (MAMBA2 if name == "mamba2" else GLA).sample_gates(2, 37, 2, 16, dtype=torch.float64, generator=gen)["g"]}
    state = FenwickState(0.3 * torch.randn(2, 1 if plain else 6, 2, 16, 8, dtype=torch.float64, generator=gen),
                         torch.tensor([21, 21]))

    def runner(op):
        return lambda xs, st: op(name, xs["q"], xs["k"], xs["v"], {"g": xs["g"]}, xs.get("level_scales"),
                                 initial_state=st, output_final_state=True, use_qk_l2norm=True)

    compare_with_reference(runner(attention), runner(R.recurrent), x, state, tol=FP32_TOL, grad_close=_close_or_tiny)


def test_chunk_sizes_agree():
    """The kernels' result does not depend on chunk_size (8 is run with the kernels' minimum chunk 16)."""
    x = mamba2_args(make_inputs(1, 70, 1, 2, 16, 16, dtype=torch.float32))
    outs = [log_linear_mamba2(**x, chunk_size=c)[0].double() for c in (8, 32, 64)]
    for o in outs[1:]:
        assert_close(o, outs[0], FP32_TOL, "chunk sizes")


@pytest.mark.parametrize("dtype, K, chunk", [(torch.float32, 136, 32), (torch.float32, 128, 64),
                                             (torch.float16, 136, 64)])
@pytest.mark.parametrize("variant", ["mamba2", "gla"])
def test_kernel_chunk_by_operand_dtype_and_key(monkeypatch, variant, dtype, K, chunk):
    """The kernels' chunk: 32 for fp32 operands with K > 128 (their tf32x3 products stage the operands' split parts
    in shared memory: at 64 the dk / dv kernel would not fit sm_90's), else the op's 64."""
    seen, rule = [], M.kernel_chunk_size

    class Chosen(Exception):
        pass

    def record(chunk_size, cap):  # the chunk the kernels would run, then stop before them
        seen.append(rule(chunk_size, cap))
        raise Chosen

    monkeypatch.setattr(M, "kernel_chunk_size", record)
    x = mamba2_args(make_inputs(1, 20, 1, 2, K, 16, dtype=dtype))
    if variant == "gla":
        x["g"] = x["g"][..., None].expand(*x["g"].shape, K).contiguous()
    op = log_linear_mamba2 if variant == "mamba2" else log_linear_gla
    with pytest.raises(Chosen):
        op(**x)
    assert seen == [chunk]


def test_gradients_are_deterministic():
    x = mamba2_args(make_inputs(1, 50, 1, 2, 16, 16, dtype=torch.float32))
    grads = []
    for _ in range(2):
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        o, _ = log_linear_mamba2(**leaves, chunk_size=16)
        o.square().sum().backward()
        grads.append([leaves[n].grad for n in x])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _scan_node(o):
    """The LevelScanMamba2 node (its autograd ctx) in o's graph."""
    todo = [o.grad_fn]
    while todo:
        node = todo.pop()
        if type(node).__name__ == "LevelScanMamba2Backward":
            return node
        todo += [f for f, _ in node.next_functions if f is not None]
    raise AssertionError("no LevelScanMamba2 node in the graph")


@pytest.mark.parametrize("with_state", [False, True])
def test_backward_frees_the_buckets_and_runs_twice(with_state):
    """The backward drops the forward's buckets after the dq kernel; a second backward through the
    retained graph recomputes them and gives the same gradients."""
    x = mamba2_args(make_inputs(1, 50, 1, 2, 16, 16, dtype=torch.float32))
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    state = _random_state(1, [21], 2, 16, 16).levels.float().requires_grad_() if with_state else None
    o, _ = log_linear_mamba2(**leaves, chunk_size=16,
                             initial_state=FenwickState(state, torch.tensor([21])) if with_state else None)
    buckets = weakref.ref(_scan_node(o).saved.buckets)
    loss = o.square().sum()
    loss.backward(retain_graph=True)
    assert buckets() is None
    params = [*leaves.values()] + ([state] if with_state else [])
    firsts = [t.grad.clone() for t in params]
    loss.backward()
    assert all(torch.equal(t.grad, 2 * first) for t, first in zip(params, firsts))


def test_index_tables_are_cached_per_plan():
    """Calls with the same sequence layout reuse one set of device index tables (no per-call host work);
    another layout gets its own, and both still match the reference."""
    M._tables.cache_clear()
    for T in (50, 50, 37):
        x = mamba2_args(make_inputs(1, T, 1, 2, 16, 16, dtype=torch.float32))
        o, _ = log_linear_mamba2(**x, chunk_size=16)
        ref = R.log_linear_mamba2_materialized(**{n: t.double() for n, t in x.items()})
        assert_close(o.double(), ref, FP32_TOL, f"T={T}")
    assert M._tables.cache_info().misses == 2  # one build per layout (T = 50 twice, T = 37)


def test_level_gradient_launch_order(no_torch_path, monkeypatch):
    """grad_order holds every kernel chunk once: those whose merged level is LONG_READS or higher first, highest
    level first, then the rest in position order; the gradients match the reference under a mixed order."""
    _, table = M._tables((0, 600), (0, 600), (600, 800), (0, 60), 16, torch.device("cpu"))  # chunks 0..37, 60..72
    order = table.grad_order.tolist()
    merged = [ctz(c + 1) for c in table.chunks.tolist()]
    assert sorted(order) == list(range(len(merged)))
    long = [p for p in order if merged[p] >= M.LONG_READS]
    assert long == order[: len(long)] and [merged[p] for p in long] == [6, 5]
    assert order[len(long):] == sorted(order[len(long):])
    monkeypatch.setattr(M, "LONG_READS", 2)
    M._tables.cache_clear()
    _compare(mamba2_args(make_inputs(1, 130, 1, 2, 16, 16)))
    M._tables.cache_clear()


class _CountOps(TorchDispatchMode):
    """Counts the torch ops dispatched while active (``ops``), those that are no view and touch a tensor of 5 or
    more dims, state-sized [N, levels, H, K, V] (``state_ops``), and the tensors made from host values
    (``host_tensors``: torch.tensor of a list, or a list index; on the GPU each a host-to-device copy)."""

    def __init__(self):
        super().__init__()
        self.ops = self.state_ops = self.host_tensors = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.ops += 1
        self.state_ops += not func.is_view and any(t.dim() >= 5 for t in tensors)
        self.host_tensors += func is torch.ops.aten.lift_fresh.default
        return out


def test_final_states_of_many_sequences_take_one_batch_of_ops(monkeypatch):
    """The final states' last chunks of every sequence in one batch of torch ops: about the same op count at 1 and
    12 sequences (varlen, last chunks of 1 to 16 tokens), their layout's tables first built under inference mode and
    then saved by autograd; states and gradients match the reference."""
    cu = torch.tensor([0, 16, 17, 40, 41, 64, 100, 101, 130, 146, 147, 170, 200])
    x = mamba2_args(make_inputs(1, 200, 1, 2, 8, 5))
    M._last_chunks.cache_clear()
    with torch.inference_mode():
        log_linear_mamba2(**{n: t.float() for n, t in x.items()}, cu_seqlens=cu, output_final_state=True,
                          chunk_size=16)
    _compare(x, cu_seqlens=cu)
    counts, final_state = [], M._final_state

    def counted(*args):
        with _CountOps() as mode:
            out = final_state(*args)
        counts.append(mode.ops)
        return out

    monkeypatch.setattr(M, "_final_state", counted)
    for bounds in (cu[[0, -1]], cu, cu[[0, -1]], cu):  # the second round: both layouts' tables cached
        log_linear_mamba2(**{n: t.float() for n, t in x.items()}, cu_seqlens=bounds, output_final_state=True,
                          chunk_size=16)
    # not per sequence (one op per sequence would add 11); the 12 keep different numbers of levels: a mask more
    assert 0 < counts[3] <= counts[2] + 8, counts


def test_a_seen_layout_makes_no_host_tables(monkeypatch):
    """A stateful call whose layout was seen before makes no tensor from host values but its final state's
    positions (on the host): the index tables and masks of its carry targets, front padding and final state are
    cached per layout, so on the GPU it does no host-to-device copy and no list index (a synchronising one).
    Varlen, 16-token chunks: positions 35 (the sequence ends in its first chunk), 70 (inside a chunk) and 1024
    (another carry target); the final states keep 11 or 12 levels (kernels stubbed)."""
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, **kwargs: None)
    cu = torch.tensor([0, 3, 20, 40])
    x = {n: t.float() for n, t in mamba2_args(make_inputs(1, 40, 1, 2, 8, 5, start=1024)).items()}
    state = FenwickState(torch.randn(3, 11, 2, 8, 5), torch.tensor([35, 70, 1024]))
    counts = []
    for _ in range(2):
        with _CountOps() as mode:
            log_linear_mamba2(**x, initial_state=state, output_final_state=True, cu_seqlens=cu, chunk_size=16)
        counts.append(mode.host_tensors)
    assert counts[1] == 1, counts


def _state_ops(x: dict, state: FenwickState | None) -> int:
    """State-sized torch ops (_CountOps.state_ops) of a forward + backward with the final state (fp32 inputs)."""
    leaves = {n: t.float().requires_grad_() for n, t in x.items()}
    if state is not None:
        state = FenwickState(state.levels.float().requires_grad_(), state.positions)
    with _CountOps() as mode:
        o, final = log_linear_mamba2(**leaves, initial_state=state, output_final_state=True, chunk_size=16)
        (o.sum() + final.levels.sum()).backward()
    return mode.state_ops


def test_one_carry_target_reads_the_state_once(monkeypatch):
    """Sequences at aligned positions that all carry into one level (3072 = 3 * 2^10, 16-token chunks: token level
    11, chunk level 6; junk in every level, some above the target): the chunk levels straight from the caller's
    levels, those below the target's neither read nor given a gradient. Outputs, final state and every gradient
    match the reference (a first level one too high drops the carried sum), and the state adds at most 8
    state-sized torch ops to the forward + backward (kernels stubbed; the general carry adds 16)."""
    B, T, H, K, V = 2, 40, 2, 8, 5
    x = mamba2_args(make_inputs(B, T, 1, H, K, V, start=3072))
    state = _random_state(B, [3072, 3072], H, K, V)
    _compare(x, state=state)
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, **kwargs: None)
    counts = [[_state_ops(x, st) for st in (None, state)] for _ in range(2)][1]  # the second: tables cached
    assert counts[1] <= counts[0] + 8, counts


def test_float64_uses_the_exact_torch_path():
    x = mamba2_args(make_inputs(1, 30, 1, 2, 8, 5))
    o, _ = log_linear_mamba2(**x)
    assert o.dtype == torch.float64
    assert_close(o, R.log_linear_mamba2_materialized(**x), 1e-12, "float64")


def test_kernels_are_the_default_on_cuda(monkeypatch):
    monkeypatch.delenv("LOGLINEAR_BACKEND")
    assert select_backend(MAMBA2, torch.device("cuda")) == "triton"
    assert select_backend(MAMBA2, torch.device("cpu")) == "torch"
    assert select_backend(MAMBA2, torch.device("cuda"), "torch") == "torch"


@pytest.mark.parametrize("name", ["mamba2", "gla"])
@pytest.mark.parametrize("final_state", [False, True])
def test_states_inside_a_chunk_copy_no_inputs(name, final_state, monkeypatch):
    """Sequences from states inside a chunk run on the kernels with their first chunk's rows before the sequence
    masked, not copied into a padded layout, and the torch ops over their first chunks (and the final states' last
    chunks) read rows that the kernels' autograd Function gathers and whose gradients it adds in place: forward and
    backward write as many whole-size tensors (rows written in place aside) as from states at chunk boundaries (a
    padded layout makes two per input and one for the outputs' way back; rows gathered from an input make its
    gradient once more at whole size, and their sum). Twice as many sequences of the same length write as many in the
    backward (a gradient per sequence would add 16). The kernels are stubbed: only the torch ops count."""
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, **kwargs: None)
    inside = large_writes(name, [256, 256], 16, 5, "triton", final_state)
    aligned = large_writes(name, [256, 256], 16, 16, "triton", final_state)
    assert inside == aligned, (inside, aligned)
    few = large_writes(name, [8] * 16, 16, 5, "triton", final_state)[1]
    many = large_writes(name, [8] * 32, 16, 5, "triton", final_state)[1]
    assert many == few, (few, many)
