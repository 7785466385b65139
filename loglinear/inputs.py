"""Validation of the public ops' arguments and the per-sequence bookkeeping every backend shares.

Every bad input gets a ValueError or TypeError naming the argument, its shape/dtype and what was
expected, before any kernel runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

from loglinear.fenwick import levels_needed
from loglinear.state import FenwickState
from loglinear.tables import device_table

if TYPE_CHECKING:
    from loglinear.variants import Variant

__all__ = [
    "OpInputs", "check_inputs", "check_decode_inputs", "check_cu_seqlens", "check_positive_ints", "check_power_of_two",
    "check_multiple", "check_value_head_dim", "check_expanded_head_dim", "Segment", "segments", "run_segments",
    "l2norm", "expand_groups", "plain_over_levels", "needs_grad", "IGNORE_INDEX",
]

IGNORE_INDEX = -100  # a label / target that is not predicted (torch's cross_entropy default)


@dataclass
class OpInputs:
    """Validated arguments.  q, k: [B, T, G, K]; v: [B, T, H, V]; gates: the variant's per-token inputs
    {name: [B, T, H]}, a per-channel gate [B, T, H, K] (Mamba-2: g; Gated DeltaNet: g, beta; GLA: g [B, T, H, K]);
    level_scales: [B, T, H, L], or None: a plain call (lambda = 1, the state one level)."""

    variant: Variant
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gates: dict[str, torch.Tensor]
    level_scales: torch.Tensor | None
    scale: float
    initial_state: FenwickState | None
    cu_seqlens: torch.Tensor | None
    bounds: list[int] | None  # cu_seqlens on the host
    # where a backend that takes the log-decay gates raw reports the peak of a per-channel one (its largest entry,
    # a scalar on its device; loglinear.ops.finite.FiniteCheck.report), or None: nobody asks
    report_finite: Callable[[torch.Tensor], None] | None = None

    @property
    def num_heads(self) -> int:
        return self.v.shape[2]

    @property
    def plain(self) -> bool:
        """Plain linear attention of the variant (level_scales None: lambda = 1, a one-level state)."""
        return self.level_scales is None

    def over_levels(self) -> "OpInputs":
        """A plain call as its log-linear equal: level_scales = 1 over the levels its positions need, the
        one-level initial state as level 0 (with lambda = 1 every live level is read and merged alike).
        Its final state, ``summed()``, is the plain call's."""
        bounds = self.bounds if self.bounds is not None else [0, self.q.shape[1]]
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        start = self.initial_state.max_position if self.initial_state is not None else 0
        ones = torch.ones((), dtype=self.v.dtype, device=self.v.device)
        return replace(self, level_scales=ones.expand(*self.v.shape[:3], levels_needed(start + max(lengths))))


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Does a gradient flow here: grad mode on and one of the tensors (None skipped) requiring it."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def plain_over_levels(run: Callable[..., tuple[torch.Tensor, FenwickState | None]]):
    """run(inputs, output_final_state, ...) -> (o, state) of log-linear calls, as a run of plain calls: each runs
    as its log-linear equal (OpInputs.over_levels) and its final levels are summed to the plain state."""

    def plain_run(inp: OpInputs, output_final_state: bool, *args, **kwargs):
        o, state = run(inp.over_levels(), output_final_state, *args, **kwargs)
        return o, (state.summed() if state is not None else None)

    return plain_run


def _shape(x: torch.Tensor) -> str:
    return f"shape {tuple(x.shape)}, dtype {x.dtype}"


def _check_tensor(name: str, x: object, rank: int, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor {layout}, got {_shape(x)}")
    if x.dim() != rank:
        raise ValueError(f"{name} must be {layout} ({rank} dims), got {_shape(x)}")
    return x


def check_positive_ints(**sizes: object) -> None:
    """Raise a ValueError naming the first size that is not a positive int (the layers' and configs' sizes)."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_nonnegative_ints(**counts: object) -> None:
    """Raise a ValueError naming the first count that is not an int >= 0 (step counts where 0 means "off")."""
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def check_bools(**flags: object) -> None:
    """Raise a TypeError naming the first flag that is not a bool (a string such as "false" would count as true)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_in_range(name: str, value: object, low: float, high: float, *, low_closed: bool) -> None:
    """Raise a ValueError naming ``name`` unless value is a finite number in [low, high] (low_closed) or
    (low, high] (hyper-parameters: learning rates, fractions, decays)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (low <= value <= high) or (value == low and not low_closed):
        raise ValueError(f"{name} must be a finite number in {'[' if low_closed else '('}{low}, {high}], "
                         f"got {value!r}")


def check_device(name: str, device: object) -> torch.device:
    """``device`` as a torch.device, or a ValueError naming ``name``: not a device string, or a CUDA device this
    machine does not have (no CUDA, or an index past its GPUs)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} must be a torch device such as cpu or cuda:0, got {device!r}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index is not None and dev.index >= count):
            raise ValueError(f"{name} is {device!r}, but this machine has {count} CUDA device(s)")
    return dev


def check_power_of_two(**sizes: int) -> None:
    """Raise a ValueError naming the first positive int size that is not a power of two (chunk sizes)."""
    for name, value in sizes.items():
        if value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")


def check_multiple(name: str, value: int, of_name: str, of: int) -> None:
    """Raise a ValueError unless value (e.g. num_heads) is a multiple of ``of`` (e.g. n_groups)."""
    if value % of:
        raise ValueError(f"{name} = {value} must be a multiple of {of_name} = {of}")


def check_value_head_dim(head_dim: int, expand_v: object) -> int:
    """The Gated DeltaNet value head dim int(head_dim * expand_v), which must be >= 1 (ValueError otherwise)."""
    if not isinstance(expand_v, (int, float)) or int(head_dim * expand_v) < 1:
        raise ValueError(f"expand_v must give a value head dim int(head_dim * expand_v) >= 1, got expand_v = "
                         f"{expand_v!r} with head_dim = {head_dim}")
    return int(head_dim * expand_v)


def check_expanded_head_dim(name: str, expand: object, hidden_size: int, num_heads: int) -> int:
    """The GLA head dim int(hidden_size * expand) / num_heads of a width ``expand`` x hidden_size split over the
    heads: int(hidden_size * expand) must be a positive multiple of num_heads (ValueError naming ``name``)."""
    width = int(hidden_size * expand) if isinstance(expand, (int, float)) and not isinstance(expand, bool) else 0
    if width < 1 or width % num_heads:
        raise ValueError(f"{name} must give a width int(hidden_size * {name}) that is a positive multiple of "
                         f"num_heads = {num_heads}, got {name} = {expand!r} with hidden_size = {hidden_size}")
    return width // num_heads


def _check_groups(H: int, G: int, v: torch.Tensor) -> None:
    if H % G:
        raise ValueError(f"the value heads H = {H} (v {tuple(v.shape)}) must be a multiple of the q/k groups G = {G}")


def check_cu_seqlens(cu_seqlens: object, batch: int, T: int, device: torch.device | None = None) -> list[int]:
    """cu_seqlens [N+1] (int32/int64, 0 = c_0 < ... < c_N = T, batch 1; on ``device`` or the CPU) -> its values."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        what = _shape(cu_seqlens) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise TypeError(f"cu_seqlens must be an int32/int64 tensor [N+1], got {what}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1] with N >= 1, got {_shape(cu_seqlens)}")
    if device is not None and cu_seqlens.device not in (device, torch.device("cpu")):
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}; it must be on the inputs' device {device} or the CPU")
    if batch != 1:
        raise ValueError(f"cu_seqlens packs sequences along T and needs batch size 1, got B = {batch}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != T or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must increase strictly from 0 to T = {T}, got {bounds}")
    return bounds


def _check_state(state: object, n_seq: int, H: int, K: int, V: int, device: torch.device) -> FenwickState:
    if not isinstance(state, FenwickState):
        raise TypeError(f"initial_state must be a FenwickState, got {type(state).__name__}")
    N, _, Hs, Ks, Vs = state.levels.shape
    if (N, Hs, Ks, Vs) != (n_seq, H, K, V):
        raise ValueError(
            f"initial_state.levels must be [N, L, H, K, V] = [{n_seq}, L, {H}, {K}, {V}] "
            f"(N = number of sequences), got {tuple(state.levels.shape)}"
        )
    if tuple(state.positions.shape) != (N,):
        raise ValueError(f"initial_state.positions must be [N] = [{N}], got shape {tuple(state.positions.shape)}")
    if state.levels.device != device:
        raise ValueError(f"initial_state is on {state.levels.device}, the inputs on {device}")
    return state


def _check_gate_names(variant: Variant, gates: object) -> None:
    if not isinstance(gates, dict) or set(gates) != set(variant.gate_names):
        got = sorted(gates) if isinstance(gates, dict) else type(gates).__name__
        wanted = ", ".join(f"{gate.name} {gate.layout()} ({gate.doc})" for gate in variant.gates)
        raise ValueError(f"gates must be a dict holding exactly {variant.name}'s per-token inputs {wanted}, got {got}")


def check_inputs(
    variant: Variant, q: object, k: object, v: object, gates: dict[str, object], level_scales: object,
    scale: float | None, initial_state: object, cu_seqlens: object,
) -> OpInputs:
    """Validate the op's arguments; raise ValueError/TypeError naming the offending one.  gates: the variant's
    per-token inputs by name (every one of variant.gates, each [B, T, H], or [B, T, H, K] if per_channel);
    level_scales None: a plain call, whose initial state must have one level."""
    q = _check_tensor("q", q, 4, "[B, T, G, K]")
    k = _check_tensor("k", k, 4, "[B, T, G, K]")
    v = _check_tensor("v", v, 4, "[B, T, H, V]")
    _check_gate_names(variant, gates)
    gates = {gate.name: _check_tensor(gate.name, gates[gate.name], 3 + gate.per_channel, gate.layout())
             for gate in variant.gates}
    if level_scales is not None:
        level_scales = _check_tensor("level_scales", level_scales, 4, "[B, T, H, L]")
    B, T, G, K = q.shape
    H = v.shape[2]
    if T < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got {_shape(q)}")
    if min(B, G, K) < 1:
        raise ValueError(f"q must be [B, T, G, K] with B, G, K >= 1, got {_shape(q)}")
    if H < 1:
        raise ValueError(f"v must be [B, T, H, V] with H >= 1, got {_shape(v)}")
    if k.shape != q.shape:
        raise ValueError(f"k must match q's shape {tuple(q.shape)} [B, T, G, K], got {_shape(k)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, H, V] with B, T = {B}, {T} as in q, got {_shape(v)}")
    _check_groups(H, G, v)
    for gate in variant.gates:
        x = gates[gate.name]
        if gate.per_channel and x.shape != (B, T, H, K):
            raise ValueError(f"{gate.name} must be [B, T, H, K] with B, T, H, K = {B}, {T}, {H}, {K}, "
                             f"got {_shape(x)}")
        if x.shape[:3] != (B, T, H):
            raise ValueError(f"{gate.name} must be [B, T, H] with B, T, H = {B}, {T}, {H}, got {_shape(x)}")
    if level_scales is not None and level_scales.shape[:3] != (B, T, H):
        raise ValueError(f"level_scales must be [B, T, H, L] with B, T, H = {B}, {T}, {H}, got {_shape(level_scales)}")
    named = gates | ({"level_scales": level_scales} if level_scales is not None else {})
    for name, x in ({"k": k, "v": v} | named).items():
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must share a device")
    if scale is None:
        scale = K ** -0.5
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    bounds = check_cu_seqlens(cu_seqlens, B, T, q.device) if cu_seqlens is not None else None
    n_seq = len(bounds) - 1 if bounds is not None else B
    state = None
    if initial_state is not None:
        state = _check_state(initial_state, n_seq, H, K, v.shape[3], q.device)
    if level_scales is None:
        if state is not None and state.num_levels != 1:
            raise ValueError(f"a plain call (level_scales=None) continues a one-level state, got initial_state "
                             f"with L = {state.num_levels} levels (a log-linear state: pass its level_scales)")
        return OpInputs(variant, q, k, v, gates, None, float(scale), state, cu_seqlens, bounds)
    lengths = [b - a for a, b in zip(bounds, bounds[1:])] if bounds is not None else [T] * B
    starts = state.positions.tolist() if state is not None else [0] * n_seq
    needed = max(levels_needed(p + n) for p, n in zip(starts, lengths))
    if state is not None:
        needed = max(needed, state.num_levels)
    if level_scales.shape[3] < needed:
        raise ValueError(
            f"level_scales has L = {level_scales.shape[3]} levels ({_shape(level_scales)}), but positions up to "
            f"{max(p + n for p, n in zip(starts, lengths))} need L >= {needed}"
        )
    return OpInputs(variant, q, k, v, gates, level_scales, float(scale), state, cu_seqlens, bounds)


def _check_same(name: str, x: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must be {layout} = {list(shape)}, got {_shape(x)}")


def check_decode_inputs(
    variant: Variant, q: object, k: object, v: object, gates: dict[str, object], level_scales: object,
    levels: object, positions: object, *, fenwick: bool,
) -> None:
    """Validate the one-token step's arguments (see loglinear.ops.decode.decode_step)."""
    q = _check_tensor("q", q, 3, "[N, G, K]")
    v = _check_tensor("v", v, 3, "[N, H, V]")
    levels = _check_tensor("levels", levels, 5, "[N, L, H, K, V]")
    (N, G, K), H, L = q.shape, v.shape[1], levels.shape[1]
    _check_groups(H, G, v)
    _check_same("k", _check_tensor("k", k, 3, "[N, G, K]"), (N, G, K), "[N, G, K]")
    _check_same("v", v, (N, H, v.shape[2]), "[N, H, V]")
    named = {"q": q, "k": k, "v": v}
    for gate in variant.gates:
        layout = gate.layout(decode=True)
        named[gate.name] = _check_tensor(gate.name, gates[gate.name], 2 + gate.per_channel, layout)
        _check_same(gate.name, named[gate.name], (N, H, K) if gate.per_channel else (N, H), layout)
    _check_same("levels", levels, (N, L, H, K, v.shape[2]), "[N, L, H, K, V]")
    if fenwick:
        lam = _check_tensor("level_scales", level_scales, 3, "[N, H, >= L]")
        if lam.shape[:2] != (N, H) or lam.shape[2] < L:
            raise ValueError(f"level_scales must be [N, H, >= L] = [{N}, {H}, >= {L}], got {_shape(lam)}")
        named["level_scales"] = lam
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        what = _shape(positions) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise TypeError(f"positions must be an int32/int64 tensor [N], got {what}")
    if tuple(positions.shape) != (N,):
        raise ValueError(f"positions must be [N] = [{N}], got {_shape(positions)}")
    if fenwick and positions.device.type == "cpu" and N:  # positions on the GPU are not read (no sync)
        needed = levels_needed(int(positions.max()) + 1)
        if L < needed:
            raise ValueError(
                f"levels has L = {L} levels ({_shape(levels)}), but a token at position {int(positions.max())} "
                f"needs L >= {needed} (pad with FenwickState.with_levels)"
            )
    for name, x in named.items():
        if x.device != levels.device:
            raise ValueError(f"{name} is on {x.device} but levels is on {levels.device}; "
                             "all inputs must share a device")


def expand_groups(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, T, G, D] -> [B, T, H, D]: value head h reads q/k group h // (H // G)."""
    groups = x.shape[2]
    return x if groups == num_heads else x.repeat_interleave(num_heads // groups, dim=2)


L2NORM_EPS = 1e-6  # of the in-op q/k normalisation, in torch and in the Triton kernels alike


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the in-op q/k normalisation of Gated DeltaNet)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2norm_backward(x: torch.Tensor, dxn: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """Gradient w.r.t. x [..., K] of x_n = l2norm(x), given dxn = dL/dx_n [..., K]: r (dxn - x_n <x_n, dxn>),
    r = rsqrt(sum x^2 + eps).  fp32, shape of x."""
    x, dxn = x.float(), dxn.float()
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    xn = x * r
    return r * (dxn - xn * (xn * dxn).sum(-1, keepdim=True))


@dataclass
class Segment:
    """Rows of the batch (or one packed sequence) that start at the same absolute position."""

    rows: list[int]  # batch rows (varlen: [0])
    t0: int  # time range [t0, t1)
    t1: int
    state_rows: list[int]  # rows of the state (sequence indices)
    position: int


def segments(inp: OpInputs) -> list[Segment]:
    """Split the call into groups that share a start position: one per packed sequence, or per distinct
    state position over the batch."""
    if inp.bounds is not None:
        pos = inp.initial_state.positions.tolist() if inp.initial_state is not None else [0] * (len(inp.bounds) - 1)
        return [Segment([0], a, b, [i], pos[i]) for i, (a, b) in enumerate(zip(inp.bounds, inp.bounds[1:]))]
    B, T = inp.q.shape[:2]
    pos = inp.initial_state.positions.tolist() if inp.initial_state is not None else [0] * B
    groups: dict[int, list[int]] = {}
    for row, p in enumerate(pos):
        groups.setdefault(p, []).append(row)
    return [Segment(rows, 0, T, rows, p) for p, rows in groups.items()]


Core = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def split_rows(x: torch.Tensor, groups: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """x [R, *] -> (x[groups[0]], x[groups[1]], ...) by one gather (none if the groups list the rows in order) and
    one split: one autograd node for all groups, where a gather per group would each write a gradient of x's whole
    size."""
    order = [row for group in groups for row in group]
    if order != list(range(x.shape[0])):
        x = x.index_select(0, device_table(order, torch.int64, x.device))
    return x.split([len(group) for group in groups], dim=0)


def run_segments(
    inp: OpInputs, core: Core, output_final_state: bool, *, l2norm_qk: bool = False, as_given: bool = False,
) -> tuple[torch.Tensor, FenwickState | None]:
    """Run ``core`` on every segment, in the compute dtype (fp32, or float64 for float64 inputs) with q/k expanded
    to the value heads, or on the op's tensors as they are (as_given).

    core(q, k, v, gates, level_scales, scale, levels, position) -> (o, levels_out), with
    q, k: [b, t, H, K]; v: [b, t, H, V]; gates: {name: [b, t, H] or [b, t, H, K]}; level_scales: [b, t, H, L]
    (None: a plain call); levels: [b, Ls, H, K, V] or None; position: int shared by the rows.
    as_given: the core takes the op's tensors as they are (their dtypes, q / k per group [b, t, G, K]) and the
    incoming levels in fp32, and normalises q and k itself: core(..., qk_l2norm=l2norm_qk).
    """
    extra = {}
    if as_given:
        q, k, v, lam, gates, dtype = inp.q, inp.k, inp.v, inp.level_scales, inp.gates, torch.float32
        extra = {"qk_l2norm": l2norm_qk}
    else:
        dtype = torch.float64 if inp.v.dtype == torch.float64 or inp.q.dtype == torch.float64 else torch.float32
        q, k = inp.q.to(dtype), inp.k.to(dtype)
        if l2norm_qk:
            q, k = l2norm(q), l2norm(k)
        q, k = expand_groups(q, inp.num_heads), expand_groups(k, inp.num_heads)
        v, lam = inp.v.to(dtype), (inp.level_scales.to(dtype) if inp.level_scales is not None else None)
        gates = {name: x.to(dtype) for name, x in inp.gates.items()}
    segs = segments(inp)
    if inp.bounds is not None:
        cut = lambda x: x.split([seg.t1 - seg.t0 for seg in segs], dim=1)  # noqa: E731
    else:
        cut = lambda x: split_rows(x, [seg.rows for seg in segs])  # noqa: E731
    parts = {"q": cut(q), "k": cut(k), "v": cut(v), "lam": cut(lam) if lam is not None else [None] * len(segs)}
    gate_parts = {name: cut(x) for name, x in gates.items()}
    states = [None] * len(segs)
    if inp.initial_state is not None:
        states = split_rows(inp.initial_state.levels.to(dtype), [seg.state_rows for seg in segs])
    outs, finals, order, positions = [], [], [], []
    for i, seg in enumerate(segs):
        o, lv = core(parts["q"][i], parts["k"][i], parts["v"][i], {name: x[i] for name, x in gate_parts.items()},
                     parts["lam"][i], inp.scale, states[i], seg.position, **extra)
        outs.append(o)
        finals.append(lv)
        order.extend(seg.state_rows)
        positions.extend([seg.position + seg.t1 - seg.t0] * len(seg.rows))
    inverse = None if order == list(range(len(order))) else torch.argsort(torch.tensor(order))
    reorder = lambda x: x if inverse is None else x.index_select(0, inverse.to(x.device))  # noqa: E731
    join = lambda xs, dim: xs[0] if len(xs) == 1 else torch.cat(xs, dim)  # noqa: E731
    o = join(outs, 1) if inp.bounds is not None else reorder(join(outs, 0))
    o = o.to(inp.v.dtype).contiguous()  # (a core may return a view; the op's output is contiguous)
    if not output_final_state:
        return o, None
    n_levels = max(f.shape[1] for f in finals)
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 0, 0, n_levels - x.shape[1]))  # noqa: E731
    levels = reorder(join([pad(f) for f in finals], 0)).contiguous()
    pos = torch.tensor(positions) if inverse is None else torch.tensor(positions)[inverse]
    return o, FenwickState(levels, pos)
