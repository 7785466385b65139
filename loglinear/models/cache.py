"""The Fenwick cache: what generate() carries between steps for a log-linear model.

Per layer one MixerState: the Fenwick level states [N, L, H, K, V] with each sequence's position, and the
short-convolution state [N, W-1, C]. A log-linear layer holds L = ceil(log2 T) + 1 level states after T
tokens (1 for the plain model), never anything that grows with T; with cuda_graph=True, max_levels from the
first graphed step on (static buffers, loglinear.models.graphs). Sequences of a batch keep their own
positions (left padding: each row counts only its real tokens).

It subclasses transformers' Cache so generate() and user code recognise it, but keeps its own storage:
transformers' per-layer cache classes hold keys/values or a single recurrent state, and their API moves
between 5.x releases (the model accepts the cache as ``cache=`` (>= 5.2x) and ``past_key_values=``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from loglinear.layers.mixer import MixerState
from loglinear.ops.decode import MAX_KEY_WINDOW, key_window_size_ok

__all__ = ["FenwickCache"]


class FenwickCache(Cache):
    """Decoding state of every layer of a log-linear model (see module docstring)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int, *, cuda_graph: bool = False, level_dtype: torch.dtype | None = None,
                 key_window: int | None = None):
        """num_layers: the model's num_hidden_layers; cuda_graph: run one-token steps as a CUDA graph
        (loglinear.models.graphs; the states then live in static buffers of max_levels levels); level_dtype: the
        dtype the static buffers keep the level states in (cuda_graph only; None: the states' own, float32).
        torch.bfloat16 halves the bytes a step reads; it needs lazy levels (log-linear layers: each level is
        rounded when it is written, not on every token; Gated DeltaNet's also at each turn of its key window);
        key_window: the tokens of Gated DeltaNet's key window in the static buffers (cuda_graph only; a power of
        two in [2, loglinear.ops.decode.MAX_KEY_WINDOW]; None: loglinear.ops.decode.KEY_WINDOW). A longer window
        rewrites the held levels less often and takes more key projections per readout (loglinear.ops.decode)."""
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        if not isinstance(cuda_graph, bool):
            raise TypeError(f"cuda_graph must be a bool, got {type(cuda_graph).__name__}")
        if level_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"level_dtype must be None, torch.float32 or torch.bfloat16, got {level_dtype!r}")
        if level_dtype is not None and not cuda_graph:
            raise ValueError("level_dtype sets the static buffers of CUDA-graph decoding: pass cuda_graph=True")
        if key_window is not None:
            if not key_window_size_ok(key_window):
                raise ValueError(f"key_window must be None or a power of two in [2, {MAX_KEY_WINDOW}], "
                                 f"got {key_window!r}")
            if not cuda_graph:
                raise ValueError("key_window sets the static buffers of CUDA-graph decoding: pass cuda_graph=True")
        # transformers' Cache.__init__ wants layer objects; this cache stores MixerStates itself.
        self.states: list[MixerState | None] = [None] * num_layers
        self.cuda_graph = cuda_graph
        self.level_dtype = level_dtype
        self.key_window = key_window
        self.graph = None  # the DecodeGraph of the current batch size (loglinear.models.graphs)
        self.layers: list = []
        self.layer_class_to_replicate = None
        self.offloading = False

    def __len__(self) -> int:
        return len(self.states)

    def __repr__(self) -> str:
        graph = ", cuda_graph=True" if self.cuda_graph else ""
        return f"FenwickCache(layers={len(self)}, tokens={self.get_seq_length()}, bytes={self.nbytes()}{graph})"

    def __getitem__(self, layer_idx: int) -> MixerState | None:
        return self.states[layer_idx]

    def update_state(self, layer_idx: int, state: MixerState) -> None:
        self.states[layer_idx] = state

    @property
    def is_linear(self) -> list[bool]:
        return [True] * len(self.states)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.states)

    @property
    def is_initialized(self) -> bool:
        return self.states[0] is not None

    @property
    def positions(self) -> torch.Tensor | None:
        """[N] tokens seen by each sequence (None before the first call)."""
        return self.states[0].positions if self.states[0] is not None else None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by the longest sequence."""
        state = self.states[layer_idx]
        return 0 if state is None else state.max_position

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.get_seq_length(layer_idx or 0)

    def num_levels(self, layer_idx: int = 0) -> int:
        """Level states held per (sequence, head) by layer ``layer_idx``."""
        state = self.states[layer_idx]
        return 0 if state is None else state.num_levels

    def nbytes(self) -> int:
        """Bytes held by all layers (level states + conv states)."""
        return sum(s.nbytes() for s in self.states if s is not None)

    def _map(self, fn) -> None:
        self.states = [fn(s) if s is not None else None for s in self.states]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda s: s.select(beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda s: s.select(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda s: s.select(torch.arange(s.num_sequences).repeat_interleave(repeats)))

    def reset(self) -> None:
        self.states = [None] * len(self.states)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a FenwickCache cannot drop tokens: the level states summarise them irreversibly")
