"""Context parallelism for whole models: every log-linear mixer runs on its rank's shard of the sequence.

Everything in a loglinear model except the mixers is token-wise (embeddings, norms, MLPs, LM head), so
sharding the sequence only changes the two sequence-mixing steps of each mixer:

    short convolution   reads the previous shard's last W-1 inputs (halo.previous_tokens)
    attention op        the context-parallel op (ops.py): the exact incoming Fenwick state per shard

``apply_context_parallel(model, group)`` rebinds the ``forward`` of every FenwickMixer in the model to
that composition (parameter names and state_dict are unchanged, so FSDP2 and checkpoints work as before),
and the model's own ``forward`` to run inside layout.shared_shard_shapes(): one all_gather of the shard
shapes per forward pass, not one per layer (every layer sees the same shards).
The model then takes this rank's slice of the inputs (mesh.shard_sequence) and returns its slice of the
outputs; a loss over a shard must use targets shifted before sharding (inputs[:, :-1], targets[:, 1:]).
Training and prefill from the start of the sequences only: no padding, packing or decoding state.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from loglinear.distributed.halo import previous_tokens
from loglinear.distributed.layout import shared_shard_shapes
from loglinear.distributed.ops import context_parallel_attention

__all__ = ["apply_context_parallel", "context_parallel_mixer_forward"]


def _level_scales(mixer, x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """lambda [B, T, H, max_levels]: the mixer's, or ones (plain models, where lambda = 1)."""
    if mixer.level_scales is not None:
        return mixer.level_scales(x).reshape(*shape, mixer.num_heads, -1)
    return torch.ones((), dtype=torch.float32, device=x.device).expand(*shape, mixer.num_heads, mixer.max_levels)


def context_parallel_mixer_forward(
    mixer, group: dist.ProcessGroup, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None, state=None, output_state: bool = False, layout=None,
) -> tuple[torch.Tensor, None]:
    """A FenwickMixer's forward on this rank's shard.  hidden_states: [B, T_r, D] -> ([B, T_r, D], None)."""
    from loglinear.layers.sequence import TokenLayout

    packed = cu_seqlens is not None or (layout is not None and layout.packed)
    if state is not None or output_state or packed or (attention_mask is not None and not bool(attention_mask.all())):
        raise ValueError(
            "context-parallel mixers run dense sequences from their start: state, output_state, padding "
            "(attention_mask zeros) and packing (cu_seqlens) are not supported"
        )
    B, T, _ = hidden_states.shape
    layout = TokenLayout.build(B, T, device=hidden_states.device)
    x = layout.flatten(hidden_states)
    conv_in, rest = mixer.conv_inputs(x)
    halo = previous_tokens(conv_in.reshape(B, T, -1), mixer.conv.kernel_size[0] - 1, group) if mixer.conv else None
    features, _ = mixer.short_conv(conv_in, layout, halo)
    inputs = mixer.op_inputs(features, rest)
    view = layout.op_view
    lam = _level_scales(mixer, x, (B, T))
    gates = {name: view(x) for name, x in inputs.gates.items()}
    o, _ = context_parallel_attention(
        mixer.variant, view(inputs.q), view(inputs.k), view(inputs.v), gates, lam, group=group, scale=mixer.scale,
        use_qk_l2norm=mixer.l2norm_qk, chunk_size=mixer.chunk_size,
    )
    return layout.unflatten(mixer.output(layout.from_op_view(o), inputs)), None


def _forward_sharing_shard_shapes(model: torch.nn.Module, *args, **kwargs):
    """The model class's forward inside shared_shard_shapes() (bound to the model by apply_context_parallel)."""
    with shared_shard_shapes():
        return type(model).forward(model, *args, **kwargs)


def apply_context_parallel(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> torch.nn.Module:
    """Make every FenwickMixer of ``model`` context parallel over ``group`` (in place; returns the model);
    the model's forward gathers the shard shapes once for all its layers."""
    from loglinear.layers.mixer import FenwickMixer

    group = group if group is not None else dist.group.WORLD
    mixers = [m for m in model.modules() if isinstance(m, FenwickMixer)]
    if not mixers:
        raise ValueError(f"{type(model).__name__} has no log-linear mixers (FenwickMixer) to run context parallel")
    forward = lambda self, *args, **kwargs: context_parallel_mixer_forward(self, group, *args, **kwargs)  # noqa: E731
    for mixer in mixers:
        mixer.forward = types.MethodType(forward, mixer)
    if not isinstance(model, FenwickMixer):
        model.forward = types.MethodType(_forward_sharing_shard_shapes, model)
    return model
