"""Hardware counters of the op's kernels (Nsight Compute): occupancy, throughput, where the warps wait.

Two steps, the first on the GPU under ncu (the third of three forward+backward calls is profiled: skip the
kernels of the first two, 4 per call for the Mamba-2 kernels named below):

    ncu --clock-control none --set full --launch-skip 8 --launch-count 4 -o /tmp/m2 -f \\
        --kernel-name regex:"mamba2_chunk_fwd|mamba2_chunk_bwd|mamba2_level_grad" \\
        python benchmarks/profiling/ncu_kernels.py run --variant mamba2 --T 32768
    ncu -i /tmp/m2.ncu-rep --page details --csv > /tmp/m2.csv
    python benchmarks/profiling/ncu_kernels.py summary /tmp/m2.csv --variant mamba2 --gpu H100 \\
        --versions "torch 2.11.0+cu130, triton 3.6.0" --out benchmarks/results

``run`` calls bench_ops.py's ``loglinear`` row (paper setting: B = 2, 48 value heads, one q/k group, K = 128,
V = 64, bf16) --calls times; ``summary`` turns ncu's details page into ncu-<variant>-<gpu>.md: per kernel, the
counters that say whether it waits on memory, on latency or on its occupancy, and ncu's findings with their
estimated speedups.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/profiling/: profile_state

from loglinear.cli import refuse  # noqa: E402

# (ncu metric name, column title), in the table's order
METRICS = [
    ("Duration", "duration"),
    ("Registers Per Thread", "registers"),
    ("Theoretical Occupancy", "occupancy, theoretical"),
    ("Achieved Occupancy", "achieved"),
    ("Executed Ipc Active", "IPC"),
    ("Issue Slots Busy", "issue slots busy"),
    ("Eligible Warps Per Scheduler", "eligible warps / scheduler"),
    ("Warp Cycles Per Issued Instruction", "cycles between issues"),
    ("DRAM Throughput", "DRAM throughput"),
    ("L2 Hit Rate", "L2 hit rate"),
    ("L2 Cache Throughput", "L2 throughput"),
]
MIN_SPEEDUP = 10.0  # findings listed: ncu's estimated speedup at least this (%)
FINDING_SENTENCES = 2  # of each finding's text: what it found and its number (the rest is ncu's general advice)


def run(variant: str, T: int, calls: int) -> None:
    """calls forward+backward calls of bench_ops' loglinear row (the kernels ncu profiles; profile_state.py's
    closure)."""
    import torch

    from profile_state import fwd_bwd

    step = fwd_bwd(variant, T, with_state=False)
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    print(f"{calls} forward+backward calls of {variant} at T = {T}")


def first_sentences(text: str, n: int) -> str:
    """The first n sentences of text, whitespace collapsed (a sentence ends at . ! or ? before a capital)."""
    return " ".join(re.split(r"(?<=[.!?])\s+(?=[A-Z])", " ".join(text.split()))[:n])


def read_details(path: Path) -> tuple[dict[str, dict[str, str]], dict[str, list[tuple[float, str, str]]]]:
    """ncu's details page (CSV): {kernel: {metric: "value unit"}}, {kernel: [(speedup %, section, finding)]}
    (the first profiled launch of each kernel)."""
    metrics: dict[str, dict[str, str]] = {}
    findings: dict[str, list[tuple[float, str, str]]] = {}
    first_id: dict[str, str] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            kernel = row.get("Kernel Name")
            if not kernel or first_id.setdefault(kernel, row["ID"]) != row["ID"]:
                continue
            if row.get("Metric Name"):
                value = f"{row['Metric Value']} {row['Metric Unit']}".strip()
                metrics.setdefault(kernel, {})[row["Metric Name"]] = value
            text, speedup = row.get("Rule Description") or "", row.get("Estimated Speedup") or ""
            if text and speedup:
                entry = (float(speedup), row["Section Name"], first_sentences(text, FINDING_SENTENCES))
                if entry not in findings.setdefault(kernel, []):
                    findings[kernel].append(entry)
    if not metrics:
        raise ValueError(f"{path} holds no kernel metrics (expected ncu's --page details --csv)")
    return metrics, findings


def summary(path: Path, variant: str, gpu: str, versions: str, out: Path) -> Path:
    """Write ncu-<variant>-<gpu>.md from the details CSV at path; returns its path."""
    metrics, findings = read_details(path)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# Hardware counters of the {variant} kernels ({gpu})",
        "",
        f"{versions}, {date}; `python benchmarks/profiling/ncu_kernels.py run --variant {variant} ...` under "
        "`ncu --clock-control none --set full` (the module docstring has the commands), one forward+backward of "
        "bench_ops.py's `loglinear` row at the paper setting, bf16.",
        "",
        "| kernel | " + " | ".join(title for _, title in METRICS) + " |",
        "|---" * (len(METRICS) + 1) + "|",
    ]
    for kernel, values in metrics.items():
        lines.append(f"| `{kernel}` | " + " | ".join(values.get(name, "—") for name, _ in METRICS) + " |")
    lines += ["", f"## ncu's findings (estimated speedup >= {MIN_SPEEDUP:g}%)", ""]
    for kernel, entries in findings.items():
        for speedup, section, text in sorted(entries, reverse=True):
            if speedup >= MIN_SPEEDUP:
                lines.append(f"- `{kernel}`, {section}, {speedup:g}%: {text}")
    target = out / f"ncu-{variant}-{gpu}.md"
    out.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(lines) + "\n")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="the forward+backward calls to profile (under ncu, on the GPU)")
    p_run.add_argument("--variant", default="mamba2", choices=["mamba2", "gdn", "gla"])
    p_run.add_argument("--T", type=int, default=32768)
    p_run.add_argument("--calls", type=int, default=3)
    p_sum = sub.add_parser("summary", help="ncu's details page (CSV) -> ncu-<variant>-<gpu>.md")
    p_sum.add_argument("csv", type=Path)
    p_sum.add_argument("--variant", default="mamba2", choices=["mamba2", "gdn", "gla"])
    p_sum.add_argument("--gpu", required=True, help="the GPU's short name for the file, e.g. H100")
    p_sum.add_argument("--versions", required=True, help="the run's versions, e.g. 'torch 2.11.0+cu130, triton 3.6.0'")
    p_sum.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.command == "run":
        if args.T < 1 or args.calls < 1:
            refuse("ncu_kernels.py", f"--T and --calls must be >= 1, got {args.T} and {args.calls}")
        run(args.variant, args.T, args.calls)
    else:
        if not args.csv.is_file():
            refuse("ncu_kernels.py", f"no such file {args.csv}")
        try:
            print(summary(args.csv, args.variant, args.gpu, args.versions, args.out))
        except ValueError as error:
            refuse("ncu_kernels.py", str(error))


if __name__ == "__main__":
    main()
