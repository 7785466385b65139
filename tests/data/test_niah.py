"""Needle-in-a-haystack construction: exact length, answer = the needle's value, depth placement, keys."""

import numpy as np
import pytest

from loglinear.data.niah import insert_needles, make_niah_case
from loglinear.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
HAY = np.frombuffer(("def f(x):\n    return x + 1\n" * 400).encode(), dtype=np.uint8).astype(np.uint16)


def _text(ids) -> str:
    return TOK.decode([int(i) for i in ids])


@pytest.mark.parametrize("keys", [1, 4])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_case_layout(keys, depth):
    rng = np.random.default_rng(0)
    case = make_niah_case(HAY, TOK, 1000, depth, keys, rng)
    assert case.input_ids.shape == (1000,)
    assert list(case.answer_pos) == list(range(1000 - len(case.answer_ids), 1000))
    value = _text(case.answer_ids)
    assert len(value) == 5 and value.isdigit()
    text = _text(case.input_ids)
    name = text.rsplit("\nassert ", 1)[1].split(" == ")[0]
    assert text.endswith(f"\nassert {name} == {value}")
    needle = f"\n{name} = {value}\n"
    assert text.count(needle) == 1
    assert (name == "pass_key") == (keys == 1)
    assert text.count(" = ") == keys  # the haystack has no assignments
    at = text.index(needle) / (1000 - len(needle))
    assert abs(at - depth) < 0.12


def test_cases_are_seeded_and_validated():
    a = make_niah_case(HAY, TOK, 500, 0.3, 4, np.random.default_rng(5))
    b = make_niah_case(HAY, TOK, 500, 0.3, 4, np.random.default_rng(5))
    c = make_niah_case(HAY, TOK, 500, 0.3, 4, np.random.default_rng(6))
    assert np.array_equal(a.input_ids, b.input_ids) and not np.array_equal(a.input_ids, c.input_ids)
    with pytest.raises(ValueError, match="depth"):
        make_niah_case(HAY, TOK, 500, 1.5, 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="haystack"):
        make_niah_case(HAY, TOK, 30, 0.5, 4, np.random.default_rng(0))


def test_insert_needles_keeps_length():
    window = HAY[:300].astype(np.int64)
    out = insert_needles(window, TOK, 2, np.random.default_rng(1))
    assert out.shape == window.shape and out.dtype == window.dtype
    assert "\nassert " in _text(out) and not np.array_equal(out, window)
