"""benchmarks/experiments/run_multigpu.py without launching anything: the run plan, the throughput and comparison
arithmetic, the report; and the training loop's peak-memory metric."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import load_benchmark
from loglinear.train.loop import peak_memory_gib
from loglinear.train.parallel import Parallel


@pytest.fixture(scope="module")
def mg():
    return load_benchmark("experiments/run_multigpu")


def test_peak_memory_is_cuda_only(monkeypatch):
    assert peak_memory_gib(Parallel()) is None
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**29)
    assert peak_memory_gib(Parallel(device=torch.device("cuda", 0))) == 1.5


def test_cpu_plan(mg, tmp_path):
    a = mg.parse_args(["--device", "cpu", "--gpus", "4", "--out", str(tmp_path), "--long-steps", "5"])
    assert (a.tag, a.d_model, a.long_steps, a.cp_sizes) == ("cpu-x4", 32, 5, [4])
    fsdp, cp = mg.plan_fsdp(a, tmp_path), mg.plan_cp_exact(a, tmp_path) + mg.plan_cp_long(a, tmp_path)
    assert [r.nproc for r in fsdp] == [1, 2, 4] and all(r.args == fsdp[0].args for r in fsdp)
    assert [r.name for r in cp] == ["cp_exact-1", "cp_exact-2", "cp_exact-4", "cp_base-64", "cp_long-256-cp4",
                                    "cp_base-128", "cp_long-512-cp4"]
    base, long = cp[3].args, cp[4].args
    flag = lambda args, name: args[args.index(name) + 1]  # noqa: E731
    assert flag(long, "--context-parallel") == "4" and flag(long, "--global-batch") == "1"
    assert "--context-parallel" not in base and flag(base, "--global-batch") == "4" and flag(base, "--seq-len") == "64"
    assert flag(long, "--stop-after") == "5" and flag(long, "--device") == "cpu"
    assert mg.child_env("cuda")["NCCL_NVLS_ENABLE"] == "0"


def test_profile_long_plan(mg, tmp_path):
    """--profile-long: the cp_long runs and their baselines train one more step and profile it; others unchanged."""
    argv = ["--device", "cpu", "--gpus", "2", "--out", str(tmp_path), "--long-steps", "5", "--parts", "cp"]
    plain = mg.parse_args(argv)
    a = mg.parse_args([*argv, "--profile-long"])
    assert not plain.profile_long and a.profile_long
    flag = lambda args, name: args[args.index(name) + 1]  # noqa: E731
    for run in mg.plan_cp_long(a, tmp_path):
        assert flag(run.args, "--stop-after") == flag(run.args, "--profile-step") == "6", run.name
    assert all("--profile-step" not in r.args for r in mg.plan_cp_long(plain, tmp_path) + mg.plan_cp_exact(a, tmp_path))
    assert [flag(r.args, "--stop-after") for r in mg.plan_cp_long(plain, tmp_path)] == ["5"] * 4
    assert [r.name for r in mg.plan_cp_long(a, tmp_path)] == ["cp_long-256-cp2", "cp_base-128", "cp_long-512-cp2",
                                                              "cp_base-256"]


def test_a_profiled_last_step_is_left_out_and_its_reports_copied(mg, tmp_path):
    a = mg.parse_args(["--device", "cpu", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
                       "--long-steps", "4", "--profile-long"])
    run = mg.plan_cp_long(a, tmp_path)[0]
    folder = tmp_path / "work" / run.name
    folder.mkdir(parents=True)
    rows = _metrics(0.5, n=5)
    rows[-1] |= {"profiled": True, "elapsed_s": rows[-1]["elapsed_s"] + 9.0}  # the profiler's time
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    row = mg.measure(run, a, None)
    assert row["step_s"] == 0.5 and row["steps"] == 5 and row["error"] is None
    assert mg.unprofiled(rows) == rows[:4] and mg.unprofiled(rows[:4]) == rows[:4]
    for r in range(2):
        (folder / f"profile-rank{r}.txt").write_text(f"rank {r}\n")
    (tmp_path / "out").mkdir()
    names = mg.copy_profiles(run, a)
    assert names == [f"profile-{run.name}-rank0.txt", f"profile-{run.name}-rank1.txt"]
    assert (tmp_path / "out" / names[1]).read_text() == "rank 1\n"


def _metrics(step_s: float, n: int = 5, tokens: int = 100, loss: float = 1.0) -> list[dict]:
    return [{"step": s, "loss": loss + s, "tokens": s * tokens, "elapsed_s": 10 + s * step_s} for s in range(1, n + 1)]


def test_steady_rate_leaves_out_the_first_steps(mg):
    rows = _metrics(0.5)
    rows[0]["elapsed_s"] = 30.0  # compilation in step 1 only shifts later times
    for r in rows[1:]:
        r["elapsed_s"] += 20
    assert mg.steady_rate(rows, 2) == pytest.approx((200.0, 0.5))
    assert mg.steady_rate(rows[:2], 2) is None


def test_compare(mg):
    row = lambda part, run, **kw: {"part": part, "run": run, "error": None, "val_loss": None, **kw}  # noqa: E731
    rows = [row("fsdp", "fsdp-1", gpus=1, tok_per_s=100, losses=[3.0, 2.0]),
            row("fsdp", "fsdp-2", gpus=2, tok_per_s=150, losses=[3.0, 2.1]),
            row("cp_base", "cp_base-128", step_s=1.0, losses=[]),
            row("cp_long", "cp_long-256-cp2", shard_len=128, step_s=1.25, losses=[])]
    out = {r["run"]: r for r in mg.compare(rows)}
    assert out["fsdp-1"]["efficiency"] == 1.0 and out["fsdp-2"]["efficiency"] == 0.75
    assert out["fsdp-2"]["max_loss_diff_vs_1gpu"] == pytest.approx(0.1)
    assert out["cp_long-256-cp2"]["cp_overhead_share"] == 0.2


def test_report_keeps_the_runs_not_planned_now(mg, tmp_path):
    a = mg.parse_args(["--device", "cpu", "--out", str(tmp_path), "--parts", "fsdp"])
    old = {"command": "first", "rows": [{"part": "cp_long", "run": "x", "error": "skipped: budget spent"},
                                        {"part": "fsdp", "run": "fsdp-1", "error": "replaced"}]}
    (tmp_path / "multigpu-cpu-x2.json").write_text(json.dumps(old))
    rows = [{"part": "fsdp", "run": "fsdp-1", "error": None, "gpus": 1, "tok_per_s": 10,
             "losses": [2.0, 1.5], "val_loss": 1.4}]
    mg.writer(a, "second", {"fsdp-1", "fsdp-2"})(rows)
    doc = json.loads((tmp_path / "multigpu-cpu-x2.json").read_text())
    assert [r["run"] for r in doc["rows"]] == ["x", "fsdp-1"] and doc["rows"][1]["efficiency"] == 1.0
    assert doc["kind"] == "cpu-x2" and doc["command"] == "first; second"
    md = (tmp_path / "multigpu-cpu-x2.md").read_text()
    assert "| 1 | 10 | — | 1 |" in md and "skipped: budget spent" in md
    assert (tmp_path / "multigpu-cpu-x2.png").stat().st_size > 0


def test_report_keeps_a_measured_row_this_call_skipped(mg, tmp_path):
    a = mg.parse_args(["--device", "cpu", "--out", str(tmp_path), "--parts", "fsdp"])
    measured = {"part": "fsdp", "run": "fsdp-2", "error": None, "gpus": 2, "tok_per_s": 15, "losses": [2.0],
                "val_loss": 1.4}
    (tmp_path / "multigpu-cpu-x2.json").write_text(json.dumps({"command": "first", "rows": [measured]}))
    rows = [{"part": "fsdp", "run": "fsdp-1", "error": None, "gpus": 1, "tok_per_s": 10, "losses": [2.0],
             "val_loss": 1.4},
            {"part": "fsdp", "run": "fsdp-2", "gpus": 2, "error": "skipped: budget spent"}]
    mg.writer(a, "second", {"fsdp-1", "fsdp-2"})(rows)
    doc = {r["run"]: r for r in json.loads((tmp_path / "multigpu-cpu-x2.json").read_text())["rows"]}
    assert doc["fsdp-2"]["tok_per_s"] == 15 and doc["fsdp-2"]["efficiency"] == 0.75 and not doc["fsdp-2"]["error"]
    assert json.loads((tmp_path / "multigpu-cpu-x2.json").read_text())["command"] == "first; second"


def test_first_error_is_the_root_cause(mg, tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("step 1\ntraceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n"
                   "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB\n"
                   "RuntimeError: NCCL communicator was aborted\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert mg.first_error(log).startswith("torch.OutOfMemoryError: CUDA out of memory")
    log.write_text("no exception\nlast line\n")
    assert mg.first_error(log) == "last line"


def test_a_run_that_fails_after_its_last_step_keeps_its_numbers(mg, tmp_path):
    a = mg.parse_args(["--device", "cpu", "--work", str(tmp_path), "--out", str(tmp_path)])
    run = mg.plan_fsdp(a, tmp_path)[0]
    (tmp_path / run.name).mkdir()
    lines = [json.dumps(r) for r in _metrics(0.5, n=a.steps)]
    (tmp_path / run.name / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    assert mg.measure(run, a, "exit code 1")["error"] == "exit code 1"
    (tmp_path / run.name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    row = mg.measure(run, a, "exit code -6: terminate called without an active exception")
    assert row["error"] is None and row["exit_error"].startswith("exit code -6") and row["step_s"] == 0.5
    assert row["final_loss"] == row["losses"][-1] == 1.0 + a.steps
