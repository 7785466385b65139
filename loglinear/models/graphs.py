"""Decoding as a CUDA graph: one replayed launch sequence per generated token.

A decoding step of a small model is a few hundred microseconds of kernels behind milliseconds of Python and
kernel launches. With ``FenwickCache(num_layers, cuda_graph=True)`` the causal LMs run every one-token step
(generate() or a hand-written loop) by replaying a CUDA graph of the whole step:

    input_ids [N, 1] -> embeddings -> each block (norm, the mixer's projections and short convolution, the fused
    decode step writing its levels in place, the output projection, the MLP) -> norm -> lm_head -> logits [N, 1, V]

A graph replays fixed shapes at fixed addresses, so on its first step the cache's states move into static buffers
(loglinear.layers.mixer.StaticState): levels [N, max_levels, H, K, V] per log-linear layer (one level for a plain one;
the extra levels are zeros), the conv states [N, W-1, C], and the positions, kept on the GPU for the kernel and on the
host for the cache. The levels of a log-linear layer are stored lazily beside their accumulated log-decays (and for the
delta rule of Gated DeltaNet a window of the last tokens, which stand for its lowest levels), so a step rewrites about
two levels (Gated DeltaNet: none between its window's turns) instead of every level it holds (loglinear.ops.decode). The
cache's states are views of the buffers; a lazy layer's view multiplies its levels out when something reads them (an
ordinary forward, beam reordering). The graph is captured once per batch size (two eager warm-up steps compile the
kernels first).

Steps that are not one real token of every sequence (a prompt, a chunk, a padded row), and calls that need
gradients, run the ordinary forward on the same states; a cache changed from outside (beam reordering, such a
call) is copied back into the buffers at the next graphed step. On the CPU the same static step runs
eagerly, without a graph (the tests run it there).
"""

from __future__ import annotations

import torch

from loglinear.inputs import needs_grad
from loglinear.layers.mixer import MixerState, StaticState
from loglinear.models.cache import FenwickCache
from loglinear.ops.stateful import check_capacity

__all__ = ["DecodeGraph", "graph_step"]


class BufferView(MixerState):
    """A cache's state of one layer while it lives in a graph's static buffers: the buffers' levels (multiplied out
    of a lazy layer's log-scales, once, when first read), the host's positions, the buffers' conv state."""

    def __init__(self, buffer: StaticState, positions: torch.Tensor):
        self.buffer, self.positions, self.conv = buffer, positions, buffer.conv
        self._levels: torch.Tensor | None = None

    @property
    def levels(self) -> torch.Tensor:
        if self._levels is None:
            self._levels = self.buffer.level_states(self.positions)
        return self._levels

    @property
    def num_sequences(self) -> int:  # shapes come from the buffer: asking them multiplies nothing out
        return self.buffer.levels.shape[0]

    @property
    def num_levels(self) -> int:
        return self.buffer.levels.shape[1]

    def nbytes(self) -> int:
        return self.buffer.nbytes()


class DecodeGraph:
    """The static buffers and the captured step of one model at one batch size N (see module docstring)."""

    def __init__(self, model, cache: FenwickCache):
        states = cache.states
        self.model = model
        self.batch = states[0].num_sequences
        device = states[0].conv.device  # not levels: reading a lazy view multiplies it out
        self.max_levels = [block.mixer.max_levels if block.mixer.level_scales is not None else 1
                           for block in model.model.layers]
        self.buffers = [block.mixer.static_state(s, cache.level_dtype, cache.key_window)
                        for block, s in zip(model.model.layers, states, strict=True)]
        self.ids = torch.zeros(self.batch, 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.batch, dtype=torch.int64, device=device)
        self.views: list[BufferView] = []
        self.graph = None
        self.logits: torch.Tensor | None = None
        if device.type == "cuda":
            self._capture(cache)

    def load(self, cache: FenwickCache) -> None:
        """Copy the cache's states into the static buffers; the cache then holds views of them."""
        for buf, s in zip(self.buffers, cache.states, strict=True):
            buf.load(s)
        host = cache.states[0].positions.clone()
        self.positions.copy_(host)
        self._publish(cache, host)

    def owns(self, cache: FenwickCache) -> bool:
        """Whether the cache's states are still this graph's buffers (nothing replaced them since the last step)."""
        return len(self.views) == len(cache.states) and all(a is b for a, b in zip(self.views, cache.states))

    @torch.no_grad()
    def step(self, cache: FenwickCache, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [N, 1] -> logits [N, 1, vocab]; the cache advances by one token."""
        if not self.owns(cache):
            self.load(cache)
        host = self.views[0].positions
        if any(L > 1 for L in self.max_levels):
            check_capacity(int(host.max()) + 1, max(self.max_levels))
        self.ids.copy_(input_ids)
        if self.graph is not None:
            with torch.cuda.device(self.ids.device):
                self.graph.replay()
            logits = self.logits.clone()
        else:
            logits = self._run()
        self._publish(cache, host + 1)
        return logits

    def _run(self) -> torch.Tensor:
        """The step itself: every layer in place, then the positions advance on the device."""
        hidden = self.model.model.step_(self.ids, self.buffers, self.positions)
        self.positions.add_(1)
        return self.model.lm_head(hidden)

    def _publish(self, cache: FenwickCache, host_positions: torch.Tensor) -> None:
        self.views = [BufferView(buf, host_positions) for buf in self.buffers]
        for i, view in enumerate(self.views):
            cache.update_state(i, view)

    def _capture(self, cache: FenwickCache) -> None:
        source = list(cache.states)
        with torch.cuda.device(self.ids.device):  # the model's GPU, whichever is current
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                self.load(cache)
                for _ in range(2):  # compiles the kernels, sets up cuBLAS; the warm-up steps' states are discarded
                    self._run()
            torch.cuda.current_stream().wait_stream(stream)
            cache.states = source
            self.load(cache)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.no_grad():
                self.logits = self._run()


def graph_step(model, cache: FenwickCache, input_ids: torch.Tensor | None,
               attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The causal LM's forward for a FenwickCache(cuda_graph=True): logits [N, 1, vocab] of a graphed step, or None
    when this call is not one (then the ordinary forward runs): a call needing gradients, an empty cache, a
    padded row, or more than one token."""
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1 or not cache.is_initialized:
        return None
    if needs_grad(*model.parameters()):
        return None
    if input_ids.shape[0] != cache.states[0].num_sequences:
        return None  # the ordinary forward names the mismatch
    if attention_mask is not None and not bool((attention_mask[:, -1] != 0).all()):
        return None
    graph = cache.graph
    if graph is None or graph.model is not model or graph.batch != input_ids.shape[0]:
        graph = cache.graph = DecodeGraph(model, cache)
    return graph.step(cache, input_ids)
