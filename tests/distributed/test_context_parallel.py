"""Context parallelism on CPU with gloo: 2 and 4 processes, float64, outputs and all gradients equal the
single-process op (every variant, uneven shards, T_r = 1 shards, G < H, varlen across and inside shards,
initial states, final states); on 4 processes also whole models under apply_context_parallel (logits and
parameter gradients equal the single-process model's); on 2 processes the Triton backend (float32, with and
without initial states)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from cp_cases import Case, worker

TIMEOUT_S = 400  # a hang fails the test (gloo itself gives up after 60 s per exchange)


def _triton_cases(lengths: list[int]) -> list[Case]:
    """The Triton backend (float32, K = V = 16 for tl.dot), interpreted on the CPU: with initial states (Mamba-2,
    and GLA on the same kernels with a per-channel gate), and without (Gated DeltaNet: rank 0's op call then gets
    no state, rank 1's only the levels a state at its start can hold)."""
    return [
        Case(f"{variant}-triton{'-state' if init else ''}", variant, lengths, K=16, V=16, chunk_size=16,
             init_positions=init, dtype=torch.float32, backend="triton")
        for variant, init in (("mamba2", [5, 12]), ("gla", [5, 12]), ("gated_deltanet", None))
    ]


def _cases(lengths: list[int]) -> list[Case]:
    T = sum(lengths)
    bounds = [0, 3, lengths[0] + 1, T - lengths[-1], T]  # inside shard 0, across shards, at a shard start
    bounds = sorted(set(bounds))
    cases = []
    for variant in ("mamba2", "gated_deltanet"):
        extra = {"use_qk_l2norm": True} if variant == "gated_deltanet" else {}
        cases += [
            Case(f"{variant}-dense", variant, lengths, G=1, H=2, op_kwargs=extra),
            Case(f"{variant}-state", variant, lengths, B=2, G=2, H=2, init_positions=[5, 12], chunk_size=8),
            Case(f"{variant}-varlen", variant, lengths, B=1, seq_bounds=bounds,
                 init_positions=[3, 0, 9, 1][: len(bounds) - 1]),
            Case(f"{variant}-varlen-fresh", variant, lengths, B=1, H=3, seq_bounds=bounds, chunk_size=2),
        ]
    return cases + [  # per-channel gates; g = -inf in shard 0 (the local states and transitions see it)
        Case("gla-dense", "gla", lengths, G=1, H=2, hard_reset=True),
        Case("gla-state", "gla", lengths, B=2, G=2, H=2, init_positions=[5, 12], chunk_size=8),
        Case("mamba2-hard-reset", "mamba2", lengths, G=1, H=2, hard_reset=True),
    ]


# (variant, log-linear, activation checkpointing)
MODELS = [("mamba2", True, False), ("gated_deltanet", True, True), ("gated_deltanet", False, False),
          ("gla", True, False)]  # GLA: no short convolution


def _spawn(lengths: list[int], cases: list[Case], models: list[tuple[str, bool, bool]], tmp_path) -> None:
    world = len(lengths)
    args = (world, str(tmp_path / "store"), cases, models)
    ctx = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    os.kill(proc.pid, 9)
            pytest.fail(f"context-parallel workers ({world} ranks) did not finish in {TIMEOUT_S} s")


@pytest.mark.slow
@pytest.mark.parametrize("lengths, models", [([13, 6], []), ([5, 9, 1, 7], MODELS)], ids=["2-ranks", "4-ranks"])
def test_context_parallel_matches_single_process(lengths, models, tmp_path):
    _spawn(lengths, _cases(lengths), models, tmp_path)


@pytest.mark.slow
def test_context_parallel_on_the_triton_backend(tmp_path, monkeypatch):
    """Any backend: the same exactness (float32) with the fused kernels, interpreted on the CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks hold CPU tensors; inherited by the spawned ranks
    _spawn([20, 12], _triton_cases([20, 12]), [], tmp_path)
