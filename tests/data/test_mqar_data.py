"""MQAR generator: targets only at query keys, each key queried once with its value, seeded, valid ranges."""

import pytest
import torch

from loglinear.data.mqar import IGNORE_INDEX, _distinct, mqar_batch, query_targets


@pytest.mark.parametrize("seq_len,kv,vocab", [(64, 4, 128), (256, 64, 8192), (32, 8, 40)])
def test_targets_are_values_of_queried_keys(seq_len, kv, vocab):
    x, y = mqar_batch(50, seq_len, kv, vocab, seed=3)
    assert x.shape == y.shape == (50, seq_len) and x.dtype == y.dtype == torch.int64
    assert int(x.min()) >= 0 and int(x.max()) < vocab
    for b in range(50):
        keys, values = x[b, 0 : 2 * kv : 2], x[b, 1 : 2 * kv : 2]
        assert len(set(keys.tolist())) == kv and len(set(values.tolist())) == kv
        assert int(keys.min()) >= 1 and int(keys.max()) < vocab // 2
        assert int(values.min()) >= vocab // 2 and int(values.max()) < vocab
        pos = (y[b] != IGNORE_INDEX).nonzero().flatten()
        assert len(pos) == kv and int(pos.min()) >= 2 * kv  # targets only in the query region
        assert ((pos - 2 * kv) % 2 == 0).all()
        answer = dict(zip(keys.tolist(), values.tolist()))
        assert sorted(x[b, pos].tolist()) == sorted(keys.tolist())  # every key queried exactly once
        assert all(answer[int(x[b, p])] == int(y[b, p]) for p in pos)


def test_seeded_determinism():
    a, b, c = (mqar_batch(20, 64, 4, 128, seed=s) for s in (7, 7, 8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_power_law_prefers_early_slots_and_filler_modes():
    x, y = mqar_batch(400, 256, 8, 1024, seed=0)
    pos = (y != IGNORE_INDEX).nonzero()[:, 1].float()
    slots = (pos - 16) / 2
    assert slots.mean() < (256 - 16) / 2 / 2 - 10  # p(i) ~ i^(a-1) is decreasing
    x0, y0 = mqar_batch(10, 64, 4, 128, seed=0, random_non_queries=False)
    filler = (y0 == IGNORE_INDEX)
    filler[:, :8] = False
    assert (x0[filler] == 0).all()
    assert (x[:, 16:][y[:, 16:] == IGNORE_INDEX] != 0).any()


@pytest.mark.parametrize("kw,match", [
    (dict(seq_len=63, num_kv_pairs=4), "even"),
    (dict(seq_len=64, num_kv_pairs=17), "num_kv_pairs"),
    (dict(seq_len=64, num_kv_pairs=0), "num_kv_pairs"),
    (dict(seq_len=64, num_kv_pairs=8, vocab_size=12), "vocab_size"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        mqar_batch(4, seed=0, **kw)


def test_query_targets_are_the_query_positions_padded():
    _, y = mqar_batch(6, 64, 4, 128, seed=1)
    pos, val = query_targets(y, 6)
    assert pos.shape == val.shape == (6, 6)
    for b in range(6):
        where = (y[b] != IGNORE_INDEX).nonzero().flatten()
        assert pos[b, :4].tolist() == where.tolist() and val[b, :4].tolist() == y[b, where].tolist()
        assert (val[b, 4:] == IGNORE_INDEX).all()


def test_distinct_is_uniform():
    d = _distinct(60000, 3, 2, 8, torch.Generator().manual_seed(0))
    assert all(len(set(r)) == 3 for r in d[:1000].tolist()) and int(d.min()) >= 2 and int(d.max()) < 8
    for column in d.T:  # every value equally likely at every position
        freq = torch.bincount(column - 2, minlength=6).float() / len(d)
        assert (freq - 1 / 6).abs().max() < 0.01
