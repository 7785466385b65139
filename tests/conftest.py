import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels are decorated at import: on a machine without CUDA, run them in Triton's CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI runs two pytest workers on two cores: one intra-op thread each avoids oversubscription on tiny ops.
torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """The largest cases (marked slow) first, so that two workers do not end on one long test each."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def triton_kernels(monkeypatch):
    """The ops on the Triton kernels (LOGLINEAR_BACKEND=triton), every kernel output buffer poisoned with NaN
    first (kernel test files use it for every test)."""
    from loglinear.ops.triton.shared import common

    if not common.interpreting() and not torch.cuda.is_available():
        pytest.fail("Triton kernels need TRITON_INTERPRET=1 without CUDA (tests/conftest.py sets it)")
    monkeypatch.setenv("LOGLINEAR_BACKEND", "triton")
    common.set_poison(True)
    yield
    common.set_poison(False)


@pytest.fixture
def no_torch_path(monkeypatch):
    """Fail if an op call falls back to the torch chunk backend."""
    from loglinear.ops import api

    def fail(*args, **kwargs):
        raise AssertionError("the triton backend fell back to the torch path")

    monkeypatch.setattr(api, "torch_chunk_backend", fail)
