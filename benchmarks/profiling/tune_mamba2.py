"""Launch choices of the Mamba-2 chunk kernels, timed on the GPU: warps and pipeline stages, one kernel at a time, for
log-linear Mamba-2, GLA (its per-channel build) or either one's plain path; on the general build also a cap on the
registers per thread (ptxas's maxnreg: three programs of 4 warps per SM at 168).

    python benchmarks/profiling/tune_mamba2.py --T 32768 --out benchmarks/results --budget 240
    python benchmarks/profiling/tune_mamba2.py --variant gla --plain
    python benchmarks/profiling/tune_mamba2.py --dtype float32 --T 8192      # the fp32 build's launches

Paper setting (bf16 unless --dtype, B = 2, H = 48, one q/k group, K = 128, V = 64; bench_ops.py's rows `loglinear` /
`loglinear_plain`). The op's own choices (LAUNCH in loglinear/ops/triton/shared/launch.py, the entry the path takes:
the general one, ``channel`` with a per-channel gate, ``plain`` on the plain path, ``fp32`` for fp32 operands on the
general one) run first; then each candidate changes one kernel's (warps, stages) on that path, or (the general 16-bit
build) its register cap. Per candidate the
forward + backward is timed (do_bench median), then the op's choices again right after it, so each row holds its own
baseline from the same minute; beside them the kernel's CUDA time (torch.profiler) and the largest relative
difference of the gradients from the op's choices (the same math: only the accumulation order may differ). Writes
tune-<variant>[-plain]-<gpu>.{json,md} after every candidate, so a cut keeps what ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: loglinear
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_ops
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_ops  # noqa: E402
from profile_state import kernel_times  # noqa: E402
from tune_gdn_local import rel_diff  # noqa: E402
from loglinear.cli import check_script_options, refuse  # noqa: E402
from loglinear.ops.triton.shared import launch  # noqa: E402
from loglinear.report import machine_name  # noqa: E402

# the chunk kernels, the costliest first (a budget's cut drops the cheap ones); the scans (fwd.py, bwd.py: no GEMM,
# blocks of 16 state rows) are left out
KERNELS = ("mamba2_chunk_bwd_dq_kernel", "mamba2_chunk_bwd_dkv_kernel", "mamba2_level_grad_kernel",
           "mamba2_chunk_fwd_kernel", "mamba2_deposit_kernel", "mamba2_gate_later_kernel", "mamba2_gate_grad_kernel")
CHANNEL_KERNELS = ("channel_cumsum_kernel", "channel_scores_kernel", "channel_dq_kernel", "channel_dk_kernel")
CONFIGS = ((4, 1), (4, 2), (4, 3), (8, 1), (8, 2))  # (warps, stages) tried for each kernel, less the op's own
# register caps tried on a general build at its own (warps, stages), less its own (None: ptxas's choice); 168 runs
# three programs of 4 warps per SM (65536 registers / 384 threads, in ptxas's steps of 8)
REGISTER_CAPS = (168, None)


def path_field(kernel: str, per_channel: bool, plain: bool, fp32: bool = False) -> str | None:
    """The field of kernel's Launch entry that a call on this path takes when it is set (launch.launch_options'
    order; the in-chunk kernels of a per-channel gate have one build: None, the general fields)."""
    if kernel in CHANNEL_KERNELS:
        return None
    return "channel" if per_channel else "plain" if plain else "fp32" if fp32 else None


def with_config(config: launch.Launch, field: str | None, warps: int, stages: int,
                registers: int | None = None) -> launch.Launch:
    """config with (warps, stages) for the path whose field is ``field`` (None: the general build's, with the
    register cap ``registers``; a special build takes none), so that launch.launch_options gives exactly them there."""
    if field is None:
        return dataclasses.replace(config, num_warps=warps, num_stages=stages, max_registers=registers)
    return dataclasses.replace(config, **{field: (warps, stages)})


def taken(config: launch.Launch, field: str | None) -> tuple[int, int]:
    """The (warps, stages) this path launches with (the general build's when its field is unset)."""
    special = getattr(config, field) if field else None
    return special if special is not None else (config.num_warps, config.num_stages)


def candidates(variant: str, plain: bool, fp32: bool = False) -> list[tuple[str, str | None, int, int, int | None]]:
    """(kernel, its path field, warps, stages, register cap) to try: every kernel the path runs (with a per-channel
    gate the in-chunk ones too) at each of CONFIGS but its own (keeping its cap), and on the general build at each of
    REGISTER_CAPS but its own. The ``fp32`` and ``plain`` fields take no cap (while one is unset, the op runs the
    general build with its cap there: then its own (warps, stages) without the cap is a candidate too)."""
    names = KERNELS + (CHANNEL_KERNELS if variant == "gla" else ())
    out = []
    for n in names:
        config, field = launch.LAUNCH[n], path_field(n, variant == "gla", plain, fp32)
        own, cap = taken(config, field), config.max_registers if field is None else None
        if field is None:
            out += [(n, field, *own, c) for c in REGISTER_CAPS if c != cap]
        capped_fallback = field in ("fp32", "plain") and getattr(config, field) is None and bool(config.max_registers)
        out += [(n, field, w, s, cap) for w, s in CONFIGS if (w, s) != own or capped_fallback]
    return out


def build_step(variant: str, plain: bool, T: int, dtype: torch.dtype = torch.bfloat16):
    """The forward + backward closure of bench_ops' row at T (paper setting, in dtype) and its gradient leaves."""
    bench, p = bench_ops.BENCHES[variant], bench_ops.PAPER
    x = bench.inputs(T, p["B"], p["H"], p["G"], p["K"], p["V"], dtype)
    run, leaves = bench.build("loglinear_plain" if plain else "loglinear", x, p["H"], p["G"])
    for t in leaves:
        t.requires_grad_(True)
    d_o = torch.randn_like(run())

    def step():
        run().backward(d_o)
    return step, leaves


def measure(step, leaves: list[torch.Tensor], kernel: str | None) -> tuple[float, float, list[torch.Tensor]]:
    """(forward + backward ms, the kernel's CUDA ms per step, the gradients of one step); kernel None: the time alone
    (a baseline: 0 and no gradients)."""
    bench_ops.settle(step, 4)
    ms = triton.testing.do_bench(step, warmup=25, rep=150, grad_to_none=leaves, return_mode="median")
    if kernel is None:
        return ms, 0.0, []
    for t in leaves:
        t.grad = None
    step()
    grads = [t.grad.clone() for t in leaves]
    times, _ = kernel_times(lambda: (step(), [setattr(t, "grad", None) for t in leaves]), 3)
    return ms, sum(v for k, v in times.items() if k.startswith(kernel)), grads


def row(kernel: str, cfg: tuple, **fields) -> dict:
    """One table row: cfg = (warps, stages, register cap) of the candidate ('' for the op's choices)."""
    return {"kernel": kernel, "warps": cfg[0], "stages": cfg[1], "registers": cfg[2], **fields}


def write(rows: list[dict], out: Path, name: str, meta: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Launch choices, {meta['title']} ({meta['gpu']}, T = {meta['T']}, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}; `{meta['command']}`", "",
             "Forward + backward (median) with one kernel's (warps, stages) or register cap changed (registers: "
             "ptxas's cap per thread, blank for its own choice), and right after it with the op's choices; the "
             "kernel's CUDA time per step; the gradients' largest relative difference from the op's choices. The "
             "first row is the op's choices alone.", "",
             "| kernel | warps | stages | registers | ms | op's choices, ms | ratio | kernel ms | grad rel diff "
             "| error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ms'] / r['base_ms']:.3f}" if "ms" in r and "base_ms" in r else ""
        lines.append(f"| `{r['kernel']}` | {r['warps']} | {r['stages']} | {r['registers'] or ''} | {r.get('ms', '')} | "
                     f"{r.get('base_ms', '')} | {ratio} | {r.get('kernel_ms', '')} | {r.get('grad_rel_diff', '')} | "
                     f"{r.get('error', '')} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=["mamba2", "gla"], default="mamba2")
    ap.add_argument("--plain", action="store_true", help="the plain path (level_scales=None)")
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the operands' dtype (float32: the fp32 build's launches)")
    ap.add_argument("--budget", type=float, default=240, help="seconds: no candidate starts after this")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = ap.parse_args(argv)
    check_script_options("tune_mamba2.py", {"--T": (args.T, 1), "--budget": (int(args.budget), 0)})
    if not torch.cuda.is_available():
        refuse("tune_mamba2.py", "needs a CUDA GPU (it times the kernels); none is visible")
    launch.STEP_DOWN = False  # a candidate over the SM's shared memory is an error row, not another build timed
    t0, out = time.monotonic(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = machine_name()
    fp32 = args.dtype == "float32"
    name = f"tune-{args.variant}{'-plain' * args.plain}{'-fp32' * fp32}-{gpu}"
    meta = {"title": ("plain " if args.plain else "log-linear ") + bench_ops.BENCHES[args.variant].title.split()[-1]
            + " fp32" * fp32,
            "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "T": args.T,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python " + " ".join(["benchmarks/profiling/tune_mamba2.py"] + (argv or sys.argv[1:]))}
    step, leaves = build_step(args.variant, args.plain, args.T, getattr(torch, args.dtype))
    base_ms, _, ref = measure(step, leaves, "")
    rows = [row("(op's choices)", ("", "", None), ms=round(base_ms, 4))]
    for kernel, field, *cfg in candidates(args.variant, args.plain, fp32):
        if time.monotonic() - t0 > args.budget:
            rows.append(row(kernel, cfg, error="budget"))
            continue
        saved = launch.LAUNCH[kernel]
        launch.LAUNCH[kernel] = with_config(saved, field, *cfg)
        try:
            ms, kernel_ms, grads = measure(step, leaves, kernel)
            fields = {"ms": round(ms, 4), "kernel_ms": round(kernel_ms, 4), "grad_rel_diff": rel_diff(grads, ref)}
        except Exception as e:  # a launch that does not fit (shared memory) is a row, not the end
            fields = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        finally:
            launch.LAUNCH[kernel] = saved
        fields["base_ms"] = round(measure(step, leaves, None)[0], 4)
        rows.append(row(kernel, cfg, **fields))
        print(rows[-1], flush=True)
        write(rows, out, name, meta)
    write(rows, out, name, meta)
    print((out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
