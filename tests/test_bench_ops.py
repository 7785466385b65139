"""benchmarks/bench_ops.py on the CPU, so that a GPU run does not find it broken: every variant's rows of ours build
and run forward + backward (the triton backend under the interpreter: the kernels, or GLA's torch path), the
results table with its ratio columns, and the command line's refusals (one line, exit status 2)."""

import pytest
import torch

from helpers import load_benchmark
from loglinear import FenwickState


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_ops")


@pytest.mark.parametrize("variant", ["mamba2", "gdn", "gla"])
def test_our_rows_run_forward_and_backward(bench, variant):
    ops = bench.BENCHES[variant]
    leaves = {}
    for impl in bench.OURS:
        x = ops.inputs(40, 2, 2, 1, 16, 16, torch.float32, seed=3, device="cpu")
        fn, leaves[impl] = ops.build(impl, x, 2, 1)
        for t in leaves[impl]:
            t.requires_grad_(True)
        o = fn()
        o.square().sum().backward()
        assert o.shape == ((1, 80) if impl == "loglinear_packed" else (2, 40)) + (2, 16), impl
        assert torch.isfinite(o).all(), impl
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves[impl]), impl
    for impl in ("loglinear_state", "loglinear_state_inside"):  # the state's levels take a gradient too
        assert len(leaves[impl]) == len(leaves["loglinear"]) + 1, impl
    x = ops.inputs(40, 2, 2, 1, 16, 16, torch.bfloat16, seed=3, device="cpu")
    for impl, dtype in (("loglinear", torch.bfloat16), ("loglinear_fp32", torch.float32)):
        assert ops.build(impl, x, 2, 1)[1][0].dtype == dtype, impl  # q: the row's operand dtype


def test_chunk_size_reaches_every_call_of_ours(bench, monkeypatch):
    """--chunk-size goes to our op on every row of ours, the state's calls of the state rows included."""
    calls = []

    def op(*args, **kw):
        calls.append(kw.get("chunk_size"))
        return torch.zeros(1), FenwickState(torch.zeros(2, 6, 2, 16, 16), torch.tensor([20, 20]))

    monkeypatch.setitem(bench.OURS_KW, "chunk_size", 32)
    x = bench.make_inputs(20, 2, 2, 1, 16, 16, torch.float32, device="cpu")
    for impl in bench.OURS:
        fn, _ = bench.ours(impl, op, x, ("q", "k", "v", "g"))
        fn()
    assert calls == [32] * len(calls) and len(calls) == 8


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
    assert "Caching-allocator retries" not in md and "PYTORCH_CUDA_ALLOC_CONF: unset." in md


def test_results_name_the_rows_timed_through_allocator_retries(bench, tmp_path):
    rows = [{"impl": "loglinear", "T": 8192, "fwd_ms": 1.0, "fwdbwd_ms": 3.0, "peak_gib": 1.0, "alloc_retries": 0},
            {"impl": "loglinear_state", "T": 131072, "fwd_ms": 1.0, "fwdbwd_ms": 3.0, "peak_gib": 70.0,
             "alloc_retries": 21}]
    meta = {"gpu": "cpu", "torch": torch.__version__, "triton": "-", "date": "-", "command": "python bench_ops.py",
            "setting": "-", "notes": "-", "allocator": "unset"}
    bench.write_results(rows, meta, tmp_path / "ops-gdn-cpu", "gdn")
    md = (tmp_path / "ops-gdn-cpu.md").read_text()
    assert "retried, which synchronizes; the row's time includes it): loglinear_state at 128K: 21." in md
    assert "loglinear at 8K" not in md


@pytest.mark.parametrize("argv, message", [
    (["--variant", "gla", "--impls", "fla_gdn"], "--impls fla_gdn: not rows of --variant gla"),
    (["--variant", "mamba2", "--impls", "fla_gla"], "--impls fla_gla: not rows of --variant mamba2"),
    (["--T", "2048", "0"], "--T must be >= 1, got 2048 0"),
    (["--rep", "0"], "--rep must be >= 1, got 0"),
    (["--chunk-size", "48"], "--chunk-size must be 16, 32 or 64 (the kernels' chunks for bf16), got 48"),
    (["--chunk-size", "128"], "--chunk-size must be 16, 32 or 64 (the kernels' chunks for bf16), got 128"),
    (["--chunk-size", "32", "--check"], "--chunk-size times our rows; --check runs at the ops' own chunk sizes"),
    (["--T", "2048"], "needs a CUDA GPU"),
])
def test_refusals_are_one_line_and_status_2(bench, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine: no benchmark starts
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1


def test_merge_keeps_the_other_runs_rows_and_names_each_run(bench, tmp_path):
    """--merge: a re-measured T replaces that T's rows (all of them: each T from one run), the file's other rows
    stay, and the header names the run behind each T; a file from other software is refused."""
    meta = {"gpu": "cpu", "torch": torch.__version__, "triton": "-", "setting": "-", "notes": "-"}
    row = lambda impl, T, ms: {"impl": impl, "T": T, "fwd_ms": ms / 3, "fwdbwd_ms": ms, "peak_gib": 1.0}  # noqa: E731
    path = tmp_path / "ops-gla-cpu"
    first = dict(meta, date="d1", command="python bench_ops.py --T 8192 4096 2048")
    bench.write_results([row(i, T, 2.0) for T in (8192, 4096, 2048) for i in ("loglinear", "fla_gla")], first, path,
                        "gla")
    second = dict(meta, date="d2", command="python bench_ops.py --T 4096 2048 --merge")
    kept = bench.merge_previous(path.with_suffix(".json"), second, [4096, 2048])
    assert {(r["impl"], r["T"]) for r in kept} == {("loglinear", 8192), ("fla_gla", 8192)}
    assert second["runs"] == [{"date": "d1", "command": first["command"], "T": [8192]},
                              {"date": "d2", "command": second["command"], "T": [2048, 4096]}]
    new = [row(i, T, ms) for T in (4096, 2048) for i, ms in (("loglinear", 3.0), ("fla_gla", 4.0))]
    bench.write_results(kept + new, second, path, "gla")
    md = path.with_suffix(".md").read_text()
    assert (f"rows at 8K: d1, `{first['command']}`; rows at 2K, 4K: d2, `{second['command']}`" in md
            and "| 2K | 0.75 |" in md and "| 8K | 1.00 |" in md)
    third = dict(meta, date="d3", command="python bench_ops.py --T 8192 --merge")
    bench.merge_previous(path.with_suffix(".json"), third, [8192])
    assert [(r["date"], r["T"]) for r in third["runs"]] == [("d2", [2048, 4096]), ("d3", [8192])]
    with pytest.raises(ValueError, match="another triton"):
        bench.merge_previous(path.with_suffix(".json"), dict(third, triton="3.6.0"), [8192])
    with pytest.raises(ValueError, match="another allocator"):
        bench.merge_previous(path.with_suffix(".json"), dict(third, allocator="expandable_segments:True"), [8192])
    fresh = dict(third)
    assert bench.merge_previous(tmp_path / "none.json", fresh, [8192]) == [] and len(fresh["runs"]) == 1


def test_results_name_the_rows_not_measured(bench, tmp_path, monkeypatch):
    """main() on stubbed timings: a row whose impl raises is named with its error, and a run cut before a row (a
    time limit: the file is written before every row) leaves a file that names the rows it did not reach; a whole
    run names none."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "machine_name", lambda: "cpu")
    monkeypatch.setattr(bench, "lift_fla_guard", lambda: None)
    cut = {"at": ("fla_gla", 2048)}

    def measure(impl, T, dtype, warmup, rep, variant):
        if (impl, T) == ("fla_gla", 4096):
            raise RuntimeError("CUDA out of memory\ndetails")
        if (impl, T) == cut["at"]:
            raise KeyboardInterrupt  # the run ends here
        return {"impl": impl, "T": T, "fwd_ms": 1.0, "fwdbwd_ms": 3.0, "peak_gib": 1.0}

    monkeypatch.setattr(bench, "measure", measure)
    argv = ["--variant", "gla", "--impls", "loglinear", "fla_gla", "--T", "4096", "2048", "--out", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    md = (tmp_path / "ops-gla-cpu.md").read_text()
    assert ("Not measured: fla_gla at 4K (RuntimeError: CUDA out of memory); fla_gla at 2K (the run ended before "
            "it was timed).") in md
    assert "| loglinear | 3 | 3 |" in md
    cut["at"] = None
    bench.main(argv)
    md = (tmp_path / "ops-gla-cpu.md").read_text()
    assert "Not measured: fla_gla at 4K (RuntimeError: CUDA out of memory)." in md and "| fla_gla | 3 | — |" in md
