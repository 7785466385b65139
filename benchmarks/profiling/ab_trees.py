"""This checkout against another one on the GPU: bench_ops.py's rows, run by each tree's own bench_ops.py, one process
per tree and round, alternating, and the two trees' forward + backward medians side by side.

    git worktree add /tmp/base HEAD~1      # any checkout of the repository to compare against
    python benchmarks/profiling/ab_trees.py --base /tmp/base --T 131072 32768 8192
    python benchmarks/profiling/ab_trees.py --base /tmp/base --variant gla --impls loglinear loglinear_plain \
        --T 32768 --rounds 3 --out /tmp/ab

Each round runs the base tree's benchmark, then this tree's, each in a process of its own with its tree first on
PYTHONPATH, so each compiles or loads its own kernels and neither inherits the other's allocator or GPU clocks; the
rounds show the spread. Paper setting (bf16; bench_ops.py's --shape and other options are its own). The table: per row
(impl, T) each tree's forward + backward median in each round, and this tree's median over the rounds against the
base's. Writes ab-<variant>-<gpu>.{json,md} to --out after every run (a cut keeps what ran): an experiment's record
for a note, not a standing result of benchmarks/results. Whether a change computes the same is bench_ops.py --check's
question (run_gpu.sh checks), not this script's.
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

ROOT = Path(__file__).resolve().parents[2]
PROG = "ab_trees.py"


def run_tree(tree: Path, variant: str, impls: list[str], Ts: list[int], out: Path) -> dict:
    """bench_ops.py of ``tree`` in a process of its own (the tree first on PYTHONPATH, run from the tree), its
    results written under ``out`` (ab-<gpu>.*, an earlier run's removed first) -> that run's json (gpu, versions,
    rows of impl, T, fwd_ms, fwdbwd_ms, peak_gib)."""
    for old in out.glob("ab-*"):
        old.unlink()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, str(tree / "benchmarks" / "bench_ops.py"), "--variant", variant, "--impls", *impls,
           "--T", *map(str, Ts), "--name", "ab", "--out", str(out)]
    run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"bench_ops.py of {tree} exited {run.returncode}: {tail[0]}")
    (result,) = out.glob("ab-*.json")
    return json.loads(result.read_text())


def table(runs: list[dict]) -> list[str]:
    """Markdown rows: per (impl, T) of the runs ({tree, round, rows}) each tree's forward + backward ms by round,
    the medians over rounds and this tree's against the base's."""
    rounds = sorted({r["round"] for r in runs})
    ms: dict[tuple[str, int], dict[str, list[float]]] = {}
    for run in runs:
        for row in run["rows"]:
            ms.setdefault((row["impl"], row["T"]), {"base": [], "this": []})[run["tree"]].append(row["fwdbwd_ms"])
    head = ["impl", "T", *(f"base r{r}" for r in rounds), *(f"this r{r}" for r in rounds), "this / base"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (impl, T), by in sorted(ms.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        cells = [f"{x:.4f}" for x in by["base"]] + [""] * (len(rounds) - len(by["base"]))
        cells += [f"{x:.4f}" for x in by["this"]] + [""] * (len(rounds) - len(by["this"]))
        ratio = (f"{statistics.median(by['this']) / statistics.median(by['base']):.3f}"
                 if by["base"] and by["this"] else "")
        lines.append(f"| {impl} | {T} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def write(runs: list[dict], out: Path, meta: dict) -> Path:
    """ab-<variant>-<gpu>.{json,md} under out (the gpu as the runs name it) -> the md's path."""
    gpu = runs[0]["gpu"]
    stem = f"ab-{meta['variant']}-{gpu}"
    (out / f"{stem}.json").write_text(json.dumps({**meta, "gpu": gpu, "runs": runs}, indent=1) + "\n")
    versions = sorted({f"torch {r['torch']}, triton {r['triton']}" for r in runs})
    lines = [f"# This tree against {meta['base']}: {meta['variant']} ({gpu}, {meta['date']})", "",
             f"{'; '.join(versions)}; `{meta['command']}`", "",
             f"This tree: {meta['this']}. Forward + backward, ms (bench_ops.py's median), each tree in a process of "
             "its own per round, the base first; the ratio is of the medians over the rounds.", "", *table(runs)]
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
    ap.add_argument("--variant", choices=sorted(bench_ops.BENCHES), default="mamba2")
    ap.add_argument("--impls", nargs="+", default=["loglinear"],
                    choices=sorted(set(bench_ops.IMPLS + bench_ops.IMPLS_GDN + bench_ops.IMPLS_GLA)))
    ap.add_argument("--T", type=int, nargs="+", default=[131072, 32768, 8192])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="/tmp/ab-trees")
    args = ap.parse_args(argv)
    check_script_options(PROG, {"--T": (args.T, 1), "--rounds": (args.rounds, 1)})
    base = Path(args.base).resolve()
    if not (base / "benchmarks" / "bench_ops.py").is_file() or not (base / "loglinear").is_dir():
        refuse(PROG, f"--base must be a checkout of the repository (no benchmarks/bench_ops.py and loglinear/ under "
                     f"{base})")
    if base == ROOT:
        refuse(PROG, f"--base must be another checkout than this one ({ROOT})")
    if not torch.cuda.is_available():
        refuse(PROG, "needs a CUDA GPU (bench_ops.py times the kernels); none is visible")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"variant": args.variant, "base": git_head(base), "this": git_head(ROOT),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python " + " ".join(["benchmarks/profiling/ab_trees.py"] + (argv or sys.argv[1:]))}
    runs = []
    for r in range(1, args.rounds + 1):
        for name, tree in (("base", base), ("this", ROOT)):
            try:
                result = run_tree(tree, args.variant, args.impls, args.T, out / f"{name}-r{r}")
            except RuntimeError as e:
                print(f"{PROG}: {e}", file=sys.stderr)
                sys.exit(1)
            runs.append({"tree": name, "round": r, **result})
            md = write(runs, out, meta)
            print(f"[round {r}] {name}: " + ", ".join(f"{x['impl']} {x['T']}: {x['fwdbwd_ms']:.4f} ms"
                                                   for x in result["rows"]), flush=True)
    print(md.read_text())


if __name__ == "__main__":
    main()
