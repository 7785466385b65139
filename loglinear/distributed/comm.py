"""Point-to-point exchange between ranks of a process group (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["exchange"]


def exchange(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: dist.ProcessGroup,
) -> None:
    """Post every send (tensor, group rank) and receive (buffer, group rank) at once, then wait for all.

    Posting both directions together means no pairing order can deadlock; receive buffers must be
    contiguous and sized as the matching sends."""
    glob = lambda r: dist.get_global_rank(group, r)  # noqa: E731
    ops = [dist.P2POp(dist.isend, t.contiguous(), glob(r), group) for t, r in sends]
    ops += [dist.P2POp(dist.irecv, t, glob(r), group) for t, r in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
