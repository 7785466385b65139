"""Random inputs for the ops (fresh every call, never zeros) and comparison helpers."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.multiprocessing as mp

from loglinear.fenwick import levels_needed


def make_inputs(
    B: int = 2, T: int = 37, G: int = 1, H: int = 2, K: int = 4, V: int = 3, L: int | None = None,
    dtype: torch.dtype = torch.float64, generator: torch.Generator | None = None, start: int = 0,
) -> dict[str, torch.Tensor]:
    """q, k: [B, T, G, K]; v: [B, T, H, V]; g, beta: [B, T, H]; level_scales: [B, T, H, L] (L covers start + T)."""
    L = L or levels_needed(start + T) + 1
    kw = dict(dtype=dtype, generator=generator)
    return {
        "q": torch.randn(B, T, G, K, **kw),
        "k": torch.randn(B, T, G, K, **kw) / K**0.5,
        "v": torch.randn(B, T, H, V, **kw),
        "g": -0.05 - 0.4 * torch.rand(B, T, H, **kw),
        "beta": 0.05 + 0.9 * torch.rand(B, T, H, **kw),
        "level_scales": 0.2 + torch.rand(B, T, H, L, **kw),
    }


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py imported as a module named after the file (registered in sys.modules: dataclasses
    look their module up); name may be a subpath, e.g. "experiments/run_multigpu"."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    module_name = Path(name).name
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def slice_time(inputs: dict[str, torch.Tensor], t0: int, t1: int) -> dict[str, torch.Tensor]:
    return {name: x[:, t0:t1] for name, x in inputs.items()}


def mamba2_args(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: x for name, x in inputs.items() if name != "beta"}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-10, what: str = "") -> None:
    """Relative error ||a - e|| / ||e|| below rtol (and no NaN)."""
    assert not torch.isnan(actual).any(), f"{what}: NaN in result"
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-30)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


def _train_worker(rank: int, world: int, port: int, cfg) -> None:
    from loglinear.train.loop import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    train(cfg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_train(cfg, world: int) -> None:
    """loglinear.train.loop.train(cfg) in `world` processes (gloo, on a free local port), as torchrun would.
    A port taken between choosing and binding it (another test process) gets one retry on a new port."""
    try:
        mp.spawn(_train_worker, args=(world, _free_port(), cfg), nprocs=world)
    except mp.ProcessRaisedException as e:
        if "address already in use" not in str(e).lower():
            raise
        mp.spawn(_train_worker, args=(world, _free_port(), cfg), nprocs=world)
