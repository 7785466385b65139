"""A sequential chain and the chunk-parallel kernels that read it, side by side on two streams.

A chain kernel runs one program per (sequence, head) and walks the chunks in order (the Gated DeltaNet scans: 96
programs at the paper setting, one per SM), so it leaves SMs idle; the chunk-parallel kernels that read a finished
segment of its chunks can run on them. The chain goes on a side stream of the highest priority, segment after
segment; after each segment the current stream waits for the chain so far and launches that segment's readers,
which run beside the chain's next segment (the side stream's priority lets the chain's blocks go first when both
are ready, so that the chain keeps its SMs). On CPU (the interpreter) both run on one stream in the same order,
and the results are the same either way: the kernels and their inputs do not change, only when they run.

    streams = ChainStreams(device)     # side=False: everything on the current stream, in this order
    for segment in segments:
        with streams.chain():
            ...                        # the chain's launches for this segment (and buffers they allocate)
        streams.hand_over(buffers)     # buffers the chain allocated that the readers below read
        ...                            # the segment's chunk-parallel readers, on the current stream
    streams.hand_over()                # after the last segment: the current stream waits for the whole chain
"""

from __future__ import annotations

import contextlib
import functools
from typing import ContextManager

import torch

_HIGHEST = -100  # stream priority: values past the device's range map to its highest priority


@functools.cache
def _side_stream(index: int) -> torch.cuda.Stream:
    """One highest-priority stream per CUDA device, made on first use."""
    return torch.cuda.Stream(index, priority=_HIGHEST)


class ChainStreams:
    """The two streams of one op call (module docstring). Made where the chain starts: the side stream first waits
    for everything launched on the current stream so far (the chain's inputs). side=False (and on CPU): one
    stream, the chain and its readers one after another."""

    def __init__(self, device: torch.device, side: bool = True):
        self.two = side and device.type == "cuda"
        if self.two:
            self.main = torch.cuda.current_stream(device)
            self.side = _side_stream(device.index if device.index is not None else torch.cuda.current_device())
            self.side.wait_stream(self.main)

    def chain(self) -> ContextManager:
        """Launches (and allocations) inside run on the side stream."""
        return torch.cuda.stream(self.side) if self.two else contextlib.nullcontext()

    def hand_over(self, *tensors: torch.Tensor) -> None:
        """The current stream's next launches wait for the chain's launches so far; tensors allocated inside
        chain() that they read stay allocated until they have run."""
        if self.two:
            self.main.wait_stream(self.side)
            for t in tensors:
                t.record_stream(self.main)
