"""This checkout against another one on the GPU: bench_ops.py's rows (or bench_decode.py's fused step), run by each
tree's own script, one process per tree and round, alternating, and the two trees' medians side by side.

    git worktree add /tmp/base HEAD~1      # any checkout of the repository to compare against
    python benchmarks/profiling/ab_trees.py --base /tmp/base --T 131072 32768 8192
    python benchmarks/profiling/ab_trees.py --base /tmp/base --variant gla --impls loglinear loglinear_plain \
        --T 32768 --rounds 3 --out /tmp/ab
    python benchmarks/profiling/ab_trees.py --base /tmp/base --bench decode --variant gdn --T 65536 --batches 16 1

Each round runs the base tree's benchmark, then this tree's, each in a process of its own with its tree first on
PYTHONPATH, so each compiles or loads its own kernels and neither inherits the other's allocator or GPU clocks; the
rounds show the spread. --bench ops (the default): bench_ops.py's forward + backward medians at the paper setting
(bf16; its --shape and other options are its own), a row per (impl, T). --bench decode: bench_decode.py --kernel-only,
the fused decode step of one layer alone (the GPU time of one CUDA-graph replay, µs), a row per (variant, batch,
measure) and T: at positions drawn from [T/2, T), at p = T, with bf16 levels, and Gated DeltaNet's mean over the key
window's tokens from a turn. The table: each tree's value in each round, and this tree's median over the rounds
against the base's. Writes ab-<variant>-<gpu>.{json,md} (ab-decode-<variant>-<gpu> for the decode step) to --out
after every run (a cut keeps what ran): an experiment's record for a note, not a standing result of
benchmarks/results. Whether a change computes the same is bench_ops.py --check's and bench_decode.py's device checks'
question (run_gpu.sh checks and decode), not this script's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: loglinear
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_ops

import bench_ops  # noqa: E402
from loglinear.cli import check_script_options, refuse  # noqa: E402
from loglinear.ops.decode import KEY_WINDOW, MAX_KEY_WINDOW, key_window_size_ok  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROG = "ab_trees.py"
DECODE_MEASURES = {  # bench_decode.py's kernel row fields -> the table's names
    "log_linear_us": "drawn", "log_linear_bf16_us": "drawn, bf16 levels", "log_linear_worst_us": "at p = T",
    "window_mean_us": "per token over a window", "window_mean_bf16_us": "per token over a window, bf16 levels",
    "plain_us": "plain",
}


def bench_command(args, tree: Path, out: Path) -> tuple[list[str], str]:
    """The command that runs --bench in ``tree`` with its results under ``out``, and its files' prefix."""
    script = tree / "benchmarks" / f"bench_{args.bench}.py"
    Ts = [str(T) for T in args.T]
    if args.bench == "ops":
        return ([sys.executable, str(script), "--variant", args.variant, "--impls", *args.impls, "--T", *Ts,
                 "--name", "ab", "--out", str(out)], "ab-")
    return ([sys.executable, str(script), "--kernel-only", "--kernel-variants", args.variant, "--contexts", *Ts,
             "--batches", *map(str, args.batches), "--key-window", str(args.key_window), "--out", str(out)],
            "decode-")


def run_tree(args, tree: Path, out: Path) -> dict:
    """The --bench script of ``tree`` in a process of its own (the tree first on PYTHONPATH, run from the tree), its
    results written under ``out`` (an earlier run's removed first) -> that run's json (gpu, versions, rows)."""
    cmd, prefix = bench_command(args, tree, out)
    for old in out.glob(f"{prefix}*"):
        old.unlink()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]))
    run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{Path(cmd[1]).name} of {tree} exited {run.returncode}: {tail[0]}")
    (result,) = out.glob(f"{prefix}*.json")
    return measures(args.bench, json.loads(result.read_text()), result.stem.removeprefix(prefix))


def measures(bench: str, result: dict, gpu: str) -> dict:
    """A run's json (written as <prefix><gpu>.json) as {gpu, torch, triton, rows: [{row, T, value}]}: bench_ops.py's
    forward + backward ms per impl, or bench_decode.py's kernel rows' µs per (variant, batch, measure)."""
    if bench == "ops":
        rows = [{"row": r["impl"], "T": r["T"], "value": r["fwdbwd_ms"]} for r in result["rows"]]
    elif "kernel" in result:
        rows = [{"row": f"{r['variant']} B={r['batch']} {name}", "T": r["context"], "value": r[field]}
                for r in result["kernel"] for field, name in DECODE_MEASURES.items() if field in r]
    else:
        raise RuntimeError(f"bench_decode.py timed no kernel rows: {result.get('kernel_failed', 'none')}")
    return {"gpu": gpu, "torch": result["torch"], "triton": result["triton"], "rows": rows}


def table(runs: list[dict], label: str) -> list[str]:
    """Markdown rows: per (row, T) of the runs ({tree, round, rows}) each tree's value by round, the medians over
    rounds and this tree's against the base's; ``label`` names the first column."""
    rounds = sorted({r["round"] for r in runs})
    values: dict[tuple[str, int], dict[str, list[float]]] = {}
    for run in runs:
        for row in run["rows"]:
            values.setdefault((row["row"], row["T"]), {"base": [], "this": []})[run["tree"]].append(row["value"])
    head = [label, "T", *(f"base r{r}" for r in rounds), *(f"this r{r}" for r in rounds), "this / base"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (impl, T), by in sorted(values.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        cells = [f"{x:.4f}" for x in by["base"]] + [""] * (len(rounds) - len(by["base"]))
        cells += [f"{x:.4f}" for x in by["this"]] + [""] * (len(rounds) - len(by["this"]))
        ratio = (f"{statistics.median(by['this']) / statistics.median(by['base']):.3f}"
                 if by["base"] and by["this"] else "")
        lines.append(f"| {impl} | {T} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def write(runs: list[dict], out: Path, meta: dict) -> Path:
    """ab-<variant>-<gpu>.{json,md} (ab-decode-<variant>-<gpu>) under out (the gpu as the runs name it) -> the md's
    path."""
    gpu = runs[0]["gpu"]
    decode = meta["bench"] == "decode"
    stem = f"ab-{'decode-' if decode else ''}{meta['variant']}-{gpu}"
    (out / f"{stem}.json").write_text(json.dumps({**meta, "gpu": gpu, "runs": runs}, indent=1) + "\n")
    versions = sorted({f"torch {r['torch']}, triton {r['triton']}" for r in runs})
    what = ("The fused decode step of one layer, µs (bench_decode.py --kernel-only: the GPU time of one CUDA-graph "
            "replay, L2 flushed; drawn: the mean over positions drawn from [T/2, T))" if decode else
            "Forward + backward, ms (bench_ops.py's median)")
    lines = [f"# This tree against {meta['base']}: {meta['variant']}{' decoding' if decode else ''} ({gpu}, "
             f"{meta['date']})", "", f"{'; '.join(versions)}; `{meta['command']}`", "",
             f"This tree: {meta['this']}. {what}, each tree in a process of its own per round, the base first; the "
             "ratio is of the medians over the rounds.", "", *table(runs, "step" if decode else "impl")]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return out / f"{stem}.md"


def git_head(tree: Path) -> str:
    """The tree's commit and whether it has changes (for the record; '' outside git)."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    return f"{tree} at {head.stdout.strip() or '?'}" + (" with changes" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the checkout to compare against")
    ap.add_argument("--bench", choices=["ops", "decode"], default="ops",
                    help="bench_ops.py's rows, or bench_decode.py's fused step (--kernel-only)")
    ap.add_argument("--variant", choices=sorted(bench_ops.BENCHES), default="mamba2")
    ap.add_argument("--impls", nargs="+", help="ops: bench_ops.py's rows (default loglinear)",
                    choices=sorted(set(bench_ops.IMPLS + bench_ops.IMPLS_GDN + bench_ops.IMPLS_GLA)))
    ap.add_argument("--T", type=int, nargs="+", help="lengths (ops; default 131072 32768 8192) or contexts (decode; "
                    "default 65536)")
    ap.add_argument("--batches", type=int, nargs="+", help="decode: sequences per step (default 16 1)")
    ap.add_argument("--key-window", type=int, help=f"decode: Gated DeltaNet's key window (default {KEY_WINDOW})")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="/tmp/ab-trees")
    args = ap.parse_args(argv)
    decode_only = [name for name, x in (("--batches", args.batches), ("--key-window", args.key_window))
                   if x is not None]
    if args.bench == "ops" and decode_only:
        refuse(PROG, f"{' and '.join(decode_only)} {'apply' if len(decode_only) > 1 else 'applies'} to --bench "
                     "decode only")
    if args.bench == "decode" and args.impls is not None:
        refuse(PROG, "--impls applies to --bench ops only")
    args.T = args.T or ([131072, 32768, 8192] if args.bench == "ops" else [65536])
    args.impls, args.batches = args.impls or ["loglinear"], args.batches or [16, 1]
    args.key_window = KEY_WINDOW if args.key_window is None else args.key_window
    check_script_options(PROG, {"--T": (args.T, 1), "--rounds": (args.rounds, 1), "--batches": (args.batches, 1)})
    if not key_window_size_ok(args.key_window):
        refuse(PROG, f"--key-window must be a power of two from 2 to {MAX_KEY_WINDOW}, got {args.key_window}")
    base = Path(args.base).resolve()
    script = f"benchmarks/bench_{args.bench}.py"
    if not (base / script).is_file() or not (base / "loglinear").is_dir():
        refuse(PROG, f"--base must be a checkout of the repository (no {script} and loglinear/ under {base})")
    if base == ROOT:
        refuse(PROG, f"--base must be another checkout than this one ({ROOT})")
    if not torch.cuda.is_available():
        refuse(PROG, f"needs a CUDA GPU ({Path(script).name} times the kernels); none is visible")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"bench": args.bench, "variant": args.variant, "base": git_head(base), "this": git_head(ROOT),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python " + " ".join(["benchmarks/profiling/ab_trees.py"] + (argv or sys.argv[1:]))}
    runs = []
    for r in range(1, args.rounds + 1):
        for name, tree in (("base", base), ("this", ROOT)):
            try:
                result = run_tree(args, tree, out / f"{name}-r{r}")
            except RuntimeError as e:
                print(f"{PROG}: {e}", file=sys.stderr)
                sys.exit(1)
            runs.append({"tree": name, "round": r, **result})
            md = write(runs, out, meta)
            print(f"[round {r}] {name}: " + ", ".join(f"{x['row']} {x['T']}: {x['value']:.4f}"
                                                   for x in result["rows"]), flush=True)
    print(md.read_text())


if __name__ == "__main__":
    main()
