"""Small shared helpers for result files (training, evaluation and the benchmarks write them): markdown tables,
smoothing, json writing, matplotlib setup, and each architecture's label and plot style."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from loglinear.variants import REGISTRY

__all__ = ["markdown_table", "smooth", "write_json", "pyplot", "save_figure", "write_results", "machine_name",
           "ARCH_LABELS", "ARCH_STYLE"]

_COLORS = ("tab:blue", "tab:red", "tab:green", "tab:purple", "tab:orange", "tab:brown")
# "transformer", then per registered variant its plain ("mamba2") and log-linear ("ll_mamba2") architecture;
# color by variant (in registry order), solid line for log-linear, dashed for its linear base
ARCH_LABELS = {"transformer": "Transformer"} | {
    arch: prefix + v.title for v in REGISTRY.values() for arch, prefix in ((v.name, ""), ("ll_" + v.name, "LL "))
}
ARCH_STYLE = {"transformer": dict(color="black", linestyle="-")} | {
    arch: dict(color=_COLORS[i % len(_COLORS)], linestyle=style)
    for i, v in enumerate(REGISTRY.values()) for arch, style in ((v.name, "--"), ("ll_" + v.name, "-"))
}


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats printed with 3 decimals."""
    fmt = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def smooth(curve: np.ndarray, window: int) -> np.ndarray:
    """Centered moving average of a 1-D curve (edges average over what exists). [T] -> [T]."""
    window = max(1, min(window, len(curve)))
    kernel = np.ones(window)
    num = np.convolve(curve, kernel, mode="same")
    den = np.convolve(np.ones_like(curve), kernel, mode="same")
    return num / den


def machine_name(device: str | torch.device = "cuda") -> str:
    """The machine's name in result file names: the GPU's ("NVIDIA H200" -> "H200", "NVIDIA H100 80GB HBM3" ->
    "H100-80GB-HBM3") for a CUDA device, "cpu" otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).replace("NVIDIA ", "").replace(" ", "-")


def write_json(path: str | Path, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1))


def pyplot():
    """matplotlib.pyplot with the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> None:
    """Lay out a matplotlib figure, write it to path (120 dpi) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def write_results(stem: str | Path, meta: dict, rows: list[dict], markdown: str,
                  plot: Callable[[list[dict], str], None]) -> None:
    """A benchmark's result files: stem.json (meta and rows), stem.md (markdown) and stem.png (plot(rows, path)),
    the folder made if needed; says where they went."""
    stem = str(stem)
    write_json(stem + ".json", {**meta, "rows": rows})
    Path(stem + ".md").write_text(markdown)
    plot(rows, stem + ".png")
    print(f"wrote {stem}.{{json,md,png}}")
