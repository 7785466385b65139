"""Model factory: an architecture name and a width -> a Hugging Face causal LM.

    transformer        LlamaForCausalLM (softmax attention, SDPA, RoPE): the baseline
    <variant>          the loglinear.models model of a registered variant with use_log_linear=False
                       (mamba2, gated_deltanet: plain Mamba-2 / Gated DeltaNet)
    ll_<variant>       its log-linear model (ll_mamba2, ll_gated_deltanet)

Heads by default: the Transformer's of 64 channels, a variant's from its config (default_num_heads: Mamba-2
2 * d_model / 64 heads of 64 channels at expand 2, Gated DeltaNet d_model / 64). The Transformer's SwiGLU has the
same width as the recurrent models' (8/3 d_model, rounded up to 32). `overrides` go straight into the config.
"""

from __future__ import annotations

import torch

from loglinear.variants import REGISTRY

__all__ = ["ARCHS", "build_model", "count_parameters", "is_log_linear", "family"]

ARCHS = ("transformer",) + tuple(arch for name in REGISTRY for arch in (name, "ll_" + name))


def is_log_linear(arch: str) -> bool:
    return arch.startswith("ll_")


def family(arch: str) -> str:
    """"transformer" or the variant's name ("mamba2", "gated_deltanet", ...)."""
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
    if kw["hidden_size"] % kw["num_attention_heads"]:  # transformers' own check raises no ValueError
        raise ValueError(f"d_model = {kw['hidden_size']} must be a multiple of the Transformer's heads "
                         f"n_heads = {kw['num_attention_heads']}")
    return LlamaForCausalLM(LlamaConfig(**kw))


def _loglinear(arch: str, vocab_size: int, d_model: int, n_layers: int, n_heads: int | None, overrides: dict):
    from loglinear.models import MODELS

    config_cls, _, lm_cls = MODELS[family(arch)]
    kw = dict(
        vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers,
        num_heads=n_heads or config_cls.default_num_heads(d_model), use_log_linear=is_log_linear(arch),
        tie_word_embeddings=True,
    )
    kw.update(overrides)
    return lm_cls(config_cls(**kw))


def build_model(
    arch: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int | None = None,
    max_seq_len: int = 65536, seed: int | None = None, **overrides,
) -> torch.nn.Module:
    """A freshly initialised causal LM (`seed` fixes the initialisation) taking input_ids [B, T] -> logits [B, T, V]."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if seed is not None:
        torch.manual_seed(seed)
    if arch == "transformer":
        return _llama(vocab_size, d_model, n_layers, n_heads or max(1, d_model // 64), max_seq_len, overrides)
    return _loglinear(arch, vocab_size, d_model, n_layers, n_heads, overrides)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
