"""Corpora, the file split, tokenizers, packed windows and the step -> windows order."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from loglinear.data.text import (
    PackedTokens, corpus_files, prepare_corpus, read_documents, split_files, stdlib_files,
    window_order,
)
from loglinear.data.tokenizer import ByteTokenizer, load_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _folder(tmp_path: Path, n: int = 12) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(n):
        (corpus / f"doc{i}.txt").write_text(f"Document {i}: "
                                            + "the quick brown fox jumps over the lazy dog. " * (5 + i))
    (corpus / "extra.jsonl").write_text("\n".join(json.dumps({"text": f"json line {i} é"}) for i in range(3)))
    (corpus / "ignored.bin").write_bytes(b"\x00\x01")
    return corpus


def test_stdlib_files_exist_and_skip_site_packages():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert STDLIB / "bisect.py" in files
    assert not any("site-packages" in f.parts for f in files)
    assert corpus_files(None) == files == corpus_files("stdlib")


def test_python_corpus_adds_the_installed_packages():
    files = corpus_files("python")
    assert {f.resolve() for f in stdlib_files()} <= set(files)
    assert Path(torch.__file__).resolve() in files  # torch is installed wherever the tests run
    assert len(files) == len(set(files)) and files == sorted(files)


def test_split_is_deterministic_disjoint_and_complete(tmp_path):
    files = corpus_files(_folder(tmp_path))
    assert len(files) == 13 and not any(f.suffix == ".bin" for f in files)
    train, val = split_files(files, 0.25)
    assert (train, val) == split_files(list(reversed(files)), 0.25)
    assert not set(train) & set(val) and sorted(train + val) == sorted(files)
    assert len(val) == 3
    assert len(split_files(files[:2], 0.01)[1]) == 1 and len(split_files(files[:2], 0.99)[0]) == 1
    with pytest.raises(ValueError, match="2 files"):
        split_files(files[:1])
    with pytest.raises(ValueError, match="not found"):
        corpus_files(tmp_path / "missing")


def test_jsonl_documents(tmp_path):
    docs = list(read_documents([_folder(tmp_path) / "extra.jsonl"]))
    assert docs == ["json line 0 é", "json line 1 é", "json line 2 é"]


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_prepare_corpus_roundtrip_and_cache(tmp_path, kind):
    corpus = _folder(tmp_path)
    meta = prepare_corpus(corpus, tmp_path / "data", tokenizer=kind, vocab_size=300, val_fraction=0.25)
    tok = load_tokenizer(tmp_path / "data" / "tokenizer.json")
    assert meta["vocab_size"] == tok.vocab_size == (257 if kind == "bytes" else 300)
    text = "Document 3: the lazy dog é"
    assert tok.decode(tok.encode(text)) == text
    train, val = split_files(corpus_files(corpus), 0.25)
    ids = np.fromfile(tmp_path / "data" / "val.bin", dtype=meta["dtype"])
    assert len(ids) == meta["val_tokens"] and (ids == tok.eos_id).sum() == sum(1 for _ in read_documents(val))
    expected = sum(len(tok.encode(d)) + 1 for d in read_documents(train))
    assert meta["train_tokens"] == expected
    stamp = (tmp_path / "data" / "train.bin").stat().st_mtime_ns
    assert prepare_corpus(corpus, tmp_path / "data", tokenizer=kind, vocab_size=300, val_fraction=0.25) == meta
    assert (tmp_path / "data" / "train.bin").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="tokenizer"):
        prepare_corpus(corpus, tmp_path / "x", tokenizer="chars")


def test_packed_windows(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(103, dtype=np.uint16).tofile(path)
    data = PackedTokens(path, 10)
    assert data.num_windows == 10
    x, y = data.batch([0, 9, 3])
    assert x.shape == y.shape == (3, 10) and x.dtype == torch.int64
    assert x[1, 0] == 90 and y[1, -1] == 100 and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="fewer than"):
        PackedTokens(path, 200)


def test_window_order_is_a_pure_function_covering_each_epoch():
    n, gb = 10, 4
    seq = torch.cat([window_order(n, s, gb, seed=1) for s in range(5)])  # 20 = two epochs
    assert sorted(seq[:10].tolist()) == list(range(10)) and sorted(seq[10:20].tolist()) == list(range(10))
    assert not torch.equal(seq[:10], seq[10:20])
    assert torch.equal(window_order(n, 3, gb, seed=1), seq[12:16])
    assert not torch.equal(window_order(n, 3, gb, seed=2), seq[12:16])


def test_byte_tokenizer():
    tok = ByteTokenizer()
    assert tok.encode("aé") == [97, 195, 169] and tok.decode([97, 195, 169, 256]) == "aé"


@pytest.mark.parametrize("suffix", [".py", ".jsonl"])
def test_a_single_file_corpus_splits_by_position(tmp_path, suffix):
    path = tmp_path / f"corpus{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps({"text": f"document {i} " * 20}) for i in range(40)))
    else:
        path.write_text("".join(f"line {i} of one file\n" for i in range(400)))
    meta = prepare_corpus(path, tmp_path / "data", tokenizer="bytes", val_fraction=0.1)
    assert meta["train_tokens"] > 5 * meta["val_tokens"] > 0
    val = bytes(PackedTokens(tmp_path / "data" / "val.bin", 8).tokens[:-1].astype("uint8"))
    assert val.startswith(b"line 36" if suffix == ".py" else b"document 36")  # the last tenth, from a line start
