"""What a variant is: the object every layer of the library reads instead of branching on a name.

A log-linear variant is a linear attention with a structured transition, o_t = scale * sum_{s<=t}
lambda_t[level(t, s)] * (q_t^T P_{t,s} k~_s) v_s^T, where P_{t,s} = A_t ... A_{s+1} is the product of per-token
transitions and k~_s the key it deposits (spec sections 1-5). A ``Variant`` bundles everything that differs
between variants:

    gates            its per-token inputs after v (names, layouts: per head, or per head and key channel), validated by
                     the public op
    form             the torch chunk form: the per-chunk algebra the Fenwick chunk scan runs on
    transfer_matrix  the materialized reference: beta_s q_t^T P_{t,s} k_s for all t >= s
    transition       one token's A_t applied to level states (the recurrent reference and the decode step)
    deposit_key      k~_t, the key a token writes into level 0
    shard_transition the whole-shard product A_{T-1} ... A_0 (context parallelism's boundary map)
    local_state      optionally, a closed form of the state a shard leaves when entered with zeros
    delta_rule       whether A_t = exp(g_t) (I - beta_t k_t k_t^T): decoding keeps lazy levels with a key window
    sample_gates     valid random gates (tests, the demo)

Backends (torch, Triton) register per variant name in loglinear.ops.api; layers, models, the training
factory and evaluation look variants up in loglinear.variants.REGISTRY.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Gate", "Variant", "by_chunk", "decays", "key_value_buckets"]

Gates = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Gate:
    """A per-token input of a variant after v: [B, T, H] in the public op ([N, H] in a decode step), or with
    per_channel one value per key channel: [B, T, H, K] ([N, H, K] in a decode step).

    log_decay: the gate is a log-decay g <= 0 (A_t = exp(g_t) ...): -inf is allowed (a hard reset) and the op floors
    it where exp underflows to 0 (loglinear.ops.finite); any other gate must be finite.

    The range in doc is the one the models produce; the op computes its formula for any finite value (a log-decay
    g > 0 grows the state, a beta outside (0, 1) is the delta rule with negative eigenvalues for beta in (1, 2)),
    as it does for a negative lambda."""

    name: str
    doc: str
    log_decay: bool = False
    per_channel: bool = False

    def layout(self, decode: bool = False) -> str:
        """Its layout in words: "[B, T, H]" / "[B, T, H, K]" (decode: "[N, H]" / "[N, H, K]")."""
        return ("[N, H" if decode else "[B, T, H") + (", K]" if self.per_channel else "]")


@dataclass(frozen=True, eq=False)
class Variant:
    """One log-linear variant (see the module docstring for the fields)."""

    name: str  # registry key, model_type suffix and architecture name ("mamba2")
    title: str  # for people ("Mamba-2")
    gates: tuple[Gate, ...]
    form: type
    transfer_matrix: Callable[[torch.Tensor, torch.Tensor, Gates], torch.Tensor]
    transition: Callable[[torch.Tensor, torch.Tensor, Gates], torch.Tensor]
    deposit_key: Callable[[torch.Tensor, Gates], torch.Tensor]
    shard_transition: Callable[..., torch.Tensor]
    matrix_transition: bool  # shard_transition is K x K per head (else a scalar per head: [.., 1, 1])
    sample_gates: Callable[..., Gates]  # (B, T, H, K, *, dtype, generator) -> valid random gates
    local_state: Callable[..., torch.Tensor] | None = None
    delta_rule: bool = False  # A_t = exp(g_t) (I - beta_t k_t k_t^T), gates g (a log-decay per head) and beta

    @property
    def gate_names(self) -> tuple[str, ...]:
        return tuple(gate.name for gate in self.gates)

    @property
    def scales_levels(self) -> bool:
        """Whether the transition only scales a state: A_t = exp(g_t) of the variant's one gate, a log-decay per head
        or per key channel. A decoding cache may then keep each level's accumulated log-decay beside it instead of
        rewriting the level every token (loglinear.ops.decode)."""
        return len(self.gates) == 1 and self.gates[0].log_decay

    @property
    def lazy_levels(self) -> bool:
        """Whether a decoding cache may keep levels lazily (loglinear.ops.decode): beside each level its accumulated
        log-decay, and for the delta rule the last tokens' keys and betas in a window."""
        return self.scales_levels or self.delta_rule

    def transition_shape(self, K: int) -> tuple[int, int]:
        """Trailing shape of shard_transition's result: (K, K) or (1, 1)."""
        return (K, K) if self.matrix_transition else (1, 1)

    def __repr__(self) -> str:
        return f"Variant({self.name!r})"


def by_chunk(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The chunks of a chunked tensor x: [b, H, N, ...] -> N views [b, H, ...], for a loop over chunks.

    One autograd node serves all N views: its backward writes x's gradient once. Indexing x[:, :, i] in the loop
    instead adds a node per chunk whose backward writes a zero tensor of x's whole size, which makes a backward
    through N chunks cost O(N^2) in memory traffic."""
    return x.unbind(2)


def key_value_buckets(kt: torch.Tensor, v: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """sum_s masks[m, s] kt_s v_s^T: the states of the selected tokens for a transition that only scales (the
    keys kt already decayed to the chunk's end).  kt: [b, H, C, K]; v: [b, H, C, V]; masks: [M, C]
    -> [b, M, H, K, V]."""
    return torch.einsum("mc,bhck,bhcv->bmhkv", masks, kt, v)


def decays(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decays of chunked log-gates g: [b, H, N, C] -> G: local inclusive cumsum [b, H, N, C];
    Gamma[t, s] = exp(G_t - G_s) for s <= t, 0 above the diagonal [b, H, N, C, C]; to_end = exp(G_last - G_s)
    [b, H, N, C]."""
    G = torch.cumsum(g, dim=-1)
    diff = G[..., :, None] - G[..., None, :]
    causal = torch.ones(diff.shape[-2:], dtype=torch.bool, device=g.device).tril()
    gamma = torch.exp(torch.where(causal, diff, torch.full_like(diff, -torch.inf)))
    to_end = torch.exp(G[..., -1:] - G)
    return G, gamma, to_end


def decay_matrix(g: torch.Tensor) -> torch.Tensor:
    """exp(G_t - G_s) for s <= t (0 above the diagonal) of g: [B, T, H] -> [B, H, T, T], G = cumsum_t g."""
    return decays(g.transpose(1, 2))[1]
