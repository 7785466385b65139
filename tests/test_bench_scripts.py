"""The command lines of benchmarks/bench_decode.py, bench_train.py, bench_torch_path.py and bench_host.py: values that
cannot work are refused (one line, exit status 2) before anything is measured or written (bench_ops.py's:
tests/test_bench_ops.py); bench_torch_path.py and bench_host.py at a tiny size write their result files;
profiling/ncu_kernels.py summarises an ncu details page; profiling/compile_sm90.py refuses a chunk it would not
compile and builds every kernel; profiling/tune_mamba2.py and tune_gdn_local.py try each candidate on its path
and put the op's choices back; profiling/ab_trees.py alternates the two trees' benchmark runs (bench_ops.py's, or
bench_decode.py --kernel-only's: the fused step alone)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, argv, message", [
    ("bench_decode", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("bench_decode", ["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    ("bench_decode", ["--contexts", "1024", "0"], "--contexts must be >= 1, got 1024 0"),
    ("bench_decode", ["--batches", "-2"], "--batches must be >= 1, got -2"),
    ("bench_decode", ["--key-window", "1"], "--key-window must be >= 2, got 1"),
    ("bench_decode", ["--key-window", "12"], "--key-window must be a power of two, got 12"),
    ("bench_decode", ["--key-window", "64"], "--key-window must be <= 32, got 64"),
    ("bench_decode", ["--device", "gpu0"], "--device must be a torch device such as cpu or cuda:0"),
    ("bench_decode", ["--kernel-only", "--device", "cpu"], "--kernel-only needs a CUDA device"),
    ("bench_train", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("bench_train", ["--seq-len", "-1"], "--seq-len must be >= 1, got -1"),
    ("bench_train", ["--device", "gpu0"], "--device must be a torch device such as cpu or cuda:0"),
    ("bench_torch_path", ["--lengths", "64", "0"], "--lengths must be >= 1, got 64 0"),
    ("bench_torch_path", ["--packed", "0"], "--packed must be >= 1, got 0"),
    ("bench_torch_path", ["--lengths", "1000", "--packed", "256"],
     "--packed must divide the longest of --lengths (1000), got 256"),
    ("bench_torch_path", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
    ("bench_torch_path", ["--device", "gpu0"], "--device must be a torch device such as cpu or cuda:0"),
    ("bench_host", ["--tokens", "100"], "--tokens must be a multiple of 64, got 100"),
    ("bench_host", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
    ("profiling/tune_mamba2", ["--T", "0"], "--T must be >= 1, got 0"),
    ("profiling/tune_mamba2", ["--budget", "-5"], "--budget must be >= 0, got -5"),
    ("profiling/tune_gdn_local", ["--T", "0"], "--T must be >= 1, got 0"),
    ("profiling/tune_gdn_local", ["--budget", "-5"], "--budget must be >= 0, got -5"),
    ("profiling/ab_trees", ["--base", "/nonexistent", "--rounds", "0"], "--rounds must be >= 1, got 0"),
    ("profiling/ab_trees", ["--base", "/nonexistent", "--T", "4096", "0"], "--T must be >= 1, got 4096 0"),
    ("profiling/ab_trees", ["--base", "/nonexistent"], "--base must be a checkout of the repository"),
    ("profiling/ab_trees", ["--base", str(ROOT)], f"--base must be another checkout than this one ({ROOT})"),
])
def test_refusals_are_one_line_and_status_2(tmp_path, capsys, script, argv, message):
    bench = load_benchmark(script)
    with pytest.raises(SystemExit) as exit_:
        bench.main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{Path(script).name}.py: {message}" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_torch_path_benchmark_writes_its_results(tmp_path):
    bench = load_benchmark("bench_torch_path")
    bench.main(["--variants", "mamba2", "gla", "--lengths", "64", "128", "--packed", "32", "--heads", "2",
                "--head-dim", "8", "--repeats", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "torch-path-cpu.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 3 and all(r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 for r in rows)
    md = (tmp_path / "torch-path-cpu.md").read_text()
    assert "## Mamba-2" in md and "## GLA" in md and "| 128 as 4 x 32 |" in md
    assert (tmp_path / "torch-path-cpu.png").stat().st_size > 0


def test_host_benchmark_counts_each_layout(tmp_path):
    """Every layout of two variants is counted (torch ops and launches, both passes); Mamba-2's states inside
    chunks take about the same host work at two positions as at one (a torch path per position took some 250 ops
    more each)."""
    bench = load_benchmark("bench_host")
    bench.main(["--variants", "mamba2", "gated_deltanet", "--sequences", "2", "--tokens", "64", "--repeats", "1",
                "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "host-cpu.json").read_text())["rows"]
    assert len(rows) == 2 * 6 and all(min(r["fwd_ops"], r["bwd_ops"], r["fwd_launches"], r["bwd_launches"]) > 0
                                      for r in rows)
    by = {(r["variant"], r["layout"]): r for r in rows}
    one, two = by["mamba2", "state at 40 (inside a chunk)"], by["mamba2", "states at 2 positions inside chunks"]
    assert two["fwd_ops"] + two["bwd_ops"] <= one["fwd_ops"] + one["bwd_ops"] + 8, (one, two)
    md = (tmp_path / "host-cpu.md").read_text()
    assert "## Mamba-2" in md and "## Gated DeltaNet" in md and "| packed, from position 0 |" in md
    assert (tmp_path / "host-cpu.png").stat().st_size > 0


NCU_HEADER = ('"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name","Rule Type",'
              '"Rule Description","Estimated Speedup Type","Estimated Speedup"\n')


def test_ncu_summary_tables_each_kernel_and_its_findings(tmp_path):
    ncu = load_benchmark("profiling/ncu_kernels")
    rows = [
        '"0","k_a","Speed","Duration","ms","1.24","","","","",""',
        '"0","k_a","Launch","Registers Per Thread","register/thread","168","","","","",""',
        '"0","k_a","Warps","","","","Stall","WRN","Warps wait. Each waits 4.9 cycles. Consider x.","local","34.1"',
        '"0","k_a","Memory","","","","Comp","INF","compression","global","2.5"',
        '"1","k_b","Speed","Duration","ms","2.73","","","","",""',
        '"2","k_a","Speed","Duration","ms","9.99","","","","",""',  # a second launch of k_a: not read
    ]
    path = tmp_path / "details.csv"
    path.write_text(NCU_HEADER + "\n".join(rows) + "\n")
    md = ncu.summary(path, "mamba2", "H100", "torch x, triton y", tmp_path / "out").read_text()
    assert "| `k_a` | 1.24 ms | 168 register/thread | — |" in md and "| `k_b` | 2.73 ms | — |" in md
    assert "9.99" not in md
    assert "- `k_a`, Warps, 34.1%: Warps wait. Each waits 4.9 cycles.\n" in md  # two sentences of each
    assert "compression" not in md  # below the 10% shown


@pytest.mark.parametrize("argv, message", [
    (["run", "--T", "0"], "--T and --calls must be >= 1, got 0 and 3"),
    (["summary", "missing.csv", "--gpu", "H100", "--versions", "v"], "no such file missing.csv"),
    (["summary", "empty.csv", "--gpu", "H100", "--versions", "v"], "empty.csv holds no kernel metrics"),
])
def test_ncu_refusals_are_one_line_and_status_2(tmp_path, monkeypatch, capsys, argv, message):
    ncu = load_benchmark("profiling/ncu_kernels")
    (tmp_path / "empty.csv").write_text(NCU_HEADER)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        ncu.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"ncu_kernels.py: {message}" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["mamba2", "--chunk", "48"], "--chunk must be a power of two from 16 to 64, got 48"),
    (["gdn", "--chunk", "32"], "--chunk applies to mamba2 and gla; gdn compiles at its own chunk rule"),
    (["gla", "--decode", "--plain"], "--has-init, --plain, --chunk and --l2norm apply to the training kernels; "
     "--decode builds every path of the decode step"),
])
def test_sm90_compile_refuses_what_it_would_not_build(argv, message):
    """In a subprocess: compile_sm90.py turns the interpreter off when imported."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "profiling" / "compile_sm90.py"
    run = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and f"compile_sm90.py: {message}" in run.stderr


@pytest.mark.parametrize("argv, kernels", [
    (["mamba2", "--has-init", "--chunk", "16"], 13),
    (["gla", "--has-init", "--chunk", "16"], 17),
    (["gdn"], 10),
    (["gla", "--decode"], 8),
    (["gdn", "--decode"], 14),
    (["gdn", "--plain", "--K", "256", "--V", "64"], 10),
    (["gla", "--has-init", "--K", "256", "--V", "128", "--heads-per-program", "1"], 17),
])
def test_sm90_compile_builds_every_kernel(argv, kernels):
    """Every kernel of a variant compiles for sm_90 with the installed triton (fp16, K = V = 32 unless argv sets
    them: plain Gated DeltaNet's chains at K = 256 fit the shared memory only at two pipeline stages; a state's build;
    --decode: the decode step's launches on each of its paths, one line each; GLA's and Gated DeltaNet's between
    them set each flag of the decode kernels both ways where the step does, Mamba-2's are GLA's with a scalar gate;
    GLA with states at K = 256 and its widest value slice, value_slice's 128):
    the compiler checks what the interpreter, which runs the kernels' Python, does not (a loop-carried value that
    changes type, a tile whose shared memory the target lacks), so a kernel the CPU tests pass may still not build."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "profiling" / "compile_sm90.py"
    run = subprocess.run([sys.executable, str(script), "--dtype", "fp16", "--K", "32", "--V", "32", *argv],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    built = [line for line in run.stdout.splitlines() if "SASS instructions" in line]
    assert len(built) == kernels and not any("OVER THE SHARED LIMIT" in line for line in built), run.stdout


@pytest.mark.parametrize("variant, plain, fp32", [("mamba2", False, False), ("mamba2", True, False),
                                                 ("gla", False, False), ("gla", True, False), ("mamba2", False, True)])
def test_mamba2_tuner_tries_each_candidate_on_its_path(variant, plain, fp32, monkeypatch):
    """Every candidate of tune_mamba2.py, set into LAUNCH, is what launch_options gives the kernel as the backend
    asks for it on that path and operand dtype (the per-channel gate's in-chunk kernels without flags), and differs
    from the op's own."""
    from types import SimpleNamespace

    from loglinear.ops.triton.shared import launch

    tune = load_benchmark("profiling/tune_mamba2")
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    cands = tune.candidates(variant, plain, fp32)
    assert len({c[0] for c in cands}) == len(tune.KERNELS) + 4 * (variant == "gla")
    assert len(set(cands)) == len(cands)
    capped = {c[0] for c in cands if c[4] is not None}
    general = set(tune.CHANNEL_KERNELS) if variant == "gla" else set() if plain or fp32 else set(tune.KERNELS)
    assert capped == general  # caps only on a general 16-bit build (launch_options' rule)
    for name, field, warps, stages, registers in cands:
        kernel, config = SimpleNamespace(__name__=name), launch.LAUNCH[name]
        flags = {} if name in tune.CHANNEL_KERNELS else {"per_channel": variant == "gla", "plain": plain, "fp32": fp32}
        own = launch.launch_options(kernel, **flags)
        monkeypatch.setitem(launch.LAUNCH, name, tune.with_config(config, field, warps, stages, registers))
        want = {"num_warps": warps, "num_stages": stages, **({"maxnreg": registers} if registers else {})}
        assert launch.launch_options(kernel, **flags) == want != own
        monkeypatch.setitem(launch.LAUNCH, name, config)


def test_mamba2_tuner_puts_the_op_choices_back(tmp_path, monkeypatch):
    """tune_mamba2.py's loop, its timings stubbed on the CPU: a row per candidate (errors and the budget's cut as
    rows), each with its own baseline, the files written, and LAUNCH as it was."""
    import torch

    from loglinear.ops.triton.shared import launch

    tune = load_benchmark("profiling/tune_mamba2")
    table = dict(launch.LAUNCH)
    x = torch.randn(8, requires_grad=True)
    calls = []

    def measure(step, leaves, kernel):
        calls.append(kernel)
        if kernel == "mamba2_level_grad_kernel" and launch.LAUNCH[kernel] != table[kernel]:
            raise RuntimeError("out of resources: shared memory")
        return 2.0, 0.5, [torch.ones(8)]

    monkeypatch.setattr(tune.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune.torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.setattr(tune, "build_step", lambda variant, plain, T, dtype: (lambda: (x * 2).sum().backward(), [x]))
    monkeypatch.setattr(tune, "measure", measure)
    tune.main(["--T", "64", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "tune-mamba2-Test-GPU.json").read_text())["rows"]
    assert launch.LAUNCH == table
    assert len(rows) == 1 + len(tune.candidates("mamba2", False))
    assert all(r["base_ms"] == 2.0 for r in rows[1:])
    assert {r["error"] for r in rows if r["kernel"] == "mamba2_level_grad_kernel"} == {
        "RuntimeError: out of resources: shared memory"}
    md = (tmp_path / "tune-mamba2-Test-GPU.md").read_text()
    assert "| `mamba2_chunk_bwd_dkv_kernel` | 8 | 2 |  | 2.0 | 2.0 | 1.000 |" in md
    assert "| `mamba2_chunk_bwd_dq_kernel` | 4 | 2 | 168 | 2.0 | 2.0 | 1.000 |" in md
    tune.main(["--T", "64", "--budget", "0", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "tune-mamba2-Test-GPU.json").read_text())["rows"]
    assert all(r["error"] == "budget" for r in rows[1:])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gdn_tuner_times_each_candidate_at_its_launch(dtype, tmp_path, monkeypatch):
    """tune_gdn_local.py's loop, its profiled steps stubbed on the CPU: each candidate is what launch_options (and
    the chunk-local key block) give its kernel for operands of that dtype while its step runs, and differs from the
    op's own; a row per candidate (an error and the budget's cut as rows), the files written, LAUNCH and KEY_BLOCK
    as they were."""
    from types import SimpleNamespace

    import torch

    from loglinear.ops.triton.gated_deltanet import local
    from loglinear.ops.triton.shared import launch

    tune = load_benchmark("profiling/tune_gdn_local")
    fp32, operands = dtype == "float32", getattr(torch, dtype)
    table, blocks, seen = dict(launch.LAUNCH), dict(local.KEY_BLOCK), []
    monkeypatch.setattr(launch, "interpreting", lambda: False)

    def kernel_times(T, dtype=torch.bfloat16):
        assert dtype == operands
        changed = [n for n in table if launch.LAUNCH[n] != table[n]]
        if changed:
            kernel = SimpleNamespace(__name__=changed[0])
            options = launch.launch_options(kernel, fp32=fp32)
            seen.append((changed[0], options["num_warps"], local.KEY_BLOCK.get(changed[0]), options["num_stages"]))
        if seen and seen[-1][0] == "_scan_grads_kernel":
            raise RuntimeError("out of resources: shared memory")
        return [(1.5, 1, n) for n in table], 3.0, [torch.ones(4)]

    monkeypatch.setattr(tune.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune.torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.setattr(tune, "kernel_times", kernel_times)
    tune.main(["--T", "64", "--dtype", dtype, "--out", str(tmp_path)])
    name = f"tune-gdn-{'fp32' if fp32 else 'local'}-Test-GPU"
    rows = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
    assert launch.LAUNCH == table and local.KEY_BLOCK == blocks
    cands = tune.candidates(fp32)
    assert cands and len(rows) == len(tune.FP32_CANDIDATES if fp32 else tune.CANDIDATES) + len(cands)
    for (kernel, (warps, block, stages)), got in zip(cands, seen):
        assert got == (kernel, warps, block if block else blocks.get(kernel), stages)
        assert (warps, block, stages) != tune.op_choice(kernel, fp32)
    errors = {r["kernel"]: r["error"] for r in rows if "error" in r}
    assert errors == ({"_scan_grads_kernel": "RuntimeError: out of resources: shared memory"} if fp32 else {})
    assert "| `_chunk_local_kernel` |" in (tmp_path / f"{name}.md").read_text()
    tune.main(["--T", "64", "--dtype", dtype, "--budget", "0", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
    assert sum(r.get("error") == "budget" for r in rows) == len(cands)


def _fake_checkout(path: Path) -> Path:
    (path / "benchmarks").mkdir(parents=True)
    (path / "benchmarks" / "bench_ops.py").write_text("")
    (path / "loglinear").mkdir()
    return path


def test_ab_trees_alternates_the_trees_and_tables_their_medians(tmp_path, monkeypatch, capsys):
    """ab_trees.py, its bench_ops.py runs stubbed on the CPU: per round the base tree's process, then this tree's,
    each with its tree first on PYTHONPATH and run from it; a table of every round's ms and the medians' ratio,
    written after every run; a run that fails ends the script with one line and exit status 1."""
    import subprocess

    ab = load_benchmark("profiling/ab_trees")
    base = _fake_checkout(tmp_path / "base")
    calls = []

    def run(cmd, cwd=None, env=None, capture_output=False, text=False):
        if cmd[0] == "git":
            return subprocess.CompletedProcess(cmd, 0, stdout="abc1234\n" if "rev-parse" in cmd else "", stderr="")
        tree = Path(cwd)
        assert cmd[1] == str(tree / "benchmarks" / "bench_ops.py") and env["PYTHONPATH"].split(":")[0] == str(tree)
        out = Path(cmd[cmd.index("--out") + 1])
        calls.append((tree, out.name))
        ms = {base: 10.0, ROOT: 9.0}[tree] + len(calls) / 100
        rows = [{"impl": "loglinear", "T": T, "fwd_ms": 1.0, "fwdbwd_ms": ms * T / 4096, "peak_gib": 1.0}
                for T in (8192, 4096)]
        out.mkdir(parents=True, exist_ok=True)
        (out / "ab-Test-GPU.json").write_text(json.dumps({"gpu": "Test-GPU", "torch": "t", "triton": "tr",
                                                           "rows": rows}))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(ab.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ab.subprocess, "run", run)
    (tmp_path / "ab" / "base-r1").mkdir(parents=True)
    (tmp_path / "ab" / "base-r1" / "ab-Other-GPU.json").write_text("{}")  # an earlier run's, on another GPU
    ab.main(["--base", str(base), "--T", "8192", "4096", "--rounds", "2", "--out", str(tmp_path / "ab")])
    assert calls == [(base, "base-r1"), (ROOT, "this-r1"), (base, "base-r2"), (ROOT, "this-r2")]
    md = (tmp_path / "ab" / "ab-mamba2-Test-GPU.md").read_text()
    assert "| impl | T | base r1 | base r2 | this r1 | this r2 | this / base |" in md
    assert "| loglinear | 8192 | 20.0200 | 20.0600 | 18.0400 | 18.0800 | 0.901 |" in md
    assert "| loglinear | 4096 | 10.0100 | 10.0300 | 9.0200 | 9.0400 | 0.901 |" in md
    assert len(json.loads((tmp_path / "ab" / "ab-mamba2-Test-GPU.json").read_text())["runs"]) == 4

    def failing(cmd, cwd=None, env=None, capture_output=False, text=False):
        if cmd[0] == "git":
            return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Traceback\nRuntimeError: boom\n")

    monkeypatch.setattr(ab.subprocess, "run", failing)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        ab.main(["--base", str(base), "--out", str(tmp_path / "ab2")])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.count("\n") == 1 and "exited 1: RuntimeError: boom" in err


def test_ab_trees_needs_a_gpu(tmp_path, monkeypatch, capsys):
    ab = load_benchmark("profiling/ab_trees")
    monkeypatch.setattr(ab.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        ab.main(["--base", str(_fake_checkout(tmp_path / "base")), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "ab_trees.py: needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_ab_trees_compares_the_decode_step(tmp_path, monkeypatch, capsys):
    """--bench decode: each tree's bench_decode.py --kernel-only for the variant, contexts, batches and key window
    asked, and a row per (variant, batch, measure) of its kernel rows."""
    ab = load_benchmark("profiling/ab_trees")
    base = _fake_checkout(tmp_path / "base")
    (base / "benchmarks" / "bench_decode.py").write_text("")
    calls = []

    def run(cmd, cwd=None, env=None, capture_output=False, text=False):
        if cmd[0] == "git":
            return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")
        tree = Path(cwd)
        assert cmd[1] == str(tree / "benchmarks" / "bench_decode.py")
        assert cmd[2:11] == ["--kernel-only", "--kernel-variants", "gdn", "--contexts", "65536", "--batches", "16",
                             "1", "--key-window"] and cmd[11] == "8"
        out = Path(cmd[cmd.index("--out") + 1])
        calls.append(tree)
        us = {base: 100.0, ROOT: 80.0}[tree]
        kernel = [{"variant": "gdn", "batch": b, "context": 65536, "log_linear_us": us / b, "plain_us": 20.0,
                   "window_mean_us": us / 2} for b in (16, 1)]
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode-Test-GPU.json").write_text(json.dumps({"device": "NVIDIA Test GPU", "torch": "t",
                                                               "triton": "tr", "rows": [], "kernel": kernel}))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(ab.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ab.subprocess, "run", run)
    ab.main(["--base", str(base), "--bench", "decode", "--variant", "gdn", "--key-window", "8", "--rounds", "1",
             "--out", str(tmp_path / "ab")])
    assert calls == [base, ROOT]
    md = (tmp_path / "ab" / "ab-decode-gdn-Test-GPU.md").read_text()
    assert "| step | T | base r1 | this r1 | this / base |" in md
    assert "| gdn B=16 drawn | 65536 | 6.2500 | 5.0000 | 0.800 |" in md
    assert "| gdn B=1 per token over a window | 65536 | 50.0000 | 40.0000 | 0.800 |" in md
    assert "| gdn B=1 plain | 65536 | 20.0000 | 20.0000 | 1.000 |" in md


@pytest.mark.parametrize("argv, message", [
    (["--bench", "decode", "--impls", "loglinear"], "--impls applies to --bench ops only"),
    (["--batches", "4"], "--batches applies to --bench decode only"),
    (["--batches", "4", "--key-window", "8"], "--batches and --key-window apply to --bench decode only"),
    (["--bench", "decode", "--batches", "0"], "--batches must be >= 1"),
    (["--bench", "decode", "--key-window", "12"], "--key-window must be a power of two from 2 to 32, got 12"),
])
def test_ab_trees_refuses_options_of_the_other_bench(tmp_path, capsys, argv, message):
    ab = load_benchmark("profiling/ab_trees")
    with pytest.raises(SystemExit) as exit_:
        ab.main(["--base", str(_fake_checkout(tmp_path / "base")), "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err


def test_decode_benchmark_times_the_kernel_alone(tmp_path, monkeypatch):
    """bench_decode.py --kernel-only: no model built, the fused step's rows for the variants asked, json and md
    written (no plot: it is of the models' rows)."""
    bench = load_benchmark("bench_decode")
    asked = []
    monkeypatch.setattr(bench, "build", lambda *a: pytest.fail("--kernel-only built a model"))
    monkeypatch.setattr(bench, "kernel_times", lambda configs, contexts, batches, device, window, variants: (
        asked.append((contexts, batches, window, variants)) or
        [{"variant": "gdn", "batch": 2, "context": 64, "levels": 7, "log_linear_us": 5.0, "log_linear_bf16_us": 4.0,
          "log_linear_worst_us": 9.0, "plain_us": 1.0, "state_bytes": 0}]))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bench.main(["--kernel-only", "--tiny", "--device", "cpu", "--contexts", "64", "--batches", "2",
                "--kernel-variants", "gdn", "--key-window", "4", "--out", str(tmp_path)])
    assert asked == [([64], [2], 4, ("gdn",))]
    results = json.loads((tmp_path / "decode-cpu.json").read_text())
    assert results["rows"] == [] and results["kernel"][0]["log_linear_us"] == 5.0 and "triton" in results
    md = (tmp_path / "decode-cpu.md").read_text()
    assert "The fused step alone (--kernel-only)" in md and "| gdn | 2 | 64 | 7 | 5.0 | 9.0 | 4.0 | 1.0 |" in md
    assert not (tmp_path / "decode-cpu.png").exists()


def test_decode_benchmark_fails_loudly_when_a_part_raises(tmp_path, monkeypatch):
    """A part of bench_decode.py that raises (here the fused step's timing) is written into the json and the md's
    targets as FAILED with its error, and the run exits with status 1 after writing them."""
    bench = load_benchmark("bench_decode")

    def boom(*args):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(bench, "kernel_times", boom)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--kernel-only", "--tiny", "--device", "cpu", "--contexts", "64", "--batches", "2",
                    "--kernel-variants", "gdn", "--key-window", "4", "--out", str(tmp_path)])
    assert stop.value.code == 1
    results = json.loads((tmp_path / "decode-cpu.json").read_text())
    assert results["kernel_failed"] == {"error": "RuntimeError: out of resource: shared memory"}
    md = (tmp_path / "decode-cpu.md").read_text()
    assert "- kernel_failed: FAILED (RuntimeError: out of resource: shared memory)" in md
