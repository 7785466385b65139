"""The log-linear variants: one object each (loglinear.variants.base.Variant), looked up by name.

    REGISTRY = {"mamba2": MAMBA2, "gated_deltanet": GATED_DELTANET, "gla": GLA}

Adding a variant: its module here (gates, chunk form, reference transfer matrix and transition, decode
deposit, shard transition), its registration line below, its layer and model config, optionally its
kernels (see docs/adding-a-variant.md).
"""

from loglinear.variants.base import Gate, Variant
from loglinear.variants.gated_deltanet import GATED_DELTANET
from loglinear.variants.gla import GLA
from loglinear.variants.mamba2 import MAMBA2

__all__ = ["Gate", "Variant", "REGISTRY", "get", "MAMBA2", "GATED_DELTANET", "GLA"]

REGISTRY: dict[str, Variant] = {v.name: v for v in (MAMBA2, GATED_DELTANET, GLA)}


def get(variant: "str | Variant") -> Variant:
    """The registered variant of that name (a Variant passes through); ValueError naming the known ones."""
    if isinstance(variant, Variant):
        return variant
    if variant not in REGISTRY:
        raise ValueError(f"variant must be one of {sorted(REGISTRY)}, got {variant!r}")
    return REGISTRY[variant]
