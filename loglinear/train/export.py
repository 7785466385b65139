"""A training run's folder is a Hugging Face model: config.json (with model_type), model.safetensors and a fast
tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json) with its end-of-text token as eos, bos
and pad. In a process that imported loglinear (a plain ``import loglinear`` registers the loglinear model types
with transformers' Auto classes, see loglinear._auto), ``AutoModelForCausalLM.from_pretrained(run_dir)``,
``AutoTokenizer.from_pretrained(run_dir)`` and ``pipeline("text-generation", model=run_dir)`` load it. The
training state and configuration live beside it under their own names (checkpoint.pt, train_config.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loglinear.data.tokenizer import EOS

__all__ = ["export_pretrained", "hf_tokenizer", "byte_level_alphabet"]


def byte_level_alphabet() -> dict[int, str]:
    """The byte -> character map of byte-level tokenizers (GPT-2's): printable bytes map to themselves, the others
    to the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def _byte_tokenizer():
    """loglinear's byte tokenizer (ids = UTF-8 bytes, end-of-text 256) as a `tokenizers` byte-level BPE without
    merges: the same ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in byte_level_alphabet().items()} | {EOS: 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True)])
    return tok


def hf_tokenizer(tokenizer_file: str | Path):
    """The run's tokenizer (what loglinear.data.tokenizer saved) as a transformers PreTrainedTokenizerFast with
    the end-of-text token as eos, bos and pad."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    text = Path(tokenizer_file).read_text()
    tok = _byte_tokenizer() if json.loads(text).get("type") == "bytes" else Tokenizer.from_str(text)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)


def export_pretrained(out_dir: str | Path, model: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                      tokenizer_file: str | Path) -> None:
    """Write the Hugging Face model (``model``'s class and config with ``state_dict``, the full weights) and the
    tokenizer into out_dir; the config's eos / bos / pad ids are the tokenizer's end-of-text token."""
    tokenizer = hf_tokenizer(tokenizer_file)
    eos = tokenizer.eos_token_id
    model.config.update({"eos_token_id": eos, "bos_token_id": eos, "pad_token_id": eos})
    model.generation_config.update(eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
