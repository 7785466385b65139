"""The portable torch chunk path (backend="torch", any device): forward and forward + backward time against T,
log-linear and plain, for every registered variant, and the same tokens as packed sequences.

    python benchmarks/bench_torch_path.py                          # the CPU, T = 1K .. 16K, about 1 minute on 2 cores
    python benchmarks/bench_torch_path.py --device cuda --lengths 4096 65536

Inputs: B = 1, one q/k group, --heads value heads, K = V = --head-dim, fp32, chunk 64, the variant's sample gates,
lambda in [0, 1). Each time is the fastest of --repeats calls after one warm-up call (on a shared CPU the
slower ones measure the neighbours). The packed rows cut the longest T
into sequences of --packed tokens (cu_seqlens). Time per token should grow with log T (log-linear) or not at all
(plain): the path is O(T log T). Writes torch-path-<device>.{json,md,png} (e.g. torch-path-cpu) with the command,
versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from loglinear.cli import check_script_options, refuse  # noqa: E402
from loglinear.fenwick import levels_needed  # noqa: E402
from loglinear.ops.api import attention  # noqa: E402
from loglinear.report import (  # noqa: E402
    ARCH_LABELS, ARCH_STYLE, machine_name, markdown_table, pyplot, save_figure, write_results,
)
from loglinear.variants import REGISTRY, get  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(name: str, log_linear: bool, T: int, heads: int, dim: int, device: torch.device, repeats: int,
              packed: int | None = None) -> dict:
    """The fastest forward and forward + backward ms of one call on T tokens (packed: sequences of ``packed``
    tokens)."""
    gen = torch.Generator().manual_seed(T)
    make = lambda *shape, f=torch.randn: f(*shape, generator=gen).to(device)  # noqa: E731
    q, k, v = make(1, T, 1, dim), make(1, T, 1, dim) / dim**0.5, make(1, T, heads, dim)
    gates = {n: x.to(device) for n, x in get(name).sample_gates(1, T, heads, dim, generator=gen).items()}
    lam = make(1, T, heads, levels_needed(T), f=torch.rand) if log_linear else None
    cu_seqlens = torch.arange(0, T + 1, packed, device=device) if packed else None
    leaves = [x.requires_grad_() for x in (q, k, v, *gates.values(), *([lam] if log_linear else []))]

    def forward() -> torch.Tensor:
        return attention(name, q, k, v, gates, lam, cu_seqlens=cu_seqlens, backend="torch")[0]

    times: dict[str, list[float]] = {"fwd_ms": [], "fwdbwd_ms": []}
    for i in range(repeats + 1):  # the first call warms up
        for x in leaves:
            x.grad = None
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            forward()
        sync(device)
        t1 = time.perf_counter()
        forward().sum().backward()
        sync(device)
        t2 = time.perf_counter()
        if i:
            times["fwd_ms"].append((t1 - t0) * 1e3)
            times["fwdbwd_ms"].append((t2 - t1) * 1e3)
    return {key: min(values) for key, values in times.items()}


def run(args, device: torch.device) -> list[dict]:
    rows = []
    cases = [(n, ll, T, None) for n in args.variants for ll in (True, False) for T in args.lengths]
    cases += [(n, ll, max(args.lengths), args.packed) for n in args.variants for ll in (True, False)]
    for i, (name, ll, T, packed) in enumerate(cases, 1):
        r = time_call(name, ll, T, args.heads, args.head_dim, device, args.repeats, packed)
        rows.append({"variant": name, "log_linear": ll, "T": T, "packed": packed, **r,
                     "us_per_token": r["fwdbwd_ms"] * 1e3 / T})
        label = f"{'LL ' if ll else ''}{get(name).title} T={T}" + (f" packed by {packed}" if packed else "")
        print(f"[{i}/{len(cases)}] {label}: fwd {r['fwd_ms']:.1f} ms, fwd+bwd {r['fwdbwd_ms']:.1f} ms", flush=True)
    return rows


def arch(row: dict) -> str:
    return ("ll_" if row["log_linear"] else "") + row["variant"]


def _pair(label: str, ll: dict, plain: dict) -> list:
    """One table row: a log-linear call and the plain one on the same tokens."""
    formats = (("fwd_ms", 1), ("fwdbwd_ms", 1), ("us_per_token", 2))
    cells = [f"{r[key]:.{digits}f}" for r in (ll, plain) for key, digits in formats]
    return [label, *cells, f"{ll['fwdbwd_ms'] / plain['fwdbwd_ms']:.2f}"]


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# The torch chunk path ({meta['device']})", "",
             f"{meta['versions']}, {meta['date']}; `{meta['command']}`", "",
             f"B = 1, one q/k group, {meta['heads']} value heads, K = V = {meta['head_dim']}, fp32, chunk 64; "
             f"the fastest of {meta['repeats']} calls. Forward (no gradients) and forward + backward in ms; us per "
             "token of forward + backward. The last row: the longest T as packed sequences (cu_seqlens).", ""]
    header = ["T", "LL fwd", "LL fwd+bwd", "LL us/token", "plain fwd", "plain fwd+bwd", "plain us/token", "LL / plain"]
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        table = []
        for T, packed in dict.fromkeys((r["T"], r["packed"]) for r in mine):
            ll, plain = (next(r for r in mine if (r["T"], r["packed"], r["log_linear"]) == (T, packed, f))
                         for f in (True, False))
            table.append(_pair(f"{T:,}" + (f" as {T // packed} x {packed}" if packed else ""), ll, plain))
        lines += [f"## {get(name).title}", "", markdown_table(header, table)]
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    dense = [r for r in rows if not r["packed"]]
    for a in dict.fromkeys(arch(r) for r in dense):
        pts = sorted((r["T"], r["us_per_token"]) for r in dense if arch(r) == a)
        ax.plot(*zip(*pts), marker="o", label=ARCH_LABELS[a], **ARCH_STYLE[a])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("forward + backward, us per token")
    ax.set_ylim(bottom=0)
    ax.set_title("torch chunk path")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", nargs="+", default=list(REGISTRY), choices=list(REGISTRY))
    parser.add_argument("--lengths", nargs="+", type=int, default=[1 << 10, 1 << 12, 1 << 14])
    parser.add_argument("--packed", type=int, default=256, help="tokens per sequence of the packed rows")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    check_script_options("bench_torch_path.py", {
        "--lengths": (args.lengths, 1), "--packed": (args.packed, 1), "--heads": (args.heads, 1),
        "--head-dim": (args.head_dim, 1), "--repeats": (args.repeats, 1)}, args.device)
    if max(args.lengths) % args.packed:
        refuse("bench_torch_path.py", f"--packed must divide the longest of --lengths ({max(args.lengths)}), got "
                                      f"{args.packed}")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    name = machine_name(device)
    meta = {"device": name if cuda else f"cpu, {torch.get_num_threads()} threads, {platform.machine()}",
            "versions": f"torch {torch.__version__}", "heads": args.heads, "head_dim": args.head_dim,
            "repeats": args.repeats, "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "command": "python " + " ".join([os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)])}
    rows = run(args, device)
    write_results(os.path.join(args.out, f"torch-path-{name}"), meta, rows, markdown(rows, meta), plot)


if __name__ == "__main__":
    main()
