"""Host work of an op call on the Triton backend, per call layout: the torch ops and kernel launches of a forward +
backward, and its host time, with the kernels themselves stubbed out (CPU, Triton's interpreter).

    python benchmarks/bench_host.py                    # the CPU, every variant with kernels, about 1 minute

On a GPU every torch op and every launch costs host time (a few microseconds each) whatever its size, so the counts
say what a call's layout costs beyond its kernels: a state at a chunk boundary or inside a chunk, states at several
positions, packed sequences. Each layout holds --sequences sequences of --tokens tokens (B rows, or one row of packed
sequences, cu_seqlens), --heads value heads, one q/k group, K = V = --head-dim, fp32, chunk 64; a state's levels
take a gradient too. The kernels run nothing (their launches return at once; the outputs are whatever the buffers
held), so the host time is the Python, the torch ops on CPU tensors and the launch bookkeeping, not a GPU's; it is
the median of --repeats calls. Torch ops: every op dispatched but views, allocations and detaches. Writes
host-cpu.{json,md,png} with the command, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ["TRITON_INTERPRET"] = "1"  # before triton and loglinear are imported: the kernels on the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from loglinear.cli import check_script_options, refuse  # noqa: E402
from loglinear.fenwick import levels_needed  # noqa: E402
from loglinear.ops.api import attention  # noqa: E402
from loglinear.ops.finite import FiniteCheck  # noqa: E402
from loglinear.report import markdown_table, pyplot, save_figure, write_results  # noqa: E402
from loglinear.state import FenwickState  # noqa: E402
from loglinear.variants import get  # noqa: E402

VARIANTS = ("mamba2", "gla", "gated_deltanet")
INSIDE = 24  # a state inside a chunk: this many tokens before the layout's chunk-aligned position
NOT_COUNTED = ("aten.empty", "aten.detach", "aten.alias")  # allocations and autograd bookkeeping: no kernel


class _Count(TorchDispatchMode):
    """The torch ops dispatched while active, views and NOT_COUNTED left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view and not str(func).startswith(NOT_COUNTED)
        return func(*args, **(kwargs or {}))


class _Launches:
    """Every Triton launch returns at once while active; ``count`` says how many there were. The kernels' outputs
    are then unwritten buffers, so the finite-input check, which reads a per-channel gate's peak from one of them
    (GLA), answers that the inputs are finite, as they are (its ops still run and count); otherwise garbage there
    would send some calls down the path for non-finite inputs."""

    def __enter__(self) -> "_Launches":
        self.count, self._run, self._answer = 0, InterpretedFunction.run, FiniteCheck.__call__

        def run(kernel, *args, **kwargs) -> None:
            self.count += 1

        def answer(check: FiniteCheck) -> bool:
            self._answer(check)  # the same host work
            return True

        InterpretedFunction.run, FiniteCheck.__call__ = run, answer
        return self

    def __exit__(self, *exc) -> None:
        InterpretedFunction.run, FiniteCheck.__call__ = self._run, self._answer


def layouts(N: int, T: int) -> dict[str, tuple[list[int] | None, bool]]:
    """Layout name -> (the sequences' state positions or None, packed). T: a multiple of 64."""
    inside = [T - INSIDE + (i * 37) % 64 for i in range(N)]  # N positions inside chunks (37: odd, so all differ)
    return {
        "from position 0": (None, False),
        f"state at {T} (a chunk boundary)": ([T] * N, False),
        f"state at {T - INSIDE} (inside a chunk)": ([T - INSIDE] * N, False),
        f"states at {N} positions inside chunks": (inside, False),
        "packed, from position 0": (None, True),
        f"packed, states at {N} positions inside chunks": (inside, True),
    }


def call(name: str, N: int, T: int, heads: int, dim: int, positions: list[int] | None, packed: bool
         ) -> Callable[[], torch.Tensor]:
    """The layout's forward on the triton backend, returning a loss to take the backward of."""
    gen = torch.Generator().manual_seed(0)
    B, rows = (1, N * T) if packed else (N, T)
    q, k, v = (torch.randn(B, rows, *shape, generator=gen) for shape in ((1, dim), (1, dim), (heads, dim)))
    gates = get(name).sample_gates(B, rows, heads, dim, generator=gen)
    top = max(positions) if positions else 0
    lam = torch.rand(B, rows, heads, levels_needed(top + T), generator=gen)
    state = None
    if positions is not None:
        levels = torch.randn(N, levels_needed(top + 1), heads, dim, dim, generator=gen)
        state = FenwickState(levels, torch.tensor(positions))
    for x in [q, k, v, *gates.values(), lam, *([state.levels] if state is not None else [])]:
        x.requires_grad_()
    cu_seqlens = torch.arange(0, N * T + 1, T) if packed else None

    def forward() -> torch.Tensor:
        o, _ = attention(name, q, k, v, gates, lam, initial_state=state, cu_seqlens=cu_seqlens, backend="triton")
        return o.sum()

    return forward


def measure(forward: Callable[[], torch.Tensor], repeats: int) -> dict:
    """Torch ops and launches of the forward and of the backward, and the median host ms of a forward + backward
    (after one call that builds the layout's cached tables: steady-state calls)."""
    with _Launches() as launches:
        forward().backward()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward().backward()
            times.append((time.perf_counter() - t0) * 1e3)
        launches.count = 0
        with _Count() as fwd:
            loss = forward()
        fwd_launches = launches.count
        with _Count() as bwd:
            loss.backward()
    return {"fwd_ops": fwd.ops, "bwd_ops": bwd.ops, "fwd_launches": fwd_launches,
            "bwd_launches": launches.count - fwd_launches, "host_ms": statistics.median(times)}


def run(args) -> list[dict]:
    rows = []
    specs = layouts(args.sequences, args.tokens)
    cases = [(name, layout, spec) for name in args.variants for layout, spec in specs.items()]
    for i, (name, layout, (positions, packed)) in enumerate(cases, 1):
        forward = call(name, args.sequences, args.tokens, args.heads, args.head_dim, positions, packed)
        rows.append({"variant": name, "layout": layout, **measure(forward, args.repeats)})
        r = rows[-1]
        print(f"[{i}/{len(cases)}] {get(name).title}, {layout}: {r['fwd_ops']} + {r['bwd_ops']} torch ops, "
              f"{r['fwd_launches']} + {r['bwd_launches']} launches, {r['host_ms']:.2f} ms", flush=True)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Host work per call layout, kernels stubbed ({meta['device']})", "",
             f"{meta['versions']}, {meta['date']}; `{meta['command']}`", "",
             f"{meta['sequences']} sequences of {meta['tokens']} tokens, {meta['heads']} value heads, one q/k group, "
             f"K = V = {meta['head_dim']}, fp32, chunk 64, the triton backend with its kernels stubbed; forward + "
             "backward, a state's levels taking a gradient too. Torch ops: dispatched ops but views, allocations and "
             f"detaches; host ms: the median of {meta['repeats']} calls on this CPU (the torch ops run on CPU "
             "tensors), not a GPU's host time.", ""]
    header = ["layout", "torch ops, fwd + bwd", "launches, fwd + bwd", "host ms"]
    for name in dict.fromkeys(r["variant"] for r in rows):
        table = [[r["layout"], f"{r['fwd_ops']} + {r['bwd_ops']}", f"{r['fwd_launches']} + {r['bwd_launches']}",
                  f"{r['host_ms']:.2f}"] for r in rows if r["variant"] == name]
        lines += [f"## {get(name).title}", "", markdown_table(header, table)]
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    names = list(dict.fromkeys(r["variant"] for r in rows))
    layouts_ = list(dict.fromkeys(r["layout"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ops = [next(r["fwd_ops"] + r["bwd_ops"] for r in rows if (r["variant"], r["layout"]) == (name, lay))
               for lay in layouts_]
        ax.barh([j + i * width for j in range(len(layouts_))], ops, height=width, label=get(name).title)
    ax.set_yticks([j + width * (len(names) - 1) / 2 for j in range(len(layouts_))], layouts_, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("torch ops of a forward + backward (kernels stubbed)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence, a multiple of 64")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    check_script_options("bench_host.py", {
        "--sequences": (args.sequences, 1), "--tokens": (args.tokens, 64), "--heads": (args.heads, 1),
        "--head-dim": (args.head_dim, 1), "--repeats": (args.repeats, 1)})
    if args.tokens % 64:
        refuse("bench_host.py", f"--tokens must be a multiple of 64, got {args.tokens}")
    meta = {"device": f"cpu, {torch.get_num_threads()} threads", "sequences": args.sequences, "tokens": args.tokens,
            "heads": args.heads, "head_dim": args.head_dim, "repeats": args.repeats,
            "versions": f"torch {torch.__version__}, triton {triton.__version__}",
            "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "command": "python " + " ".join([os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)])}
    rows = run(args)
    write_results(os.path.join(args.out, "host-cpu"), meta, rows, markdown(rows, meta), plot)


if __name__ == "__main__":
    main()
