"""Causal LMs on the log-linear mixers: Hugging Face PreTrainedModel + GenerationMixin.

    embeddings -> [x + mixer(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] x num_hidden_layers -> RMSNorm -> lm_head

The forward takes input_ids [B, T], attention_mask [B, T] (left or right padding: padded positions are
skipped, every row is its own sequence), cu_seqlens [N + 1] (packed sequences, B = 1), labels,
and a FenwickCache as ``cache`` or ``past_key_values`` with use_cache. Outputs at padded positions are
those of a zero hidden state; a batch gives exactly the per-sequence results. Token ids and labels outside the
vocabulary (labels other than -100) raise a ValueError (checked_tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from loglinear.inputs import IGNORE_INDEX
from loglinear.layers import LogLinearGatedDeltaNet, LogLinearGLA, LogLinearMamba2, MixerState, RMSNorm, TokenLayout
from loglinear.layers.mixer import FenwickMixer, StaticState
from loglinear.layers.norm import GatedRMSNorm, wide
from loglinear.models.cache import FenwickCache
from loglinear.models.configuration import LogLinearGatedDeltaNetConfig, LogLinearGLAConfig, LogLinearMamba2Config
from loglinear.models.graphs import graph_step
from loglinear.ops.finite import host_later

__all__ = [
    "LogLinearMamba2Model", "LogLinearMamba2ForCausalLM", "LogLinearGatedDeltaNetModel",
    "LogLinearGatedDeltaNetForCausalLM", "LogLinearGLAModel", "LogLinearGLAForCausalLM", "CACHE_KEY",
]


# transformers' outputs name the cache "cache" from 5.2x on, "past_key_values" before: use the installed name.
CACHE_KEY = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def checked_tokens(name: str, x: torch.Tensor | None, high: int, ignore: int | None = None
                   ) -> tuple[torch.Tensor | None, Callable[[], None]]:
    """Token ids x (any shape; None: nothing to check) and a check of their range: entries outside [0, high) other
    than ``ignore`` are replaced (by ``ignore``, else 0) in the tensor returned, so that no lookup or loss kernel
    reads past its table (on CUDA that is a device-side assert, which ends the process's CUDA context), and the
    check raises a ValueError naming ``name`` if there were any. Its flag reaches the host behind the work queued so far
    (ops.finite.host_later): call the check after queueing the forward, so the host does not wait before it.
    Nothing is checked while torch.compile traces or a CUDA graph is captured (x as given)."""
    if x is None or torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return x, lambda: None
    bad = (x < 0) | (x >= high)
    if ignore is not None:
        bad &= x != ignore
    flag = host_later(bad.any().reshape(1))

    def check() -> None:
        if flag()[0]:
            allowed = f"in [0, {high})" + (f" or {ignore}" if ignore is not None else "")
            raise ValueError(f"{name} must be {allowed}, got {x[bad][0].item()}")

    return torch.where(bad, 0 if ignore is None else ignore, x), check


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)).  x: [*, D]."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class FenwickBlock(GradientCheckpointingLayer):
    """x + mixer(RMSNorm(x)), then x + MLP(RMSNorm(x)) (no MLP when intermediate_size = 0).  x: [B, T, D]."""

    def __init__(self, config, mixer_cls: type[FenwickMixer], layer_idx: int):
        super().__init__()
        self.mixer_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mixer = mixer_cls(**config.mixer_kwargs(), layer_idx=layer_idx)
        self.mlp = None
        if config.intermediate_size:
            self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, hidden_states: torch.Tensor, layout: TokenLayout, state: MixerState | None = None,
        output_state: bool = False,
    ) -> tuple[torch.Tensor, MixerState | None]:
        mixed, state = self.mixer(self.mixer_norm(hidden_states), state=state, output_state=output_state, layout=layout)
        return self._with_mlp(hidden_states + mixed), state

    def step_(self, hidden_states: torch.Tensor, state: StaticState, positions: torch.Tensor) -> torch.Tensor:
        """One token per sequence, the mixer's state updated in place (FenwickMixer.step_).  [N, 1, D] -> [N, 1, D]."""
        return self._with_mlp(hidden_states + self.mixer.step_(self.mixer_norm(hidden_states), state, positions))

    def _with_mlp(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.mlp is None:
            return hidden_states
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))


class _FenwickPreTrainedModel(PreTrainedModel):
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["FenwickBlock"]
    _is_stateful = True
    mixer_cls: type[FenwickMixer]

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own FenwickCache

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, FenwickMixer):
            module.init_special_parameters(init.copy_)
            if module.conv is not None:
                module.conv.reset_parameters()


class _FenwickModel(_FenwickPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(FenwickBlock(config, self.mixer_cls, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings = value

    def forward(
        self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None, past_key_values: Cache | None = None, inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None, cu_seqlens: torch.Tensor | None = None,
        output_hidden_states: bool | None = None, return_dict: bool | None = None, **kwargs,
    ) -> BaseModelOutputWithPast:
        """input_ids: [B, T] (or inputs_embeds [B, T, D]); see the module docstring for the rest."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] and inputs_embeds [B, T, D]")
        self._check_inputs(input_ids, inputs_embeds)
        input_ids, check_ids = checked_tokens("input_ids", input_ids, self.config.vocab_size)
        hidden = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = hidden.shape[:2]
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        cache = self._cache(cache if cache is not None else past_key_values, use_cache)
        if cache is not None:  # checked before the layers update it: a refused call leaves the cache as it was
            check_ids()
        layout = TokenLayout.build(B, T, attention_mask, cu_seqlens, hidden.device)
        all_hidden = [] if output_hidden_states else None
        for i, block in enumerate(self.layers):
            if all_hidden is not None:
                all_hidden.append(hidden)
            state = cache[i] if cache is not None else None
            hidden, state = block(hidden, layout=layout, state=state, output_state=cache is not None)
            if cache is not None:
                cache.update_state(i, state)
        hidden = self.norm(hidden)
        if cache is None:  # checked once the forward is queued
            check_ids()
        if all_hidden is not None:
            all_hidden.append(hidden)
        hidden_states = tuple(all_hidden) if all_hidden is not None else None
        return BaseModelOutputWithPast(last_hidden_state=hidden, hidden_states=hidden_states, **{CACHE_KEY: cache})

    @torch.no_grad()
    def step_(self, input_ids: torch.Tensor, states: list[StaticState], positions: torch.Tensor) -> torch.Tensor:
        """One token per sequence through every layer, the layers' states updated in place (the step
        loglinear.models.graphs captures).  input_ids: [N, 1]; states: one per layer; positions: [N] int64 on the
        device (not advanced here).  Returns the last hidden state [N, 1, D]."""
        hidden = self.embeddings(input_ids)
        for block, state in zip(self.layers, states, strict=True):
            hidden = block.step_(hidden, state, positions)
        return self.norm(hidden)

    def _check_inputs(self, input_ids: object, inputs_embeds: object) -> None:
        if input_ids is not None:
            if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
                what = f"dtype {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
                raise TypeError(f"input_ids must be an int32/int64 tensor [B, T], got {what}")
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        elif not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 \
                or inputs_embeds.shape[2] != self.config.hidden_size:
            what = (tuple(inputs_embeds.shape) if isinstance(inputs_embeds, torch.Tensor)
                    else type(inputs_embeds).__name__)
            raise ValueError(f"inputs_embeds must be [B, T, hidden_size = {self.config.hidden_size}], got {what}")

    def _cache(self, cache: Cache | None, use_cache: bool) -> FenwickCache | None:
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError(f"cache must be a FenwickCache (or None), got {type(cache).__name__}")
        if isinstance(cache, FenwickCache) and len(cache) != self.config.num_hidden_layers:
            raise ValueError(f"cache holds {len(cache)} layers, "
                             f"the model has num_hidden_layers = {self.config.num_hidden_layers}")
        if cache is not None and not isinstance(cache, FenwickCache):
            if cache.get_seq_length() != 0:
                raise TypeError(f"log-linear models decode with a FenwickCache, got a non-empty {type(cache).__name__}")
            cache = None  # an empty cache made by generic code: replace it
        if cache is None and use_cache:
            cache = FenwickCache(self.config.num_hidden_layers)
        return cache


class _FenwickForCausalLM(_FenwickPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}
    model_cls: type[_FenwickModel]

    def __init__(self, config):
        super().__init__(config)
        self.model = self.model_cls(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None, past_key_values: Cache | None = None, inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None, use_cache: bool | None = None, cu_seqlens: torch.Tensor | None = None,
        output_hidden_states: bool | None = None, return_dict: bool | None = None, logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """labels: [B, T] next-token targets (-100 ignored; shifted inside; with cu_seqlens no target crosses
        a sequence boundary). logits_to_keep > 0 computes logits of the last positions only. With a
        FenwickCache(cuda_graph=True), a one-token step of every sequence replays a CUDA graph
        (loglinear.models.graphs)."""
        given = cache if cache is not None else past_key_values
        if isinstance(given, FenwickCache) and given.cuda_graph and use_cache is not False and labels is None \
                and inputs_embeds is None and cu_seqlens is None and not output_hidden_states:
            logits = graph_step(self, given, input_ids, attention_mask)
            if logits is not None:
                return CausalLMOutputWithPast(logits=logits, **{CACHE_KEY: given})
        out = self.model(
            input_ids, attention_mask=attention_mask, cache=cache, past_key_values=past_key_values,
            inputs_embeds=inputs_embeds, use_cache=use_cache, cu_seqlens=cu_seqlens,
            output_hidden_states=output_hidden_states,
        )
        hidden = out.last_hidden_state if not logits_to_keep else out.last_hidden_state[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = self.loss(logits, labels, cu_seqlens) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                      **{CACHE_KEY: out.get(CACHE_KEY)})

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy of logits[:, t] against labels[:, t + 1].  logits: [B, T, V]; labels: [B, T] in [0, V)
        or IGNORE_INDEX (checked_tokens)."""
        if labels.shape != logits.shape[:2]:
            raise ValueError(f"labels must be [B, T] = {list(logits.shape[:2])} like the logits, "
                             f"got shape {tuple(labels.shape)}")
        labels, check_labels = checked_tokens("labels", labels, logits.shape[-1], IGNORE_INDEX)
        targets = labels[:, 1:].clone()
        if cu_seqlens is not None:
            starts = cu_seqlens[1:-1].to(targets.device)
            targets[:, starts - 1] = IGNORE_INDEX  # the first token of a packed sequence is not predicted from the last
        loss = F.cross_entropy(wide(logits[:, :-1]).reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX)
        check_labels()  # once the loss is queued
        return loss


class LogLinearMamba2PreTrainedModel(_FenwickPreTrainedModel):
    config_class = LogLinearMamba2Config
    mixer_cls = LogLinearMamba2


class LogLinearMamba2Model(LogLinearMamba2PreTrainedModel, _FenwickModel):
    """Log-linear Mamba-2 backbone: input_ids [B, T] -> last_hidden_state [B, T, D]."""


class LogLinearMamba2ForCausalLM(LogLinearMamba2PreTrainedModel, _FenwickForCausalLM):
    """Log-linear Mamba-2 causal LM (use_log_linear=False: plain Mamba-2)."""

    model_cls = LogLinearMamba2Model


class LogLinearGatedDeltaNetPreTrainedModel(_FenwickPreTrainedModel):
    config_class = LogLinearGatedDeltaNetConfig
    mixer_cls = LogLinearGatedDeltaNet


class LogLinearGatedDeltaNetModel(LogLinearGatedDeltaNetPreTrainedModel, _FenwickModel):
    """Log-linear Gated DeltaNet backbone: input_ids [B, T] -> last_hidden_state [B, T, D]."""


class LogLinearGatedDeltaNetForCausalLM(LogLinearGatedDeltaNetPreTrainedModel, _FenwickForCausalLM):
    """Log-linear Gated DeltaNet causal LM (use_log_linear=False: plain Gated DeltaNet)."""

    model_cls = LogLinearGatedDeltaNetModel


class LogLinearGLAPreTrainedModel(_FenwickPreTrainedModel):
    config_class = LogLinearGLAConfig
    mixer_cls = LogLinearGLA


class LogLinearGLAModel(LogLinearGLAPreTrainedModel, _FenwickModel):
    """Log-linear GLA backbone: input_ids [B, T] -> last_hidden_state [B, T, D]."""


class LogLinearGLAForCausalLM(LogLinearGLAPreTrainedModel, _FenwickForCausalLM):
    """Log-linear GLA causal LM (use_log_linear=False: plain GLA)."""

    model_cls = LogLinearGLAModel
