"""Triton log-linear Gated DeltaNet (CPU: TRITON_INTERPRET=1, set by conftest) against the float64 references.

Every case draws fresh random inputs, runs the kernels in fp32 with every kernel output poisoned (NaN)
before launch, and compares outputs, final states and all gradients (q, k, v, g, beta, level_scales,
initial state) with autograd through the float64 recurrent reference.
"""

import pytest
import torch

from helpers import assert_close, compare_with_reference, make_inputs, slice_time
from loglinear import FenwickState, log_linear_gated_deltanet
from loglinear import reference as R
from loglinear.inputs import check_inputs, expand_groups, l2norm
from loglinear.ops import api
from loglinear.ops.torch_chunk import chunked, pad_time
from loglinear.ops.triton.gated_deltanet import backend as gdn
from loglinear.ops.triton.gated_deltanet import scan as scan_module
from loglinear.ops.triton.gated_deltanet.chunking import Chunking
from loglinear.ops.triton.gated_deltanet.local import chunk_local_segments, chunk_local_torch
from loglinear.ops.triton.gated_deltanet.scan import fenwick_delta_scan
from loglinear.ops.triton.shared.common import set_poison
from loglinear.variants import GATED_DELTANET

NAMES = ["q", "k", "v", "g", "beta", "level_scales"]
RTOL = 2e-5  # fp32 kernels against float64


@pytest.fixture(autouse=True)
def poison_and_opt_in(monkeypatch):
    """NaN-fill every kernel output before launch; select the triton backend (CPU tensors: the interpreter)."""
    monkeypatch.setenv("LOGLINEAR_BACKEND", "triton")
    set_poison(True)
    yield
    set_poison(False)


def _checked(x, state, cu_seqlens):
    """The validated call (OpInputs) of the op's arguments x (NAMES)."""
    gates = {"g": x["g"], "beta": x["beta"]}
    return check_inputs(GATED_DELTANET, x["q"], x["k"], x["v"], gates, x["level_scales"], None, state, cu_seqlens)


def _triton(x, state=None, cu_seqlens=None, chunk_size=16, l2norm=False):
    inp = _checked(x, state, cu_seqlens)
    return gdn.backend(inp, True, chunk_size, l2norm)


def _reference(x, state=None, cu_seqlens=None, l2norm=False):
    return R.log_linear_gated_deltanet_recurrent(
        **x, initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm=l2norm
    )


def _state(B, L, H, K, V, positions, dtype):
    levels = 0.3 * torch.randn(B, L, H, K, V, dtype=dtype)
    return FenwickState(levels, torch.tensor(positions))


def _compare(x64, state64=None, cu_seqlens=None, chunk_size=16, l2norm=False, grads=True):
    """Run both; compare o, the final state and (grads) every gradient under a random cotangent."""
    compare_with_reference(lambda x, st: _triton(x, st, cu_seqlens, chunk_size, l2norm),
                           lambda x, st: _reference(x, st, cu_seqlens, l2norm),
                           x64, state64, tol=RTOL, grad_tol=10 * RTOL, grads=grads)


def _plain(x):
    return {n: t for n, t in x.items() if n != "level_scales"}


def _compare_plain(x64, state64=None, cu_seqlens=None):
    """A plain call (level_scales None) on the kernels' one-level schedule against the float64 plain reference:
    o, the one-level final state and every gradient; the torch path is never taken."""
    compare_with_reference(
        lambda x, st: log_linear_gated_deltanet(**x, level_scales=None, initial_state=st, output_final_state=True,
                                                cu_seqlens=cu_seqlens, chunk_size=16, use_qk_l2norm=True),
        lambda x, st: R.log_linear_gated_deltanet_recurrent(**x, level_scales=None, initial_state=st,
                                                            output_final_state=True, cu_seqlens=cu_seqlens,
                                                            use_qk_l2norm=True),
        _plain(x64), state64, tol=RTOL, grad_tol=10 * RTOL)


# One token: every output is a single q.k, which random inputs now and then make cancel (|q.k| << sum |q_i k_i|),
# so that fp32 misses the relative tolerance on the kernels' correct result; with B = 2 and G = 2 four independent
# products share the norm-wise error (a B = 1, G = 1 draw fails about once in several hundred).
@pytest.mark.parametrize("B, T, G, H, K, V, start", [
    (2, 1, 2, 4, 8, 4, 0),  # one token (B = 2, G = 2: above)
    (2, 21, 1, 2, 16, 16, 0),  # T not a multiple of the chunk, B > 1, G < H
    (1, 40, 1, 2, 20, 24, 13),  # a state at an unaligned position; K, V not powers of two
])
def test_plain_calls_run_the_one_level_schedule(monkeypatch, B, T, G, H, K, V, start):
    monkeypatch.setattr(api, "torch_chunk_backend", _no_fallback)
    state = _state(B, 1, H, K, V, [start] * B, torch.float64) if start else None
    _compare_plain(make_inputs(B, T, G, H, K, V), state)


def test_plain_varlen_with_states_at_different_positions(monkeypatch):
    monkeypatch.setattr(api, "torch_chunk_backend", _no_fallback)
    _compare_plain(make_inputs(1, 70, 1, 2, 16, 16), _state(3, 1, 2, 16, 16, [17, 0, 48], torch.float64),
                   torch.tensor([0, 3, 40, 70]))


def _no_fallback(*args, **kwargs):
    raise AssertionError("the triton backend fell back to the torch path")


@pytest.mark.parametrize(
    "B, T, G, H, K, V, chunk",
    [
        (2, 37, 1, 2, 8, 5, 16),  # T not a multiple of the chunk, B > 1
        (2, 1, 2, 4, 8, 4, 16),  # one token (B = 2, G = 2: see the plain calls' cases)
        (1, 70, 2, 4, 20, 24, 16),  # GQA, K and V not powers of two, 5 chunks
        (1, 40, 1, 1, 16, 16, 4),  # chunk sizes below 16 run at 16: same result
        (1, 19, 1, 1, 256, 8, 16),  # K = 256: four K blocks in the chunk-local kernels, [256, 16] scan tiles
    ],
)
def test_matches_reference(B, T, G, H, K, V, chunk):
    _compare(make_inputs(B, T, G, H, K=K, V=V), chunk_size=chunk)


def test_qk_l2norm_in_op():
    x = make_inputs(1, 33, 1, 2, K=8, V=4)
    x["q"], x["k"] = 3 * x["q"], 3 * x["k"]
    _compare(x, l2norm=True)


def _spread_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] with every row scaled by 10^u, u uniform in [-3, 3] (row norms over six decades: the
    normalisation is exercised, the eps too for the smallest rows)."""
    return x * 10.0 ** (6 * torch.rand(*x.shape[:-1], 1, dtype=x.dtype) - 3)


@pytest.mark.parametrize(
    "B, T, G, H, K, V, positions",
    [
        (2, 37, 1, 2, 72, 12, None),  # two K blocks of 64 (fp32), T not a multiple of the chunk
        (1, 50, 2, 4, 20, 8, None),  # GQA
        (2, 21, 1, 2, 8, 4, [5, 5]),  # from a state (one position: the in-kernel path with the incoming state)
    ],
)
def test_qk_l2norm_in_kernels(B, T, G, H, K, V, positions, monkeypatch):
    """use_qk_l2norm on the single-segment path: the chunk-local kernels get the op's q/k as they are and
    normalise rows themselves; outputs, state and every gradient against the float64 reference."""
    start = max(positions or [0])
    x = make_inputs(B, T, G, H, K=K, V=V, start=start)
    x["q"], x["k"] = _spread_rows(x["q"]), _spread_rows(x["k"])
    L = max(1, (start - 1).bit_length() + 1)
    state = _state(B, L, H, K, V, positions, torch.float64) if positions else None
    seen = []
    local = gdn.chunk_local_segments
    monkeypatch.setattr(gdn, "chunk_local_segments", lambda *a: seen.append((a[0], a[-1])) or local(*a))
    _compare(x, state, l2norm=True)
    (q, norm), = seen[:1]
    assert norm and torch.equal(q, x["q"].float())


def test_qk_l2norm_varlen_with_states():
    """use_qk_l2norm with varlen + states (run_segments: q/k normalised in torch before the kernels)."""
    lengths, positions = [7, 30, 1], [0, 19, 64]
    x = make_inputs(1, sum(lengths), 1, 2, K=8, V=4, start=64)
    x["q"], x["k"] = _spread_rows(x["q"]), _spread_rows(x["k"])
    cu = torch.tensor([0, 7, 37, 38])
    _compare(x, _state(3, 8, 2, 8, 4, positions, torch.float64), cu_seqlens=cu, l2norm=True)


@pytest.mark.parametrize("positions", [[5, 5], [16, 3], [37, 50]])
def test_continuation_from_a_state(positions):
    """Rows at different (unaligned and aligned) positions, junk-perturbed level states, gradients to the state."""
    start = max(positions)
    x = make_inputs(2, 21, 1, 2, K=8, V=4, start=start)
    L = max(1, (start - 1).bit_length() + 1)
    _compare(x, _state(2, L, 2, 8, 4, positions, torch.float64))


@pytest.mark.parametrize("position, T, levels", [(1, 2, 1), (0, 2, 1), (5, 3, 3), (12, 2, 4), (40, 30, 6)])
def test_final_state_from_a_short_state_keeps_its_width(position, T, levels):
    """A call from a state of few levels returns max(levels_needed(end), the state's levels) levels, as the
    reference and the torch path do, not the chunk levels the kernels carried (compare_with_reference checks
    the shape). At 12 the call is one chunk whose last token 13 would read the state's buckets 0..2 at levels
    1..2 but for the carry past 12 (ctz 2), which puts them in level 3: the kernels' path never forms it."""
    x = make_inputs(1, T, 1, 2, K=8, V=4, start=position)
    _compare(x, _state(1, levels, 2, 8, 4, [position], torch.float64))


@pytest.mark.parametrize("position, seeds", [(256, 0b10000), (128, 0b1000), (64, 0b1100), (80, 0b1111)])
def test_continuation_seeds_only_the_levels_the_carry_left(position, seeds, monkeypatch):
    """A state at an aligned position, 100 tokens in chunks of 16 (c = 4; J = 4 chunk levels, 5 at 256): the carry
    past the position clears the token levels up to ctz(position), the in-chunk ones among them, so the scan seeds
    only the chunk levels above them (256: level 4; 128: 3; 64: 2 and 3; 80: all, the carry clears no chunk level)
    and nothing for the in-chunk buckets, never the cleared ones; o, the final state and every gradient (the
    junk-filled state's too) match the float64 reference."""
    seen = []
    apply = scan_module.FenwickDeltaScan.apply
    monkeypatch.setattr(scan_module.FenwickDeltaScan, "apply", lambda *a: seen.append(a[10]) or apply(*a))
    x = make_inputs(1, 100, 1, 2, K=8, V=4, start=position)
    _compare(x, _state(1, (position - 1).bit_length() + 1, 2, 8, 4, [position], torch.float64))
    assert {sched.bits[0] for sched in seen} == {seeds}


def _segments_launched(monkeypatch, segment: int, plain_segment: int) -> list[tuple[int, int]]:
    """Chain segments of ``segment`` chunks (``plain_segment`` on the plain schedule with gradients); returns the
    list that the chunk-local stage's launches append their chunk ranges (i0, i1) to."""
    monkeypatch.setattr(scan_module, "SEGMENT", segment)
    monkeypatch.setattr(scan_module, "PLAIN_SEGMENT", plain_segment)
    launched, local = [], gdn.chunk_local_segments

    def spy(*args):
        out, launch = local(*args)
        return out, lambda i0, i1: launched.append((i0, i1)) or launch(i0, i1)

    monkeypatch.setattr(gdn, "chunk_local_segments", spy)
    return launched


@pytest.mark.parametrize("plain", [False, True])
def test_chunk_local_stage_launched_by_segments(plain, monkeypatch):
    """Chain segments of 2 chunks: the scan launches the chunk-local stage of each segment before the chain's
    segment (the outputs are poisoned until then), 100 tokens from a state at position 5 in chunks of 16 (7 chunks:
    segments of 2, 2, 2 and 1); o, the final state and every gradient against the float64 reference."""
    launched = _segments_launched(monkeypatch, 2, 2)
    x = make_inputs(1, 100, 1, 2, K=8, V=4, start=5)
    L = 1 if plain else 4
    (_compare_plain if plain else _compare)(x, _state(1, L, 2, 8, 4, [5], torch.float64))
    assert launched == [(0, 2), (2, 4), (4, 6), (6, 7)]


def test_plain_segments_with_and_without_gradients(monkeypatch):
    """The plain schedule's chains in PLAIN_SEGMENT chunks with gradients and SEGMENT without (3 and 2 here: the
    forward and the backward cut differently from the forward without gradients): o, the final state and every
    gradient, then o without gradients, against the float64 recurrence; the chunk-local stage launched per segment."""
    launched = _segments_launched(monkeypatch, 2, 3)
    x = make_inputs(1, 100, 1, 2, K=8, V=4, start=5)
    state = _state(1, 1, 2, 8, 4, [5], torch.float64)
    _compare_plain(x, state)
    assert launched == [(0, 3), (3, 6), (6, 7)]
    launched.clear()
    with torch.no_grad():
        x32 = {n: t.float() for n, t in _plain(x).items()}
        st32 = FenwickState(state.levels.float(), state.positions)
        o, _ = log_linear_gated_deltanet(**x32, level_scales=None, initial_state=st32, chunk_size=16,
                                         use_qk_l2norm=True)
        ref, _ = R.log_linear_gated_deltanet_recurrent(**_plain(x), level_scales=None, initial_state=state,
                                                       use_qk_l2norm=True)
    assert_close(o, ref, RTOL)
    assert launched == [(0, 2), (2, 4), (4, 6), (6, 7)]


def test_wide_keys_read_out_apart_without_gradients():
    """A forward without gradients reads out in its chain only for 16-bit keys up to 128 on the log-linear schedule
    (that chain at key block 256 made illegal memory accesses on an H100), and on the plain schedule."""
    cpu = torch.device("cpu")
    ll = scan_module.schedule(gdn._merge_targets(0, 8), 4, 0, cpu)
    plain = scan_module.schedule(gdn._plain_targets(8), 1, 0, cpu)
    assert [scan_module.reads_apart(torch.bfloat16, ll, BK) for BK in (64, 128, 256)] == [False, False, True]
    assert scan_module.reads_apart(torch.float32, ll, 64) and not scan_module.reads_apart(torch.float16, ll, 128)
    assert not any(scan_module.reads_apart(dtype, plain, 256) for dtype in (torch.bfloat16, torch.float32))


def test_varlen_with_states():
    lengths, positions = [7, 30, 1], [0, 19, 64]
    x = make_inputs(1, sum(lengths), 1, 2, K=8, V=4, start=64)
    cu = torch.tensor([0, 7, 37, 38])
    _compare(x, _state(3, 8, 2, 8, 4, positions, torch.float64), cu_seqlens=cu)


@pytest.mark.parametrize("plain", [False, True])
def test_group_heads_by_the_launch_rule(plain, monkeypatch):
    """The op with every launch asking for whole groups (CHUNK_PROGRAMS 1): the key backward sums a group of 3
    value heads per program (the one-segment path keeps G < H up to the kernels); q/k normalised in the kernels,
    states (plain: at different positions), against the float64 reference."""
    from loglinear.ops.triton.shared import launch

    monkeypatch.setattr(launch, "CHUNK_PROGRAMS", 1)
    monkeypatch.setattr(api, "torch_chunk_backend", _no_fallback)
    x = make_inputs(2, 40, 2, 6, K=8, V=4, start=48)
    if plain:
        _compare_plain(x, _state(2, 1, 6, 8, 4, [5, 48], torch.float64))
    else:
        _compare(x, _state(2, 7, 6, 8, 4, [48, 48], torch.float64), l2norm=True)


def test_state_roundtrip_equals_one_pass():
    """Prefill, a chunk, then single tokens, each continuing the previous state, equal one pass."""
    x = {n: t.float() for n, t in make_inputs(1, 45, 1, 2, K=8, V=4).items()}
    full, full_state = _triton(x)
    outs, state = [], None
    for a, b in [(0, 13), (13, 35)] + [(t, t + 1) for t in range(35, 45)]:
        o, state = _triton(slice_time(x, a, b), state)
        outs.append(o)
    assert_close(torch.cat(outs, 1), full, 1e-5, "outputs")
    assert_close(state.levels, full_state.levels, 1e-5, "state")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    x = make_inputs(1, 40, 1, 2, K=16, V=16)
    o, st = _triton({n: t.to(dtype) for n, t in x.items()})
    ro, rst = _reference({n: t.to(dtype).double() for n, t in x.items()})
    assert o.dtype == dtype and st.levels.dtype == torch.float32
    assert_close(o.double(), ro, 2e-2, "o")
    assert_close(st.levels.double(), rst.levels, 2e-2, "state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_launches_follow_the_operand_dtype(dtype, monkeypatch):
    """Every chunk-local and scan launch of a call with gradients asks for the fp32 builds' launch exactly when the
    operands are fp32, so that the kernels with an ``fp32`` config (launch.LAUNCH) take it then and only then."""
    from loglinear.ops.triton.gated_deltanet import local
    from loglinear.ops.triton.shared import launch

    asked = []
    for module in (local, scan_module):
        def options(kernel, *args, fp32=False, of=module.launch_options, **kwargs):
            asked.append((kernel.__name__, fp32))
            return of(kernel, *args, fp32=fp32, **kwargs)

        monkeypatch.setattr(module, "launch_options", options)
    x = {n: t.to(dtype).requires_grad_() for n, t in make_inputs(1, 40, 1, 2, K=16, V=16).items()}
    o, _ = _triton(x)
    o.float().sum().backward()
    assert {fp32 for _, fp32 in asked} == {dtype == torch.float32}
    with_fp32 = {name for name, config in launch.LAUNCH.items() if config.fp32 is not None}
    gdn_kernels = {name for name in with_fp32 if name.startswith(("_chunk_", "_scan_"))}
    assert gdn_kernels and gdn_kernels <= {name for name, _ in asked}


def test_deterministic_gradients():
    x = {n: t.float().requires_grad_() for n, t in make_inputs(1, 50, 1, 2, K=16, V=16).items()}
    do = torch.randn(1, 50, 2, 16)
    grads = [torch.autograd.grad((_triton(x)[0] * do).sum(), list(x.values())) for _ in range(2)]
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _chunk_view(x, ch, H):
    """The torch form's view of an op-layout tensor [b, T, G|H, *]: zero-padded chunks [b, H, N, C, *]."""
    return chunked(expand_groups(pad_time(x, ch.front, ch.Tp - ch.front - ch.T), H), ch.C)


@pytest.mark.parametrize("K, V, dtype, rtol, norm, plain", [
    (20, 12, torch.float32, RTOL, False, False),
    (72, 80, torch.float32, RTOL, False, False),  # two K and two V blocks of 64
    (72, 80, torch.float16, 5e-3, False, False),  # 16-bit operands: the inverse's Gram from one 128-column K block
    (20, 12, torch.float32, RTOL, True, False),  # q/k rows normalised in the kernels
    (72, 80, torch.float32, RTOL, True, False),  # ... over two K blocks
    (72, 80, torch.float16, 5e-3, True, False),  # ... the inverse's Gram from one 128-column K block
    (20, 12, torch.float32, RTOL, False, True),  # plain: lam None, the torch form with lambda = 1
    (72, 80, torch.float16, 5e-3, True, True),
])
def test_chunk_local_kernels_match_torch_form(K, V, dtype, rtol, norm, plain):
    """The chunk-local forward and backward kernels, reading the op's layouts (front padding, a partial last
    chunk, two value heads per q/k group), against autograd through the float64 torch form; norm: q/k rows
    spread over six decades and normalised in the kernels (the reference applies l2norm); plain: the kernels get
    no lambda (None) and the torch form lambda = 1."""
    _check_chunk_local(K, V, dtype, rtol, norm, plain, G=1, H=2)


@pytest.mark.parametrize("K, G, H, heads, norm, plain", [
    (72, 2, 8, 4, True, False),  # a whole group per program (its sum in the operand dtype), three key blocks
    (20, 2, 8, 2, False, False),  # half a group per program: fp32 parts, summed per group after the kernel
    (20, 1, 6, 3, True, True),
])
def test_key_backward_sums_a_groups_heads(K, G, H, heads, norm, plain, monkeypatch):
    """The key backward with ``heads`` value heads per program: dq / dk summed over them, dg / dbeta per head; it
    runs at the group key block when a program sums heads (the one-head block is only for one)."""
    from loglinear.ops.triton.gated_deltanet import local
    from loglinear.ops.triton.shared import launch

    monkeypatch.setattr(launch, "heads_per_program", lambda rows, H, G, per_head=False: heads)
    ran = []
    meta_of = local.kernel_meta

    def kernel_meta(kernel, meta):
        out = meta_of(kernel, meta)
        ran.append((kernel.__name__, meta["HP"], out.get("BK")))
        return out

    monkeypatch.setattr(local, "kernel_meta", kernel_meta)
    _check_chunk_local(K, 12, torch.float32, RTOL, norm, plain, G=G, H=H)
    assert ("_chunk_local_bwd_k_kernel", heads, local.KEY_BLOCK["_chunk_local_bwd_k_kernel"]) in ran


def test_key_backward_block_follows_heads_per_program():
    """The key backward takes the group key block when a program sums a group's heads and the whole key (up to
    ONE_HEAD_KEY_BLOCK) with one head per program; the other chunk-local kernels ignore the heads per program."""
    from loglinear.ops.triton.gated_deltanet import local

    group = local.KEY_BLOCK["_chunk_local_bwd_k_kernel"]
    assert group < local.ONE_HEAD_KEY_BLOCK
    meta = dict(K=128, BK_MAX=128, N=4, HP=48)
    assert local.kernel_meta(local._chunk_local_bwd_k_kernel, meta)["BK"] == group
    assert local.kernel_meta(local._chunk_local_bwd_k_kernel, dict(meta, HP=1))["BK"] == local.ONE_HEAD_KEY_BLOCK
    assert local.kernel_meta(local._chunk_local_bwd_k_kernel, dict(meta, HP=1, K=64))["BK"] == 64
    inverse = local.KEY_BLOCK["_chunk_inverse_kernel"]
    for hp in (1, 48):
        assert local.kernel_meta(local._chunk_inverse_kernel, dict(meta, HP=hp))["BK"] == inverse


def _check_chunk_local(K, V, dtype, rtol, norm, plain, G, H):
    b, T, L = 2, 37, 7
    ch = Chunking(b, T, H, front=5, C=16)  # 3 chunks: 5 padding tokens in front, 6 behind
    xs = [torch.randn(b, T, G, K), torch.randn(b, T, G, K) / K**0.5, torch.randn(b, T, H, V),
          -0.05 - 0.4 * torch.rand(b, T, H), 0.05 + 0.9 * torch.rand(b, T, H), 0.2 + torch.rand(b, T, H, L)]
    if plain:
        xs[5] = torch.ones(b, T, H, L)
    if norm:
        xs[0], xs[1] = _spread_rows(xs[0]), _spread_rows(xs[1])
    x64 = [x.double().requires_grad_() for x in xs]
    x32 = [x.float().requires_grad_() for x in xs]
    qk64 = [l2norm(x) if norm else x for x in x64[:2]]
    want = chunk_local_torch(*[_chunk_view(x, ch, H) for x in qk64 + x64[2:5]], _chunk_view(x64[5], ch, H)[..., :5])
    want = [w.reshape(b * H, -1, *w.shape[4:]) if w.dim() == 5 else w.reshape(b * H, ch.N) for w in want]
    got, fill = chunk_local_segments(*x32[:5], None if plain else x32[5], ch, dtype, norm)
    fill(0, ch.N)
    for name, a, e in zip(["o", "qt", "wt", "kt", "u", "decay"], got, want):
        assert_close(a.double(), e, rtol, name)
    cot = [torch.randn_like(w) for w in want]
    n = 5 if plain else 6
    g64 = torch.autograd.grad(sum((w * c).sum() for w, c in zip(want, cot)), x64[:n])
    g32 = torch.autograd.grad(sum((w * c.to(w.dtype)).sum() for w, c in zip(got, cot)), x32[:n])
    for name, a, e in zip(["q", "k", "v", "g", "beta", "lam"], g32, g64):
        assert_close(a.double(), e, rtol, f"d{name}")


def _scan_torch(qt, wt, kt, u, decay, lam, h0, merge):
    """Plain loop of the fused scan's recurrence (see gated_deltanet/scan.py)."""
    N, J = decay.shape[1], h0.shape[1]
    C = qt.shape[1] // N
    h, outs = list(h0.unbind(1)), []
    for i in range(N):
        rows = slice(i * C, (i + 1) * C)
        q, w, k, uu = qt[:, rows], wt[:, rows], kt[:, rows], u[:, rows]
        outs.append(sum(lam[:, rows, j, None] * (q @ h[j]) for j in range(J)))
        h = [decay[:, i, None, None] * hj - k.transpose(1, 2) @ (w @ hj) for hj in h]
        m = merge[i]
        if m >= 0:
            merged = sum(h[: m + 1]) + k.transpose(1, 2) @ uu
            h = [torch.zeros_like(merged)] * m + [merged] + h[m + 1 :]
    return torch.cat(outs, 1), torch.stack(h, 1)


class _Launches:
    """A kernel whose launches (grids) are recorded in ``seen``: kernel[grid](...) as the kernel's."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen, self.__name__ = kernel, seen, kernel.__name__

    def __getitem__(self, grid):
        self.seen.append(grid)
        return self.kernel[grid]


@pytest.mark.slow
@pytest.mark.parametrize("seeded, segment, K, one, dtype", [
    (True, 256, 20, False, torch.float32), (False, 256, 20, False, torch.float32),
    (True, 4, 136, False, torch.float32), (True, 2, 20, False, torch.float32),  # three segments: the ring wraps
    (True, 4, 20, True, torch.float32), (False, 4, 136, True, torch.float32),  # the plain schedule, two segments
    (False, 4, 20, True, torch.float16), (True, 4, 20, True, torch.float16),
    (True, 4, 20, False, torch.float16),  # 16-bit operands: without gradients the chain reads out itself
    (False, 4, 136, False, torch.float16),  # but not at keys wider than 128 (reads_apart)
])
def test_scan_kernel_and_its_backward(seeded, segment, K, one, dtype, monkeypatch):
    """Initial states in every level (all live at chunk 0), or none (only the levels the cascade filled);
    o = scale (o_intra + readouts) written for the real tokens of the op's layout, by the readout kernel from
    snapshots (gradients, and fp32 operands or keys wider than 128 without on the log-linear schedule: a ring of two
    segments' buffers) and by the chain itself (otherwise without gradients); the backward in one segment of chunks
    or more.
    K = 20: the chains' one [BK, BK] transition matrix per chunk and the grads kernel's Z = sum_j h_j dg_j^T;
    K = 136 (BK = 256): their two products per level and the grads kernel's four. one: the plain schedule, one
    level that every chunk cascades into (the chains' ONE build: the state in registers, two products per chunk),
    seeded or not, with fp32 or fp16 operands (dtype: qt, wt, kt, u)."""
    monkeypatch.setattr(scan_module, "SEGMENT", segment)
    monkeypatch.setattr(scan_module, "PLAIN_SEGMENT", segment)
    b, H, N, C, V, J = 1, 3, 6, 16, 40, 1 if one else 3  # V = 40: two V blocks of 32; three of 16 at K = 136
    BH, ch, scale = b * H, Chunking(b, N * C - 8, H, front=5, C=C), 0.7
    merge = [0] * N if one else [0, 2, 0, 1, 0, -1]  # chunks 2..7
    sched = scan_module.schedule(tuple(merge), J, (1 << J) - 1 if seeded else 0, torch.device("cpu"))
    assert sched.one == one
    # keys of norm ~1.3 at every K (at K = 136 with entries of 0.3 the gradients pass fp16's range)
    args = [0.3 * min(1.0, (20 / K) ** 0.5) * torch.randn(BH, N * C, K, dtype=torch.float64) for _ in range(3)]
    args += [torch.randn(BH, N * C, V, dtype=torch.float64), torch.rand(BH, N, dtype=torch.float64),
             torch.rand(BH, N * C, J, dtype=torch.float64), torch.randn(BH, J, K, V, dtype=torch.float64),
             torch.randn(BH, N * C, V, dtype=torch.float64)]
    if not seeded:
        args[6] = torch.zeros_like(args[6])
    args = [a.requires_grad_() for a in args]
    h0 = args[6].float() if seeded else None
    rtol = RTOL if dtype == torch.float32 else 2e-3  # fp16 operands: errors up to 7.2e-4 here
    stage = [a.to(dtype) for a in args[:4]] + [a.float() for a in args[4:6]]  # qt, wt, kt, u in the operand dtype
    o, hN = fenwick_delta_scan(*stage, h0, args[7].float(), merge, ch, scale, torch.float32)
    inter, rh = _scan_torch(*[a.to(dtype).double() for a in args[:4]], *args[4:7], merge)
    ro = (scale * (args[7] + inter)).view(b, H, N * C, V).transpose(1, 2)[:, ch.front : ch.front + ch.T]
    assert_close(o.double(), ro, rtol, "o")
    assert_close(hN.double(), rh, rtol, "hN")
    readouts = []
    monkeypatch.setattr(scan_module, "_scan_readout_kernel", _Launches(scan_module._scan_readout_kernel, readouts))
    with torch.no_grad():  # inputs that need no gradient (autograd's needs_input_grad ignores no_grad)
        free = [None if a is None else a.detach() for a in (*stage, h0, args[7].float())]
        o_chain, hN_chain = fenwick_delta_scan(*free, merge, ch, scale, torch.float32)
    assert len(readouts) == (-(-N // segment) if (dtype == torch.float32 or K > 128) and not one else 0)
    assert_close(o_chain.double(), ro, rtol, "o (no gradients)")
    assert_close(hN_chain.double(), rh, rtol, "hN (no gradients)")
    do, dh = torch.randn_like(ro), torch.randn_like(rh)
    inputs = args if seeded else args[:6] + args[7:]
    got = torch.autograd.grad((o * do.float()).sum() + (hN * dh.float()).sum(), inputs)
    want = torch.autograd.grad((ro * do).sum() + (rh * dh).sum(), inputs)
    names = ["qt", "wt", "kt", "u", "decay", "lam"] + ["h0"] * seeded + ["o_intra"]
    for name, a, e in zip(names, got, want):
        assert_close(a.double(), e, rtol, f"d{name}")


def test_public_op_reaches_the_kernels_when_selected(monkeypatch):
    """LOGLINEAR_BACKEND=triton runs the kernels (and matches the reference); =torch does not."""
    x = {n: t.float() for n, t in make_inputs(1, 20, 1, 2, K=8, V=4).items()}
    calls = []
    scan = gdn.fenwick_delta_scan
    monkeypatch.setattr(gdn, "fenwick_delta_scan", lambda *a, **kw: calls.append(1) or scan(*a, **kw))
    o, _ = log_linear_gated_deltanet(**x, chunk_size=16)
    assert calls == [1]
    assert_close(o.double(), _reference({n: t.double() for n, t in x.items()})[0], RTOL, "o")
    monkeypatch.setenv("LOGLINEAR_BACKEND", "torch")
    log_linear_gated_deltanet(**x, chunk_size=16)
    assert calls == [1]


def test_paper_head_dims_over_many_chunks(monkeypatch):
    """K = 128, V = 64 (the paper's head dims), 600 tokens = 19 kernel chunks (the last partial) and 5 chunk
    levels, q/k L2-normalised in the op: outputs, state and all gradients against the float64 torch chunk path
    (itself exact against the references)."""
    T, L = 600, 11
    x = {"q": torch.randn(1, T, 1, 128), "k": torch.randn(1, T, 1, 128), "v": torch.randn(1, T, 1, 64),
         "g": -(0.01 + 0.1 * torch.rand(1, T, 1)), "beta": 0.05 + 0.9 * torch.rand(1, T, 1),
         "level_scales": 0.2 + torch.rand(1, T, 1, L)}
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, st = log_linear_gated_deltanet(**leaves, output_final_state=True, use_qk_l2norm=True)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    monkeypatch.setenv("LOGLINEAR_BACKEND", "torch")
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    ro, rst = log_linear_gated_deltanet(**ref, output_final_state=True, use_qk_l2norm=True)
    (ro * do.double()).sum().backward()
    assert_close(o.double(), ro, RTOL, "o")
    assert_close(st.levels.double(), rst.levels, RTOL, "state")
    for n in x:
        assert_close(leaves[n].grad.double(), ref[n].grad, 10 * RTOL, f"d{n}")


@pytest.mark.parametrize("varlen", [False, True])
def test_no_final_state_skips_its_path(varlen, monkeypatch):
    """output_final_state=False (the training default) never builds the final state (the torch forms of the
    last chunk), plain call or varlen with states (run_segments); o and every gradient equal the call with
    True."""
    x = {n: t.float() for n, t in make_inputs(1, 45, 1, 2, K=8, V=4).items()}
    cu = torch.tensor([0, 13, 45]) if varlen else None
    state = _state(2, 8, 2, 8, 4, [3, 40], torch.float32) if varlen else None
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}

    def run(final):
        return gdn.backend(_checked(leaves, state, cu), final, 16, True)

    o_full, _ = run(True)
    want = torch.autograd.grad(o_full.sum(), list(leaves.values()))

    def refuse(*args):
        raise AssertionError("the final state was computed")

    monkeypatch.setattr(gdn, "final_levels", refuse)
    o, st = run(False)
    assert st is None
    assert torch.equal(o, o_full)
    for name, a, e in zip(NAMES, torch.autograd.grad(o.sum(), list(leaves.values())), want):
        assert torch.equal(a, e), name


def test_schedule_is_cached_per_shape(monkeypatch):
    """Repeated calls at one shape reuse the scan's schedule (the same device tensors: no host-to-device copy
    after the first call; the merge targets are built once too); another T gets its own, and both stay right."""
    seen = []
    apply = scan_module.FenwickDeltaScan.apply
    monkeypatch.setattr(scan_module.FenwickDeltaScan, "apply", lambda *a: seen.append(a[10]) or apply(*a))
    built = []  # per call: how often it built a tensor from Python values
    tensor = torch.tensor
    for T in (50, 50, 83, 50):
        x = make_inputs(1, T, 1, 2, K=8, V=4)
        built.append(0)
        monkeypatch.setattr(torch, "tensor", lambda *a, **k: built.__setitem__(-1, built[-1] + 1) or tensor(*a, **k))
        o, _ = log_linear_gated_deltanet(**{n: t.float() for n, t in x.items()}, chunk_size=16)
        monkeypatch.setattr(torch, "tensor", tensor)
        assert_close(o.double(), _reference(x)[0], RTOL, f"o (T = {T})")
    assert seen[0] is seen[1] is seen[3] and seen[2] is not seen[0]
    assert seen[0].lev is seen[1].lev and seen[0].merge is seen[3].merge
    assert seen[2].bits != seen[0].bits
    assert built[1] == built[3] == 0, built  # repeated shapes: no tensor built from host values


@pytest.mark.parametrize("layout", ["packed", "rows at two positions"])
def test_segments_run_on_the_op_tensors(monkeypatch, layout):
    """Packed sequences and rows at different positions reach the kernels as the op's tensors (their dtype, q / k
    per group, q / k normalised by the kernels), one launch set per segment, and match the reference."""
    seen = []
    core = gdn.gated_deltanet_core
    monkeypatch.setattr(gdn, "gated_deltanet_core", lambda q, k, *a, **kw: seen.append((q.dtype, k.shape[2])) or
                        core(q, k, *a, **kw))
    B, cu_seqlens, state = (1, torch.tensor([0, 20, 29, 70]), None) if layout == "packed" else (2, None, None)
    x = make_inputs(B, 70, 1, 2, K=8, V=4)
    if layout != "packed":
        state = FenwickState(torch.randn(2, 7, 2, 8, 4, dtype=torch.float64), torch.tensor([37, 64]))
    _compare(x, state, cu_seqlens, l2norm=True)
    assert seen and all(s == (torch.float32, 1) for s in seen), seen  # never expanded to the 2 value heads


def _core_calls(monkeypatch) -> list[int]:
    """The rows of every gated_deltanet_core call from here on."""
    calls = []
    core = gdn.gated_deltanet_core
    monkeypatch.setattr(gdn, "gated_deltanet_core", lambda q, *a, **kw: calls.append(q.shape[0]) or core(q, *a, **kw))
    return calls


def test_packed_sequences_run_as_padded_rows(monkeypatch):
    """Packed sequences of similar lengths (30, 25 and 40 tokens: 120 row slots for 95 tokens) run as the rows of one
    core call, each padded at its end: a log-linear call without states and without a final state (o and every
    gradient), and a plain one with states at three positions and its final state; lengths 10 and 40 (80 slots for
    50 tokens) run a core call each."""
    calls = _core_calls(monkeypatch)
    cu = torch.tensor([0, 30, 55, 95])
    x = make_inputs(1, 95, 1, 2, 16, 8)
    ours = {n: t.float().requires_grad_() for n, t in x.items()}
    ref = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, state = log_linear_gated_deltanet(**ours, cu_seqlens=cu, chunk_size=16, use_qk_l2norm=True)
    o_ref, _ = R.log_linear_gated_deltanet_recurrent(**ref, cu_seqlens=cu, use_qk_l2norm=True)
    assert state is None and calls == [3], calls
    assert_close(o.double(), o_ref, RTOL, "o")
    d_o = torch.randn_like(o_ref)
    for name, a, e in zip(NAMES, torch.autograd.grad((o.double() * d_o).sum(), list(ours.values())),
                          torch.autograd.grad((o_ref * d_o).sum(), list(ref.values()))):
        assert_close(a.double(), e, 10 * RTOL, f"d{name}")
    calls.clear()
    _compare_plain(x, _state(3, 1, 2, 16, 8, [17, 0, 48], torch.float64), cu)
    assert calls == [3], calls
    calls.clear()
    _compare_plain(make_inputs(1, 50, 1, 2, 16, 8), None, torch.tensor([0, 10, 50]))
    assert calls == [1, 1], calls


def test_packed_sequences_of_one_length_are_a_batch(monkeypatch):
    """Packed sequences of one length from states at one position (inside a chunk here) run as the rows of one core
    call, the final state too; at two positions, a core call each. Outputs, final states and every gradient against
    the reference."""
    calls = _core_calls(monkeypatch)
    cu = torch.tensor([0, 30, 60, 90])
    x = make_inputs(1, 90, 1, 2, 16, 8, start=37)
    _compare(x, _state(3, 8, 2, 16, 8, [37, 37, 37], torch.float64), cu)
    assert calls == [3], calls
    calls.clear()
    _compare(x, _state(3, 8, 2, 16, 8, [37, 5, 37], torch.float64), cu)
    assert calls == [1, 1, 1], calls
