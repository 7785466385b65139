"""Data: the MQAR generator, real-text corpora with local tokenizers, packed token streams, needles."""

from loglinear.data.mqar import mqar_batch
from loglinear.data.text import PackedTokens, corpus_files, prepare_corpus, split_files, stdlib_files
from loglinear.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "mqar_batch", "PackedTokens", "corpus_files", "prepare_corpus", "split_files", "stdlib_files",
    "ByteTokenizer", "Tokenizer", "load_tokenizer", "train_bpe",
]
