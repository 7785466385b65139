"""Layers: log-linear Mamba-2, Gated DeltaNet and GLA mixers (spec sections 6, 6b), with their decoding state."""

from loglinear.layers.gated_deltanet import LogLinearGatedDeltaNet
from loglinear.layers.gla import LogLinearGLA
from loglinear.layers.mamba2 import LogLinearMamba2
from loglinear.layers.mixer import FenwickMixer, MixerState
from loglinear.layers.norm import GatedRMSNorm, RMSNorm
from loglinear.layers.sequence import TokenLayout

__all__ = ["LogLinearMamba2", "LogLinearGatedDeltaNet", "LogLinearGLA", "FenwickMixer", "MixerState", "TokenLayout",
           "RMSNorm", "GatedRMSNorm"]
