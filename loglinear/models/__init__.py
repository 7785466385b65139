"""Hugging Face causal LMs on the log-linear mixers, registered with the Auto classes on import:

    AutoConfig / AutoModel / AutoModelForCausalLM  <->  "loglinear_mamba2", "loglinear_gated_deltanet", "loglinear_gla"

MODELS maps a variant's name (loglinear.variants) to its (config, model, causal LM) classes.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from loglinear.models.cache import FenwickCache
from loglinear.models.configuration import LogLinearGatedDeltaNetConfig, LogLinearGLAConfig, LogLinearMamba2Config
from loglinear.models.modeling import (
    LogLinearGatedDeltaNetForCausalLM,
    LogLinearGatedDeltaNetModel,
    LogLinearGLAForCausalLM,
    LogLinearGLAModel,
    LogLinearMamba2ForCausalLM,
    LogLinearMamba2Model,
)

__all__ = [
    "LogLinearMamba2Config", "LogLinearMamba2Model", "LogLinearMamba2ForCausalLM",
    "LogLinearGatedDeltaNetConfig", "LogLinearGatedDeltaNetModel", "LogLinearGatedDeltaNetForCausalLM",
    "LogLinearGLAConfig", "LogLinearGLAModel", "LogLinearGLAForCausalLM",
    "FenwickCache", "MODELS",
]

MODELS = {
    "mamba2": (LogLinearMamba2Config, LogLinearMamba2Model, LogLinearMamba2ForCausalLM),
    "gated_deltanet": (LogLinearGatedDeltaNetConfig, LogLinearGatedDeltaNetModel, LogLinearGatedDeltaNetForCausalLM),
    "gla": (LogLinearGLAConfig, LogLinearGLAModel, LogLinearGLAForCausalLM),
}

for _config, _model, _lm in MODELS.values():
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)
