"""Tokenizers trained or built locally: byte-level BPE (the `tokenizers` library) or raw bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Protocol

__all__ = ["Tokenizer", "ByteTokenizer", "BPETokenizer", "train_bpe", "load_tokenizer", "EOS"]

EOS = "<|endoftext|>"


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, path: str | Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255, end-of-text = 256 (vocab 257)."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"type": "bytes"}))


class BPETokenizer:
    """Byte-level BPE from `tokenizers`; the end-of-text token is a special token."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eos_id = tok.token_to_id(EOS)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE tokenizer with `vocab_size` entries (256 byte tokens + merges + EOS)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 for byte-level BPE, got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load what `Tokenizer.save` wrote."""
    text = Path(path).read_text()
    if json.loads(text).get("type") == "bytes":
        return ByteTokenizer()
    from tokenizers import Tokenizer as HFTokenizer

    return BPETokenizer(HFTokenizer.from_str(text))
