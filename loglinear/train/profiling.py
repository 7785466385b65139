"""One profiled training step per process: `loglinear train --profile-step N` (TrainConfig.profile_step).

profiled_call runs a step under torch.profiler (CPU, and CUDA on a GPU) between a barrier and device
synchronisations; profile_report writes what it saw as text: the step's wall time, the top kernels by
device time (CUDA) or ops by self CPU time, the top host ops, and the labelled context-parallel scopes
(cp/..., loglinear.distributed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from loglinear.train.parallel import Parallel

__all__ = ["profiled_call", "profile_report"]

Result = TypeVar("Result")


def _synchronize(par: Parallel) -> None:
    if par.device.type == "cuda":
        torch.cuda.synchronize(par.device)


def profiled_call(fn: Callable[[], Result], par: Parallel, path: Path, title: str) -> Result:
    """fn() under torch.profiler (CPU activity, and CUDA on a GPU): the processes meet at a barrier first,
    the device is synchronised before and after; profile_report goes to path. Returns fn's result."""
    if par.distributed:
        torch.distributed.barrier()
    _synchronize(par)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if par.device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        result = fn()
        _synchronize(par)
        wall = time.perf_counter() - t0
    path.write_text(profile_report(prof.key_averages(), wall, par.device.type == "cuda", title))
    return result


def _ms(us: float) -> str:
    return f"{us / 1e3:.3f}"


def _table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """Fixed-width text table: the first column left-aligned (names), the others right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def fmt(cells: list) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return ["", f"## {title}", fmt(header), *map(fmt, rows)]


def _kernel_rows(events, wall_s: float, top: int) -> list[list]:
    """The top kernels / copies (device events, not annotations) by device time: name, calls, ms, % of step."""
    device = sorted((e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation),
                    key=lambda e: -e.self_device_time_total)
    return [[e.key[:110], e.count, _ms(e.self_device_time_total), f"{e.self_device_time_total / 1e4 / wall_s:.1f}"]
            for e in device[:top]]


def _host_rows(events, top: int) -> list[list]:
    """The top host ops by self CPU time: name, calls, self ms, total ms."""
    host = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)
    return [[e.key[:110], e.count, _ms(e.self_cpu_time_total), _ms(e.cpu_time_total)] for e in host[:top]]


def _scope_rows(events) -> list[list]:
    """Every cp/... scope, host and device side: name, side, calls, host ms, device ms."""
    scopes = sorted((e for e in events if e.key.startswith("cp/")),
                    key=lambda e: (e.key, e.device_type != DeviceType.CPU))
    return [[e.key, "host" if e.device_type == DeviceType.CPU else "device", e.count, _ms(e.cpu_time_total),
             _ms(e.device_time_total)] for e in scopes]


def profile_report(events, wall_s: float, cuda: bool, title: str, top: int = 30) -> str:
    """The text of a profiled step: wall time; on CUDA the kernels' total and the top kernels / copies by device
    time, then the top host ops by self CPU time (top // 2 of them on CUDA); then every cp/... scope
    (loglinear.distributed: the shard-shape all_gather, local state, transition, cross-rank scans, halo exchange,
    shard op) with its host time and the device time of the kernels it launched (host side) or its span on
    the GPU (device side). events: prof.key_averages() (FunctionEventAvg rows); times in ms."""
    lines = [f"# {title}", f"step wall time: {wall_s * 1e3:.3f} ms (device synchronised before and after)"]
    if cuda:
        busy = sum(e.self_device_time_total for e in events
                   if e.device_type != DeviceType.CPU and not e.is_user_annotation)
        lines.append(f"kernels and copies, summed over streams: {_ms(busy)} ms")
        lines += _table(f"top {top} kernels / copies by device time", ["name", "calls", "device ms", "% of step"],
                        _kernel_rows(events, wall_s, top))
    n_host = top // 2 if cuda else top
    lines += _table(f"top {n_host} host ops by self CPU time", ["name", "calls", "self CPU ms", "CPU total ms"],
                    _host_rows(events, n_host))
    lines += _table("context-parallel scopes (cp/...)", ["name", "side", "calls", "host ms", "device ms"],
                    _scope_rows(events))
    return "\n".join(lines) + "\n"
