"""Random inputs for the ops (fresh every call, never zeros) and comparison helpers."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from loglinear.fenwick import levels_needed
from loglinear.ops.api import attention
from loglinear.state import FenwickState
from loglinear.variants import GLA, get


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


def gla_inputs(B: int, T: int, G: int = 1, H: int = 2, K: int = 4, V: int = 3, start: int = 0, seed: int = 0,
               dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """GLA's op inputs: q, k: [B, T, G, K]; v: [B, T, H, V]; g: [B, T, H, K] (GLA.sample_gates: a quarter of the
    channels forget fast); level_scales: [B, T, H, L] covering positions start .. start + T."""
    gen = torch.Generator().manual_seed(seed)
    kw = dict(dtype=dtype, generator=gen)
    return {
        "q": torch.randn(B, T, G, K, **kw),
        "k": torch.randn(B, T, G, K, **kw) / K**0.5,
        "v": torch.randn(B, T, H, V, **kw),
        "g": GLA.sample_gates(B, T, H, K, **kw)["g"],
        "level_scales": 0.2 + torch.rand(B, T, H, levels_needed(start + T) + 1, **kw),
    }


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


def compare_with_reference(
    run: Callable, reference: Callable, x: dict[str, torch.Tensor], state: FenwickState | None = None, *,
    tol: float, grad_tol: float | None = None, dtype: torch.dtype = torch.float32, grads: bool = True,
    grad_close: Callable = assert_close,
) -> None:
    """An op's kernels against its float64 reference: ``run(inputs, state)`` on x in ``dtype`` (the state's
    levels in fp32) and ``reference(inputs, state)`` on x (float64) -> (o, final FenwickState) each.

    Checks o (dtype, shape, contiguous) and the final state (fp32, shape, positions) within tol (relative error),
    then, with grads, the gradients of every input and of the initial state under random cotangents, within
    grad_tol (default tol); grad_close(actual, expected, tol, what) checks the inputs' (assert_close, or a
    test's own rule), assert_close the initial state's."""
    ours = {n: t.detach().to(dtype).requires_grad_(grads) for n, t in x.items()}
    ref = {n: t.detach().clone().requires_grad_(grads) for n, t in x.items()}
    st_ours = st_ref = None
    if state is not None:
        st_ours = FenwickState(state.levels.detach().float().requires_grad_(grads), state.positions)
        st_ref = FenwickState(state.levels.detach().clone().requires_grad_(grads), state.positions)
    o, fs = run(ours, st_ours)
    o_ref, fs_ref = reference(ref, st_ref)
    assert o.dtype == dtype and o.shape == o_ref.shape and o.is_contiguous()
    assert fs.levels.dtype == torch.float32 and fs.levels.shape == fs_ref.levels.shape
    assert torch.equal(fs.positions, fs_ref.positions)
    assert_close(o.double(), o_ref, tol, "o")
    assert_close(fs.levels.double(), fs_ref.levels, tol, "final state")
    if not grads:
        return
    d_o, d_s = torch.randn_like(o_ref), torch.randn_like(fs_ref.levels)
    leaves_ref = [*ref.values()] + ([st_ref.levels] if state is not None else [])
    leaves = [*ours.values()] + ([st_ours.levels] if state is not None else [])
    grads_ref = torch.autograd.grad((o_ref * d_o).sum() + (fs_ref.levels * d_s).sum(), leaves_ref)
    grads_ours = torch.autograd.grad((o.double() * d_o).sum() + (fs.levels.double() * d_s).sum(), leaves)
    for name, a, e in zip([*x, "initial_state"], grads_ours, grads_ref):
        assert a.shape == e.shape, f"d{name}: shape {tuple(a.shape)}, expected {tuple(e.shape)}"
        close = grad_close if name in x else assert_close
        close(a.double(), e, tol if grad_tol is None else grad_tol, f"d{name}")


def save_perturbed(model: torch.nn.Module, path) -> torch.nn.Module:
    """A converter's source model with every weight moved off its init (0.1 x noise), saved to path (eval mode)."""
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||a||."""
    return ((a - b).norm() / a.norm()).item()


class _LargeWrites(TorchDispatchMode):
    """Counts the ops that write a tensor of at least `numel` elements: views (which write nothing) and indexed
    writes into an existing tensor (a few rows copied or added in place) aside."""

    ROWS_IN_PLACE = ("index_copy_", "index_add_", "index_put_")

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func.overloadpacket.__name__ not in self.ROWS_IN_PLACE:
            self.count += sum(t.numel() >= self.numel for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


def large_writes(name: str, lengths: list[int], chunk_size: int, position: int | None, backend: str,
                 final_state: bool = False) -> tuple[int, int]:
    """How many ops of a forward and of its backward on ``backend`` write a tensor at least as large as v (the
    packed sequences of ``lengths``, each from a state at ``position`` or none; final_state: the final state is
    returned and its levels are in the loss): a backward count that grows with the number of chunks or sequences
    means a whole-size gradient written per chunk or sequence."""
    variant, T, H, K = get(name), sum(lengths), 2, 4
    gen = torch.Generator().manual_seed(0)
    x = {"q": torch.randn(1, T, 1, K, generator=gen), "k": torch.randn(1, T, 1, K, generator=gen),
         "v": torch.randn(1, T, H, K, generator=gen), "level_scales": torch.rand(1, T, H, 12, generator=gen)}
    gates = variant.sample_gates(1, T, H, K, generator=gen)
    leaves = [*x.values(), *gates.values()]
    initial = None
    if position is not None:
        levels = torch.randn(len(lengths), levels_needed(position), H, K, K, generator=gen, requires_grad=True)
        initial, leaves = FenwickState(levels, torch.full((len(lengths),), position)), leaves + [levels]
    for t in leaves:
        t.requires_grad_()
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    with _LargeWrites(x["v"].numel()) as forward:
        o, final = attention(variant, x["q"], x["k"], x["v"], gates, x["level_scales"], initial_state=initial,
                             cu_seqlens=cu_seqlens, chunk_size=chunk_size, backend=backend,
                             output_final_state=final_state)
    with _LargeWrites(x["v"].numel()) as backward:
        (o.sum() + (final.levels.sum() if final_state else 0)).backward()
    return forward.count, backward.count
