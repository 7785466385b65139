"""Needle-in-a-haystack on a real-text haystack (the validation tokens of the LM corpus).

A needle is a line of code-like text, `\\n{name} = {value}\\n`, inserted at a chosen depth of the
haystack; the sequence ends with the query `\\nassert {name} == ` followed by the answer `{value}`.
Single pass-key: name = "pass_key", one needle. Multi-key: `num_keys` needles with distinct names, the
query asks for one of them (the others are distractors at random depths). Values are random 5-digit numbers.

Pieces are tokenized separately and concatenated, so the answer tokens are exactly encode(value) in both
the needle and the answer. Scoring is teacher-forced: the case is solved iff the argmax prediction is right
at every answer token (equivalent to a greedy exact match of the value).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loglinear.data.tokenizer import Tokenizer

__all__ = ["NeedleCase", "make_niah_case", "insert_needles", "WORDS"]

WORDS = (
    "amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "indigo", "jasper", "kettle",
    "lantern", "meadow", "nectar", "orchid", "pepper", "quartz", "raven", "saffron", "timber", "umber",
    "velvet", "willow", "yarrow", "zephyr", "basalt", "cobalt", "dune", "falcon", "garnet", "heron", "iris",
)


@dataclass
class NeedleCase:
    """input_ids: [T] int64; the answer's tokens answer_ids sit at answer_pos (their targets are at answer_pos - 1)."""

    input_ids: np.ndarray
    answer_pos: np.ndarray
    answer_ids: np.ndarray
    depth: float


def _names(num_keys: int, rng: np.random.Generator) -> list[str]:
    if num_keys == 1:
        return ["pass_key"]
    pairs = rng.choice(len(WORDS) * len(WORDS), size=num_keys, replace=False)
    return [f"{WORDS[p // len(WORDS)]}_{WORDS[p % len(WORDS)]}" for p in pairs]


def _needles(tok: Tokenizer, num_keys: int, rng: np.random.Generator):
    """(needle token lists, query tokens, answer tokens): the query asks for needle 0."""
    names = _names(num_keys, rng)
    values = [str(v) for v in rng.integers(10000, 100000, size=num_keys)]
    needles = [tok.encode(f"\n{n} = ") + tok.encode(v) + tok.encode("\n") for n, v in zip(names, values)]
    return needles, tok.encode(f"\nassert {names[0]} == "), tok.encode(values[0])


def make_niah_case(
    haystack: np.ndarray, tok: Tokenizer, length: int, depth: float, num_keys: int, rng: np.random.Generator
) -> NeedleCase:
    """A sequence of `length` tokens: haystack text (a random slice of `haystack`), the target needle at
    fraction `depth` of it, num_keys - 1 distractor needles at random depths, then the query and answer."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needles, query, answer = _needles(tok, num_keys, rng)
    fill = length - sum(map(len, needles)) - len(query) - len(answer)
    if fill < 1 or fill > len(haystack):
        raise ValueError(f"length {length} leaves {fill} haystack tokens; the haystack has {len(haystack)}")
    start = int(rng.integers(0, len(haystack) - fill + 1))
    hay = haystack[start : start + fill].astype(np.int64)
    cuts = [round(depth * fill)] + sorted(int(c) for c in rng.integers(0, fill + 1, size=num_keys - 1))
    order = np.argsort(cuts, kind="stable")
    pieces, prev = [], 0
    for i in order:
        pieces += [hay[prev : cuts[i]], np.asarray(needles[i], dtype=np.int64)]
        prev = cuts[i]
    pieces += [hay[prev:], np.asarray(query + answer, dtype=np.int64)]
    ids = np.concatenate(pieces)
    return NeedleCase(ids, np.arange(length - len(answer), length), np.asarray(answer, dtype=np.int64), depth)


def insert_needles(window: np.ndarray, tok: Tokenizer, num_keys: int, rng: np.random.Generator) -> np.ndarray:
    """Training augmentation: overwrite `window` ([T+1] tokens) with needles at random depths and, at its end,
    the query and answer. Returns a new array; the window keeps its length."""
    case = make_niah_case(window, tok, len(window), float(rng.random()), num_keys, rng)
    return case.input_ids.astype(window.dtype)
