"""Convert a transformers ``Mamba2ForCausalLM`` checkpoint (a folder: config.json, safetensors weights, tokenizer
files) into the plain (use_log_linear=False) ``LogLinearMamba2ForCausalLM`` with the same logits, or with
log_linear into a log-linear one whose level weights start at exactly 1 (the same logits until trained); also the
``loglinear convert SRC DST [--log-linear]`` command, which also converts fla Gated DeltaNet checkpoints
(convert_fla_gated_deltanet, mapping in loglinear.models.convert_fla) and makes a plain loglinear model (of any
variant) log-linear the same way (log_linearize).

Weights (i: layer; transformers -> loglinear):

    backbone.embeddings.weight (or .embedding.)    -> model.embeddings.weight
    backbone.layers.i.norm.weight                  -> model.layers.i.mixer_norm.weight
    backbone.layers.i.mixer.in_proj.weight         -> model.layers.i.mixer.in_proj.weight   (z | xBC | dt, same order)
    backbone.layers.i.mixer.conv1d.weight / .bias  -> model.layers.i.mixer.conv.weight / .bias (zeros without bias)
    backbone.layers.i.mixer.{dt_bias, A_log, D}    -> model.layers.i.mixer.{dt_bias, A_log, D}
    backbone.layers.i.mixer.norm.weight            -> model.layers.i.mixer.norm.weight      (gated RMSNorm)
    backbone.layers.i.mixer.out_proj.weight        -> model.layers.i.mixer.out_proj.weight
    backbone.norm_f.weight                         -> model.norm.weight
    lm_head.weight                                 -> lm_head.weight (the embeddings when tie_word_embeddings)

Config: vocab_size, hidden_size, num_hidden_layers, num_heads, head_dim, state_size, expand, n_groups (also as
norm_groups: transformers normalises the gated RMSNorm per q/k group), conv_kernel, tie_word_embeddings,
initializer_range, time_step_min/max/floor, use_cache, pad/bos/eos_token_id
carry over; layer_norm_epsilon -> norm_eps; intermediate_size=0 (the blocks are mixer-only, like transformers');
use_log_linear=False. chunk_size carries over when a power of two, else the largest power of two below it (the
chunking does not change the function). use_conv_bias=False gives a zero conv bias. time_step_rank and
rescale_prenorm_residual only matter to transformers' initialisation. residual_in_fp32: our residual stream keeps the
model's dtype (the same in float32; bfloat16/float16 round differently).

An fla Mamba2ForCausalLM folder has the same weight names and model_type; its config's norm_eps, dt_limit, dt_min,
dt_max and dt_init_floor are read as layer_norm_epsilon and time_step_* (transformers' Mamba2Config would ignore
them and use its defaults).

Refused (ValueError naming the field): hidden_act other than silu; use_bias=True (our in_proj/out_proj have no
bias); a time_step_limit that clamps dt (ours does not clamp); fla's D_has_hdim=True, rmsnorm=False,
norm_before_gate=True; pickle weights (.bin/.pt, never loaded).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import torch

__all__ = ["convert", "convert_mamba2", "convert_fla_gated_deltanet", "convert_fla_log_linear_mamba2", "log_linearize",
           "load_exactly",
           "mamba2_config", "mamba2_state_dict", "TOKENIZER_FILES", "add_arguments", "run"]

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_DTYPES = {"source": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# per-layer parameters with the same name on both sides
_SAME = ("in_proj.weight", "out_proj.weight", "dt_bias", "A_log", "D", "norm.weight")


def _read_source_config(src: Path):
    """The transformers Mamba2Config of ``src`` (its defaults fill the fields config.json leaves out)."""
    from transformers import Mamba2Config

    path = src / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {src} (expected a transformers Mamba2ForCausalLM folder)")
    model_type = json.loads(path.read_text()).get("model_type")
    if model_type != "mamba2":
        raise ValueError(f"{path} has model_type {model_type!r}: only transformers' \"mamba2\" can be converted")
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: no strict config validation
        StrictDataclassError = ValueError
    try:
        hf = Mamba2Config.from_pretrained(src)
    except StrictDataclassError as e:
        raise ValueError(f"invalid {path}: {' '.join(str(e).split())}") from e
    return _with_fla_names(hf) if hasattr(hf, "norm_eps") else hf


# fla's Mamba2Config names -> transformers' (an fla "mamba2" folder has transformers' weight names and model_type)
_FLA_MAMBA2_NAMES = {"norm_eps": "layer_norm_epsilon", "dt_limit": "time_step_limit", "dt_min": "time_step_min",
                     "dt_max": "time_step_max", "dt_init_floor": "time_step_floor"}


def _with_fla_names(hf):
    """An fla Mamba2ForCausalLM config (transformers' Mamba2Config holding fla's fields as extra attributes) with
    fla's values under transformers' names; fla's block options ours cannot express are refused."""
    from loglinear.models.convert_fla import refuse

    fields = {"D_has_hdim": False, "rmsnorm": True, "norm_before_gate": False}
    cfg = {name: getattr(hf, name, default) for name, default in fields.items()}
    refuse({
        "D_has_hdim": (cfg["D_has_hdim"], "ours has one D per head"),
        "rmsnorm": (not cfg["rmsnorm"], "ours always has the gated RMSNorm"),
        "norm_before_gate": (cfg["norm_before_gate"], "ours gates before the norm (y * silu(z))"),
    }, cfg)
    for fla_name, name in _FLA_MAMBA2_NAMES.items():
        if hasattr(hf, fla_name):
            value = getattr(hf, fla_name)
            setattr(hf, name, tuple(value) if isinstance(value, list) else value)
    return hf


def mamba2_config(hf, log_linear: bool = False):
    """transformers Mamba2Config -> the LogLinearMamba2Config of the same function: plain (use_log_linear=False),
    or with log_linear a log-linear one whose level weights are 2 sigmoid(Ls W x) (level_activation "sigmoid",
    exactly 1 while W = 0). ValueError naming any field our model cannot express."""
    from loglinear.models.configuration import LogLinearMamba2Config

    d_inner = hf.num_heads * hf.head_dim
    if hf.hidden_act != "silu":
        raise ValueError(f"cannot convert hidden_act = {hf.hidden_act!r}: our Mamba-2 uses silu")
    if hf.use_bias:
        raise ValueError("cannot convert use_bias = True: our in_proj and out_proj have no bias")
    low, high = (float(x) for x in hf.time_step_limit)
    if low > 0 or high != math.inf:
        raise ValueError(f"cannot convert time_step_limit = {tuple(hf.time_step_limit)}: our Mamba-2 does not clamp "
                         "dt (only (0.0, inf) converts)")
    if int(hf.expand * hf.hidden_size) != d_inner:
        raise ValueError(f"inconsistent config: expand * hidden_size = {hf.expand * hf.hidden_size} "
                         f"!= num_heads * head_dim = {d_inner}")
    chunk = hf.chunk_size if hf.chunk_size & (hf.chunk_size - 1) == 0 else 1 << (hf.chunk_size.bit_length() - 1)
    return LogLinearMamba2Config(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers,
        num_heads=hf.num_heads, head_dim=hf.head_dim, state_size=hf.state_size, expand=hf.expand,
        n_groups=hf.n_groups, norm_groups=hf.n_groups, use_log_linear=log_linear,
        level_activation="sigmoid" if log_linear else "softplus",
        conv_kernel=hf.conv_kernel, chunk_size=chunk,
        intermediate_size=0, norm_eps=hf.layer_norm_epsilon, initializer_range=hf.initializer_range,
        tie_word_embeddings=bool(hf.tie_word_embeddings), use_cache=hf.use_cache,
        time_step_min=hf.time_step_min, time_step_max=hf.time_step_max, time_step_floor=hf.time_step_floor,
        pad_token_id=hf.pad_token_id, bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id,
    )


def _weight_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        return [src / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(src.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in src.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(f"{src} holds pickle weights ({', '.join(pickles)}), which are not loaded (unsafe): save "
                         "the model with safetensors first (save_pretrained(..., safe_serialization=True))")
    raise FileNotFoundError(f"no *.safetensors weights in {src}")


def _read_weights(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for path in _weight_files(src):
        if not path.is_file():
            raise FileNotFoundError(f"weight file {path} (listed in the index) is missing")
        weights.update(load_file(path))
    return weights


def mamba2_state_dict(weights: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """transformers Mamba2ForCausalLM tensors -> LogLinearMamba2ForCausalLM state dict (see the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in weights.items():
        name = name.replace("backbone.embedding.", "backbone.embeddings.")
        layer = re.fullmatch(r"backbone\.layers\.(\d+)\.(.+)", name)
        if name == "backbone.embeddings.weight":
            out["model.embeddings.weight"] = tensor
        elif name == "backbone.norm_f.weight":
            out["model.norm.weight"] = tensor
        elif name == "lm_head.weight":
            out["lm_head.weight"] = tensor
        elif layer and layer[2] == "norm.weight":
            out[f"model.layers.{layer[1]}.mixer_norm.weight"] = tensor
        elif layer and layer[2] in ("mixer.conv1d.weight", "mixer.conv1d.bias"):
            out[f"model.layers.{layer[1]}.mixer.conv.{layer[2].rsplit('.', 1)[1]}"] = tensor
        elif layer and layer[2].startswith("mixer.") and layer[2][len("mixer."):] in _SAME:
            out[f"model.layers.{layer[1]}.{layer[2]}"] = tensor
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"unexpected tensors in the checkpoint: {', '.join(sorted(unknown)[:5])}")
    for i in range(config.num_hidden_layers):  # use_conv_bias=False: a zero bias
        weight = out.get(f"model.layers.{i}.mixer.conv.weight")
        if weight is not None:
            out.setdefault(f"model.layers.{i}.mixer.conv.bias", weight.new_zeros(weight.shape[0]))
    if config.tie_word_embeddings and "model.embeddings.weight" in out:
        out["lm_head.weight"] = out["model.embeddings.weight"]
    return out


def load_exactly(model: torch.nn.Module, state: dict[str, torch.Tensor], mismatch: str) -> None:
    """Load state into model when it holds exactly the model's tensors (tied copies, saved once, may be absent);
    else a ValueError "<mismatch> (missing: ...; unexpected: ...; wrong shape: ...)"."""
    expected = model.state_dict()
    stored = {expected[n].data_ptr() for n in state if n in expected}
    tied = {n for n, t in expected.items() if n not in state and t.data_ptr() in stored}
    missing, extra = sorted(set(expected) - set(state) - tied), sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
             if k in state and state[k].shape != v.shape]
    if missing or extra or wrong:
        parts = [f"{what}: {', '.join(names[:5])}" for what, names in
                 (("missing", missing), ("unexpected", extra), ("wrong shape", wrong)) if names]
        raise ValueError(f"{mismatch} ({'; '.join(parts)})")
    model.load_state_dict(state, strict=False)  # only tied copies are absent, and they share storage


def _level_weights_at_one(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """state with every layer's level weights set to lambda = 1 exactly: a zero lambda projection W and Ls = 1
    (2 sigmoid(0) = 1), so the log-linear model computes the plain one until training moves W."""
    levels = {name: torch.zeros_like(t) if name.endswith("proj.weight") else torch.ones_like(t)
              for name, t in model.state_dict().items() if ".level_scales." in name}
    return state | levels


def _check_folders(src: Path, dst: Path, dtype: str) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if not src.is_dir():
        raise FileNotFoundError(f"source folder {src} does not exist")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"destination {dst} exists and is not an empty folder")


def _write(model: torch.nn.Module, state: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], src: Path,
           dst: Path, dtype: str, log_linear: bool) -> None:
    """Load the converted state into model (level weights at exactly 1 when log_linear), save it to dst in dtype
    ("source": the checkpoint's tensors' dtype when they share one, else float32) and copy the tokenizer files."""
    source_dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
    target = _DTYPES[dtype] or (source_dtypes.pop() if len(source_dtypes) == 1 else torch.float32)
    if log_linear:
        state = _level_weights_at_one(model, state)
    load_exactly(model, state, "the checkpoint's weights do not match its config")
    model.to(target).save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def convert_mamba2(src_dir: str | Path, dst_dir: str | Path, dtype: str = "source", log_linear: bool = False) -> None:
    """Convert the transformers Mamba2ForCausalLM folder ``src_dir`` into a LogLinearMamba2ForCausalLM folder
    ``dst_dir`` (new or empty) with the same logits; tokenizer files are copied along. dtype: "source" (the dtype of
    the checkpoint's tensors when they share one, else float32), "float32", "bfloat16" or "float16". log_linear: a
    log-linear model (use_log_linear=True) whose level weights start at exactly lambda = 1 (see mamba2_config), so
    it too has the source's logits until it is trained."""
    from loglinear.models.modeling import LogLinearMamba2ForCausalLM

    src, dst = Path(src_dir), Path(dst_dir)
    _check_folders(src, dst, dtype)
    config = mamba2_config(_read_source_config(src), log_linear)
    weights = _read_weights(src)
    _write(LogLinearMamba2ForCausalLM(config), mamba2_state_dict(weights, config), weights, src, dst, dtype,
           log_linear)


def convert_fla_gated_deltanet(src_dir: str | Path, dst_dir: str | Path, dtype: str = "source",
                               log_linear: bool = False) -> None:
    """Convert the fla GatedDeltaNetForCausalLM folder ``src_dir`` into a LogLinearGatedDeltaNetForCausalLM folder
    ``dst_dir`` with the same logits (loglinear.models.convert_fla); dtype and log_linear as in convert_mamba2."""
    from loglinear.models.convert_fla import gated_deltanet_config, gated_deltanet_state_dict
    from loglinear.models.modeling import LogLinearGatedDeltaNetForCausalLM

    src, dst = Path(src_dir), Path(dst_dir)
    _check_folders(src, dst, dtype)
    config = gated_deltanet_config(json.loads((src / "config.json").read_text()), log_linear)
    weights = _read_weights(src)
    _write(LogLinearGatedDeltaNetForCausalLM(config), gated_deltanet_state_dict(weights, config), weights, src, dst,
           dtype, log_linear)


def log_linearize(src_dir: str | Path, dst_dir: str | Path) -> None:
    """A plain (use_log_linear=False) loglinear model folder (any variant, e.g. a finished ``loglinear train --arch
    mamba2`` run) -> its log-linear model in dst_dir (new or empty) with the same logits: the same weights,
    level_activation "sigmoid" and level weights at exactly 1 (W = 0); tokenizer files are copied along."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    import loglinear.models  # noqa: F401  (registers the loglinear model types with the Auto classes)

    src, dst = Path(src_dir), Path(dst_dir)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"destination {dst} exists and is not an empty folder")
    config = AutoConfig.from_pretrained(src)
    if config.use_log_linear:
        raise ValueError(f"{src} is log-linear already (use_log_linear = True)")
    config.use_log_linear, config.level_activation = True, "sigmoid"
    model = AutoModelForCausalLM.from_config(config)
    weights = load_file(src / "model.safetensors")
    load_exactly(model, _level_weights_at_one(model, weights), f"{src}'s weights do not match its config")
    model.to(next(iter(weights.values())).dtype).save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def convert_fla_log_linear_mamba2(src_dir: str | Path, dst_dir: str | Path, dtype: str = "source") -> None:
    """Convert the fla LogLinearMamba2ForCausalLM folder ``src_dir`` into our log-linear LogLinearMamba2ForCausalLM
    in ``dst_dir`` with the same logits (loglinear.models.convert_fla); dtype as in convert_mamba2."""
    from loglinear.models.convert_fla import log_linear_mamba2_config, log_linear_mamba2_state_dict
    from loglinear.models.modeling import LogLinearMamba2ForCausalLM

    src, dst = Path(src_dir), Path(dst_dir)
    _check_folders(src, dst, dtype)
    raw = json.loads((src / "config.json").read_text())
    weights = _read_weights(src)
    levels = weights.get("backbone.layers.0.mixer.L")
    if levels is None or levels.dim() != 2:
        raise ValueError(f"{src} has no level weights backbone.layers.0.mixer.L [heads, levels]")
    config = log_linear_mamba2_config(raw, levels.shape[1])
    _write(LogLinearMamba2ForCausalLM(config), log_linear_mamba2_state_dict(weights, config), weights, src, dst, dtype,
           False)


def convert(src_dir: str | Path, dst_dir: str | Path, dtype: str = "source", log_linear: bool = False) -> str:
    """What ``loglinear convert`` does, by the source's model_type: a transformers or fla Mamba2ForCausalLM
    ("mamba2") -> convert_mamba2; an fla GatedDeltaNetForCausalLM ("gated_deltanet") -> convert_fla_gated_deltanet;
    an fla LogLinearMamba2ForCausalLM ("log_linear_mamba2") -> convert_fla_log_linear_mamba2; a plain loglinear
    model folder with log_linear -> log_linearize. Returns the written model's class name."""
    if not Path(src_dir).is_dir():
        raise FileNotFoundError(f"source folder {src_dir} does not exist")
    path = Path(src_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {src_dir} (expected a transformers Mamba2ForCausalLM, an fla "
                                "GatedDeltaNetForCausalLM or a loglinear model folder)")
    model_type = str(json.loads(path.read_text()).get("model_type", ""))
    if model_type.startswith("loglinear_"):
        if not log_linear:
            raise ValueError(f"{src_dir} is a loglinear model already; --log-linear makes a plain one log-linear")
        log_linearize(src_dir, dst_dir)
        return json.loads((Path(dst_dir) / "config.json").read_text())["architectures"][0]
    if model_type == "gated_deltanet":
        convert_fla_gated_deltanet(src_dir, dst_dir, dtype=dtype, log_linear=log_linear)
        return "LogLinearGatedDeltaNetForCausalLM"
    if model_type == "log_linear_mamba2":  # log-linear already: --log-linear changes nothing
        convert_fla_log_linear_mamba2(src_dir, dst_dir, dtype=dtype)
        return "LogLinearMamba2ForCausalLM"
    convert_mamba2(src_dir, dst_dir, dtype=dtype, log_linear=log_linear)
    return "LogLinearMamba2ForCausalLM"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="transformers Mamba2ForCausalLM or fla GatedDeltaNetForCausalLM folder (config.json, "
                   "*.safetensors, tokenizer files), or with --log-linear a plain loglinear model folder (e.g. a "
                   "`loglinear train --arch mamba2` run)")
    p.add_argument("dst", help="output folder (new or empty): the plain (use_log_linear=False) loglinear model")
    p.add_argument("--log-linear", action="store_true",
                   help="make it log-linear, with level weights lambda = 2 sigmoid(Ls W x) starting at exactly 1 "
                   "(W = 0): the same logits until trained")
    p.add_argument("--dtype", choices=list(_DTYPES), default="source",
                   help="dtype of the saved weights (source: that of the checkpoint's tensors)")


def run(args: argparse.Namespace) -> int:
    name = convert(args.src, args.dst, dtype=args.dtype, log_linear=args.log_linear)
    print(f"converted {args.src} -> {args.dst} ({name}, use_log_linear={args.log_linear})")
    return 0
