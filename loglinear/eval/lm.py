"""Language-model evaluation: validation loss / perplexity and the per-position loss curve.

Per-position loss: the mean next-token loss at each position t of windows of length T,
curve[t] = mean_b CE(logits[b, t], tokens[b, t+1]); plotted smoothed. A model that uses long context
keeps lowering it as t grows; a model that forgets flattens out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from loglinear.data.text import PackedTokens
from loglinear.train.loop import bf16_autocast, lm_loss

__all__ = ["LMEval", "evaluate_lm"]


@dataclass
class LMEval:
    val_loss: float
    ppl: float
    per_position: np.ndarray  # [T]
    windows: int


@torch.no_grad()
def evaluate_lm(model: torch.nn.Module, val: PackedTokens, *, num_windows: int, batch_size: int,
                device: torch.device | str, bf16: bool = False) -> LMEval:
    """Loss over `num_windows` evenly spaced validation windows of val.seq_len tokens."""
    device = torch.device(device)
    n = min(num_windows, val.num_windows)
    idx = torch.linspace(0, val.num_windows - 1, n).long()
    sums = torch.zeros(val.seq_len, dtype=torch.float64, device=device)
    model.eval()
    for i in range(0, n, batch_size):
        x, y = val.batch(idx[i : i + batch_size])
        with bf16_autocast(device.type, bf16):
            loss = lm_loss(model, x.to(device), y.to(device), reduction="none")
        sums += loss.double().sum(0)
    curve = (sums / n).cpu().numpy()
    mean = float(curve.mean())
    return LMEval(mean, math.exp(mean), curve, n)
