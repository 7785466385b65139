"""`loglinear train --profile-step N`: one step under torch.profiler, a report per process; on 2 gloo processes
with --context-parallel 2 the report holds the labelled context-parallel scopes, and their call counts show
the cheap overhead items gone (one shard-shape all_gather per forward, no local state on the last rank)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from helpers import spawn_train
from loglinear.train.command import add_arguments, config_from_args
from loglinear.train.loop import TrainConfig, train
from loglinear.train.profiling import profile_report


def _config(data: Path, out: Path, *extra: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args([
        "--arch", "ll_mamba2", "--d-model", "32", "--layers", "2", "--heads", "2", "--tokenizer", "bytes",
        "--data-dir", str(data), "--seq-len", "32", "--steps", "2", "--global-batch", "2", "--warmup", "1",
        "--out-dir", str(out), "--log-every", "1", "--eval-batches", "1", "--no-progress", "--device", "cpu",
        "--model-config", json.dumps({"chunk_size": 8, "max_levels": 8}), "--profile-step", "2", *extra,
    ]))


def _scope_calls(report: str) -> dict[str, int]:
    """{scope: calls} of the report's host-side cp/... rows."""
    rows = [line.split() for line in report.splitlines() if line.startswith("cp/")]
    return {row[0]: int(row[2]) for row in rows if row[1] == "host"}


def test_profile_step_on_one_process(tiny_data, tmp_path):
    train(_config(tiny_data, tmp_path))
    report = (tmp_path / "profile-rank0.txt").read_text()
    assert report.startswith("# loglinear train: step 2, rank 0 of 1, cpu, context parallel 1")
    assert "step wall time:" in report and "## top 30 host ops by self CPU time" in report
    assert _scope_calls(report) == {}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("profiled", False) for r in rows if "loss" in r] == [False, True]


@pytest.mark.slow
def test_profile_step_labels_the_context_parallel_scopes(tiny_data, tmp_path):
    spawn_train(_config(tiny_data, tmp_path, "--context-parallel", "2"), 2)
    calls = [_scope_calls((tmp_path / f"profile-rank{r}.txt").read_text()) for r in range(2)]
    per_layer = {"cp/scan_forward": 2, "cp/scan_backward": 2, "cp/halo_forward": 2, "cp/halo_backward": 2,
                 "cp/shard_op": 2}
    for rank, mine in enumerate(calls):
        for scope, n in per_layer.items():
            assert mine.get(scope) == n, f"rank {rank}: {scope} {mine}"
        assert mine["cp/shard_shapes_all_gather"] == 1, "one shard-shape all_gather per forward, not per layer"
    assert calls[0]["cp/local_state"] == calls[0]["cp/transition"] == 2
    assert "cp/local_state" not in calls[1] and "cp/transition" not in calls[1], "the last rank's map is unread"


def test_cuda_report_from_events():
    """The CUDA layout of the report, from stand-ins of key_averages() rows (times in µs): kernels by device time
    (not the GPU-side annotations), then host ops, then both sides of every cp/ scope."""
    def event(key, device, us, annotation=False, calls=1, launched_us=0.0):
        cuda = device == DeviceType.CUDA
        return SimpleNamespace(key=key, device_type=device, is_user_annotation=annotation, count=calls,
                               self_device_time_total=us if cuda else 0, device_time_total=us if cuda else launched_us,
                               self_cpu_time_total=0 if cuda else us, cpu_time_total=0 if cuda else us)

    events = [event("ncclDevKernel_SendRecv", DeviceType.CUDA, 4000.0, calls=4),
              event("mamba2_chunk_bwd_dq_kernel", DeviceType.CUDA, 9000.0, calls=2),
              event("cp/scan_backward", DeviceType.CUDA, 5000.0, annotation=True, calls=2),
              event("cp/scan_backward", DeviceType.CPU, 300.0, annotation=True, calls=2, launched_us=4000.0),
              event("cudaStreamSynchronize", DeviceType.CPU, 1500.0, calls=3)]
    report = profile_report(events, 0.1, True, "title", top=4)
    lines = report.splitlines()
    assert lines[:3] == ["# title", "step wall time: 100.000 ms (device synchronised before and after)",
                         "kernels and copies, summed over streams: 13.000 ms"]
    kernels = lines[lines.index("## top 4 kernels / copies by device time") + 2:][:2]
    assert [row.split()[:4] for row in kernels] == [["mamba2_chunk_bwd_dq_kernel", "2", "9.000", "9.0"],
                                                   ["ncclDevKernel_SendRecv", "4", "4.000", "4.0"]]
    host = lines[lines.index("## top 2 host ops by self CPU time") + 2]
    assert host.split() == ["cudaStreamSynchronize", "3", "1.500", "1.500"]
    scopes = [row.split() for row in lines if row.startswith("cp/") and row.split()[1] in ("host", "device")]
    assert scopes == [["cp/scan_backward", "host", "2", "0.300", "4.000"],
                      ["cp/scan_backward", "device", "2", "0.000", "5.000"]]
