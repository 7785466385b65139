"""``loglinear mqar``: multi-query associative recall, a sweep over architectures x widths x seeds x
learning rates, 2-layer models as in the paper; best learning rate per (model, width, seed).

Each run trains on a mixture of KV-pair counts (at one sequence length, or segments of several: a batch
holds one length), gives every recurrent model a short convolution of SHORT_CONV (Zoology's recipe), reads the
LM head at the query positions only, and reports the accuracy over all query positions of a held-out set at the
test length (different seed), also per KV-pair count. With --eval-every
it checks the test set periodically and stops at --early-stop (Zoology's 0.99). Runs are independent: with
--workers N, N worker slots train them concurrently, each run in its own process; with --device cuda slot i
uses cuda:(i mod GPUs), so several runs share each GPU (small models leave it mostly idle). `--preset gpu`
is the paper's setting (GPU_SWEEP_ARGS).

Writes <out>.json (one row per run: model, log_linear, d_model, seed, lr, accuracy, ...), <out>.md (table)
and <out>.png (accuracy vs width).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import queue
import shlex
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from loglinear.data.mqar import IGNORE_INDEX, mqar_batch, query_targets
from loglinear.inputs import (
    check_device, check_in_range, check_nonnegative_ints, check_positive_ints, check_power_of_two,
)
from loglinear.report import ARCH_LABELS, ARCH_STYLE, markdown_table, pyplot, write_json
from loglinear.train.factory import ARCHS, build_model, count_parameters, family, is_log_linear
from loglinear.train.loop import bf16_autocast, cosine_schedule

__all__ = ["MQARRun", "GPU_SWEEP_ARGS", "PRESETS", "train_mqar", "evaluate", "sweep", "slot_device", "summarize",
           "add_arguments", "base_run", "run"]


@dataclass(frozen=True)
class MQARRun:
    arch: str
    d_model: int
    seed: int
    lr: float
    seq_len: int = 32  # of the test set, and of the training data unless train_mix says otherwise
    kv_pairs: tuple[int, ...] = (2, 4)  # KV-pair counts of the test set (and of the training data, likewise)
    # training segments (seq_len, kv_pairs, examples); () = seq_len x kv_pairs sharing train_examples
    train_mix: tuple[tuple[int, int, int], ...] = ()
    vocab_size: int = 64
    n_layers: int = 2
    train_examples: int = 8192
    test_examples: int = 512  # split over kv_pairs
    epochs: int = 4
    max_steps: int = 0  # > 0: at most this many steps (the schedule spans them)
    batch_size: int = 64
    weight_decay: float = 0.1
    warmup: float = 0.1  # fraction of the steps of linear warmup, then cosine to 0
    eval_every: int = 0  # steps between test-set evaluations (0: only at the end)
    early_stop: float = 0.99  # a periodic evaluation at least this accurate ends the run
    chunk_size: int = 16  # of the recurrent models' chunkwise ops (16 is fastest at these lengths on a CPU)
    device: str = "cpu"
    bf16: bool = True  # autocast on CUDA


Pool = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # inputs [N, T], query positions / values [N, Q]


def train_segments(run: MQARRun) -> tuple[tuple[int, int, int], ...]:
    """The run's training data as (seq_len, kv_pairs, examples) segments."""
    if run.train_mix:
        return run.train_mix
    per = math.ceil(run.train_examples / len(run.kv_pairs))
    return tuple((run.seq_len, kv, per) for kv in run.kv_pairs)


def _pool(segments: list[tuple[int, int, int]], vocab_size: int, seed: int) -> Pool:
    """The examples of segments of one sequence length, concatenated, with their query positions/values."""
    parts = [mqar_batch(n, t, kv, vocab_size, seed=seed * 1_000_003 + t * 1000 + kv) for t, kv, n in segments]
    inputs, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return (inputs, *query_targets(targets, max(kv for _, kv, _ in segments)))


def make_pools(segments: tuple[tuple[int, int, int], ...], vocab_size: int, seed: int) -> list[Pool]:
    """One pool per sequence length (a batch never mixes lengths), in order of first appearance."""
    by_len: dict[int, list[tuple[int, int, int]]] = {}
    for seg in segments:
        by_len.setdefault(seg[0], []).append(seg)
    return [_pool(segs, vocab_size, seed) for segs in by_len.values()]


def _test_pools(run: MQARRun) -> dict[int, Pool]:
    """kv -> held-out pool at seq_len (another seed than the training data's)."""
    per = math.ceil(run.test_examples / len(run.kv_pairs))
    return {kv: _pool([(run.seq_len, kv, per)], run.vocab_size, 2 * run.seed + 1) for kv in run.kv_pairs}


def query_logits(model: torch.nn.Module, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, Q, V]: the LM head read at positions [B, Q] only (the other positions have no target)."""
    hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
    picked = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return model.lm_head(picked)


def query_loss(model: torch.nn.Module, inputs: torch.Tensor, positions: torch.Tensor,
               values: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (fp32) over the queries (values -100: padding, ignored)."""
    logits = query_logits(model, inputs, positions).float()
    return F.cross_entropy(logits.flatten(0, 1), values.flatten(), ignore_index=IGNORE_INDEX)


@torch.no_grad()
def evaluate(model: torch.nn.Module, tests: dict[int, Pool], batch_size: int, bf16: bool = True) -> dict[int, float]:
    """kv -> fraction of its queries whose argmax prediction is the value; key 0: over all queries."""
    model.eval()
    hits: dict[int, int] = {}
    counts: dict[int, int] = {}
    for kv, (x, pos, val) in tests.items():
        hit = torch.zeros((), dtype=torch.int64, device=x.device)
        for i in range(0, len(x), batch_size):
            with bf16_autocast(x.device.type, bf16):
                pred = query_logits(model, x[i : i + batch_size], pos[i : i + batch_size]).argmax(-1)
            v = val[i : i + batch_size]
            hit += ((pred == v) & (v != IGNORE_INDEX)).sum()
        hits[kv], counts[kv] = int(hit), int((val != IGNORE_INDEX).sum())
    model.train()
    out = {kv: hits[kv] / counts[kv] for kv in tests}
    out[0] = sum(hits.values()) / sum(counts.values())
    return out


def total_steps(run: MQARRun, pools: list[Pool]) -> int:
    """epochs x batches per epoch, capped by max_steps."""
    per_epoch = sum(len(p[0]) // run.batch_size for p in pools)
    steps = run.epochs * per_epoch
    return min(steps, run.max_steps) if run.max_steps > 0 else steps


def batch_stream(pools: list[Pool], batch_size: int, gen: torch.Generator) -> Iterator[Pool]:
    """Batches forever: per epoch every pool's examples in a fresh random order, cut into full batches; with
    several pools (lengths) the epoch's batches are shuffled together."""
    while True:
        batches = []
        for pool in pools:
            perm = torch.randperm(len(pool[0]), generator=gen).to(pool[0].device)  # one copy per epoch
            batches += [(pool, perm[i * batch_size : (i + 1) * batch_size]) for i in range(len(perm) // batch_size)]
        if len(pools) > 1:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
        for pool, idx in batches:
            yield tuple(t[idx] for t in pool)


SHORT_CONV = 4  # every recurrent model's short convolution (Zoology's recipe; GLA's config has none by default)


def _build(run: MQARRun) -> torch.nn.Module:
    extra = {} if run.arch == "transformer" else {"chunk_size": run.chunk_size, "conv_kernel": SHORT_CONV}
    longest = max([run.seq_len] + [t for t, _, _ in train_segments(run)])
    model = build_model(run.arch, vocab_size=run.vocab_size, d_model=run.d_model, n_layers=run.n_layers, n_heads=1,
                        max_seq_len=longest, seed=run.seed, **extra)
    return model.to(run.device)


def _optimizer(model: torch.nn.Module, run: MQARRun, total: int) -> tuple[torch.optim.Optimizer, object]:
    """AdamW (fused on CUDA) and its schedule: linear warmup over run.warmup of the steps, cosine to 0."""
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=run.weight_decay,
                            fused=run.device.startswith("cuda"))
    warmup = max(1, int(run.warmup * total))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_schedule(s, warmup, total, 0.0))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched, batch: Pool, run: MQARRun) -> torch.Tensor:
    """One optimizer step on batch (inputs, query positions, values); returns the loss (not synced)."""
    with bf16_autocast(run.device.split(":")[0], run.bf16):
        loss = query_loss(model, *batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss.detach()


def train_mqar(run: MQARRun, on_step: Callable[[int, torch.Tensor], None] | None = None,
               stop_at: float | None = None) -> dict:
    """Train one model on MQAR; returns the run's fields plus accuracy (all test queries), accuracy_by_kv,
    steps, stopped ("early_stop": an evaluation reached run.early_stop; "budget": time.time() passed
    stop_at), evals ([step, accuracy] of the periodic evaluations), final_loss, params, seconds.

    on_step(step, loss) is called after every optimizer step (step from 1; loss: the 0-dim tensor, not synced).
    """
    t0 = time.perf_counter()
    if run.device.startswith("cuda:"):
        torch.cuda.set_device(run.device)  # Triton launches on the current device, whatever the tensors'
    torch.manual_seed(run.seed)
    pools = [tuple(t.to(run.device) for t in p) for p in make_pools(train_segments(run), run.vocab_size, 2 * run.seed)]
    tests = {kv: tuple(t.to(run.device) for t in p) for kv, p in _test_pools(run).items()}
    model = _build(run)
    total = total_steps(run, pools)
    opt, sched = _optimizer(model, run, total)
    stream = batch_stream(pools, run.batch_size, torch.Generator().manual_seed(run.seed))
    evals, stopped, acc = [], None, None
    for step in range(1, total + 1):
        loss = _train_step(model, opt, sched, next(stream), run)
        if on_step is not None:
            on_step(step, loss)
        if run.eval_every and step % run.eval_every == 0 and step < total:
            acc = evaluate(model, tests, 4 * run.batch_size, run.bf16)
            evals.append([step, round(acc[0], 4)])
            if acc[0] >= run.early_stop:
                stopped = "early_stop"
                break
            acc = None
        if stop_at is not None and time.time() >= stop_at:
            stopped = "budget"
            break
    acc = acc or evaluate(model, tests, 4 * run.batch_size, run.bf16)
    row = asdict(run) | {"bf16": run.bf16 and run.device.startswith("cuda")}  # what ran: autocast is CUDA-only
    row.update(model=family(run.arch), log_linear=is_log_linear(run.arch), accuracy=acc.pop(0),
               accuracy_by_kv={str(kv): a for kv, a in acc.items()}, steps=step, stopped=stopped, evals=evals,
               final_loss=float(loss), params=count_parameters(model), seconds=round(time.perf_counter() - t0, 1))
    return row


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def slot_device(device: str, slot: int, n_gpus: int) -> str:
    """The device of worker slot `slot`: a bare "cuda" spreads the slots over the GPUs (cuda:(slot mod
    n_gpus)); any other device (an indexed GPU, the CPU) is kept."""
    return f"cuda:{slot % n_gpus}" if device == "cuda" and n_gpus > 0 else device


def default_workers(device: str) -> int:
    """Concurrent runs: 2 on the CPU, 8 per visible GPU (small MQAR models leave a GPU mostly idle)."""
    return 8 * max(1, torch.cuda.device_count()) if device.startswith("cuda") else 2


@contextmanager
def _thread_env(threads: int) -> Iterator[None]:
    """OMP_NUM_THREADS=threads for the worker processes started meanwhile (restored afterwards)."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old


def sweep(runs: list[MQARRun], workers: int = 1, threads: int | None = None, budget: float | None = None,
          grace: float = 60.0, on_row: Callable[[list[dict]], None] | None = None, retries: int = 1) -> list[dict]:
    """Run `runs` in order (in `workers` processes when > 1), with a progress bar. No run starts after
    `budget` seconds (the rest are skipped) and a run still training at budget + grace stops there and is
    evaluated (its row says stopped "budget"). A failed run is tried again up to `retries` times after the
    others (its row then says "attempts"). on_row(rows so far) is called after every finished run.
    Returns one row per finished run."""
    t0 = time.monotonic()
    deadline = t0 + (budget if budget is not None else math.inf)
    stop_at = time.time() + budget + grace if budget is not None else None
    rows = []
    bar = tqdm(total=len(runs), desc="mqar", dynamic_ncols=True)
    pending = list(runs)
    for attempt in range(1, retries + 2):
        failed = []
        for run, row in _execute(pending, workers, threads, deadline, stop_at):
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
        print(f"mqar: {len(runs) - len(rows)} of {len(runs)} runs skipped at the {budget} s budget")
    return _ordered(rows)


def _execute(runs: list[MQARRun], workers: int, threads: int | None, deadline: float,
             stop_at: float | None) -> Iterator[tuple[MQARRun, dict]]:
    """(run, row) for each run started before the (monotonic) deadline, in this process or in `workers`
    worker slots: slot i takes the next run from the queue and trains it in its own process on
    slot_device(run.device, i, GPUs), with `threads` torch / OpenMP threads.

    On a GPU every run gets a fresh process: a CUDA error (an illegal memory access, say) poisons its
    process's context for good, and would otherwise fail every later run of that worker.
    """
    if workers <= 1:
        for r in runs:
            row = _run_before(r, deadline, stop_at)
            if row is None:
                return
            yield r, row
        return
    threads = threads or max(1, (os.cpu_count() or 1) // workers)
    todo: queue.Queue = queue.Queue()
    for r in runs:
        todo.put(r)
    done: queue.Queue = queue.Queue()
    n_gpus = torch.cuda.device_count() if any(r.device == "cuda" for r in runs) else 0
    with _thread_env(threads), ThreadPoolExecutor(workers) as slots:
        futures = [slots.submit(_slot, i, n_gpus, threads, todo, done, deadline, stop_at) for i in range(workers)]
        for _ in range(workers):
            yield from iter(done.get, None)  # None: that slot has finished
        for f in futures:
            f.result()  # a slot's own error (not a run's) surfaces here


def _slot(slot: int, n_gpus: int, threads: int, todo: queue.Queue, done: queue.Queue, deadline: float,
          stop_at: float | None) -> None:
    """One worker slot: trains queued runs one at a time in its worker process (a fresh one per run on a
    GPU), puts (run, row) into `done` for each and None once the queue is empty or the deadline passed."""
    pool = None
    try:
        while time.monotonic() <= deadline:
            try:
                run = todo.get_nowait()
            except queue.Empty:
                break
            placed = replace(run, device=slot_device(run.device, slot, n_gpus))
            pool = pool or ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_init_worker,
                                               initargs=(threads,),
                                               max_tasks_per_child=1 if placed.device.startswith("cuda") else None)
            try:
                row = pool.submit(_run_before, placed, deadline, stop_at).result()
            except Exception as e:  # noqa: BLE001 -- the worker process died (a crash, the OOM killer)
                row = _error_row(placed, e)
                pool.shutdown(cancel_futures=True)
                pool = None
            if row is not None:
                done.put((run, row))
    finally:
        if pool is not None:
            pool.shutdown()
        done.put(None)


def _run_fields(row: dict) -> dict:
    """The MQARRun fields of a result row (tuples back from JSON lists)."""
    fields = {k: row[k] for k in MQARRun.__dataclass_fields__ if k in row}
    fields["kv_pairs"] = tuple(fields["kv_pairs"])
    fields["train_mix"] = tuple(tuple(seg) for seg in fields.get("train_mix", ()))
    return fields


def _ordered(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (ARCHS.index(r["arch"]), r["d_model"], r["seed"], r["lr"]))


def _run_before(run: MQARRun, deadline: float, stop_at: float | None = None) -> dict | None:
    """train_mqar(run, stop_at=stop_at) unless the (monotonic-clock) deadline has passed; a failing run gives
    a row with "error" instead of "accuracy" (one bad run does not end the sweep)."""
    if time.monotonic() > deadline:
        return None
    try:
        return train_mqar(run, stop_at=stop_at)
    except Exception as e:  # noqa: BLE001 -- reported in the results, the sweep goes on
        return _error_row(run, e)


def _error_row(run: MQARRun, e: BaseException) -> dict:
    return dict(asdict(run), model=family(run.arch), log_linear=is_log_linear(run.arch),
                error=f"{type(e).__name__}: {str(e)[:300]}", traceback=traceback.format_exc()[-3000:])


def summarize(rows: list[dict]) -> dict[tuple[str, int], float]:
    """(arch, d_model) -> mean over seeds of the best accuracy over learning rates (failed runs and runs cut
    short by the budget left out)."""
    best: dict[tuple[str, int, int], float] = {}
    for r in (r for r in rows if "accuracy" in r and r.get("stopped") != "budget"):
        key = (r["arch"], r["d_model"], r["seed"])
        best[key] = max(best.get(key, 0.0), r["accuracy"])
    out: dict[tuple[str, int], list[float]] = {}
    for (arch, d, _), acc in best.items():
        out.setdefault((arch, d), []).append(acc)
    return {k: sum(v) / len(v) for k, v in out.items()}


def report(rows: list[dict], out: Path, title: str, provenance: str = "") -> str:
    """Write out.{json,md,png}; returns the markdown. provenance: a line on when, where and how it ran."""
    summary = summarize(rows)
    archs = [a for a in ARCHS if any(k[0] == a for k in summary)]
    widths = sorted({k[1] for k in summary})
    table = markdown_table(["model"] + [f"d={d}" for d in widths],
                           [[ARCH_LABELS[a]] + [summary.get((a, d), float("nan")) for d in widths] for a in archs])
    first = rows[0]
    mix = ", ".join(f"{t}/{kv} x {n}" for t, kv, n in train_segments(MQARRun(**_run_fields(first))))
    steps = [r["steps"] for r in rows if "steps" in r]
    stops = {k: sum(r.get("stopped") == k for r in rows) for k in ("early_stop", "budget")}
    head = f"# {title}\n\n" + (f"{provenance}\n\n" if provenance else "")
    md = (f"{head}MQAR accuracy (mean over seeds of the best learning rate), test: seq_len {first['seq_len']}, "
          f"KV pairs {list(first['kv_pairs'])}; train (seq_len/KV pairs x examples): {mix}; vocab "
          f"{first['vocab_size']}, {first['n_layers']} layers, batch {first['batch_size']}, up to {first['epochs']} "
          f"epochs / {first['max_steps'] or 'no'} step cap, {len(rows)} runs "
          f"(steps {min(steps, default=0)}-{max(steps, default=0)}; stopped early at {first['early_stop']}: "
          f"{stops['early_stop']}, at the budget (left out of the table): {stops['budget']}; "
          f"chance: {2 / first['vocab_size']:.3f}).\n\n{table}")
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
    if archs:  # no finished run: an empty plot (the .md lists the failures)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    return md


# The paper's MQAR setting (test at seq 256 with 4-64 KV pairs, widths 16/32/64, 2 layers) Zoology-style on
# GPUs, as `loglinear mqar` arguments (`--preset gpu`): Zoology's training mixture (64/4 x 100K, then 128/8 and
# 256/16, 256/32, 256/64 x 20K), batch 256, AdamW with weight decay 0.1, the middle two learning rates of
# Zoology's logspace(-3, -1.5, 4), warmup then cosine, the test set checked every 200 steps with early stop
# at 0.99; the step cap is the device budget's (docs/experiments.md, "Next GPU run").
GPU_SWEEP_ARGS = ("--device cuda --widths 16 32 64 --seeds 0 1 --lrs 3.2e-3 1e-2 --seq-len 256 "
                  "--kv-pairs 4 8 16 32 64 --train-mix 64:4:100000 128:8:20000 256:16:20000 256:32:20000 "
                  "256:64:20000 --vocab-size 8192 --test-examples 5000 --epochs 32 --max-steps 4000 "
                  "--batch-size 256 --eval-every 200 --early-stop 0.99 --chunk-size 64")
PRESETS = {"gpu": GPU_SWEEP_ARGS}


class _Preset(argparse.Action):
    """--preset NAME: parse PRESETS[NAME] into the namespace here (options after it override it)."""

    def __call__(self, parser, namespace, value, option_string=None):
        parser.parse_args(PRESETS[value].split(), namespace)


def _segment(text: str) -> tuple[int, int, int]:
    """"SEQ:KV:N" -> (seq_len, kv_pairs, examples)."""
    try:
        t, kv, n = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a training segment is SEQ_LEN:KV_PAIRS:EXAMPLES, got {text!r}") from None
    return t, kv, n


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = MQARRun("transformer", 0, 0, 0.0)
    p.add_argument("--preset", choices=sorted(PRESETS), action=_Preset,
                   help="a set of the options below (gpu: the paper's setting, Zoology-style); put it first, "
                        "options after it override it")
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS,
                   help="models to train: transformer (Llama), a variant (plain) or ll_<variant> (log-linear)")
    p.add_argument("--widths", nargs="+", type=int, default=[16, 32], help="model widths (d_model) to train")
    p.add_argument("--seeds", nargs="+", type=int, default=[0],
                   help="seeds of the model's initialisation and of the data, one set of runs each")
    p.add_argument("--lrs", nargs="+", type=float, default=[1e-2],
                   help="peak learning rates to try; the table keeps each model's best")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="of the test set (and of training)")
    p.add_argument("--kv-pairs", nargs="+", type=int, default=list(d.kv_pairs),
                   help="of the test set (and of training)")
    p.add_argument("--train-mix", nargs="+", type=_segment, default=[], metavar="SEQ:KV:N",
                   help="training segments instead of seq-len x kv-pairs sharing --train-examples, e.g. Zoology's "
                        "64:4:100000 128:8:20000 256:16:20000 256:32:20000 256:64:20000")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size,
                   help="tokens: keys from the lower half, values from the upper half")
    p.add_argument("--layers", type=int, default=d.n_layers, help="blocks per model")
    p.add_argument("--train-examples", type=int, default=d.train_examples,
                   help="training examples, split over --kv-pairs (not with --train-mix)")
    p.add_argument("--test-examples", type=int, default=d.test_examples, help="split over --kv-pairs")
    p.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training examples")
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="at most this many steps (0: epochs decide)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="training examples per step")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--warmup", type=float, default=d.warmup, help="fraction of the steps of linear warmup")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="steps between test evaluations (0: at the end)")
    p.add_argument("--early-stop", type=float, default=d.early_stop, help="end a run once an evaluation reaches this")
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="chunk of the recurrent models' ops")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda (the runs spread over all visible GPUs) or cuda:N")
    p.add_argument("--workers", type=int, default=None,
                   help="runs at once, each in its own process (default: 2 on the CPU, 8 per GPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch / OpenMP threads per worker (default: cores / workers)")
    p.add_argument("--budget", type=float, default=None,
                   help="start no run after this many seconds; runs still training at budget + --grace stop "
                        "and are evaluated")
    p.add_argument("--grace", type=float, default=60.0,
                   help="seconds past --budget that runs still training get before they stop")
    p.add_argument("--out", default="runs/mqar/mqar-cpu", help="output path stem: writes .json, .md, .png")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of an existing <out>.json that this call does not redo "
                        "(a sweep over several calls)")


def base_run(args: argparse.Namespace) -> MQARRun:
    """The settings every run of the parsed arguments shares (arch, width, seed, lr left at placeholders)."""
    return MQARRun(arch="transformer", d_model=0, seed=0, lr=0.0, seq_len=args.seq_len,
                   kv_pairs=tuple(args.kv_pairs), train_mix=tuple(args.train_mix), vocab_size=args.vocab_size,
                   n_layers=args.layers, train_examples=args.train_examples, test_examples=args.test_examples,
                   epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size,
                   weight_decay=args.weight_decay, warmup=args.warmup, eval_every=args.eval_every,
                   early_stop=args.early_stop, chunk_size=args.chunk_size, device=args.device)


def check_runs(runs: list[MQARRun]) -> None:
    """ValueError naming the first setting of the sweep that would fail every run that has it (checked before any
    run starts: inside the sweep a failed run is only a row of the results): sizes, the schedule, the data (each
    training segment and each test set of the examples' generator), and each (arch, width)'s model config."""
    for run in runs:  # what differs between the runs
        check_positive_ints(width=run.d_model)
        check_in_range("lr", run.lr, 0, math.inf, low_closed=False)
    run = runs[0]  # what they share
    check_positive_ints(seq_len=run.seq_len, vocab_size=run.vocab_size, layers=run.n_layers,
                        train_examples=run.train_examples, test_examples=run.test_examples, epochs=run.epochs,
                        batch_size=run.batch_size, chunk_size=run.chunk_size,
                        **{f"train_mix examples ({t}:{kv})": n for t, kv, n in run.train_mix})
    check_power_of_two(chunk_size=run.chunk_size)
    check_nonnegative_ints(max_steps=run.max_steps, eval_every=run.eval_every)
    check_in_range("weight_decay", run.weight_decay, 0, math.inf, low_closed=True)
    check_in_range("warmup", run.warmup, 0, 1, low_closed=True)
    check_in_range("early_stop", run.early_stop, 0, 1, low_closed=False)
    check_device("device", run.device)
    if not run.kv_pairs:
        raise ValueError("kv_pairs must name at least one KV-pair count")
    for t, kv in {(t, kv) for t, kv, _ in train_segments(run)} | {(run.seq_len, kv) for kv in run.kv_pairs}:
        mqar_batch(1, t, kv, run.vocab_size, seed=0)  # the generator's own checks, on one example
    for model in {(r.arch, r.d_model): r for r in runs}.values():
        _build(replace(model, device="cpu"))


def kept_rows(path: Path, runs: list[MQARRun]) -> list[dict]:
    """The rows of an earlier sweep's json at path whose (arch, d_model, seed, lr) `runs` do not redo."""
    if not path.exists():
        return []
    planned = {(r.arch, r.d_model, r.seed, r.lr) for r in runs}
    return [r for r in json.loads(path.read_text()) if (r["arch"], r["d_model"], r["seed"], r["lr"]) not in planned]


def run(args: argparse.Namespace) -> int:
    base = base_run(args)
    # seed-major order: a time limit leaves whole seeds, every model and width covered
    runs = [replace(base, arch=a, d_model=d, seed=s, lr=lr)
            for s, lr, d, a in itertools.product(args.seeds, args.lrs, args.widths, args.archs)]
    check_runs(runs)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    title = f"MQAR ({args.device})"
    provenance = (f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, torch {torch.__version__}, "
                  f"{os.cpu_count()} CPUs; `{shlex.join(['loglinear', *sys.argv[1:]])}`")
    workers = args.workers or default_workers(args.device)
    earlier = kept_rows(out.with_suffix(".json"), runs) if args.merge else []
    done = sweep(runs, workers=workers, threads=args.threads, budget=args.budget, grace=args.grace,
                 on_row=lambda rows: report(_ordered(earlier + rows), out, title, provenance))  # survives a cut
    rows = _ordered(earlier + done)
    if not rows:
        raise SystemExit("mqar: no run finished")
    md = report(rows, out, title, provenance)
    print(md)
    print(f"{len(runs)} runs in {time.perf_counter() - t0:.0f} s; wrote {out}.json/.md/.png")
    failed = sum("error" in r for r in done)
    if failed:  # reported in the results; the exit status says so too
        print(f"loglinear mqar: {failed} of {len(runs)} runs failed (their errors: {out}.md)", file=sys.stderr)
        return 1
    return 0
