"""benchmarks/bench_decode.py's command line: values that cannot work are refused (one line, exit status 2) before
anything is measured or written."""

import pytest

from helpers import load_benchmark


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--contexts", "1024", "0"], "--contexts must be >= 1, got 1024 0"),
    (["--batches", "-2"], "--batches must be >= 1, got -2"),
    (["--device", "gpu0"], "--device must be a torch device such as cpu or cuda:0"),
])
def test_refusals_are_one_line_and_status_2(tmp_path, capsys, argv, message):
    bench = load_benchmark("bench_decode")
    with pytest.raises(SystemExit) as exit_:
        bench.main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"bench_decode.py: {message}" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
