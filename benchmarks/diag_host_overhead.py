"""Diagnosis (session 12): where the host time of our ops' forward goes (paper setting, bf16, T = 8K).

bench_ops on the two-GPU H200 machine measured our Mamba-2 forward at ~8 ms for every T from 8K to 64K
(kernels: ~0.7 ms at 8K), so the forward is host-bound there. Per variant this prints do_bench's median, the
host time of a call (launches only, no sync), torch.profiler's CPU ops by self time, and cProfile's
functions by own time.

    python benchmarks/diag_host_overhead.py [--T 8192] [--variants mamba2 gdn]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_ops import PAPER, build, build_gdn, gdn_inputs, make_inputs  # noqa: E402


def host_ms(fn, n: int = 20) -> float:
    """Mean host time of a call: n calls queued back to back, timed before the sync."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return host


def copy_ms(n: int = 50) -> float:
    """Host time of one small pageable host-to-device copy (as the ops' chunk tables do)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        torch.tensor([[i, 1, 2], [3, 4, 5]], dtype=torch.int32).to("cuda", non_blocking=True)
    return (time.perf_counter() - t0) / n * 1e3


def profile_cpu(fn, n: int = 5) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)


def profile_py(fn, n: int = 10) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--variants", nargs="+", default=["mamba2", "gdn"])
    a = ap.parse_args()
    print(f"small pageable H2D copy: {copy_ms():.3f} ms host per copy", flush=True)
    for variant in a.variants:
        if variant == "gdn":
            x = gdn_inputs(a.T, PAPER["B"], PAPER["H"], PAPER["G"], PAPER["K"], PAPER["V"], torch.bfloat16)
            fn, _ = build_gdn("loglinear", x, PAPER["H"], PAPER["G"])
        else:
            x = make_inputs(a.T, PAPER["B"], PAPER["H"], PAPER["G"], PAPER["K"], PAPER["V"], torch.bfloat16)
            fn, _ = build("loglinear", x, PAPER["H"], PAPER["G"])
        with torch.no_grad():
            for _ in range(12):
                fn()
            med = triton.testing.do_bench(fn, return_mode="median")
            print(f"== {variant} T={a.T}: do_bench fwd {med:.3f} ms; host per call {host_ms(fn):.3f} ms", flush=True)
            print(profile_cpu(fn), flush=True)
            print(profile_py(fn), flush=True)


if __name__ == "__main__":
    main()
