"""Layers: log-linear Mamba-2 and Gated DeltaNet mixers (spec section 6), with their decoding state."""

from loglinear.layers.gated_deltanet import LogLinearGatedDeltaNet
from loglinear.layers.mamba2 import LogLinearMamba2
from loglinear.layers.mixer import FenwickMixer, MixerState
from loglinear.layers.norm import GatedRMSNorm, RMSNorm
from loglinear.layers.sequence import TokenLayout

__all__ = ["LogLinearMamba2", "LogLinearGatedDeltaNet", "FenwickMixer", "MixerState", "TokenLayout", "RMSNorm",
           "GatedRMSNorm"]
