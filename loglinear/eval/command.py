"""``loglinear eval``: evaluate trained runs (folders written by ``loglinear train``) side by side.

For each run: validation loss and perplexity, the per-position loss curve on windows of --eval-len tokens
(may exceed the training length), and needle-in-a-haystack accuracy (single pass-key and multi-key,
needles at several depths, lengths up to 16K) on the validation text. Writes <out>/lm-<tag>.{json,md,png}
and <out>/niah-<tag>.{json,md,png}.

With --lm-eval TASK [TASK ...] it also runs these lm-evaluation-harness tasks on each run (its Hugging Face model;
loglinear.eval.harness), with the task YAMLs of --include-path beside lm-eval's own, and writes
<out>/lm-eval-<tag>.{json,md}. The task names are checked before any run is evaluated; the perplexity and NIAH
parts run as without it (--niah-lengths with no value turns NIAH off).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from loglinear.data.text import PackedTokens
from loglinear.data.niah import make_niah_case
from loglinear.data.tokenizer import Tokenizer, load_tokenizer
from loglinear.eval.harness import lm_eval_record, lm_eval_report, require_lm_eval, run_lm_eval, task_manager
from loglinear.eval.lm import evaluate_lm
from loglinear.eval.niah import evaluate_niah
from loglinear.inputs import check_device, check_in_range, check_nonnegative_ints, check_positive_ints
from loglinear.report import ARCH_LABELS, ARCH_STYLE, markdown_table, pyplot, smooth, write_json
from loglinear.train.checkpoint import load_model_weights
from loglinear.train.loop import TRAIN_CONFIG, TrainConfig, model_from_config

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

__all__ = ["load_run", "evaluate_run", "lm_report", "niah_report", "add_arguments", "run"]


def load_run(run_dir: str | Path, device) -> tuple[torch.nn.Module, dict]:
    """(model with the checkpoint's weights on `device`, the run's train_config.json)."""
    meta = json.loads((Path(run_dir) / TRAIN_CONFIG).read_text())
    fields = {k: v for k, v in meta.items() if k in TrainConfig.__dataclass_fields__}
    model = model_from_config(TrainConfig(**fields), meta["vocab"])
    meta["trained_steps"] = load_model_weights(run_dir, model)
    return model.to(device).eval(), meta


def _ranges(T: int) -> list[tuple[int, int]]:
    """Position buckets [0, 64), [64, 256), [256, 1K), ... (x4) covering [0, T)."""
    edges = [0] + [64 * 4**i for i in range(12) if 64 * 4**i < T] + [T]
    return list(zip(edges[:-1], edges[1:]))


def _niah_data(data_dir: str | Path) -> tuple[np.ndarray, Tokenizer]:
    """The NIAH haystack (the validation tokens) and the tokenizer of a corpus."""
    haystack = np.asarray(PackedTokens.from_dir(data_dir, "val", 1).tokens)
    return haystack, load_tokenizer(Path(data_dir) / "tokenizer.json")


def _check_niah_lengths(args: argparse.Namespace) -> None:
    """Every --niah-lengths x --niah-keys case fits each run's corpus (needles and query within the length, the
    haystack long enough): one case of each is built before any run is evaluated (ValueError naming the length)."""
    for run_dir in args.runs if args.niah_lengths else []:
        data_dir = args.data_dir or json.loads((Path(run_dir) / TRAIN_CONFIG).read_text())["data_dir"]
        haystack, tok = _niah_data(data_dir)
        for length, keys in itertools.product(args.niah_lengths, args.niah_keys):
            try:
                make_niah_case(haystack, tok, length, 0.0, keys, np.random.default_rng(0))
            except ValueError as e:
                raise ValueError(f"--niah-lengths {length} with {keys} keys does not fit {data_dir}: {e}") from None


def evaluate_run(run_dir: str | Path, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """One run's LM record and NIAH rows."""
    device = torch.device(args.device)
    bf16 = device.type == "cuda"
    model, meta = load_run(run_dir, device)
    data_dir = args.data_dir or meta["data_dir"]
    eval_len = args.eval_len or meta["seq_len"]
    lm = evaluate_lm(model, PackedTokens.from_dir(data_dir, "val", eval_len), num_windows=args.windows,
                     batch_size=args.batch_size, device=device, bf16=bf16)
    curve = smooth(lm.per_position, args.smooth)
    step = max(1, len(curve) // 512)
    record = {
        "arch": meta["arch"], "run": str(run_dir), "params": meta["params"], "train_seq_len": meta["seq_len"],
        "train_tokens": meta["trained_steps"] * meta["global_batch"] * meta["seq_len"], "eval_len": eval_len,
        "windows": lm.windows, "val_loss": lm.val_loss, "ppl": lm.ppl,
        "loss_by_range": {f"{a}-{b}": float(lm.per_position[a:b].mean()) for a, b in _ranges(eval_len)},
        "per_position_smoothed": {"positions": list(range(0, len(curve), step)),
                                  "loss": [round(float(v), 5) for v in curve[::step]], "window": args.smooth},
    }
    niah = []
    if args.niah_lengths:
        niah = evaluate_niah(model, *_niah_data(data_dir), lengths=args.niah_lengths, depths=args.niah_depths,
                             keys=args.niah_keys,
                             samples=args.niah_samples, seed=args.seed, device=device, bf16=bf16,
                             batch_size=args.batch_size)
        for row in niah:
            row["arch"] = meta["arch"]
    return record, niah


def lm_report(records: list[dict], out: Path, title: str) -> str:
    ranges = list(records[0]["loss_by_range"])
    rows = [[ARCH_LABELS[r["arch"]], f"{r['params'] / 1e6:.1f}M", f"{r['train_tokens'] / 1e6:.1f}M", r["val_loss"],
             r["ppl"]] + [r["loss_by_range"][k] for k in ranges] for r in records]
    tokens = "the same tokens each" if len({r["train_tokens"] for r in records}) == 1 else "NOT the same tokens each"
    md = (f"# {title}\n\nValidation loss on windows of {records[0]['eval_len']} tokens "
          f"({records[0]['windows']} windows; trained at {records[0]['train_seq_len']}, {tokens}). "
          "Mean loss per position range:\n\n"
          + markdown_table(["model", "params", "train tokens", "val loss", "ppl"] + [f"pos {k}" for k in ranges], rows))
    write_json(out.with_suffix(".json"), records)
    out.with_suffix(".md").write_text(md)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in records:
        pp = r["per_position_smoothed"]
        ax.plot(np.asarray(pp["positions"]) + 1, pp["loss"], label=ARCH_LABELS[r["arch"]], **ARCH_STYLE[r["arch"]])
    ax.axvline(records[0]["train_seq_len"], color="gray", linewidth=0.8, linestyle=":")
    ax.set(xscale="log", xlabel="position", ylabel="loss (nats, smoothed)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    return md


def niah_report(rows: list[dict], out: Path, title: str) -> str:
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    keys = sorted({r["keys"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})

    def acc(a, k, n):
        return float(np.mean([r["accuracy"] for r in rows if (r["arch"], r["keys"], r["length"]) == (a, k, n)]))

    md = f"# {title}\n\nAccuracy (exact match of the 5-digit value), mean over depths {depths}.\n"
    for k in keys:
        name = "single pass-key" if k == 1 else f"multi-key ({k} keys)"
        md += f"\n## {name}\n\n" + markdown_table(
            ["model"] + [str(n) for n in lengths], [[ARCH_LABELS[a]] + [acc(a, k, n) for n in lengths] for a in archs])
    write_json(out.with_suffix(".json"), rows)
    out.with_suffix(".md").write_text(md)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, k in zip(axes[0], keys):
        for a in archs:
            ax.plot(lengths, [acc(a, k, n) for n in lengths], marker="o", label=ARCH_LABELS[a], **ARCH_STYLE[a])
        ax.set(xscale="log", xlabel="context length", ylabel="accuracy", ylim=(-0.02, 1.02),
               title="pass-key" if k == 1 else f"multi-key ({k})")
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    return md


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run folders written by `loglinear train`")
    p.add_argument("--data-dir", default=None, help="tokenized corpus (default: the one each run trained on)")
    p.add_argument("--eval-len", type=int, default=None, help="window length (default: the training length)")
    p.add_argument("--windows", type=int, default=32, help="validation windows (evenly spaced) for the loss")
    p.add_argument("--batch-size", type=int, default=4,
                   help="sequences per forward pass (loss windows, NIAH cases, lm-eval requests)")
    p.add_argument("--smooth", type=int, default=32, help="moving-average window of the per-position curve")
    p.add_argument("--niah-lengths", nargs="*", type=int, default=None,
                   help="haystack lengths (default: 1/4, 1/2, 1, 2 and 4 times the longest training length, at "
                   "least 128; none: no NIAH)")
    p.add_argument("--niah-depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="needle depths as fractions of the haystack (0: its start, 1: its end, before the query)")
    p.add_argument("--niah-keys", nargs="+", type=int, default=[1, 4], help="1 = single pass-key, >1 = multi-key")
    p.add_argument("--niah-samples", type=int, default=8, help="NIAH cases per (length, depth, keys)")
    p.add_argument("--seed", type=int, default=0, help="seed of the NIAH cases and of lm-eval (few-shot examples)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (bf16 autocast on CUDA)")
    p.add_argument("--out", default=None, help="results folder (default: <run>/eval for one run, "
                   "runs/eval/<run names> for several)")
    p.add_argument("--tag", default=None, help="file suffix (default: cpu or cuda)")
    p.add_argument("--lm-eval", nargs="+", default=None, metavar="TASK",
                   help="also run these lm-evaluation-harness tasks (or groups), e.g. hellaswag arc_easy, on each "
                   'run; results in <out>/lm-eval-<tag>.{json,md} (needs pip install "loglinear[eval]")')
    p.add_argument("--include-path", default=None, metavar="DIR",
                   help="a folder of extra lm-eval task YAMLs (they override built-in tasks of the same name)")
    p.add_argument("--lm-eval-limit", type=int, default=None, metavar="N",
                   help="lm-eval documents per task (default: all)")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="N",
                   help="lm-eval few-shot examples per document (default: each task's own)")


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The run-derived defaults: the results folder and the NIAH lengths (around the longest training length)."""
    runs = [Path(r) for r in args.runs]
    if args.out is None:
        args.out = str(runs[0] / "eval") if len(runs) == 1 else str(Path("runs/eval") / "-".join(r.name for r in runs))
    if args.niah_lengths is None:
        trained = max(json.loads((r / TRAIN_CONFIG).read_text())["seq_len"] for r in runs)
        args.niah_lengths = sorted({max(128, trained * m // 4) for m in (1, 2, 4, 8, 16)})
    return args


def _check_args(args: argparse.Namespace) -> None:
    """ValueError naming the first option that cannot work, before any run is loaded or evaluated."""
    check_positive_ints(**{"--windows": args.windows, "--batch-size": args.batch_size, "--smooth": args.smooth,
                           "--niah-samples": args.niah_samples})
    if args.eval_len is not None:
        check_positive_ints(**{"--eval-len": args.eval_len})
    for option in ("niah_lengths", "niah_keys"):
        for value in getattr(args, option):
            check_positive_ints(**{f"--{option.replace('_', '-')}": value})
    for depth in args.niah_depths:
        check_in_range("--niah-depths", depth, 0, 1, low_closed=True)
    check_nonnegative_ints(**{"--seed": args.seed})
    check_device("--device", args.device)


def _lm_eval_manager(args: argparse.Namespace) -> TaskManager | None:
    """The lm-eval TaskManager for --lm-eval (None without it), built before any run is evaluated: a missing
    lm-eval or an unknown task name fails at once."""
    if not args.lm_eval:
        stray = [opt for opt in ("include_path", "lm_eval_limit", "num_fewshot") if getattr(args, opt) is not None]
        if stray:
            raise ValueError(f"--{stray[0].replace('_', '-')} needs --lm-eval")
        return None
    for opt, value, least in (("--lm-eval-limit", args.lm_eval_limit, 1), ("--num-fewshot", args.num_fewshot, 0)):
        if value is not None and value < least:
            raise ValueError(f"{opt} must be >= {least}, got {value}")
    require_lm_eval()
    return task_manager(args.lm_eval, args.include_path)


def run(args: argparse.Namespace) -> int:
    args = _defaults(args)
    _check_args(args)
    _check_niah_lengths(args)
    manager = _lm_eval_manager(args)
    tag = args.tag or torch.device(args.device).type
    out = Path(args.out)
    records, niah, harness = [], [], []
    t0 = time.perf_counter()
    for run_dir in args.runs:
        rec, rows = evaluate_run(run_dir, args)
        records.append(rec)
        niah += rows
        print(f"{run_dir}: val loss {rec['val_loss']:.4f} (ppl {rec['ppl']:.2f}) [{time.perf_counter() - t0:.0f} s]")
        if manager is not None:
            results = run_lm_eval(run_dir, args.lm_eval, device=args.device, batch_size=args.batch_size,
                                  limit=args.lm_eval_limit, num_fewshot=args.num_fewshot, seed=args.seed,
                                  manager=manager)
            harness.append(lm_eval_record(run_dir, args.lm_eval, results))
            print(f"{run_dir}: lm-eval {', '.join(args.lm_eval)} done [{time.perf_counter() - t0:.0f} s]")
    print(lm_report(records, out / f"lm-{tag}", f"Language modelling ({tag})"))
    written = [f"{out}/lm-{tag}.*"]
    if niah:
        print(niah_report(niah, out / f"niah-{tag}", f"Needle in a haystack ({tag})"))
        written.append(f"{out}/niah-{tag}.*")
    if harness:
        print(lm_eval_report(harness, out / f"lm-eval-{tag}", f"lm-evaluation-harness ({tag})"))
        written.append(f"{out}/lm-eval-{tag}.*")
    print(f"wrote {' and '.join(written)}")
    return 0
