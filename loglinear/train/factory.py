"""Model factory: an architecture name and a width -> a Hugging Face causal LM.

    transformer        LlamaForCausalLM (softmax attention, SDPA, RoPE): the baseline
    mamba2             loglinear.models Mamba-2 with use_log_linear=False
    ll_mamba2          log-linear Mamba-2
    gated_deltanet     Gated DeltaNet with use_log_linear=False
    ll_gated_deltanet  log-linear Gated DeltaNet

Heads by default (at least one): head_dim 64 for the Transformer and Gated DeltaNet (value dim 128),
2 * d_model / 64 heads of 64 channels for Mamba-2 (expand 2). The Transformer's SwiGLU has the same width
as the recurrent models' (8/3 d_model, rounded up to 32). `overrides` go straight into the config.
"""

from __future__ import annotations

import torch

__all__ = ["ARCHS", "build_model", "count_parameters", "is_log_linear", "family"]

ARCHS = ("transformer", "mamba2", "ll_mamba2", "gated_deltanet", "ll_gated_deltanet")


def is_log_linear(arch: str) -> bool:
    return arch.startswith("ll_")


def family(arch: str) -> str:
    """"transformer", "mamba2" or "gated_deltanet"."""
    return arch.removeprefix("ll_")


def _llama(vocab_size: int, d_model: int, n_layers: int, n_heads: int, max_seq_len: int, overrides: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=vocab_size, hidden_size=d_model, intermediate_size=-(-(8 * d_model // 3) // 32) * 32,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_heads, max_position_embeddings=max_seq_len,
        tie_word_embeddings=True, attn_implementation="sdpa", use_cache=False,
    )
    kw.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**kw))


def _loglinear(arch: str, vocab_size: int, d_model: int, n_layers: int, n_heads: int, overrides: dict):
    import loglinear.models as models

    kw = dict(
        vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers, num_heads=n_heads,
        use_log_linear=is_log_linear(arch), tie_word_embeddings=True,
    )
    kw.update(overrides)
    if family(arch) == "mamba2":
        return models.LogLinearMamba2ForCausalLM(models.LogLinearMamba2Config(**kw))
    return models.LogLinearGatedDeltaNetForCausalLM(models.LogLinearGatedDeltaNetConfig(**kw))


def build_model(
    arch: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int | None = None,
    max_seq_len: int = 65536, seed: int | None = None, **overrides,
) -> torch.nn.Module:
    """A freshly initialised causal LM (`seed` fixes the initialisation) taking input_ids [B, T] -> logits [B, T, V]."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    n_heads = n_heads or max(1, (2 if family(arch) == "mamba2" else 1) * d_model // 64)
    if seed is not None:
        torch.manual_seed(seed)
    if arch == "transformer":
        return _llama(vocab_size, d_model, n_layers, n_heads, max_seq_len, overrides)
    return _loglinear(arch, vocab_size, d_model, n_layers, n_heads, overrides)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
