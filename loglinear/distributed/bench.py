"""Time context-parallel log-linear attention against the single-device op (and check it).

    torchrun --nproc-per-node 4 -m loglinear.distributed.bench --T 131072 --dtype bfloat16   # GPUs, NCCL
    python -m loglinear.distributed.bench --spawn 2 --T 4096                               # CPU, gloo

Per repeat, all ranks synchronised: the single-device op on the whole sequence on rank 0 alone (unless
--no-single), with --shard-op the single-device op on every rank's own shard (no state: what the
context-parallel op costs beyond it is its overhead), then the context-parallel op on the shards;
forward + backward. Reports medians in ms (shard_op_ms, cp_ms: max over ranks), the
time spent inside the cross-rank scans (forward and backward, max over ranks; it includes waiting for a
slower partner rank), the scan's message size,
peak memory per rank (CUDA) and, with --check, the max relative error of the shard outputs against the
single-device op. Rank 0 prints one JSON line (and appends it to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from loglinear.distributed import context_parallel_attention
from loglinear.distributed import scan as scan_module
from loglinear.distributed.mesh import shard_bounds
from loglinear.fenwick import levels_needed
from loglinear.ops import attention
from loglinear.variants import REGISTRY


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=sorted(REGISTRY), default="mamba2")
    p.add_argument("--qk-l2norm", action="store_true", help="normalise q and k inside the op (use_qk_l2norm)")
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--V", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="float32")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-single", action="store_true", help="skip the single-device op (too long for one device)")
    p.add_argument("--shard-op", action="store_true", help="also time the single-device op on each rank's shard")
    p.add_argument("--check", action="store_true", help="compare the shard outputs with the single-device op")
    p.add_argument("--spawn", type=int, default=0, help="spawn this many CPU processes with gloo (no torchrun)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


class _ScanTimer:
    """Wall time inside the forward and backward scans of this process (wraps scan.exclusive_scan)."""

    def __init__(self):
        self.seconds, self._inner = 0.0, scan_module.exclusive_scan
        scan_module.exclusive_scan = self

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._inner(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        return out


def _inputs(a: argparse.Namespace) -> list[torch.Tensor]:
    """The whole sequence's inputs q, k, v, the variant's gates, level_scales, on the host (the same on every
    rank)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = getattr(torch, a.dtype)
    L = levels_needed(a.T)
    make = lambda *shape, f=torch.randn: f(*shape, generator=gen).to(dtype)  # noqa: E731
    x = [make(a.B, a.T, 1, a.K), make(a.B, a.T, 1, a.K) / a.K**0.5, make(a.B, a.T, a.H, a.V)]
    gates = REGISTRY[a.variant].sample_gates(a.B, a.T, a.H, a.K, generator=gen)
    return x + [t.to(dtype) for t in gates.values()] + [0.2 + make(a.B, a.T, a.H, L, f=torch.rand)]


def _op(op, variant: str, kw: dict):
    """op(variant, q, k, v, gates, level_scales, **kw) called with the positional list of _inputs."""
    names = REGISTRY[variant].gate_names
    return lambda q, k, v, *rest: op(variant, q, k, v, dict(zip(names, rest[:-1])), rest[-1], **kw)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(fn, tensors: list[torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in tensors]
    _sync(device)
    t0 = time.perf_counter()
    o, _ = fn(*leaves)
    o.float().square().sum().backward()
    _sync(device)
    return time.perf_counter() - t0, o.detach()


def _max_ms(seconds: float, device: torch.device) -> float:
    """The largest of the ranks' times, in ms."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t) * 1e3


def run(a: argparse.Namespace) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    kw = {"chunk_size": a.chunk_size, "use_qk_l2norm": a.qk_l2norm}
    single, cp = _op(attention, a.variant, kw), _op(context_parallel_attention, a.variant, kw)
    host = _inputs(a)
    start, end = shard_bounds(a.T, world, rank)
    shard = [t[:, start:end].to(device) for t in host]
    needs_full = rank == 0 and not a.no_single or a.check
    x = [t.to(device) for t in host] if needs_full else None
    del host
    timer = _ScanTimer()
    single_ms, shard_ms, cp_ms, scan_ms, errors = [], [], [], [], []
    for _ in range(a.repeat + 1):  # the first round warms up
        ref = None
        if not a.no_single and rank == 0:
            seconds, ref = _fwd_bwd(single, x, device)
            single_ms.append(seconds * 1e3)
        dist.barrier()
        if a.shard_op:
            shard_ms.append(_max_ms(_fwd_bwd(single, shard, device)[0], device))
        timer.seconds = 0.0
        seconds, o = _fwd_bwd(cp, shard, device)
        times = torch.tensor([seconds, timer.seconds], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        cp_ms.append(float(times[0]) * 1e3)
        scan_ms.append(float(times[1]) * 1e3)
        if a.check:
            ref = single(*x)[0] if ref is None else ref
            err = (o.double() - ref[:, start:end].double()).norm() / ref[:, start:end].double().norm()
            errors.append(float(err))
        dist.barrier()
    state_bytes = a.B * levels_needed(a.T) * a.H * a.K * a.V * 4
    rows, cols = REGISTRY[a.variant].transition_shape(a.K)
    mat_bytes = a.B * a.H * rows * cols * 4
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    err = max(errors) if errors else None
    errs = [None] * world
    dist.all_gather_object(errs, err)
    if rank != 0:
        return None
    med = lambda xs: statistics.median(xs[1:]) if len(xs) > 1 else None  # noqa: E731
    return {
        "variant": a.variant, "world": world, "T": a.T, "B": a.B, "H": a.H, "K": a.K, "V": a.V,
        "dtype": a.dtype, "chunk_size": a.chunk_size, "device": str(device), "backend": dist.get_backend(),
        "torch": torch.__version__, "single_ms": med(single_ms), "shard_op_ms": med(shard_ms), "cp_ms": med(cp_ms),
        "scan_ms": med(scan_ms),
        "scan_rounds": (world - 1).bit_length(), "message_mb": (state_bytes + mat_bytes) / 1e6,
        "peak_mib_per_rank": peaks, "max_rel_err": max(e for e in errs) if a.check else None,
    }


def _main(rank: int, world: int, a: argparse.Namespace, init: str | None) -> None:
    if init is not None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    else:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        result = run(a)
        if result is not None:
            text = json.dumps(result)
            if a.out:
                with open(a.out, "a") as fh:
                    fh.write(text + "\n")
            print(text, flush=True)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    a = _args(argv)
    if a.spawn:
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_main, args=(a.spawn, a, f"file://{tmp}/store"), nprocs=a.spawn)
    else:
        _main(0, 0, a, None)


if __name__ == "__main__":
    main()
