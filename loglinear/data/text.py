"""Real text for language modelling: corpus files, a deterministic train/val split by file, tokenization
into flat token files, and packed fixed-length windows.

The default corpus is the Python standard library's own source (every machine with Python has it); any
folder of .txt / .md / .py / .jsonl files works too (jsonl: one {"text": ...} document per line).
Documents are joined with the tokenizer's end-of-text token into one stream, cut into windows of
seq_len + 1 tokens (inputs = window[:-1], targets = window[1:]).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from loglinear.data.tokenizer import ByteTokenizer, Tokenizer, train_bpe

__all__ = [
    "stdlib_files", "corpus_files", "split_files", "read_documents", "prepare_corpus", "PackedTokens",
    "window_order",
]

TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")


def stdlib_files() -> list[Path]:
    """The standard library's .py files (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def python_files() -> list[Path]:
    """The standard library's and the installed packages' .py files, sorted: a larger corpus on every machine
    (its size depends on what is installed: tens of millions of tokens next to torch and transformers)."""
    paths = sysconfig.get_paths()
    roots = sorted({Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib")})
    files = {p.resolve() for root in roots for p in root.rglob("*.py")}
    return sorted(files)


def corpus_files(source: str | Path | None) -> list[Path]:
    """Files of a corpus: None or "stdlib" -> stdlib_files(); "python" -> python_files(); a folder -> its
    text files; a file -> itself."""
    if source is None or str(source) == "stdlib":
        return stdlib_files()
    if str(source) == "python":
        return python_files()
    path = Path(source)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"corpus must be 'stdlib', 'python', a file or a folder, got {str(source)!r} (not found)")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"corpus folder {str(source)!r} has no {'/'.join(TEXT_SUFFIXES)} files")
    return files


def _file_key(path: Path) -> str:
    return hashlib.sha1(f"{path.parent.name}/{path.name}".encode()).hexdigest()


def split_files(files: list[Path], val_fraction: float = 0.05) -> tuple[list[Path], list[Path]]:
    """Deterministic split by file: the files whose name hashes lowest go to validation (>= 1 each side)."""
    if len(files) < 2:
        raise ValueError(f"need >= 2 files to split into train and validation, got {len(files)}")
    ordered = sorted(files, key=_file_key)
    n_val = min(len(files) - 1, max(1, round(val_fraction * len(files))))
    return sorted(ordered[n_val:]), sorted(ordered[:n_val])


def read_documents(files: list[Path]) -> Iterator[str]:
    """One document per text file, one per line of a .jsonl file (its "text" field)."""
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".jsonl":
            for line in text.splitlines():
                if line.strip():
                    yield json.loads(line)["text"]
        elif text:
            yield text


def split_documents(files: list[Path], val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """Train and validation documents. Several files: split by file (split_files). One file: its documents (a
    .jsonl) or its text (cut at a line boundary) split by position, the last val_fraction to validation."""
    if len(files) >= 2:
        train, val = split_files(files, val_fraction)
        return list(read_documents(train)), list(read_documents(val))
    docs = list(read_documents(files))
    if len(docs) >= 2:
        n_val = min(len(docs) - 1, max(1, round(val_fraction * len(docs))))
        return docs[:-n_val], docs[-n_val:]
    text = docs[0] if docs else ""
    if len(text) < 2:
        raise ValueError(f"corpus {files[0] if files else ''} holds too little text to split into train and "
                         "validation")
    cut = text.rfind("\n", 1, int(len(text) * (1 - val_fraction))) + 1 or int(len(text) * (1 - val_fraction))
    cut = min(max(cut, 1), len(text) - 1)
    return [text[:cut]], [text[cut:]]


def _tokenize_to_file(tok: Tokenizer, docs: list[str], out: Path, desc: str, batch: int = 256) -> int:
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    total = 0
    with out.open("wb") as f:
        for i in tqdm(range(0, len(docs), batch), desc=desc, unit="batch", leave=False):
            for ids in tok.encode_batch(docs[i : i + batch]):
                arr = np.asarray(ids + [tok.eos_id], dtype=dtype)
                f.write(arr.tobytes())
                total += arr.size
    return total


def prepare_corpus(
    source: str | Path | None, out_dir: str | Path, *, tokenizer: str = "bpe", vocab_size: int = 4096,
    val_fraction: float = 0.05, tokenizer_sample_bytes: int = 8 << 20,
) -> dict:
    """Tokenize a corpus into out_dir/{train,val}.bin + tokenizer.json + meta.json; reuse them if present.

    tokenizer: "bpe" (trained here on the train split's first tokenizer_sample_bytes) or "bytes".
    Returns meta: {"source", "tokenizer", "vocab_size", "eos_id", "dtype", "train_tokens", "val_tokens", ...}.
    """
    if tokenizer not in ("bpe", "bytes"):
        raise ValueError(f"tokenizer must be 'bpe' or 'bytes', got {tokenizer!r}")
    out = Path(out_dir)
    wanted = {"source": str(source or "stdlib"), "tokenizer": tokenizer, "val_fraction": val_fraction}
    wanted["requested_vocab_size"] = vocab_size if tokenizer == "bpe" else 257
    meta_path = out / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in wanted.items()):
            return meta
    out.mkdir(parents=True, exist_ok=True)
    files = corpus_files(source)
    print(f"preparing the corpus {wanted['source']} ({len(files)} files, {tokenizer} tokens) in {out}",
          file=sys.stderr, flush=True)
    train, val = split_documents(files, val_fraction)
    if tokenizer == "bytes":
        tok: Tokenizer = ByteTokenizer()
    else:
        tok = train_bpe(_sample(iter(train), tokenizer_sample_bytes), vocab_size)
    # Built in a private folder and moved in file by file, meta.json last: processes preparing the same
    # out_dir at once (several trainers started together) never read a half-written file.
    with tempfile.TemporaryDirectory(dir=out, prefix=".prepare-") as tmp:
        tmp_dir = Path(tmp)
        tok.save(tmp_dir / "tokenizer.json")
        meta = dict(wanted, vocab_size=tok.vocab_size, eos_id=tok.eos_id,
                    dtype="uint16" if tok.vocab_size <= 65536 else "uint32",
                    train_documents=len(train), val_documents=len(val),
                    train_tokens=_tokenize_to_file(tok, train, tmp_dir / "train.bin", "tokenizing train"),
                    val_tokens=_tokenize_to_file(tok, val, tmp_dir / "val.bin", "tokenizing validation"))
        (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=1))
        for name in ("tokenizer.json", "train.bin", "val.bin", "meta.json"):
            os.replace(tmp_dir / name, out / name)
    return meta


def _sample(docs: Iterator[str], max_bytes: int) -> Iterator[str]:
    seen = 0
    for doc in docs:
        if seen >= max_bytes:
            return
        seen += len(doc)
        yield doc


class PackedTokens:
    """Fixed-length windows over a flat token file: window i = tokens[i*T : i*T + T + 1]."""

    def __init__(self, path: str | Path, seq_len: int, dtype: str = "uint16") -> None:
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        self.seq_len = seq_len
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"{path} has {len(self.tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")

    @classmethod
    def from_dir(cls, data_dir: str | Path, split: str, seq_len: int) -> "PackedTokens":
        meta = json.loads((Path(data_dir) / "meta.json").read_text())
        return cls(Path(data_dir) / f"{split}.bin", seq_len, meta["dtype"])

    def windows(self, indices: list[int] | torch.Tensor) -> np.ndarray:
        """[B, T + 1] int64: the windows `indices`."""
        T = self.seq_len
        return np.stack([self.tokens[i * T : i * T + T + 1] for i in (int(j) for j in indices)]).astype(np.int64)

    def batch(self, indices: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B, T], targets [B, T]) int64 for the windows `indices`."""
        rows = torch.from_numpy(self.windows(indices))
        return rows[:, :-1], rows[:, 1:]


def window_order(num_windows: int, step: int, global_batch: int, seed: int) -> torch.Tensor:
    """[global_batch] window indices of training step `step`: epoch-wise seeded permutations, concatenated.

    A pure function of (step, seed): resuming at a step reproduces the data exactly.
    """
    flat = torch.arange(step * global_batch, (step + 1) * global_batch)
    epochs, offsets = flat // num_windows, flat % num_windows
    out = torch.empty(global_batch, dtype=torch.int64)
    for e in epochs.unique().tolist():
        perm = torch.randperm(num_windows, generator=torch.Generator().manual_seed(seed * 100003 + e))
        sel = epochs == e
        out[sel] = perm[offsets[sel]]
    return out
