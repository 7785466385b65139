"""Convert an fla (flash-linear-attention) ``GatedDeltaNetForCausalLM`` checkpoint (a folder: config.json with
model_type "gated_deltanet", safetensors weights, tokenizer files) into the plain (use_log_linear=False)
``LogLinearGatedDeltaNetForCausalLM`` with the same logits, or with log_linear into a log-linear one whose level
weights start at exactly 1. fla is not imported: the folder is read as files.

Weights (i: layer; fla -> loglinear; [a; b]: rows stacked in that order):

    model.embeddings.weight                          -> model.embeddings.weight
    model.layers.i.attn_norm.weight                  -> model.layers.i.mixer_norm.weight
    model.layers.i.attn.{q,k,v}_proj.weight          -> model.layers.i.mixer.qkv_proj.weight   [q; k; v]
    model.layers.i.attn.{q,k,v}_conv1d.weight        -> model.layers.i.mixer.conv.weight       [q; k; v]
    model.layers.i.attn.{a,b}_proj.weight            -> model.layers.i.mixer.ab_proj.weight    [a; b]
    model.layers.i.attn.{A_log, dt_bias}             -> model.layers.i.mixer.{A_log, dt_bias}
    model.layers.i.attn.g_proj.weight                -> model.layers.i.mixer.g_proj.weight
    model.layers.i.attn.o_norm.weight                -> model.layers.i.mixer.norm.weight       (RMSNorm(o) * silu(g))
    model.layers.i.attn.o_proj.weight                -> model.layers.i.mixer.o_proj.weight
    model.layers.i.mlp_norm.weight                   -> model.layers.i.mlp_norm.weight
    model.layers.i.mlp.{gate,up}_proj.weight         -> model.layers.i.mlp.gate_up.weight      [gate; up]
    model.layers.i.mlp.down_proj.weight              -> model.layers.i.mlp.down.weight
    model.norm.weight, lm_head.weight                -> the same (lm_head: the embeddings when tie_word_embeddings)

The function is the same: fla's layer computes g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b),
l2-normalised q and k after SiLU(short conv), scale head_dim^-1/2, the output norm before its SiLU gate and a SwiGLU
MLP, as ours does. Config: vocab_size, hidden_size, num_hidden_layers, num_heads, head_dim, expand_v, conv_size ->
conv_kernel, norm_eps, the MLP width (intermediate_size, or fla's rule from hidden_ratio), tie_word_embeddings,
initializer_range, use_cache, pad/bos/eos_token_id; intermediate_size as fla computes it.

Refused (ValueError naming the field): hybrid attention layers (attn), attention residuals (attnres_block_size),
num_v_heads other than num_heads, use_gate=False, use_short_conv=False (fla then applies SiLU without a conv; ours
has neither), allow_neg_eigval=True, an output gate other than swish/silu, hidden_act other than swish, conv biases.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["is_fla_gated_deltanet", "gated_deltanet_config", "gated_deltanet_state_dict"]

FLA_MODEL_TYPE = "gated_deltanet"
# fla's GatedDeltaNetConfig defaults for fields a config.json may leave out
_FLA_DEFAULTS = dict(
    hidden_size=2048, expand_v=2.0, use_gate=True, use_short_conv=True, allow_neg_eigval=False, conv_size=4,
    head_dim=256, num_heads=6, num_v_heads=None, hidden_ratio=4, intermediate_size=None, hidden_act="swish",
    num_hidden_layers=21, norm_eps=1e-6, attn=None, use_cache=True, pad_token_id=None, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, initializer_range=0.02, vocab_size=32000, attnres_block_size=None,
    output_gate_activation="swish",
)


def is_fla_gated_deltanet(src: Path) -> bool:
    """Does src/config.json name fla's Gated DeltaNet model type?"""
    return json.loads((Path(src) / "config.json").read_text()).get("model_type") == FLA_MODEL_TYPE


def _mlp_width(cfg: dict) -> int:
    """fla's GatedMLP width: intermediate_size, else 2/3 hidden_ratio hidden rounded up to a multiple of 256."""
    if cfg["intermediate_size"] is not None:
        return int(cfg["intermediate_size"])
    width = int(cfg["hidden_size"] * (cfg["hidden_ratio"] or 4) * 2 / 3)
    return 256 * ((width + 255) // 256)


def gated_deltanet_config(raw: dict, log_linear: bool = False):
    """fla GatedDeltaNetConfig fields (config.json as a dict) -> the LogLinearGatedDeltaNetConfig of the same
    function (plain, or log-linear with level weights 2 sigmoid(Ls W x), exactly 1 while W = 0). ValueError naming
    any field our model cannot express."""
    from loglinear.models.configuration import LogLinearGatedDeltaNetConfig

    cfg = _FLA_DEFAULTS | raw
    refused = {
        "attn": (cfg["attn"] is not None, "hybrid attention layers are not a Gated DeltaNet block of ours"),
        "attnres_block_size": (cfg["attnres_block_size"] is not None, "ours has no attention residuals"),
        "num_v_heads": (cfg["num_v_heads"] not in (None, cfg["num_heads"]), "ours has one value head per q/k head"),
        "use_gate": (not cfg["use_gate"], "ours always has the output gate"),
        "use_short_conv": (not cfg["use_short_conv"], "fla then applies SiLU without a convolution, ours neither"),
        "allow_neg_eigval": (bool(cfg["allow_neg_eigval"]), "ours keeps beta in (0, 1)"),
        "output_gate_activation": (cfg["output_gate_activation"] not in ("swish", "silu"), "ours gates with silu"),
        "hidden_act": (cfg["hidden_act"] != "swish", "our MLP is SwiGLU"),
    }
    for field, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"cannot convert {field} = {cfg[field]!r}: {why}")
    return LogLinearGatedDeltaNetConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_heads"], head_dim=cfg["head_dim"], expand_v=float(cfg["expand_v"]),
        conv_kernel=cfg["conv_size"], intermediate_size=_mlp_width(cfg), norm_eps=cfg["norm_eps"],
        use_log_linear=log_linear, level_activation="sigmoid" if log_linear else "softplus",
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]), initializer_range=cfg["initializer_range"],
        use_cache=cfg["use_cache"], pad_token_id=cfg["pad_token_id"], bos_token_id=cfg["bos_token_id"],
        eos_token_id=cfg["eos_token_id"],
    )


# ours <- fla, per layer: one tensor, or several stacked along dim 0 in this order
_LAYER = {
    "mixer_norm.weight": ("attn_norm.weight",),
    "mixer.qkv_proj.weight": ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"),
    "mixer.conv.weight": ("attn.q_conv1d.weight", "attn.k_conv1d.weight", "attn.v_conv1d.weight"),
    "mixer.ab_proj.weight": ("attn.a_proj.weight", "attn.b_proj.weight"),
    "mixer.A_log": ("attn.A_log",),
    "mixer.dt_bias": ("attn.dt_bias",),
    "mixer.g_proj.weight": ("attn.g_proj.weight",),
    "mixer.norm.weight": ("attn.o_norm.weight",),
    "mixer.o_proj.weight": ("attn.o_proj.weight",),
    "mlp_norm.weight": ("mlp_norm.weight",),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.down.weight": ("mlp.down_proj.weight",),
}
_TOP = {"model.embeddings.weight": "model.embeddings.weight", "model.norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}


def gated_deltanet_state_dict(weights: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """fla GatedDeltaNetForCausalLM tensors -> LogLinearGatedDeltaNetForCausalLM state dict (module docstring).
    ValueError listing tensors that are missing or have no place in ours (e.g. conv biases)."""
    out = {ours: weights[theirs] for ours, theirs in _TOP.items() if theirs in weights}
    used, missing = {theirs for theirs in _TOP.values() if theirs in weights}, []
    for i in range(config.num_hidden_layers):
        for ours, theirs in _LAYER.items():
            names = [f"model.layers.{i}.{name}" for name in theirs]
            absent = [n for n in names if n not in weights]
            if absent:
                missing += absent
                continue
            used |= set(names)
            parts = [weights[n] for n in names]
            out[f"model.layers.{i}.{ours}"] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    unexpected = sorted(set(weights) - used)
    if missing or unexpected:
        parts = [f"{what}: {', '.join(names[:5])}" for what, names in
                 (("missing", missing), ("unexpected", unexpected)) if names]
        raise ValueError(f"the fla Gated DeltaNet checkpoint does not match its config ({'; '.join(parts)})")
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embeddings.weight"]
    return out
