"""shared/launch.py: launch(), through which every kernel of the package is launched, and its step-down of a
build over an SM's shared memory (stand-in kernels; the ops' launches under TRITON_INTERPRET=1 on CPU tensors)."""

import pytest
import torch

from helpers import make_inputs, mamba2_args
from loglinear import FenwickState, log_linear_gated_deltanet, log_linear_gla, log_linear_mamba2

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("triton_kernels")]


class _Kernel:
    """A stand-in for a @triton.jit kernel whose builds need more shared memory than an SM has above ``fits``
    stages (Triton raises OutOfResources when such a build is loaded, before it runs); it records the stages of each
    attempt and the arguments of the launch that ran."""

    def __init__(self, fits: int, resource: str = "shared memory"):
        self.fits, self.resource, self.tried, self.ran = fits, resource, [], None

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.tried.append(kwargs["num_stages"])
            if kwargs["num_stages"] > self.fits:
                from triton.runtime.errors import OutOfResources

                raise OutOfResources(300000, 232448, self.resource)
            self.ran = grid, args, kwargs
        return run


@pytest.mark.parametrize("stages, fits", [(3, 1), (3, 2), (2, 2)])
def test_a_build_over_shared_memory_launches_at_fewer_stages(stages, fits, monkeypatch):
    """launch() launches a build that does not fit an SM's shared memory again at one stage fewer until it fits, with
    the grid, arguments and other options unchanged, and later launches of the same build (kernel, keyword arguments,
    tensor dtypes) at those stages; it raises when one stage does not fit, for other resources, and with STEP_DOWN
    off (the tuning scripts')."""
    from triton.runtime.errors import OutOfResources

    from loglinear.ops.triton.shared import launch

    kernel, x = _Kernel(fits), torch.zeros(2, dtype=torch.bfloat16)
    launch.launch(kernel, (7, 2), x, 3, BK=256, num_warps=4, num_stages=stages, maxnreg=168)
    assert kernel.tried == list(range(stages, fits - 1, -1))
    assert kernel.ran == ((7, 2), (x, 3), {"BK": 256, "num_warps": 4, "num_stages": fits, "maxnreg": 168})
    # the same build starts at the stages it ran at; another build (constexprs, dtypes) at its own
    kernel.tried = []
    launch.launch(kernel, (5,), torch.ones(3, dtype=torch.bfloat16), 4, BK=256, num_warps=4, num_stages=stages,
                  maxnreg=168)
    assert kernel.tried == [fits] and kernel.ran[0] == (5,)
    for other, dtype in ((dict(BK=128), torch.bfloat16), (dict(BK=256), torch.float32)):
        kernel.tried = []
        launch.launch(kernel, (1,), x.to(dtype), 3, **other, num_warps=4, num_stages=stages, maxnreg=168)
        assert kernel.tried == list(range(stages, fits - 1, -1))
    for kernel in (_Kernel(0), _Kernel(1, "registers")):
        with pytest.raises(OutOfResources):
            launch.launch(kernel, (1,), num_warps=4, num_stages=3)
        assert kernel.tried == ([3, 2, 1] if kernel.fits == 0 else [3])
    monkeypatch.setattr(launch, "STEP_DOWN", False)
    kernel = _Kernel(1)
    with pytest.raises(OutOfResources):
        launch.launch(kernel, (1,), num_warps=4, num_stages=3)
    assert kernel.tried == [3]


def test_every_launch_has_a_build_key(monkeypatch, no_torch_path):
    """Once some build has stepped down, every launch looks its build up (launch._build), so each kernel's arguments
    must form a key (hashable): Mamba-2 from a state inside a chunk (seeds, initial levels' gradients), plain, GLA,
    Gated DeltaNet from a state, forward and backward, and the fused decode step."""
    from loglinear.ops.triton.shared import launch

    keys = []
    build = launch._build

    def looked_up(kernel, args, kwargs):
        keys.append(hash(build(kernel, args, kwargs)))
        return keys[-1]

    monkeypatch.setattr(launch, "_build", looked_up)
    monkeypatch.setattr(launch, "_STAGES", {"a build that stepped down": 1})
    x = make_inputs(2, 21, 1, 2, 8, 8, dtype=torch.float32)
    state = FenwickState(torch.randn(2, 6, 2, 8, 8), torch.tensor([13, 40]))
    for call in (
        lambda: log_linear_mamba2(**mamba2_args(x), initial_state=state, output_final_state=True, chunk_size=16),
        lambda: log_linear_mamba2(**{**mamba2_args(x), "level_scales": None}, chunk_size=16),
        lambda: log_linear_gla(**{**mamba2_args(x), "g": x["g"][..., None].expand(-1, -1, -1, 8)}, chunk_size=16),
        lambda: log_linear_gated_deltanet(**x, initial_state=state, chunk_size=16, use_qk_l2norm=True),
    ):
        before = len(keys)
        leaves = [t.requires_grad_() for t in x.values()]
        out = call()[0]
        torch.autograd.grad(out.sum(), [t for t in leaves if t.requires_grad], allow_unused=True)
        assert len(keys) > before
        for t in leaves:
            t.requires_grad_(False)
    before = len(keys)
    step = {n: t[:, :1] for n, t in mamba2_args(x).items()}
    log_linear_mamba2(**step, initial_state=state, output_final_state=True)
    assert len(keys) > before


def test_every_kernel_launch_goes_through_launch():
    """No kernel of the package is launched as kernel[grid](...) outside launch(): each launch takes its
    stage step-down."""
    import re
    from pathlib import Path

    import loglinear

    root = Path(loglinear.__file__).parent
    direct = re.compile(r"^\s*[\w.]+\[[^\]]+\]\(", re.M)
    found = {str(p.relative_to(root)): direct.findall(p.read_text()) for p in root.rglob("*.py")}
    assert {p: f for p, f in found.items() if f} == {"ops/triton/shared/launch.py": ["            kernel[grid]("]}
