"""Fixture shared by tests/train and tests/eval: a tiny real-text corpus (a few standard-library files,
byte tokens), tokenized once per session."""

import shutil
import sysconfig
from pathlib import Path

import pytest

from loglinear.data.text import prepare_corpus

FILES = ["bisect.py", "heapq.py", "colorsys.py", "keyword.py", "this.py", "abc.py", "copy.py", "glob.py"]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    corpus = tmp_path_factory.mktemp("corpus")
    for name in FILES:
        shutil.copy(root / name, corpus / name)
    data = tmp_path_factory.mktemp("data")
    prepare_corpus(corpus, data, tokenizer="bytes", val_fraction=0.25)
    return data
