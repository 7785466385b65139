"""Needle-in-a-haystack scoring: for each (keys, length, depth), `samples` cases built by
loglinear.data.niah.make_niah_case; a case counts as solved iff the model's argmax is right at every
answer token (teacher-forced, equal to a greedy exact match of the value)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from tqdm import tqdm

from loglinear.data.niah import make_niah_case
from loglinear.data.tokenizer import Tokenizer
from loglinear.train.loop import bf16_autocast

__all__ = ["niah_accuracy", "evaluate_niah"]


@torch.no_grad()
def niah_accuracy(model, haystack: np.ndarray, tok: Tokenizer, *, length: int, depth: float, num_keys: int,
                  samples: int, seed: int, device, bf16: bool = False, batch_size: int = 4) -> float:
    """Fraction of `samples` cases solved at this (length, depth, num_keys)."""
    rng = np.random.default_rng([seed, length, int(depth * 1000), num_keys])
    device = torch.device(device)
    cases = [make_niah_case(haystack, tok, length, depth, num_keys, rng) for _ in range(samples)]
    solved = 0
    for i in range(0, samples, batch_size):
        batch = cases[i : i + batch_size]
        x = torch.from_numpy(np.stack([c.input_ids for c in batch])).to(device)
        with bf16_autocast(device.type, bf16):
            logits = model(input_ids=x, use_cache=False).logits
        for b, case in enumerate(batch):
            pred = logits[b, torch.from_numpy(case.answer_pos - 1).to(device)].argmax(-1).cpu().numpy()
            solved += bool((pred == case.answer_ids).all())
    return solved / samples


def evaluate_niah(model, haystack: np.ndarray, tok: Tokenizer, *, lengths: list[int], depths: list[float],
                  keys: list[int], samples: int, seed: int, device, bf16: bool = False,
                  batch_size: int = 4) -> list[dict]:
    """Rows {"keys", "length", "depth", "accuracy"} over the grid keys x lengths x depths."""
    model.eval()
    grid = list(itertools.product(keys, lengths, depths))
    return [
        {"keys": k, "length": n, "depth": d,
         "accuracy": niah_accuracy(model, haystack, tok, length=n, depth=d, num_keys=k, samples=samples,
                                   seed=seed, device=device, bf16=bf16, batch_size=batch_size)}
        for k, n, d in tqdm(grid, desc="niah", leave=False, dynamic_ncols=True)
    ]
