"""``loglinear mqar``: multi-query associative recall, a sweep over architectures x widths x seeds x
learning rates, 2-layer models as in the paper; best learning rate per (model, width, seed).

Each run trains on a mixture of KV-pair counts at one sequence length and reports the accuracy over all
query positions of a held-out set (different seed). Runs are independent: with --workers N they go to N
processes (on one GPU they share it, which packs many small runs concurrently).

Writes <out>.json (one row per run: model, log_linear, d_model, seed, lr, accuracy, ...), <out>.md (table)
and <out>.png (accuracy vs width).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from loglinear.data.mqar import IGNORE_INDEX, mqar_batch
from loglinear.eval.report import ARCH_LABELS, ARCH_STYLE, markdown_table, pyplot, write_json
from loglinear.train.factory import ARCHS, build_model, count_parameters, family, is_log_linear
from loglinear.train.loop import cosine_schedule, lm_loss

__all__ = ["MQARRun", "GPU_SWEEP_ARGS", "train_mqar", "sweep", "summarize", "add_arguments", "base_run", "run"]


@dataclass(frozen=True)
class MQARRun:
    arch: str
    d_model: int
    seed: int
    lr: float
    seq_len: int = 32
    kv_pairs: tuple[int, ...] = (2, 4)
    vocab_size: int = 64
    n_layers: int = 2
    train_examples: int = 8192
    test_examples: int = 512
    epochs: int = 4
    batch_size: int = 64
    chunk_size: int = 16  # of the recurrent models' chunkwise ops (16 is fastest at these lengths on a CPU)
    device: str = "cpu"
    bf16: bool = True  # autocast on CUDA


def _data(run: MQARRun, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    per = math.ceil(n / len(run.kv_pairs))
    parts = [mqar_batch(per, run.seq_len, kv, run.vocab_size, seed=seed * 1000 + kv) for kv in run.kv_pairs]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@torch.no_grad()
def accuracy(model, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int, device: str,
             bf16: bool = True) -> float:
    """Fraction of query positions (targets != -100) whose argmax prediction is the value."""
    hit = total = 0
    for i in range(0, len(inputs), batch_size):
        x, y = inputs[i : i + batch_size].to(device), targets[i : i + batch_size].to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16 and device.startswith("cuda")):
            pred = model(input_ids=x, use_cache=False).logits.argmax(-1)
        mask = y != IGNORE_INDEX
        hit += int((pred[mask] == y[mask]).sum())
        total += int(mask.sum())
    return hit / total


def train_mqar(run: MQARRun, on_step: Callable[[int, torch.Tensor], None] | None = None) -> dict:
    """Train one model on MQAR; returns the run's fields plus accuracy, params, seconds.

    on_step(step, loss) is called after every optimizer step (step from 1; loss: the 0-dim tensor, not synced).
    """
    t0 = time.perf_counter()
    torch.manual_seed(run.seed)
    x, y = (t.to(run.device) for t in _data(run, run.train_examples, seed=2 * run.seed))
    xt, yt = _data(run, run.test_examples, seed=2 * run.seed + 1)
    extra = {} if run.arch == "transformer" else {"chunk_size": run.chunk_size}
    model = build_model(run.arch, vocab_size=run.vocab_size, d_model=run.d_model, n_layers=run.n_layers,
                        n_heads=1, max_seq_len=run.seq_len, seed=run.seed, **extra).to(run.device)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=0.1)
    steps_per_epoch = len(x) // run.batch_size
    total = run.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_schedule(s, total // 10, total, 0.0))
    gen = torch.Generator().manual_seed(run.seed)
    amp = run.bf16 and run.device.startswith("cuda")
    for _ in range(run.epochs):
        perm = torch.randperm(len(x), generator=gen).to(run.device)
        for i in range(steps_per_epoch):
            idx = perm[i * run.batch_size : (i + 1) * run.batch_size]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = lm_loss(model, x[idx], y[idx])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if on_step is not None:
                on_step(sched.last_epoch, loss.detach())
    model.eval()
    acc = accuracy(model, xt, yt, 4 * run.batch_size, run.device, run.bf16)
    row = asdict(run)
    row.update(model=family(run.arch), log_linear=is_log_linear(run.arch), accuracy=acc,
               final_loss=float(loss.detach()), params=count_parameters(model), seconds=round(time.perf_counter() - t0, 1))
    return row


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def sweep(runs: list[MQARRun], workers: int = 1, threads: int | None = None,
          max_seconds: float | None = None, on_row: Callable[[list[dict]], None] | None = None,
          retries: int = 1) -> list[dict]:
    """Run `runs` in order (in `workers` processes when > 1), with a progress bar; no run starts after
    max_seconds (the rest are skipped). A failed run is tried again up to `retries` times after the others
    (its row then says "attempts"). on_row(rows so far) is called after every finished run.
    Returns one row per finished run."""
    deadline = time.monotonic() + (max_seconds if max_seconds is not None else math.inf)
    rows = []
    bar = tqdm(total=len(runs), desc="mqar", dynamic_ncols=True)
    pending = list(runs)
    for attempt in range(1, retries + 2):
        failed = []
        for run, row in _execute(pending, workers, threads, deadline):
            if "error" in row and attempt <= retries:
                failed.append(run)
                continue
            row["attempts"] = attempt
            rows.append(row)
            result = f"{row['accuracy']:.2f}" if "accuracy" in row else "FAILED"
            bar.set_postfix(last=f"{row['arch']} d{row['d_model']}: {result}")
            bar.update()
            if on_row is not None:
                on_row(_ordered(rows))
        pending = failed
        if not pending:
            break
    bar.close()
    if len(rows) < len(runs):
        print(f"mqar: {len(runs) - len(rows)} of {len(runs)} runs skipped at the {max_seconds} s limit")
    return _ordered(rows)


def _execute(runs: list[MQARRun], workers: int, threads: int | None,
             deadline: float) -> Iterator[tuple[MQARRun, dict]]:
    """(run, row) for each run started before the deadline, in this process or in `workers` processes.

    On a GPU every run gets a fresh process: a CUDA error (an illegal memory access, say) poisons its
    process's context for good, and would otherwise fail every later run of that worker.
    """
    if workers <= 1:
        for r in runs:
            row = _run_before(r, deadline)
            if row is None:
                return
            yield r, row
        return
    threads = threads or max(1, torch.get_num_threads() // workers)
    fresh = 1 if any(r.device.startswith("cuda") for r in runs) else None
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                             initargs=(threads,), max_tasks_per_child=fresh) as pool:
        futures = {pool.submit(_run_before, r, deadline): r for r in runs}
        for fut in as_completed(futures):
            if fut.result() is not None:
                yield futures[fut], fut.result()


def _ordered(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (ARCHS.index(r["arch"]), r["d_model"], r["seed"], r["lr"]))


def _run_before(run: MQARRun, deadline: float) -> dict | None:
    """train_mqar(run) unless the (monotonic-clock) deadline has passed; a failing run gives a row with
    "error" instead of "accuracy" (one bad run does not end the sweep)."""
    if time.monotonic() > deadline:
        return None
    try:
        return train_mqar(run)
    except Exception as e:  # noqa: BLE001 -- reported in the results, the sweep goes on
        return dict(asdict(run), model=family(run.arch), log_linear=is_log_linear(run.arch),
                    error=f"{type(e).__name__}: {str(e)[:300]}", traceback=traceback.format_exc()[-3000:])


def summarize(rows: list[dict]) -> dict[tuple[str, int], float]:
    """(arch, d_model) -> mean over seeds of the best accuracy over learning rates (failed runs left out)."""
    best: dict[tuple[str, int, int], float] = {}
    for r in (r for r in rows if "accuracy" in r):
        key = (r["arch"], r["d_model"], r["seed"])
        best[key] = max(best.get(key, 0.0), r["accuracy"])
    out: dict[tuple[str, int], list[float]] = {}
    for (arch, d, _), acc in best.items():
        out.setdefault((arch, d), []).append(acc)
    return {k: sum(v) / len(v) for k, v in out.items()}


def report(rows: list[dict], out: Path, title: str) -> str:
    """Write out.{json,md,png}; returns the markdown."""
    summary = summarize(rows)
    archs = [a for a in ARCHS if any(k[0] == a for k in summary)]
    widths = sorted({k[1] for k in summary})
    table = markdown_table(["model"] + [f"d={d}" for d in widths],
                           [[ARCH_LABELS[a]] + [summary.get((a, d), float("nan")) for d in widths] for a in archs])
    first = rows[0]
    md = (f"# {title}\n\nMQAR accuracy (mean over seeds of the best learning rate), seq_len {first['seq_len']}, "
          f"KV pairs {list(first['kv_pairs'])}, vocab {first['vocab_size']}, {first['n_layers']} layers, "
          f"{first['epochs']} epochs x {first['train_examples']} examples, {len(rows)} runs "
          f"(chance: {2 / first['vocab_size']:.3f}).\n\n{table}")
    failed = [r for r in rows if "error" in r]
    if failed:
        md += f"\n{len(failed)} runs failed:\n\n" + "".join(
            f"- {r['arch']} d={r['d_model']} seed {r['seed']} lr {r['lr']}: {r['error']}\n" for r in failed)
    write_json(out.with_suffix(".json"), rows)
    out.with_suffix(".md").write_text(md)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for a in archs:
        ax.plot(widths, [summary.get((a, d), float("nan")) for d in widths], marker="o", label=ARCH_LABELS[a],
                **ARCH_STYLE[a])
    ax.set(xscale="log", xlabel="d_model", ylabel="accuracy", title=title, ylim=(0, 1.02))
    ax.set_xticks(widths, [str(d) for d in widths])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    return md


# The paper's setting on a GPU (seq 256, 4-64 KV pairs, widths 16/32/64) as `loglinear mqar` arguments
GPU_SWEEP_ARGS = ("--widths 16 32 64 --seeds 0 1 --lrs 1e-2 3e-3 --seq-len 256 --kv-pairs 4 8 16 32 64 "
                  "--vocab-size 8192 --train-examples 20000 --test-examples 1000 --epochs 8 --batch-size 64 "
                  "--chunk-size 64")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    d = MQARRun("transformer", 0, 0, 0.0)
    p.add_argument("--widths", nargs="+", type=int, default=[16, 32])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--lrs", nargs="+", type=float, default=[1e-2])
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--kv-pairs", nargs="+", type=int, default=list(d.kv_pairs))
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--layers", type=int, default=d.n_layers)
    p.add_argument("--train-examples", type=int, default=d.train_examples)
    p.add_argument("--test-examples", type=int, default=d.test_examples)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="chunk of the recurrent models' ops")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workers", type=int, default=2, help="processes running runs concurrently")
    p.add_argument("--max-seconds", type=float, default=None, help="start no run after this many seconds")
    p.add_argument("--out", default="runs/mqar/mqar-cpu", help="output path stem: writes .json, .md, .png")


def base_run(args: argparse.Namespace) -> MQARRun:
    """The settings every run of the parsed arguments shares (arch, width, seed, lr left at placeholders)."""
    return MQARRun(arch="transformer", d_model=0, seed=0, lr=0.0, seq_len=args.seq_len,
                   kv_pairs=tuple(args.kv_pairs), vocab_size=args.vocab_size, n_layers=args.layers,
                   train_examples=args.train_examples, test_examples=args.test_examples, epochs=args.epochs,
                   batch_size=args.batch_size, chunk_size=args.chunk_size, device=args.device)


def run(args: argparse.Namespace) -> int:
    base = base_run(args)
    # seed-major order: a time limit leaves whole seeds, every model and width covered
    runs = [replace(base, arch=a, d_model=d, seed=s, lr=lr)
            for s, lr, d, a in itertools.product(args.seeds, args.lrs, args.widths, args.archs)]
    t0 = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    title = f"MQAR ({args.device})"
    rows = sweep(runs, workers=args.workers, max_seconds=args.max_seconds,
                 on_row=lambda rows: report(rows, out, title))  # results so far survive an interruption
    if not rows:
        raise SystemExit("mqar: no run finished")
    md = report(rows, out, title)
    print(md)
    print(f"{len(runs)} runs in {time.perf_counter() - t0:.0f} s; wrote {out}.json/.md/.png")
    return 0
