"""Non-finite inputs stay where they are: never in earlier positions, other sequences or their gradients.

A chunked op mixes the tokens of a chunk in masked matrix products, and a masked-out weight times a NaN or an
infinity is NaN: left alone, one bad value at token t spoils every output of its chunk, also those before t. And a
log-decay of -inf (a hard reset) or -1e30 turns the in-chunk differences of prefix sums G_t - G_s into NaN or
garbage. The public op (loglinear.ops.api.attention) therefore

  1. floors every log-decay gate (Gate.log_decay) at LOG_DECAY_FLOOR of its compute dtype, where exp underflows
     to exactly 0: g = -inf is a hard reset and very negative gates give the exact result. floor_log_decays does
     it in torch before the backend runs, unless the backend takes the gates raw and floors them itself where it
     reads them (Backend.takes_raw_log_decays: every Triton backend), with the same values and gradient (_Floor);
  2. checks that the inputs are finite (FiniteCheck): one read of them, queued before the op's kernels (a
     log-decay gate may hold -inf: it is checked unfloored, by its maximum), except a per-channel log-decay gate
     of a backend that takes it raw, which checks it where it reads it and reports its peak; on CUDA the answer
     comes back through an event recorded behind the last read, so the host waits for the work queued before it,
     not for the op. Skipped while a CUDA graph is captured or torch.compile traces the op (the mixers' custom op
     runs it eagerly, so they are covered);
  3. only if they are not, runs the call again with every non-finite token zeroed, and puts its effect back as NaN:
        a token whose k, v or gate (per variant: the inputs that change the state) has a NaN or an infinity
          -> every output of that head from the token on (to the end of its sequence) and the head's final
             state are NaN;
        a token whose q or level_scales row has one -> that token's output of that head is NaN.

Outputs before a bad token, and of other sequences, are then exactly those of the same call without it, and so are
their gradients (zeroed inputs and NaN outputs pass no gradient).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import torch

from loglinear.inputs import OpInputs, expand_groups, needs_grad
from loglinear.state import FenwickState

__all__ = ["LOG_DECAY_FLOOR", "FiniteCheck", "floor_log_decay", "floor_log_decays", "finite_check", "contained",
           "log_decay_peak", "host_later"]

# exp(floor) is exactly 0 in the dtype the op computes in (float64 for float64 inputs, else float32)
LOG_DECAY_FLOOR = {torch.float64: -750.0, torch.float32: -110.0}

Run = Callable[[OpInputs], tuple[torch.Tensor, FenwickState | None]]


class _Floor(torch.autograd.Function):
    """max(g, floor) in one pass each way (NaN stays NaN): clamp_min forward; backward the gradient where
    g > floor and 0 elsewhere (threshold_backward, ReLU's fused kernel; a NaN entry passes it)."""

    @staticmethod
    def forward(g: torch.Tensor, floor: float) -> torch.Tensor:
        return g.clamp_min(floor)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.floor = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (g,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad, g, ctx.floor), None


def floor_log_decay(g: torch.Tensor) -> torch.Tensor:
    """max(g, floor) of one log-decay gate g (any shape; the floor of its compute dtype; NaN stays NaN, the
    gradient is 0 where g <= floor)."""
    floor = LOG_DECAY_FLOOR[torch.float64 if g.dtype == torch.float64 else torch.float32]
    if needs_grad(g):
        return _Floor.apply(g, floor)
    return _Floor.forward(g, floor)  # no gradient: no autograd node (its bookkeeping is a decoding step's host time)


def floor_log_decays(inp: OpInputs) -> OpInputs:
    """inp with every log-decay gate g: [B, T, H] (per channel: [B, T, H, K]) replaced by floor_log_decay(g)."""
    gates = dict(inp.gates)
    for gate in inp.variant.gates:
        if gate.log_decay:
            gates[gate.name] = floor_log_decay(gates[gate.name])
    return replace(inp, gates=gates)


class FiniteCheck:
    """Whether every input of one op call is finite, read once (finite_check starts it); calling it answers.

    The check queues one peak per input when it starts: max |x| of q, k, v, level_scales and the gates that are not
    log-decays, and max g of a log-decay gate (NaN or +inf fail; -inf, a hard reset, passes). A backend that takes
    the log-decay gates raw (Backend.takes_raw_log_decays) checks the per-channel ones where it reads them and passes
    their peak to ``report`` (OpInputs.report_finite); if none came, the answer reads them itself. The peaks reach
    the host in one copy; on CUDA behind an event recorded after the last of them, so the answer waits for that read
    and the work queued before it, not for the op's kernels queued after it."""

    def __init__(self, inp: OpInputs, raw_log_decays: bool) -> None:
        decays = [gate for gate in inp.variant.gates if gate.log_decay]
        reported = {gate.name for gate in decays if raw_log_decays and gate.per_channel}
        self._reported = [inp.gates[name] for name in reported]
        read = [inp.gates[gate.name] for gate in decays if gate.name not in reported]
        others = [inp.gates[gate.name] for gate in inp.variant.gates if not gate.log_decay]
        tensors = [x for x in (inp.q, inp.k, inp.v, inp.level_scales, *others) if x is not None]
        wide = torch.float64 if any(x.dtype == torch.float64 for x in tensors) else torch.float32
        peaks = [*torch._foreach_norm(tensors, float("inf"), dtype=wide),  # max |x|: NaN or inf if any entry is
                 *(torch._foreach_max(read) if read else ())]  # max g: the same, and -inf when every g is
        self._peaks = torch.stack(peaks)
        self._answer: Callable[[], bool] | None = None
        if not self._reported:
            self._post()

    def report(self, peak: torch.Tensor) -> None:
        """Add the peak of the per-channel log-decay gates: a scalar on the inputs' device, their largest entry
        (NaN if any is NaN; queued behind the read it comes from)."""
        self._peaks = torch.cat([self._peaks, peak.reshape(1).to(self._peaks.dtype)])
        self._post()

    def __call__(self) -> bool:
        if self._answer is None:  # no peak of the reported gates came: read them here
            self.report(log_decay_peak(self._reported))
        return self._answer()

    def _post(self) -> None:
        """Send the peaks so far to the host (on CUDA behind an event, without waiting)."""
        peaks = host_later(self._peaks)
        self._answer = lambda: all(x < math.inf for x in peaks())  # NaN compares False


def host_later(x: torch.Tensor) -> Callable[[], list]:
    """Start copying x (a few values) to the host without waiting; the function returned gives x.tolist() once
    it has arrived. On CUDA the copy goes to pinned memory behind an event, so waiting for it waits for the work
    queued before it, not for what is queued after."""
    if not x.is_cuda:
        return x.tolist
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    arrived = torch.cuda.Event()
    arrived.record()

    def values() -> list:
        arrived.synchronize()
        return host.tolist()

    return values


def log_decay_peak(xs: list[torch.Tensor]) -> torch.Tensor:
    """The largest entry of the log-decay tensors xs (non-empty), a scalar on their device: NaN if one is NaN, +inf
    if one is +inf, -inf (a hard reset everywhere, which passes) if all are."""
    return torch.stack(torch._foreach_max(xs)).amax()


def finite_check(inp: OpInputs, raw_log_decays: bool = False) -> FiniteCheck | None:
    """Start checking that every input of the call is finite (FiniteCheck; raw_log_decays: the backend takes the
    log-decay gates raw and reports the peak of the per-channel ones to the check's ``report``); calling the check
    answers. None while a CUDA graph is captured or torch.compile traces: no check there (no host sync)."""
    if torch.compiler.is_compiling() or (inp.q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return FiniteCheck(inp, raw_log_decays)


def _bad_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [B, T, X, D] -> [B, T, X] bool: the row holds a NaN or an infinity."""
    return ~torch.isfinite(x).all(-1)


def _bad_gate(g: torch.Tensor, log_decay: bool) -> torch.Tensor:
    """g: [B, T, H] (or per channel [B, T, H, K]) -> bool of g's shape: NaN or an infinity (-inf is a valid
    log-decay)."""
    return torch.isnan(g) | (g == torch.inf) if log_decay else ~torch.isfinite(g)


def _from_token_on(bad: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
    """bad: [B, T, H] -> [B, T, H]: some token at or before t of the same sequence is bad (cu_seqlens bounds: the
    packed sequences of row 0)."""
    seen = bad.to(torch.int32).cumsum(1)
    if bounds is not None:
        starts = torch.tensor(bounds[:-1], device=bad.device)
        lengths = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], device=bad.device)
        before = torch.cat([seen.new_zeros(1, 1, seen.shape[2]), seen[:, :-1]], dim=1)  # seen at t - 1
        seen = seen - before[:, starts].repeat_interleave(lengths, dim=1)
    return seen > 0


def _bad_sequences(bad: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
    """bad: [B, T, H] -> [N, H]: the sequence holds a bad token (N = B, or the packed sequences)."""
    if bounds is None:
        return bad.any(1)
    return torch.stack([bad[0, a:b].any(0) for a, b in zip(bounds, bounds[1:])])


def _zero_rows(x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """x: [B, T, X, D] with the rows flagged by bad: [B, T, X] set to 0."""
    return torch.where(bad[..., None], 0, x)


def contained(inp: OpInputs, run: Run, output_final_state: bool) -> tuple[torch.Tensor, FenwickState | None] | None:
    """The call run with its non-finite tokens zeroed and their outputs (and state) set to NaN as the module
    docstring says, or None when no input is non-finite."""
    H = inp.num_heads
    q_bad, k_bad, v_bad = _bad_rows(inp.q), _bad_rows(inp.k), _bad_rows(inp.v)
    gate_bad = {gate.name: _bad_gate(inp.gates[gate.name], gate.log_decay) for gate in inp.variant.gates}
    lam_bad = _bad_rows(inp.level_scales) if inp.level_scales is not None else False
    carried = expand_groups(k_bad[..., None], H)[..., 0] | v_bad
    for gate in inp.variant.gates:
        bad = gate_bad[gate.name]
        carried = carried | (bad.any(-1) if gate.per_channel else bad)  # a token is bad if any channel is
    read = expand_groups(q_bad[..., None], H)[..., 0] | lam_bad
    if not bool((carried | read).any()):
        return None
    clean = replace(
        inp, q=_zero_rows(inp.q, q_bad), k=_zero_rows(inp.k, k_bad), v=_zero_rows(inp.v, v_bad),
        gates={name: torch.where(gate_bad[name], 0, x) for name, x in inp.gates.items()},
        level_scales=_zero_rows(inp.level_scales, lam_bad) if inp.level_scales is not None else None,
    )
    o, state = run(clean)
    poisoned = _from_token_on(carried, inp.bounds) | read
    o = torch.where(poisoned[..., None], torch.nan, o)
    if state is not None:
        lost = _bad_sequences(carried, inp.bounds)[:, None, :, None, None]  # [N, 1, H, 1, 1]
        state = FenwickState(torch.where(lost, torch.nan, state.levels), state.positions)
    return o, state
