"""Continue a plain Mamba-2 run as log-linear: its loss goes on from where the plain model stopped.

    python benchmarks/experiments/continue_log_linear.py                  # CPU, a few minutes

Trains a plain Mamba-2 (``loglinear train --arch mamba2``) for --steps on the Python standard library's source
(byte tokenizer), makes it log-linear (``loglinear convert --log-linear``: the same weights, level weights
lambda = 2 sigmoid(Ls W x) at exactly 1), and continues it for --steps more twice from the same weights with
``--init``: as log-linear (``--arch ll_mamba2``) and, as the control, as plain Mamba-2. The continuations restart
the learning-rate schedule (--warmup) and the data stream. Writes <out>/continue-<device>.{json,md,png}: the three
training-loss curves on one step axis, with the command, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loglinear.models.convert import convert  # noqa: E402
from loglinear.report import machine_name, markdown_table, pyplot, write_json  # noqa: E402
from loglinear.train.loop import TrainConfig, train  # noqa: E402


def run_all(args: argparse.Namespace, work: Path) -> dict[str, list[float]]:
    """The three runs' per-step training losses: {"plain", "log-linear", "plain (control)"}."""
    base = dict(d_model=args.d_model, n_layers=args.layers, data_dir=args.data_dir, tokenizer="bytes",
                seq_len=args.seq_len, steps=args.steps, global_batch=args.batch, lr=args.lr, warmup=args.warmup,
                eval_batches=2, log_every=args.steps, device=args.device, seed=0)
    plain = train(TrainConfig(arch="mamba2", out_dir=str(work / "plain"), **base))
    convert(work / "plain", work / "ll", log_linear=True)
    ll = train(TrainConfig(arch="ll_mamba2", out_dir=str(work / "ll-run"), init=str(work / "ll"),
                           model_overrides={"level_activation": "sigmoid"}, **base))
    control = train(TrainConfig(arch="mamba2", out_dir=str(work / "control"), init=str(work / "plain"), **base))
    return {"plain": plain["losses"], "log-linear": ll["losses"], "plain (control)": control["losses"]}


def report(results: dict, stem: Path) -> str:
    losses, n = results["losses"], results["setting"]["steps"]
    window = max(1, n // 10)
    rows = [["plain Mamba-2, steps 1-" + str(n), np.mean(losses["plain"][:window]), np.mean(losses["plain"][-window:])]]
    rows += [[f"{name}, steps {n + 1}-{2 * n}", np.mean(losses[name][:window]), np.mean(losses[name][-window:])]
             for name in ("log-linear", "plain (control)")]
    s = results["setting"]
    md = (f"# A plain Mamba-2 continued as log-linear ({results['device']})\n\n{results['versions']}, "
          f"{results['date']}; `{results['command']}`\n\n{s['layers']} layers, d_model {s['d_model']}, "
          f"{s['batch']} x {s['seq_len']} byte tokens per step, lr {s['lr']}, {s['steps']} steps per run. The plain "
          "run is converted with `loglinear convert --log-linear` (level weights exactly 1) and continued from the "
          "same weights as log-linear and, as the control, as plain.\n\n"
          + markdown_table(["run", f"mean loss, first {window} steps", f"mean loss, last {window} steps"], rows)
          + "\n")
    write_json(stem.with_suffix(".json"), results)
    stem.with_suffix(".md").write_text(md)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, n + 1)
    ax.plot(steps, losses["plain"], color="tab:blue", label="plain Mamba-2")
    ax.plot(n + steps, losses["log-linear"], color="tab:red", label="continued as log-linear")
    ax.plot(n + steps, losses["plain (control)"], color="tab:blue", linestyle="--", linewidth=0.9,
            label="continued as plain (control)")
    ax.axvline(n + 0.5, color="gray", linewidth=0.8, linestyle=":")
    ax.set(xlabel="step", ylabel="training loss (nats per byte)", title="Plain Mamba-2 continued as log-linear")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    plt.close(fig)
    return md


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--d-model", type=int, default=128, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="blocks")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens (bytes) per window")
    parser.add_argument("--batch", type=int, default=8, help="windows per step")
    parser.add_argument("--steps", type=int, default=150, help="steps of each run")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of each run")
    parser.add_argument("--warmup", type=int, default=10, help="warmup steps of each run")
    parser.add_argument("--data-dir", default="runs/data/stdlib-bytes", help="the tokenized corpus (made if absent)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--out", default="benchmarks/results", help="results folder")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        losses = run_all(args, Path(work))
    device = torch.cuda.get_device_name(args.device) if torch.device(args.device).type == "cuda" else "cpu"
    results = {
        "device": device, "versions": f"torch {torch.__version__}",
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "setting": {k: getattr(args, k) for k in ("layers", "d_model", "batch", "seq_len", "steps", "lr", "warmup")},
        "losses": losses,
    }
    name = machine_name(args.device)
    print(report(results, Path(args.out) / f"continue-{name}"))


if __name__ == "__main__":
    main()
