"""benchmarks/bench_ops.py on the CPU, so that a GPU run does not find it broken: every variant's rows of ours build
and run forward + backward (the triton backend under the interpreter: the kernels, or GLA's torch path), the
results table with its ratio columns, and the command line's refusals (one line, exit status 2)."""

import pytest
import torch

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_ops")


@pytest.mark.parametrize("variant", ["mamba2", "gdn", "gla"])
def test_our_rows_run_forward_and_backward(bench, variant):
    ops = bench.BENCHES[variant]
    for impl in ("loglinear", "loglinear_plain", "loglinear_state"):
        x = ops.inputs(20, 2, 2, 1, 16, 16, torch.float32, seed=3, device="cpu")
        fn, leaves = ops.build(impl, x, 2, 1)
        for t in leaves:
            t.requires_grad_(True)
        o = fn()
        o.square().sum().backward()
        assert o.shape == (2, 20, 2, 16) and torch.isfinite(o).all(), impl
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves), impl
    assert len(leaves) == len(ops.build("loglinear", x, 2, 1)[1]) + 1  # the state's levels take a gradient too


def test_results_table_has_the_ratios(bench, tmp_path):
    rows = [{"impl": impl, "T": T, "fwd_ms": ms / 3, "fwdbwd_ms": ms, "peak_gib": 1.0}
            for T in (2048, 4096) for impl, ms in (("loglinear", 3.0), ("loglinear_plain", 2.0), ("fla_gla", 4.0))]
    meta = {"gpu": "cpu", "torch": torch.__version__, "triton": "-", "date": "-", "command": "python bench_ops.py",
            "setting": "-", "notes": "-"}
    bench.write_results(rows, meta, tmp_path / "ops-gla-cpu", "gla")
    md = (tmp_path / "ops-gla-cpu.md").read_text()
    assert "# Op benchmark, log-linear GLA (cpu)" in md
    assert "| T | loglinear / fla_gla | loglinear_plain / fla_gla | loglinear / loglinear_plain |" in md
    assert "| 2K | 0.75 | 0.50 | 1.50 |" in md
    assert (tmp_path / "ops-gla-cpu.json").exists() and (tmp_path / "ops-gla-cpu.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["--variant", "gla", "--impls", "fla_gdn"], "--impls fla_gdn: not rows of --variant gla"),
    (["--variant", "mamba2", "--impls", "fla_gla"], "--impls fla_gla: not rows of --variant mamba2"),
])
def test_refusals_are_one_line_and_status_2(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1
