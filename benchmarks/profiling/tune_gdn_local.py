"""Launch choices of the Gated DeltaNet kernels, timed on the GPU: warps, key block, pipeline stages.

    python benchmarks/profiling/tune_gdn_local.py --T 32768 --out benchmarks/results --budget 150
    python benchmarks/profiling/tune_gdn_local.py --dtype float32 --T 8192 --out benchmarks/results --budget 150

Paper setting (B = 2, H = 48, K = 128, V = 64, use_qk_l2norm). The op's own choices (warps and stages: LAUNCH in
loglinear/ops/triton/shared/launch.py; key block: KEY_BLOCK in gated_deltanet/local.py) run first; then each
candidate changes one kernel's launch and the forward+backward is profiled again (`profile_gdn.kernel_times`):
that kernel's CUDA time per step, the total, and the largest relative difference of the six gradients from the
first run (the same math: only the accumulation order may differ).
bf16 (the default): the chunk-local kernels' (warps, BK, stages), candidates from the sm_90 compile report
(`compile_sm90.py gdn`): the ones with few or no spills; writes tune-gdn-local-<gpu>.{json,md}.
--dtype float32: the (warps, stages) of the fp32 builds (`Launch.fp32`) of the chunk-local and scan kernels, the
16-bit builds' launch among the candidates; writes tune-gdn-fp32-<gpu>.{json,md}.
The files are written after every candidate, so a cut keeps what ran.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_ops (for profile_gdn)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_gdn import kernel_times  # noqa: E402
from loglinear.cli import check_script_options, refuse  # noqa: E402
from loglinear.ops.triton.gated_deltanet import local  # noqa: E402
from loglinear.ops.triton.shared import launch  # noqa: E402
from loglinear.report import machine_name  # noqa: E402

CANDIDATES = {  # (warps, BK, stages) of the 16-bit builds
    "_chunk_local_bwd_k_kernel": [(4, 32, 2), (8, 64, 2), (8, 128, 1), (8, 128, 3)],
    "_chunk_local_bwd_cc_kernel": [(8, 128, 2), (4, 128, 2), (4, 64, 2)],
    "_chunk_local_kernel": [(8, 64, 2), (4, 64, 1), (4, 64, 3)],
    "_chunk_inverse_kernel": [(8, 128, 2), (4, 128, 1)],
}
FP32_CANDIDATES = {  # (warps, stages) of the fp32 builds; the key block stays the op's
    "_scan_readout_kernel": [(8, 2), (4, 1), (8, 1)],
    "_scan_dh_kernel": [(8, 2), (4, 2)],
    "_scan_readout_bwd_kernel": [(4, 2), (8, 1)],
    "_scan_grads_kernel": [(8, 2), (4, 1)],
    "_scan_fwd_kernel": [(8, 1)],
    "_chunk_local_bwd_cc_kernel": [(4, 1), (8, 2)],
    "_chunk_local_kernel": [(4, 1), (8, 2)],
    "_chunk_inverse_kernel": [(4, 1), (8, 2)],
}


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest ||a_i - b_i||_max / ||b_i||_max over the gradients."""
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a, b))


def choice(name: str, cfg: tuple[int, int | None, int], **fields) -> dict:
    """A result row: the kernel, its (warps, BK, stages) (BK None: the op's), and what was measured (or the
    error)."""
    return {"kernel": name, "warps": cfg[0], "BK": cfg[1], "stages": cfg[2], **fields}


def op_choice(name: str, fp32: bool) -> tuple[int, int | None, int]:
    """The op's (warps, BK, stages) of kernel name: its fp32 build's launch (fp32; BK None), else the 16-bit one."""
    config = launch.LAUNCH[name]
    if fp32:
        warps, stages = config.fp32 or (config.num_warps, config.num_stages)
        return warps, None, stages
    return config.num_warps, local.KEY_BLOCK[name], config.num_stages


def candidates(fp32: bool) -> list[tuple[str, tuple[int, int | None, int]]]:
    """(kernel, (warps, BK, stages)) to time, none of them the op's own choice."""
    if fp32:
        return [(name, (w, None, s)) for name, cfgs in FP32_CANDIDATES.items() for w, s in cfgs
                if (w, None, s) != op_choice(name, True)]
    return [(name, cfg) for name, cfgs in CANDIDATES.items() for cfg in cfgs if cfg != op_choice(name, False)]


def set_choice(name: str, cfg: tuple[int, int | None, int], fp32: bool) -> None:
    """Kernel name's launch (and, 16-bit, key block) set to cfg, as launch_options and the backend read them."""
    warps, block, stages = cfg
    if fp32:
        launch.LAUNCH[name] = dataclasses.replace(launch.LAUNCH[name], fp32=(warps, stages))
    else:
        launch.LAUNCH[name] = dataclasses.replace(launch.LAUNCH[name], num_warps=warps, num_stages=stages)
        local.KEY_BLOCK[name] = block


def timings(rows: list[tuple[float, int, str]], name: str, diff: float) -> dict:
    """kernel_ms of kernel name, total_ms of the step (kernel_times rows), grad_rel_diff."""
    ms = {key: t for t, _, key in rows}
    return {"kernel_ms": round(ms.get(name, 0.0), 4), "total_ms": round(sum(ms.values()), 3), "grad_rel_diff": diff}


def run(name: str, cfg: tuple[int, int | None, int], T: int, dtype: torch.dtype, ref: list[torch.Tensor]) -> dict:
    """One profiled step with kernel name at cfg (the others at the op's choices): its row."""
    saved = launch.LAUNCH[name], dict(local.KEY_BLOCK)
    set_choice(name, cfg, dtype == torch.float32)
    try:
        rows, _, grads = kernel_times(T, dtype=dtype)
    finally:
        launch.LAUNCH[name] = saved[0]
        local.KEY_BLOCK.update(saved[1])
    return choice(name, cfg, **timings(rows, name, rel_diff(grads, ref)))


def write(rows: list[dict], out: Path, name: str, meta: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(dict(meta, rows=rows), indent=1) + "\n")
    lines = [f"# {meta['title']} ({meta['gpu']}, T = {meta['T']}, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}; `{meta['command']}`; first row per kernel = the op's "
             "choice; kernel ms: the kernel's CUDA time per forward + backward, total ms: every kernel's (side "
             "streams overlap: more than the wall time)", "",
             "| kernel | warps | BK | stages | kernel ms | total ms | grad rel diff | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['kernel']}` | {r['warps']} | {r['BK'] or ''} | {r['stages']} | {r.get('kernel_ms', '')} "
                     f"| {r.get('total_ms', '')} | {r.get('grad_rel_diff', '')} | {r.get('error', '')} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the operands' dtype (float32: the fp32 builds' launches, scan kernels included)")
    ap.add_argument("--budget", type=float, default=150, help="seconds: no candidate starts after this")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = ap.parse_args(argv)
    check_script_options("tune_gdn_local.py", {"--T": (args.T, 1), "--budget": (int(args.budget), 0)})
    if not torch.cuda.is_available():
        refuse("tune_gdn_local.py", "needs a CUDA GPU (it times the kernels); none is visible")
    launch.STEP_DOWN = False  # a candidate over the SM's shared memory is an error row, not another build timed
    t0, out = time.monotonic(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = machine_name()
    dtype, fp32 = getattr(torch, args.dtype), args.dtype == "float32"
    name = f"tune-gdn-{'fp32' if fp32 else 'local'}-{gpu}"
    meta = {"title": f"{'fp32' if fp32 else 'Chunk-local'} launch choices, log-linear Gated DeltaNet", "gpu": gpu,
            "torch": torch.__version__, "triton": triton.__version__, "T": args.T,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python " + " ".join(["benchmarks/profiling/tune_gdn_local.py"] + (argv or sys.argv[1:]))}
    base, _, ref = kernel_times(args.T, dtype=dtype)
    kernels = FP32_CANDIDATES if fp32 else CANDIDATES
    rows = [choice(n, op_choice(n, fp32), **timings(base, n, 0.0)) for n in kernels]
    write(rows, out, name, meta)
    for kernel, cfg in candidates(fp32):
        if time.monotonic() - t0 > args.budget:
            rows.append(choice(kernel, cfg, error="budget"))
            continue
        try:
            row = run(kernel, cfg, args.T, dtype, ref)
        except Exception as e:  # a launch that does not fit (shared memory) is a row, not the end
            row = choice(kernel, cfg, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
        rows.append(row)
        print(row, flush=True)
        write(rows, out, name, meta)
    rows.sort(key=lambda r: r["kernel"])
    write(rows, out, name, meta)
    print((out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
