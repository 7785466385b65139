"""Where an incoming state's cost goes: CUDA time per kernel of one forward+backward with and without a state.

    python benchmarks/profiling/profile_state.py                       # Mamba-2 and GDN at 32K and 128K
    python benchmarks/profiling/profile_state.py --variants mamba2 --T 8192 131072 --name profile-state-mamba2
    python benchmarks/profiling/profile_state.py --states boundary inside    # also from a state inside a chunk

The calls are bench_ops.py's `loglinear` row and its state rows (paper setting: B = 2, 48 value heads, one
q/k group, K = 128, V = 64, bf16): the same inputs, once from zeros and once continuing the state left by T
tokens of the same kind (`loglinear_state`: at position T, a chunk boundary; with --states inside,
`loglinear_state_inside`: the state after T - 24 tokens, inside a chunk; the state's gradient taken). Per T,
variant and state row, a table of the kernels (torch.profiler, CUDA time per call, averaged over --reps calls)
side by side, sorted by the difference, and the wall time per call. Writes <out>/<name>-<gpu>.md (--name, default
profile-state: a run of other variants or lengths under another name keeps that file).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_ops
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: loglinear

import bench_ops  # noqa: E402
from loglinear.report import machine_name  # noqa: E402


def kernel_times(step, reps: int) -> tuple[dict[str, float], float]:
    """(kernel name -> CUDA ms per call, wall ms per call) of step() (a forward+backward), after warmup."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if cuda_us and event.key.strip():
            times[event.key[:60]] = times.get(event.key[:60], 0.0) + cuda_us / 1e3 / reps
    return times, wall


STATE_ROWS = {"boundary": "loglinear_state", "inside": "loglinear_state_inside"}


def fwd_bwd(variant: str, T: int, impl: str):
    """A forward+backward closure of bench_ops' row ``impl`` (loglinear or one of STATE_ROWS)."""
    bench = bench_ops.BENCHES[variant]
    p = bench_ops.PAPER
    x = bench.inputs(T, p["B"], p["H"], p["G"], p["K"], p["V"], torch.bfloat16, seed=1)
    run, leaves = bench.build(impl, x, p["H"], p["G"])
    for t in leaves:
        t.requires_grad_(True)
    d_o = torch.randn_like(run())

    def step():
        run().backward(d_o)
        for t in leaves:
            t.grad = None
    return step


def table(label: str, base: tuple[dict, float], state: tuple[dict, float], rows: int) -> list[str]:
    (k0, w0), (k1, w1) = base, state
    names = sorted(set(k0) | set(k1), key=lambda n: k1.get(n, 0.0) - k0.get(n, 0.0), reverse=True)
    lines = [f"## {label}", "",
             f"wall per forward+backward: {w0:.2f} ms without a state, {w1:.2f} ms with one ({w1 / w0:.2f}x); "
             f"kernel time {sum(k0.values()):.2f} / {sum(k1.values()):.2f} ms", "",
             "| kernel | no state, ms | state, ms | difference, ms |", "|---|---|---|---|"]
    for n in names[:rows]:
        a, b = k0.get(n, 0.0), k1.get(n, 0.0)
        lines.append(f"| `{n}` | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["mamba2", "gdn"], choices=sorted(bench_ops.BENCHES))
    ap.add_argument("--T", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--states", nargs="+", default=["boundary"], choices=sorted(STATE_ROWS),
                    help="where the incoming state is: at a chunk boundary, inside a chunk (one table each)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=14, help="kernels per table (largest differences first)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    ap.add_argument("--name", default="profile-state",
                    help="result file stem: <name>-<gpu>.md (another name keeps the default run's file)")
    args = ap.parse_args(argv)
    gpu = machine_name()
    command = "python " + " ".join(["benchmarks/profiling/profile_state.py"] + (argv or sys.argv[1:]))
    lines = [f"# Where an incoming state's cost goes ({gpu})", "",
             f"torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
             f"`{command}`", "",
             "One forward+backward of bench_ops.py's `loglinear` row and of its state rows (the same call continuing "
             "the state left by T tokens, a chunk boundary, or by T - 24 tokens, inside a chunk; its gradient "
             "taken); paper setting, bf16. CUDA time per call by kernel (torch.profiler), the largest differences "
             "first.", ""]
    for variant in args.variants:
        for T in args.T:
            base = kernel_times(fwd_bwd(variant, T, "loglinear"), args.reps)
            for where in args.states:
                res = kernel_times(fwd_bwd(variant, T, STATE_ROWS[where]), args.reps)
                lines += table(f"{variant}, T = {T}, state at {where}", base, res, args.rows)
                print("\n".join(lines[-args.rows - 6:]), flush=True)
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}-{gpu}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
