"""A sequential chain and the chunk-parallel kernels that feed it and read it, side by side on two streams.

A chain kernel runs one program per (sequence, head) and walks the chunks in order (the Gated DeltaNet scans: 96
programs at the paper setting, one per SM), so it leaves SMs idle; the chunk-parallel kernels that produce the
inputs of a later segment of its chunks, or read a finished one, can run on them. The chain goes on a side stream of
the highest priority, segment after segment; a segment's producers are launched on the current stream before it
(``feed``), and after a segment the current stream waits for it (``hand_over``) and launches its readers. Both run
beside the chain's later segments (the side stream's priority lets the chain's blocks go first when both are ready,
so that the chain keeps its SMs). On CPU (the interpreter) everything runs on one stream in launch order, and the
results are the same either way: the kernels and their inputs do not change, only when they run.

    streams = ChainStreams(device)     # side=False: everything on the current stream, in launch order
    for n, segment in enumerate(segments):
        ...                            # producers of the segment's inputs, on the current stream
        streams.feed()                 # the chain's next launches wait for them
        with streams.chain():
            ...                        # the chain's launches for this segment (and buffers they allocate)
        streams.hand_over(buffers, upto=n)  # the current stream waits for chain segment n; buffers it allocated
        ...                            # the segment's chunk-parallel readers, on the current stream
    streams.hand_over()                # after the last segment: the current stream waits for the whole chain

A segment's readers may be launched after the next segment's producers and chain (hand_over's upto), so that the
producers run beside the chain instead of behind the readers, which wait for it. The decode step (decode.py) runs
two passes this way beside a third, each on a side stream of its own (``lane``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

_HIGHEST = -100  # stream priority: values past the device's range map to its highest priority


@functools.cache
def _side_stream(index: int, lane: int) -> torch.cuda.Stream:
    """One highest-priority stream per CUDA device and lane, made on first use."""
    return torch.cuda.Stream(index, priority=_HIGHEST)


class ChainStreams:
    """The two streams of one op call (module docstring). Made where the chain starts: the side stream first waits
    for everything launched on the current stream so far (the chain's inputs). side=False (and on CPU): one
    stream, the chain, its producers and its readers in launch order. lane: which side stream of the device;
    chains that run beside each other take different lanes."""

    def __init__(self, device: torch.device, side: bool = True, lane: int = 0):
        self.two = side and device.type == "cuda"
        self.done: list[torch.cuda.Event] = []  # recorded on the side stream after each chain() block
        if self.two:
            self.main = torch.cuda.current_stream(device)
            self.side = _side_stream(device.index if device.index is not None else torch.cuda.current_device(), lane)
            self.side.wait_stream(self.main)

    def feed(self) -> None:
        """The chain's next launches wait for everything launched on the current stream so far."""
        if self.two:
            self.side.wait_stream(self.main)

    @contextlib.contextmanager
    def chain(self) -> Iterator[None]:
        """Launches (and allocations) inside run on the side stream."""
        if not self.two:
            yield
            return
        with torch.cuda.stream(self.side):
            yield
        self.done.append(self.side.record_event())

    def hand_over(self, *tensors: torch.Tensor, upto: int | None = None) -> None:
        """The current stream's next launches wait for the chain's launches up to the end of chain() block ``upto``
        (counted from 0; None: all so far); tensors allocated inside chain() that they read stay allocated until
        they have run."""
        if self.two:
            if upto is None:
                self.main.wait_stream(self.side)
            else:
                self.main.wait_event(self.done[upto])
            for t in tensors:
                t.record_stream(self.main)
