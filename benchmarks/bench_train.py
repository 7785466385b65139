"""Training-step benchmark: tokens/s and peak memory of log-linear, plain (linear) and Transformer models.

    python benchmarks/bench_train.py                           # 12 layers, d_model 768, 4 x 16K tokens per step
    python benchmarks/bench_train.py --tiny --device cpu       # smoke run

For every architecture (loglinear.train.factory.ARCHS: ll_<variant> log-linear, <variant> its plain
use_log_linear=False model, transformer), without and with activation checkpointing: forward, backward and an
AdamW step of a freshly initialised model on random tokens (vocabulary --vocab-size, the default of
``loglinear train``), bf16 autocast on CUDA. Reports the median step time over --steps after --warmup as tokens/s,
and the peak memory of the measured steps (torch.cuda.max_memory_allocated). All models in one process on one
device. Writes benchmarks/results/train-<gpu>.{json,md,png} with the command, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loglinear.cli import check_script_options  # noqa: E402
from loglinear.report import ARCH_LABELS, machine_name, markdown_table, pyplot, save_figure, write_json  # noqa: E402
from loglinear.train.factory import ARCHS, build_model  # noqa: E402
from loglinear.train.loop import bf16_autocast, enable_activation_checkpointing, lm_loss  # noqa: E402


def measure(arch: str, checkpointing: bool, args: argparse.Namespace) -> dict:
    """One architecture's step: {"arch", "checkpointing", "step_ms", "tokens_per_s", "peak_gib"} (or "error")."""
    device = torch.device(args.device)
    row = {"arch": arch, "checkpointing": checkpointing}
    try:
        model = build_model(arch, vocab_size=args.vocab_size, d_model=args.d_model, n_layers=args.layers,
                            seed=0).to(device).train()
        if checkpointing:
            enable_activation_checkpointing(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        tokens = torch.randint(0, args.vocab_size, (args.batch, args.seq_len + 1), device=device)

        def step() -> float:
            start = time.perf_counter()
            with bf16_autocast(device.type, device.type == "cuda"):
                loss = lm_loss(model, tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        for _ in range(args.warmup):
            step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = [step() for _ in range(args.steps)]
        median = statistics.median(times)
        row.update(step_ms=median * 1e3, tokens_per_s=args.batch * args.seq_len / median,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    finally:
        model = optimizer = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def markdown(results: dict) -> str:
    rows = [[ARCH_LABELS[r["arch"]], "yes" if r["checkpointing"] else "no"]
            + ([r["error"], "", ""] if "error" in r else
               [f"{r['tokens_per_s'] / 1e3:.1f}K", f"{r['step_ms']:.1f}",
                "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"]) for r in results["rows"]]
    s = results["setting"]
    return (f"# Training step ({results['device']})\n\n{results['versions']}, {results['date']}; `{results['command']}`"
            f"\n\n{s['layers']} layers, d_model {s['d_model']}, {s['batch']} x {s['seq_len']} tokens per step, "
            f"vocabulary {s['vocab_size']}, bf16 autocast on CUDA; forward + backward + AdamW, median of "
            f"{s['steps']} steps after {s['warmup']}; peak memory of the measured steps.\n\n"
            + markdown_table(["model", "activation checkpointing", "tokens/s", "step ms", "peak GiB"], rows) + "\n")


def plot(results: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    archs = list(dict.fromkeys(r["arch"] for r in results["rows"]))
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s (thousands)"), (axes[1], "peak_gib", "peak GiB")):
        for offset, ckpt in ((-0.2, False), (0.2, True)):
            values = [next((r.get(key) or 0 for r in results["rows"] if r["arch"] == a and r["checkpointing"] == ckpt),
                           0) for a in archs]
            scale = 1e-3 if key == "tokens_per_s" else 1
            ax.bar([i + offset for i in range(len(archs))], [v * scale for v in values], width=0.4,
                   label="activation checkpointing" if ckpt else "no checkpointing", hatch="//" if ckpt else None)
        ax.set_xticks(range(len(archs)), [ARCH_LABELS[a] for a in archs], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    s = results["setting"]
    fig.suptitle(f"Training step, {s['layers']} x d{s['d_model']}, {s['batch']} x {s['seq_len']} tokens "
                 f"({results['device']})")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS, help="architectures to time")
    parser.add_argument("--d-model", type=int, default=768, help="model width")
    parser.add_argument("--layers", type=int, default=12, help="blocks")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens per sequence")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary (loglinear train's default)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (kernel compilation)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--tiny", action="store_true", help="a tiny setting (2 layers, d_model 64, 2 x 256 tokens)")
    parser.add_argument("--out", default="benchmarks/results", help="results folder")
    args = parser.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.batch, args.seq_len, args.steps, args.warmup = 64, 2, 2, 256, 2, 1
    least = {"d_model": 1, "layers": 1, "batch": 1, "seq_len": 1, "vocab_size": 1, "steps": 1, "warmup": 0}
    check_script_options("bench_train.py", {f"--{name.replace('_', '-')}": (getattr(args, name), low)
                                            for name, low in least.items()}, args.device)
    cuda = torch.device(args.device).type == "cuda"
    name = machine_name(args.device)
    import transformers
    import triton

    results = {
        "device": torch.cuda.get_device_name(args.device) if cuda else "cpu",
        "versions": f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}",
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "setting": {k: getattr(args, k) for k in ("layers", "d_model", "batch", "seq_len", "vocab_size", "steps",
                                                  "warmup")},
        "rows": [],
    }
    stem = Path(args.out) / f"train-{name}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    for arch in args.archs:
        for checkpointing in (False, True):
            row = measure(arch, checkpointing, args)
            results["rows"].append(row)
            print(row, flush=True)
            write_json(stem.with_suffix(".json"), results)  # kept as it goes
            stem.with_suffix(".md").write_text(markdown(results))
    plot(results, str(stem.with_suffix(".png")))
    print(markdown(results))


if __name__ == "__main__":
    main()
