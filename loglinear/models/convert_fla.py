"""Convert fla (flash-linear-attention) checkpoints (a folder: config.json, safetensors weights, tokenizer files)
into ours with the same logits; fla is not imported, the folder is read as files.

  * ``GatedDeltaNetForCausalLM`` (model_type "gated_deltanet") -> the plain ``LogLinearGatedDeltaNetForCausalLM``,
    or with log_linear a log-linear one whose level weights start at exactly 1 (below);
  * ``LogLinearMamba2ForCausalLM`` (model_type "log_linear_mamba2") -> our log-linear Mamba-2
    (log_linear_mamba2_state_dict: the same level weights softplus(L * (W x)), over fla's 15 levels, i.e. up to
    2^14 tokens per sequence; the gated RMSNorm per q/k group; fla's SwiGLU of width 256 ceil(8 hidden / 3 / 256));
  * fla's ``Mamba2ForCausalLM`` has transformers' layout: loglinear.models.convert reads it.

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

import math

import torch

__all__ = ["refuse", "gated_deltanet_config", "gated_deltanet_state_dict", "log_linear_mamba2_config",
           "log_linear_mamba2_state_dict"]

# fla's GatedDeltaNetConfig defaults for fields a config.json may leave out
_FLA_DEFAULTS = dict(
    hidden_size=2048, expand_v=2.0, use_gate=True, use_short_conv=True, allow_neg_eigval=False, conv_size=4,
    head_dim=256, num_heads=6, num_v_heads=None, hidden_ratio=4, intermediate_size=None, hidden_act="swish",
    num_hidden_layers=21, norm_eps=1e-6, attn=None, use_cache=True, pad_token_id=None, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, initializer_range=0.02, vocab_size=32000, attnres_block_size=None,
    output_gate_activation="swish",
)


def refuse(refused: dict[str, tuple[bool, str]], cfg: dict) -> None:
    """ValueError "cannot convert <field> = <value>: <why>" for the first field whose condition holds."""
    for field, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"cannot convert {field} = {cfg[field]!r}: {why}")


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
    refuse(refused, cfg)
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


# --- log-linear Mamba-2 ---------------------------------------------------------------------------------------
# fla's LogLinearMamba2Config (a Mamba2Config) defaults for fields a config.json may leave out
_FLA_LL_MAMBA2_DEFAULTS = dict(
    head_dim=64, vocab_size=32000, hidden_size=2048, state_size=128, num_hidden_layers=48, norm_eps=1e-5,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, expand=2, conv_kernel=4, n_groups=1, use_bias=False,
    use_conv_bias=True, D_has_hdim=False, hidden_act="silu", initializer_range=0.02, dt_min=0.001, dt_max=0.1,
    dt_init_floor=1e-4, dt_limit=(0.0, math.inf), use_cache=True, rmsnorm=True, norm_before_gate=False,
    chunk_size=64, tie_word_embeddings=False, attnres_block_size=None,
)


def _float(x) -> float:
    """A config.json number; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(x["__float__"]) if isinstance(x, dict) else float(x)


def log_linear_mamba2_config(raw: dict, levels: int):
    """fla LogLinearMamba2Config fields (config.json as a dict) and its level count (the L parameter's width) -> the
    LogLinearMamba2Config of the same function: level weights softplus(Ls * (W x)) over ``levels`` levels (fla's
    form), the gated RMSNorm per q/k group, fla's fixed SwiGLU width. ValueError naming what ours cannot express."""
    from loglinear.models.configuration import LogLinearMamba2Config

    cfg = _FLA_LL_MAMBA2_DEFAULTS | raw
    low, high = (_float(x) for x in cfg["dt_limit"])
    refuse({
        "attnres_block_size": (cfg["attnres_block_size"] is not None, "ours has no attention residuals"),
        "D_has_hdim": (bool(cfg["D_has_hdim"]), "ours has one D per head"),
        "rmsnorm": (not cfg["rmsnorm"], "ours always has the gated RMSNorm"),
        "norm_before_gate": (bool(cfg["norm_before_gate"]), "ours gates before the norm (y * silu(z))"),
        "use_bias": (bool(cfg["use_bias"]), "our in_proj and out_proj have no bias"),
        "hidden_act": (cfg["hidden_act"] not in ("silu", "swish"), "our Mamba-2 uses silu"),
        "dt_limit": (low > 0 or high != math.inf, "our Mamba-2 does not clamp dt"),
    }, cfg)
    hidden = cfg["hidden_size"]
    return LogLinearMamba2Config(
        vocab_size=cfg["vocab_size"], hidden_size=hidden, num_hidden_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_heads"], head_dim=cfg["head_dim"], state_size=cfg["state_size"], expand=cfg["expand"],
        n_groups=cfg["n_groups"], norm_groups=cfg["n_groups"], conv_kernel=cfg["conv_kernel"],
        chunk_size=cfg["chunk_size"], use_log_linear=True, max_levels=levels, level_activation="softplus",
        intermediate_size=_mlp_width({"intermediate_size": None, "hidden_size": hidden, "hidden_ratio": 4}),
        norm_eps=cfg["norm_eps"], time_step_min=cfg["dt_min"], time_step_max=cfg["dt_max"],
        time_step_floor=cfg["dt_init_floor"], tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        initializer_range=cfg["initializer_range"], use_cache=cfg["use_cache"], pad_token_id=cfg["pad_token_id"],
        bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"],
    )


_LL_LAYER = {
    "mixer_norm.weight": "mixer_norm.weight", "mlp_norm.weight": "mlp_norm.weight",
    "mixer.conv.weight": "mixer.conv1d.weight", "mixer.conv.bias": "mixer.conv1d.bias",
    "mixer.A_log": "mixer.A_log", "mixer.D": "mixer.D", "mixer.dt_bias": "mixer.dt_bias",
    "mixer.norm.weight": "mixer.norm.weight", "mixer.out_proj.weight": "mixer.out_proj.weight",
    "mixer.level_scales.level_scale": "mixer.L", "mlp.down.weight": "mlp.down_proj.weight",
}


def log_linear_mamba2_state_dict(weights: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """fla LogLinearMamba2ForCausalLM tensors -> our LogLinearMamba2ForCausalLM state dict: fla's in_proj
    (z | xBC | dt | lambda logits, the last H * levels rows) splits into our in_proj and level_scales.proj; its L
    is our level_scale; gate_proj and up_proj stack into gate_up; a missing conv bias (use_conv_bias=False) is 0."""
    d_inner = config.num_heads * config.head_dim
    split = 2 * d_inner + 2 * config.n_groups * config.state_size + config.num_heads
    out = {"model.embeddings.weight": weights.get("backbone.embeddings.weight"),
           "model.norm.weight": weights.get("backbone.norm_f.weight"), "lm_head.weight": weights.get("lm_head.weight")}
    for i in range(config.num_hidden_layers):
        fla, ours = f"backbone.layers.{i}.", f"model.layers.{i}."
        conv = weights.get(fla + "mixer.conv1d.weight")
        if conv is not None and fla + "mixer.conv1d.bias" not in weights:
            weights = weights | {fla + "mixer.conv1d.bias": conv.new_zeros(conv.shape[0])}
        out |= {ours + mine: weights.get(fla + theirs) for mine, theirs in _LL_LAYER.items()}
        in_proj = weights.get(fla + "mixer.in_proj.weight")
        if in_proj is not None and in_proj.shape[0] > split:
            out[ours + "mixer.in_proj.weight"], out[ours + "mixer.level_scales.proj.weight"] = in_proj.split(
                [split, in_proj.shape[0] - split])
        elif in_proj is not None:  # too few rows: load_exactly names the wrong shape
            out[ours + "mixer.in_proj.weight"] = in_proj
        gate, up = weights.get(fla + "mlp.gate_proj.weight"), weights.get(fla + "mlp.up_proj.weight")
        out[ours + "mlp.gate_up.weight"] = torch.cat([gate, up]) if gate is not None and up is not None else None
    used = {f"backbone.layers.{i}.{name}" for i in range(config.num_hidden_layers)
            for name in [*_LL_LAYER.values(), "mixer.in_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"]}
    used |= {"backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight"}
    unexpected = sorted(set(weights) - used)
    if unexpected:
        raise ValueError(f"the fla log-linear Mamba-2 checkpoint does not match its config (unexpected: "
                         f"{', '.join(unexpected[:5])})")
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embeddings.weight"]
    return {name: t for name, t in out.items() if t is not None}  # what is missing, load_exactly names
