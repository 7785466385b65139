"""Context-parallel exactness cases, run inside spawned gloo processes (one spawn per world size).

Every rank builds the same global float64 inputs, runs the single-process op on all of them and the
context-parallel op on its shard, and compares its slice of the output and of every gradient (q, k, v,
the variant's gates, level_scales; initial_state.levels summed over ranks; the final state and its gradient path).
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loglinear.distributed import context_parallel_attention, context_parallel_log_linear_mamba2
from loglinear.ops import attention
from loglinear.state import FenwickState
from loglinear.variants import get

from helpers import make_inputs


@dataclass
class Case:
    name: str
    variant: str  # a registered variant's name
    lengths: list[int]  # shard length per rank
    B: int = 2
    G: int = 1
    H: int = 2
    K: int = 4
    V: int = 3
    chunk_size: int = 4
    seq_bounds: list[int] | None = None  # global cu_seqlens (B = 1)
    init_positions: list[int] | None = None  # initial state positions (None: no initial state)
    op_kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float64
    backend: str | None = None  # LOGLINEAR_BACKEND for the op calls (None: the default)
    hard_reset: bool = False  # g = -inf (every channel) at token 2 of every row: a reset inside shard 0

    @property
    def rtol(self) -> float:
        return 1e-10 if self.dtype == torch.float64 else 2e-5


def _inputs(case: Case, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """q, k, v, level_scales and the variant's gates (its own sample_gates), in the op's argument order."""
    T = sum(case.lengths)
    start = max(case.init_positions or [0])
    x = make_inputs(case.B, T, case.G, case.H, K=case.K, V=case.V, dtype=case.dtype, generator=gen, start=start)
    gates = get(case.variant).sample_gates(case.B, T, case.H, case.K, dtype=case.dtype, generator=gen)
    if case.hard_reset:
        gates["g"][:, 2] = -torch.inf
    return {"q": x["q"], "k": x["k"], "v": x["v"], **gates, "level_scales": x["level_scales"]}


def _initial_state(case: Case, n_seq: int, L: int, gen: torch.Generator) -> FenwickState | None:
    if case.init_positions is None:
        return None
    levels = torch.randn(n_seq, L, case.H, case.K, case.V, dtype=case.dtype, generator=gen) * 0.3
    return FenwickState(levels.requires_grad_(), torch.tensor(case.init_positions))


def _call(case: Case, cp: bool, x: dict, state, cu, group=None):
    kwargs = dict(chunk_size=case.chunk_size, initial_state=state, output_final_state=True, cu_seqlens=cu)
    kwargs |= case.op_kwargs
    gates = {name: x[name] for name in get(case.variant).gate_names}
    args = (case.variant, x["q"], x["k"], x["v"], gates, x["level_scales"])
    if cp:
        return context_parallel_attention(*args, group=group, **kwargs)
    return attention(*args, **kwargs)


def _close(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor, what: str, rtol: float = 1e-10) -> None:
    """|actual - expected| <= rtol * |expected of the whole (global) tensor|: a zero-gradient slice compares
    against the global magnitude, not against its own rounding noise."""
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    err = (actual - expected).norm() / scale.norm().clamp_min(1e-30)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


def run_case(case: Case, rank: int, group) -> None:
    if case.backend is not None:
        os.environ["LOGLINEAR_BACKEND"] = case.backend
    try:
        _run_case(case, rank, group)
    finally:
        os.environ.pop("LOGLINEAR_BACKEND", None)


def _run_case(case: Case, rank: int, group) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    x = _inputs(case, gen)
    T, L = sum(case.lengths), x["level_scales"].shape[-1]
    n_seq = len(case.seq_bounds) - 1 if case.seq_bounds else case.B
    state = _initial_state(case, n_seq, L, gen)
    cu = torch.tensor(case.seq_bounds) if case.seq_bounds else None
    w = torch.randn(case.B, T, case.H, case.V, dtype=case.dtype, generator=gen)
    w_final = torch.randn(n_seq, L, case.H, case.K, case.V, dtype=case.dtype, generator=gen)

    full = {n: t.clone().requires_grad_() for n, t in x.items()}
    o_ref, final_ref = _call(case, False, full, state, cu)
    ((o_ref * w).sum() + (final_ref.levels * w_final[:, : final_ref.num_levels]).sum()).backward()
    init_grad_ref = state.levels.grad.clone() if state is not None else None
    if state is not None:
        state.levels.grad = None

    a = sum(case.lengths[:rank])
    b = a + case.lengths[rank]
    shard = {n: t[:, a:b].detach().clone().requires_grad_() for n, t in x.items()}
    o, final = _call(case, True, shard, state, cu, group)
    _close(o, o_ref[:, a:b], o_ref, f"{case.name}: o on rank {rank}", case.rtol)
    loss = (o * w[:, a:b]).sum()
    ends = _ending_sequences(case, a, b)
    if ends:
        assert final is not None and final.num_sequences == len(ends), f"{case.name}: final state rows on rank {rank}"
        n_levels = max(final.num_levels, final_ref.num_levels)
        ref_levels = final_ref.select(ends).with_levels(n_levels).levels
        what = f"{case.name}: final state on rank {rank}"
        _close(final.with_levels(n_levels).levels, ref_levels, ref_levels, what, case.rtol)
        assert final.positions.tolist() == final_ref.positions[ends].tolist(), f"{case.name}: final positions"
        loss = loss + (final.levels * w_final[ends][:, : final.num_levels]).sum()
    else:
        assert final is None, f"{case.name}: rank {rank} returned a final state for no ending sequence"
    loss.backward()
    for n in shard:
        _close(shard[n].grad, full[n].grad[:, a:b], full[n].grad, f"{case.name}: d{n} on rank {rank}", case.rtol)
    if state is not None:
        init_grad = state.levels.grad.clone() if state.levels.grad is not None else torch.zeros_like(state.levels)
        dist.all_reduce(init_grad, group=group)
        _close(init_grad, init_grad_ref, init_grad_ref, f"{case.name}: d initial_state on rank {rank}", case.rtol)


def _ending_sequences(case: Case, a: int, b: int) -> list[int]:
    """Global sequences that end inside [a, b)."""
    if case.seq_bounds is None:
        return list(range(case.B)) if b == sum(case.lengths) else []
    return [n for n, end in enumerate(case.seq_bounds[1:]) if a < end <= b]


def _tiny_model(variant: str, use_log_linear: bool) -> torch.nn.Module:
    import loglinear.models as models

    common = dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_heads=2, chunk_size=4, max_levels=8,
                  use_log_linear=use_log_linear)
    own = {"mamba2": dict(state_size=8), "gated_deltanet": dict(head_dim=8), "gla": dict(gate_low_rank_dim=4)}
    config_cls, _, lm_cls = models.MODELS[variant]
    torch.manual_seed(0)
    return lm_cls(config_cls(**common, **own[variant])).double()


def run_model_case(variant: str, use_log_linear: bool, checkpointing: bool, rank: int, group) -> None:
    """apply_context_parallel: the sharded model's logits and its (all-reduced) parameter gradients equal
    the single-process model's (conv halos and the attention scan across shards), also when the blocks
    are recomputed in backward (activation checkpointing re-runs the exchanges)."""
    import copy

    from loglinear.distributed import apply_context_parallel, shard_sequence

    name = f"model-{variant}-{'ll' if use_log_linear else 'plain'}{'-checkpointed' if checkpointing else ''}"
    ids = torch.randint(0, 32, (2, 23), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    model = _tiny_model(variant, use_log_linear)
    cp_model = apply_context_parallel(copy.deepcopy(model), group)
    if checkpointing:
        cp_model.train()
        cp_model.gradient_checkpointing_enable()
    logits = model(inputs).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()

    shard_logits = cp_model(shard_sequence(inputs, group), use_cache=False).logits
    expected = shard_sequence(logits, group)
    _close(shard_logits, expected, logits, f"{name}: logits on rank {rank}")
    loss = torch.nn.functional.cross_entropy(
        shard_logits.flatten(0, 1), shard_sequence(targets, group).flatten(), reduction="sum"
    )
    loss.backward()
    for (pname, p), cp_p in zip(model.named_parameters(), cp_model.parameters()):
        grad = cp_p.grad.clone()
        dist.all_reduce(grad, group=group)
        _close(grad, p.grad, p.grad, f"{name}: d{pname} on rank {rank}")


def check_disagreeing_shapes(rank: int, group) -> None:
    """Shards whose head dims differ raise ValueError on every rank (after the shape all_gather)."""
    K = 4 + (rank == 1)
    gen = torch.Generator().manual_seed(rank)
    q, k = torch.randn(2, 2, 3, 1, K, dtype=torch.float64, generator=gen)
    v, g, lam = torch.randn(2, 3, 2, 3), -torch.rand(2, 3, 2), torch.rand(2, 3, 2, 4)
    try:
        context_parallel_log_linear_mamba2(q, k, v.double(), g.double(), lam.double(), group=group)
    except ValueError as err:
        assert "disagree on K" in str(err), str(err)
    else:
        raise AssertionError("disagreeing K across ranks was accepted")


def worker(
    rank: int, world: int, init_file: str, cases: list[Case], model_cases: list[tuple[str, bool, bool]],
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        for case in cases:
            try:
                run_case(case, rank, dist.group.WORLD)
            except Exception:  # a peer's failure shows up as a broken connection: print every rank's own error
                traceback.print_exc()
                print(f"^ rank {rank}/{world}, case {case.name}", file=sys.stderr, flush=True)
                raise
        check_disagreeing_shapes(rank, dist.group.WORLD)
        for variant, use_log_linear, checkpointing in model_cases:
            run_model_case(variant, use_log_linear, checkpointing, rank, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
