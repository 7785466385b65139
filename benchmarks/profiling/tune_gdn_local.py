"""Launch choices of the Gated DeltaNet chunk-local kernels, timed on the GPU: warps, key block, pipeline stages.

    python benchmarks/profiling/tune_gdn_local.py --T 32768 --out benchmarks/results --budget 150

Paper setting (bf16, B = 2, H = 48, K = 128, V = 64, use_qk_l2norm). The op's own choices (warps and
stages: LAUNCH in loglinear/ops/triton/shared/launch.py; key block: KEY_BLOCK in gated_deltanet/local.py)
run first; then each candidate changes one kernel's (warps, BK, stages) and the forward+backward is profiled
again (`profile_gdn.kernel_times`): that kernel's CUDA time per step, the total, and the largest relative
difference of the six gradients from the first run (the same math: only the accumulation order may differ).
Candidates come from the sm_90 compile report (`compile_sm90.py gdn`): the ones with few or no spills.
Writes tune-gdn-local-<gpu>.{json,md} after every candidate, so a cut keeps what ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: loglinear
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_ops (for profile_gdn)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_gdn import kernel_times  # noqa: E402
from loglinear.ops.triton.gated_deltanet import local  # noqa: E402
from loglinear.ops.triton.shared import launch  # noqa: E402

CANDIDATES = {
    "_chunk_local_bwd_k_kernel": [(4, 32, 2), (8, 64, 2), (8, 128, 1), (8, 128, 3)],
    "_chunk_local_bwd_cc_kernel": [(8, 128, 2), (4, 128, 2), (4, 64, 2)],
    "_chunk_local_kernel": [(8, 64, 2), (4, 64, 1), (4, 64, 3)],
    "_chunk_inverse_kernel": [(8, 128, 2), (4, 128, 1)],
}


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest ||a_i - b_i||_max / ||b_i||_max over the gradients."""
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a, b))


def choice(name: str, cfg: tuple[int, int, int], **fields) -> dict:
    """A result row: the kernel, its (warps, BK, stages), and what was measured (or the error)."""
    return {"kernel": name, "warps": cfg[0], "BK": cfg[1], "stages": cfg[2], **fields}


def op_choice(name: str) -> tuple[int, int, int]:
    """The op's (warps, BK, stages) of chunk-local kernel name."""
    config = launch.LAUNCH[name]
    return config.num_warps, local.KEY_BLOCK[name], config.num_stages


def timings(rows: list[tuple[float, int, str]], name: str, diff: float) -> dict:
    """kernel_ms of kernel name, total_ms of the step (kernel_times rows), grad_rel_diff."""
    ms = {key: t for t, _, key in rows}
    return {"kernel_ms": round(ms.get(name, 0.0), 4), "total_ms": round(sum(ms.values()), 3), "grad_rel_diff": diff}


def run(name: str, cfg: tuple[int, int, int], T: int, ref: list[torch.Tensor]) -> dict:
    """One profiled step with kernel name at cfg (the others at the op's choices): its row."""
    saved = launch.LAUNCH[name], local.KEY_BLOCK[name]
    launch.LAUNCH[name], local.KEY_BLOCK[name] = launch.Launch(cfg[0], cfg[2]), cfg[1]
    try:
        rows, _, grads = kernel_times(T)
    finally:
        launch.LAUNCH[name], local.KEY_BLOCK[name] = saved
    return choice(name, cfg, **timings(rows, name, rel_diff(grads, ref)))


def write(rows: list[dict], out: Path, gpu: str, T: int) -> None:
    meta = {"gpu": gpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "T": T, "command": "python " + " ".join(sys.argv), "rows": rows}
    (out / f"tune-gdn-local-{gpu}.json").write_text(json.dumps(meta, indent=1) + "\n")
    lines = [f"# Chunk-local launch choices, log-linear Gated DeltaNet ({gpu}, T = {T}, {meta['date']})", "",
             f"`{meta['command']}`; first row per kernel = the op's choice", "",
             "| kernel | warps | BK | stages | kernel ms | total ms | grad rel diff | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['kernel']}` | {r['warps']} | {r['BK']} | {r['stages']} | {r.get('kernel_ms', '')} | "
                     f"{r.get('total_ms', '')} | {r.get('grad_rel_diff', '')} | {r.get('error', '')} |")
    (out / f"tune-gdn-local-{gpu}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--budget", type=float, default=150, help="seconds: no candidate starts after this")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = ap.parse_args()
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-")
    base, _, ref = kernel_times(args.T)
    rows = [choice(n, op_choice(n), **timings(base, n, 0.0)) for n in local.KEY_BLOCK]
    write(rows, out, gpu, args.T)
    for name, cfgs in CANDIDATES.items():
        for cfg in cfgs:
            if time.monotonic() - t0 > args.budget:
                rows.append(choice(name, cfg, error="budget"))
                continue
            try:
                row = run(name, cfg, args.T, ref)
            except Exception as e:  # a launch that does not fit (shared memory) is a row, not the end
                row = choice(name, cfg, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            rows.append(row)
            print(row, flush=True)
            write(rows, out, gpu, args.T)
    rows.sort(key=lambda r: r["kernel"])
    write(rows, out, gpu, args.T)
    print((out / f"tune-gdn-local-{gpu}.md").read_text())


if __name__ == "__main__":
    main()
