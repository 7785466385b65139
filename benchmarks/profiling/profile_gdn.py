"""Where the time of log-linear Gated DeltaNet goes: per-kernel CUDA time of one forward+backward.

    python benchmarks/profiling/profile_gdn.py --T 32768 131072 --out benchmarks/results

Paper setting (B = 2, 48 value heads, one q/k group, K = 128, V = 64, bf16, q/k L2-normalised in the op).
For each T: the wall time of a forward+backward step, and torch.profiler over two steps (after a warm-up step),
CUDA time summed per kernel name; writes profile-gdn-<gpu>.md (one table per T, ms per step). The chains' readers
run beside them on a second stream, so the kernel times add up to more than the wall time.

--ab: each T again with the scan kernels' square forms off (`square_fits` -> False: the chains without Wm,
the scan grads without Z), so the square forms and the plain ones are compared in one run.
--one-stream-ab: each T again with the chains and their readers on one stream, one after another.
--plain: plain Gated DeltaNet (level_scales=None, the one-level schedule); writes profile-gdn-plain-<gpu>.md.
--fla: each T also fla's linear chunk_gated_delta_rule (the op benchmark's baseline, its Hopper guard lifted as
bench_ops lifts it for timing), kernel by kernel, in the same file.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: loglinear
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_ops

from bench_ops import PAPER, build_gdn, gdn_inputs, lift_fla_guard  # noqa: E402
from loglinear import log_linear_gated_deltanet  # noqa: E402
from loglinear.ops.triton.gated_deltanet import scan as gated_deltanet_scan  # noqa: E402
from loglinear.ops.triton.shared.streams import ChainStreams  # noqa: E402
from loglinear.report import machine_name  # noqa: E402


def kernel_times(T: int, plain: bool = False, steps: int = 2, fla: bool = False, dtype: torch.dtype = torch.bfloat16
                 ) -> tuple[list[tuple[float, int, str]], float, list]:
    """One forward+backward at the paper setting (use_qk_l2norm; q, k, v, level_scales and the upstream gradient
    in dtype; plain: level_scales=None; fla: fla's chunk_gated_delta_rule), after a warm-up step: [(ms per step,
    calls per step, kernel name)], largest first, the wall ms per step (unprofiled), and the gradients of the
    leaves (ours: q, k, v, g, beta and level_scales unless plain)."""
    p = PAPER
    x = gdn_inputs(T, p["B"], p["H"], p["G"], p["K"], p["V"], dtype)
    gen = torch.Generator(device="cuda").manual_seed(2)  # the same upstream gradient on every call
    grad = torch.randn(p["B"], T, p["H"], p["V"], device="cuda", dtype=dtype, generator=gen)
    if fla:
        fn, leaves = build_gdn("fla_gdn", x, p["H"], p["G"])
    else:
        names = ("q", "k", "v", "g", "beta") + (() if plain else ("level_scales",))
        leaves = [x[n] for n in names]
        lam = None if plain else leaves[-1]
        fn = lambda: log_linear_gated_deltanet(*leaves[:5], lam, use_qk_l2norm=True)[0]  # noqa: E731
    for t in leaves:
        t.requires_grad_()

    def step():
        for t in leaves:
            t.grad = None
        fn().backward(grad)

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / 1000 / steps, e.count // steps, e.key))
    return sorted(rows, reverse=True), wall, [t.grad for t in leaves]


def profile_step(T: int, top: int, label: str = "", plain: bool = False, fla: bool = False) -> list[str]:
    rows, wall, _ = kernel_times(T, plain, fla=fla)
    total = sum(r[0] for r in rows)
    lines = [f"## T = {T}{label}: {wall:.2f} ms per forward+backward, {total:.2f} ms of kernel time", "",
             "| ms | % | calls | kernel |", "|---|---|---|---|"]
    for ms, n, key in rows[:top]:
        lines.append(f"| {ms:.3f} | {100 * ms / total:.1f} | {n} | `{key[:90]}` |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[32768])
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--ab", action="store_true", help="each T also with the square forms off")
    ap.add_argument("--one-stream-ab", action="store_true", help="each T also with the chains' readers after them")
    ap.add_argument("--plain", action="store_true", help="plain Gated DeltaNet (level_scales=None)")
    ap.add_argument("--fla", action="store_true", help="each T also fla's linear chunk_gated_delta_rule")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = ap.parse_args()
    gpu = machine_name()
    what = "plain Gated DeltaNet (one-level schedule)" if args.plain else "log-linear Gated DeltaNet"
    lines = [f"# {what}, CUDA time per kernel ({gpu}, torch {torch.__version__})", "",
             "B=2, H=48, G=1, K=128, V=64, bf16, use_qk_l2norm; `python " + " ".join(sys.argv) + "`", ""]
    fits = gated_deltanet_scan.square_fits
    if args.fla:
        lift_fla_guard()
    variants = [(fits, ChainStreams, "")]
    if args.ab:
        variants.append((lambda BK, dtype: False, ChainStreams, ", square forms off"))
    if args.one_stream_ab:
        variants.append((fits, functools.partial(ChainStreams, side=False), ", one stream"))
    for T in args.T:
        for rule, streams, label in variants:
            gated_deltanet_scan.square_fits, gated_deltanet_scan.ChainStreams = rule, streams
            try:
                lines += profile_step(T, args.top, label, args.plain)
            except Exception as e:  # keep what was measured
                lines += [f"## T = {T}{label}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", ""]
            print("\n".join(lines[-25:]), flush=True)
            torch.cuda.empty_cache()
        if args.fla:
            lines += profile_step(T, args.top, ", fla's linear chunk_gated_delta_rule", fla=True)
            print("\n".join(lines[-25:]), flush=True)
            torch.cuda.empty_cache()
    gated_deltanet_scan.square_fits, gated_deltanet_scan.ChainStreams = fits, ChainStreams
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile-gdn{'-plain' if args.plain else ''}-{gpu}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
