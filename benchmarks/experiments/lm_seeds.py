"""Log-linear against its linear base over seeds: is the language-model difference larger than seed noise?

Reads one `lm-<tag>.json` per seed (`run_experiments.py --seed S --tag ...`, the same token budget in each) and
writes <out>.md (per model: the mean validation loss over seeds and each seed's; per pair: log-linear minus base,
per seed and per position range) and <out>.png (that difference along the position, one line per seed).

    python benchmarks/experiments/lm_seeds.py benchmarks/results/lm-h200-seed0.json \
        benchmarks/results/lm-h200-seed1.json --out benchmarks/results/lm-h200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loglinear.report import ARCH_LABELS, markdown_table, pyplot  # noqa: E402

PAIRS = [("ll_mamba2", "mamba2"), ("ll_gated_deltanet", "gated_deltanet")]


def by_arch(paths: list[Path]) -> list[dict[str, dict]]:
    """One {arch: row} per seed file; every row must have the same token budget and evaluation."""
    seeds = [{r["arch"]: r for r in json.loads(p.read_text())} for p in paths]
    setups = {(r["train_tokens"], r["train_seq_len"], r["eval_len"], r["windows"]) for s in seeds for r in s.values()}
    if len(setups) != 1:
        raise ValueError("files: the rows differ in (train_tokens, train_seq_len, eval_len, windows): "
                         f"{sorted(setups)}")
    return seeds


def common_archs(seeds: list[dict[str, dict]]) -> list[str]:
    """The models every seed file has, in the first file's order."""
    return [a for a in seeds[0] if all(a in s for s in seeds)]


def model_table(seeds: list[dict[str, dict]]) -> str:
    rows = [[ARCH_LABELS[a], float(np.mean([s[a]["val_loss"] for s in seeds]))] + [s[a]["val_loss"] for s in seeds]
            for a in common_archs(seeds)]
    return markdown_table(["model", "mean val loss"] + [f"seed file {i}" for i in range(len(seeds))], rows)


def pair_table(seeds: list[dict[str, dict]]) -> str:
    """Log-linear minus base: the validation loss and each position range, per seed and the mean."""
    ranges = list(next(iter(seeds[0].values()))["loss_by_range"])
    rows = []
    for ll, base in PAIRS:
        if not all(ll in s and base in s for s in seeds):
            continue
        deltas = [[s[ll]["val_loss"] - s[base]["val_loss"]]
                  + [s[ll]["loss_by_range"][k] - s[base]["loss_by_range"][k] for k in ranges] for s in seeds]
        label = f"{ARCH_LABELS[ll]} - {ARCH_LABELS[base]}"
        rows += [[label, f"seed file {i}"] + d for i, d in enumerate(deltas)]
        rows.append([label, "mean"] + list(np.mean(deltas, axis=0)))
    return markdown_table(["pair", "seed", "val loss"] + [f"pos {k}" for k in ranges], rows)


def spread(seeds: list[dict[str, dict]]) -> float:
    """The largest seed-to-seed range of one model's validation loss."""
    return max(np.ptp([s[a]["val_loss"] for s in seeds]) for a in common_archs(seeds))


def log_bins(x: np.ndarray, y: np.ndarray, per_decade: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """Mean of y over log-spaced bins of x (x >= 1): the per-position curves are too noisy to read raw."""
    edges = 10.0 ** (np.arange(np.floor(np.log10(x.max()) * per_decade) + 2) / per_decade)  # 1 .. past x.max()
    idx = np.digitize(x, edges)
    bins = np.unique(idx)
    return np.array([x[idx == i].mean() for i in bins]), np.array([y[idx == i].mean() for i in bins])


def plot(seeds: list[dict[str, dict]], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (ll, base), color in zip(PAIRS, ["tab:blue", "tab:green"]):
        for i, s in enumerate(seeds):
            if ll in s and base in s:
                a, b = s[ll]["per_position_smoothed"], s[base]["per_position_smoothed"]
                x, d = log_bins(np.asarray(a["positions"]) + 1, np.asarray(a["loss"]) - np.asarray(b["loss"]))
                ax.plot(x, d, color=color, marker=".",
                        linestyle=["-", "--", ":", "-."][i % 4],
                        label=f"{ARCH_LABELS[ll]} - {ARCH_LABELS[base]}, seed file {i}")
    ax.axhline(0.0, color="gray", linewidth=0.8)
    ax.axvline(next(iter(seeds[0].values()))["train_seq_len"], color="gray", linewidth=0.8, linestyle=":")
    ax.set(xscale="log", xlabel="position", ylabel="loss difference (nats, smoothed)",
           title="log-linear minus linear base, mean per log-spaced bin\n(below 0: log-linear better)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="lm-<tag>.json, one per seed")
    p.add_argument("--out", type=Path, required=True, help="output path without suffix")
    a = p.parse_args()
    seeds = by_arch(a.files)
    first = next(iter(seeds[0].values()))
    md = (f"# Language modelling over {len(seeds)} seeds\n\n"
          f"Seed files: {', '.join(f'{i}: `{f.name}`' for i, f in enumerate(a.files))}. Validation loss on "
          f"{first['windows']} windows of {first['eval_len']} tokens (trained at {first['train_seq_len']}, "
          f"{first['train_tokens'] / 1e6:.1f}M tokens per model).\n\n" + model_table(seeds).rstrip()
          + "\n\nLog-linear minus its base (negative: log-linear better):\n\n" + pair_table(seeds).rstrip()
          + f"\n\nLargest seed-to-seed range of one model's validation loss: {spread(seeds):.3f} nats.\n")
    a.out.with_suffix(".md").write_text(md)
    plot(seeds, a.out)
    print(md)


if __name__ == "__main__":
    main()
