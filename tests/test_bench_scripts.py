"""The command lines of benchmarks/bench_decode.py and bench_train.py: values that cannot work are refused (one line,
exit status 2) before anything is measured or written (bench_ops.py's: tests/test_bench_ops.py)."""

import pytest

from helpers import load_benchmark


@pytest.mark.parametrize("script, argv, message", [
    ("bench_decode", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("bench_decode", ["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    ("bench_decode", ["--contexts", "1024", "0"], "--contexts must be >= 1, got 1024 0"),
    ("bench_decode", ["--batches", "-2"], "--batches must be >= 1, got -2"),
    ("bench_decode", ["--device", "gpu0"], "--device must be a torch device such as cpu or cuda:0"),
    ("bench_train", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("bench_train", ["--seq-len", "-1"], "--seq-len must be >= 1, got -1"),
    ("bench_train", ["--device", "gpu0"], "--device must be a torch device such as cpu or cuda:0"),
])
def test_refusals_are_one_line_and_status_2(tmp_path, capsys, script, argv, message):
    bench = load_benchmark(script)
    with pytest.raises(SystemExit) as exit_:
        bench.main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{script}.py: {message}" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
