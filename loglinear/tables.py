"""Small index tables built from Python values, put on the device without a synchronising copy, and the
cache that makes steady-state calls copy nothing from the host (used from the level math up to the kernels'
backends)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

TABLE_CACHE_SIZE = 64  # entries of each table_cache: distinct shapes / positions a run cycles through

Fn = TypeVar("Fn", bound=Callable)


def device_table(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (a Python sequence, nested for more dims, or a CPU tensor) as a ``dtype`` tensor on ``device``.
    On CUDA it is staged in pinned memory and copied without blocking the host (the caching host allocator
    keeps the pinned block until the copy has run), so it does not synchronise as a pageable copy does."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def table_cache(maxsize: int = TABLE_CACHE_SIZE) -> Callable[[Fn], Fn]:
    """Decorator: memoise a function of hashable arguments (ints, tuples, dtypes, devices) that builds small
    host or device tables (functools.lru_cache, at most maxsize entries, least recently used dropped).
    The cached results are shared between calls: callers must not modify them."""
    return functools.lru_cache(maxsize=maxsize)


def keyed_tables(build: Callable[..., Sequence], maxsize: int = TABLE_CACHE_SIZE
                 ) -> Callable[[tuple, torch.dtype, torch.device], torch.Tensor]:
    """A cache of device tables: table(key, dtype, device) = device_table(build(*key), dtype, device), built once
    per (key, dtype, device), so that a steady-state call makes no host tensor and no host-to-device copy. Read-only,
    and normal tensors even when first built under inference mode (autograd may save them)."""

    @table_cache(maxsize)
    def table(key: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with torch.inference_mode(False):
            return device_table(build(*key), dtype, device)

    return table


_VALUES = keyed_tables(lambda values: values)


def cached_table(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """device_table of values (a tuple of ints or bools, nested for more dims), built once per distinct values
    (keyed_tables): a layout's index tables and masks."""
    return _VALUES((values,), dtype, device)
