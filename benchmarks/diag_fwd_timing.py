"""Diagnosis (session 11): our Mamba-2 forward under no_grad, timed per iteration (paper setting, bf16).

Why `bench_ops.py --warmup 5 --rep 20` reported 5.97 ms at 8K for a ~0.8 ms forward: the first calls of a
fresh shape are slow, and so few iterations put the median among them. Prints one line per T.

    python benchmarks/diag_fwd_timing.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_ops import PAPER, build, make_inputs  # noqa: E402


def first_calls_ms(fn, n: int = 15) -> list[float]:
    """CUDA-event time of each of n calls after one warm call."""
    fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [round(start.elapsed_time(end), 3) for start, end in events]


def kernel_ms(fn) -> float:
    """CUDA kernel time of one call (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / 1e3


def main() -> None:
    for T in (4096, 8192, 16384):
        x = make_inputs(T, **PAPER, dtype=torch.bfloat16)
        fn, leaves = build("loglinear", x, PAPER["H"], PAPER["G"])
        for t in leaves:
            t.requires_grad_(True)
        with torch.no_grad():
            per = first_calls_ms(fn)
            med = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            kern = kernel_ms(fn)
        grad_med = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        print(f"T={T}: no_grad per-iter {per}; do_bench(25,100) {med:.3f} ms; kernel time {kern:.3f} ms; "
              f"grad-enabled fwd {grad_med:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
