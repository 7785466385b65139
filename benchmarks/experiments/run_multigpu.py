"""The runs that need several GPUs, as one command. Every run is `loglinear train` under torchrun
(`python -m torch.distributed.run --standalone`), one process per GPU; this script plans the runs, launches
them one after another, reads their metrics.jsonl and writes <out>/multigpu-<tag>.{json,md,png}.

  fsdp      FSDP2 data parallel on 1, 2, 4, 8 GPUs (up to --gpus), the same global batch for all: loss
            curves against one GPU, tokens/s, tokens/s per GPU, scaling efficiency tok/s(n) / (n tok/s(1)).
  cp_exact  the same short run with --context-parallel n on n GPUs against one GPU (fp32 on CUDA): the
            largest loss difference (exactness of the sequence split in training).
  cp_long   one --seq-len T sequence (128K-1M tokens) split over --context-parallel c GPUs, data parallel
            over the rest (global batch = gpus / c): throughput, peak memory per GPU and the CP overhead
            share 1 - t_base / t_cp, where t_base is the step time of the same GPUs each training its own
            T/c-token window without context parallelism (the same tokens per GPU and step, the same FSDP
            collectives, no cross-rank scan or halo exchange: what context parallelism costs in total).

    python benchmarks/experiments/run_multigpu.py --out benchmarks/results --budget 470   # on a multi-GPU machine
    python benchmarks/experiments/run_multigpu.py --device cpu --out runs/multigpu-cpu     # gloo smoke, tiny sizes

--profile-long: every cp_long run and its baseline trains one step more and runs that last step under
torch.profiler (loglinear train --profile-step); each process's report is copied to
<out>/profile-<run>-rank<r>.txt, and the throughput is taken over the steps before it. The context-parallel
run goes before its baseline (its report is the one wanted first).

Results are rewritten after every run (a killed command leaves what it finished); the rows of runs not planned
now are kept from an existing <out>/multigpu-<tag>.json, so the parts (or lengths) can be separate commands.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from loglinear.data.text import prepare_corpus  # noqa: E402
from loglinear.report import markdown_table, pyplot  # noqa: E402

# NVLink multicast stays off in every process (on hosts whose GPUs are shared, it can take them down).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PARTS = ("fsdp", "cp", "cp_exact", "cp_long")  # cp = cp_exact + cp_long
# --device cpu: tiny sizes for the options not given
CPU_DEFAULTS = {"corpus": "stdlib", "d_model": 32, "layers": 1, "seq_len": 256, "global_batch": 2, "steps": 4,
                "cp_d_model": 32, "cp_layers": 1, "exact_seq_len": 256, "exact_steps": 3, "long_seq_lens": [256, 512],
                "long_steps": 4, "skip_steps": 1}
EXCEPTION = re.compile(r"\w(Error|Exception): \S|^terminate called")  # "torch.OutOfMemoryError: CUDA out of ..."
T0 = time.monotonic()


@dataclass
class Run:
    """One torchrun launch of `loglinear train`: its name, process count and train arguments."""

    name: str
    part: str
    nproc: int
    args: list[str]
    info: dict = field(default_factory=dict)  # what the row reports about the setup (gpus, seq_len, ...)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results", help="where multigpu-<tag>.{json,md,png} go")
    p.add_argument("--work", default=None, help="the runs' folders and logs (default: runs/multigpu-<tag>)")
    p.add_argument("--tag", default=None, help="default: the machine kind, e.g. nvidia-h200-x4 (cpu-x2 on CPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo processes at tiny sizes (the smoke test of this pipeline)")
    p.add_argument("--gpus", type=int, default=None, help="processes at most (default: all GPUs; 2 on CPU)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=["fsdp", "cp"])
    p.add_argument("--budget", type=float, default=None, help="seconds: no run starts after this (its row says "
                   "so) and one still going 60 s after it is stopped")
    p.add_argument("--run-timeout", type=float, default=300, help="seconds: a run still going is stopped")
    p.add_argument("--arch", default="ll_mamba2")
    p.add_argument("--corpus", default="python", help="'python', 'stdlib' or a folder (loglinear train --corpus)")
    p.add_argument("--skip-steps", type=int, default=2, help="first steps left out of the throughput (compile)")
    g = p.add_argument_group("fsdp")
    g.add_argument("--d-model", type=int, default=1024)
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--seq-len", type=int, default=4096)
    g.add_argument("--global-batch", type=int, default=16, help="windows per step for every GPU count")
    g.add_argument("--steps", type=int, default=40)
    g = p.add_argument_group("cp")
    g.add_argument("--cp-d-model", type=int, default=512)
    g.add_argument("--cp-layers", type=int, default=2)
    g.add_argument("--exact-seq-len", type=int, default=8192)
    g.add_argument("--exact-steps", type=int, default=6)
    g.add_argument("--long-seq-lens", nargs="+", type=int, default=[131072, 262144, 524288, 1048576])
    g.add_argument("--cp-sizes", nargs="+", type=int, default=None, help="context-parallel degrees (default: all GPUs)")
    g.add_argument("--long-steps", type=int, default=8)
    g.add_argument("--profile-long", action="store_true", help="cp_long and cp_base runs: one more step, "
                   "profiled on every process (<out>/profile-<run>-rank<r>.txt), left out of the throughput")
    if p.parse_known_args(argv)[0].device == "cpu":
        p.set_defaults(**CPU_DEFAULTS)
    a = p.parse_args(argv)
    a.gpus = a.gpus or (torch.cuda.device_count() if a.device == "cuda" else 2)
    a.cp_sizes = a.cp_sizes or [a.gpus]
    if any(a.gpus % c or T % c for c in a.cp_sizes for T in a.long_seq_lens):
        p.error(f"every --cp-sizes {a.cp_sizes} must divide the GPUs ({a.gpus}) and every --long-seq-lens")
    a.tag = a.tag or machine_kind(a.device, a.gpus)
    a.work = Path(a.work or ROOT / "runs" / f"multigpu-{a.tag}").resolve()
    a.out = Path(a.out).resolve()
    return a


def machine_kind(device: str, gpus: int) -> str:
    """'nvidia-h200-x4' for 4 H200s (the device kind's name), 'cpu-x2' for 2 CPU processes."""
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return f"{name.lower().replace(' ', '-')}-x{gpus}"


def gpu_counts(gpus: int) -> list[int]:
    """1, 2, 4, 8 up to gpus."""
    return [n for n in (1, 2, 4, 8) if n <= gpus]


def child_env(device: str) -> dict[str, str]:
    """The runs' environment: ours plus multicast off; on CPU one thread per process (fair scaling)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **NO_MULTICAST)
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return env


def train_args(a: argparse.Namespace, data_dir: Path, d_model: int, layers: int, seq_len: int, batch: int,
               steps: int, *extra: str) -> list[str]:
    """`loglinear train` arguments shared by every run (one metrics line per step)."""
    args = ["--arch", a.arch, "--corpus", a.corpus, "--data-dir", str(data_dir), "--d-model", str(d_model),
            "--layers", str(layers), "--heads", str(max(1, d_model // 64)), "--seq-len", str(seq_len),
            "--global-batch", str(batch), "--steps", str(steps), "--warmup", str(max(1, steps // 4)),
            "--log-every", "1", "--eval-batches", "1", "--no-progress", *extra]
    return args + (["--device", "cpu"] if a.device == "cpu" else [])


def plan_fsdp(a: argparse.Namespace, data_dir: Path) -> list[Run]:
    """The same run on 1, 2, 4, 8 processes."""
    args = train_args(a, data_dir, a.d_model, a.layers, a.seq_len, a.global_batch, a.steps)
    return [Run(f"fsdp-{n}", "fsdp", n, args, {"gpus": n, "seq_len": a.seq_len, "global_batch": a.global_batch})
            for n in gpu_counts(a.gpus)]


def plan_cp_exact(a: argparse.Namespace, data_dir: Path) -> list[Run]:
    """The same short fp32 run with --context-parallel n on n processes, n = 1, 2, 4, 8."""
    return [Run(f"cp_exact-{n}", "cp_exact", n,
                train_args(a, data_dir, a.cp_d_model, a.cp_layers, a.exact_seq_len, 2, a.exact_steps,
                           "--context-parallel", str(n), "--precision", "fp32"),
                {"gpus": n, "context_parallel": n, "seq_len": a.exact_seq_len, "global_batch": 2})
            for n in gpu_counts(a.gpus)]


def plan_cp_long(a: argparse.Namespace, data_dir: Path) -> list[Run]:
    """For every long length and cp size: the baseline at the shard length without context parallelism
    (once per shard length), then the context-parallel run (with --profile-long the other way round)."""

    steps = a.long_steps + a.profile_long
    profile = ["--profile-step", str(steps)] if a.profile_long else []

    def long(T: int, batch: int, *extra: str) -> list[str]:
        # --stop-after < --steps: no validation at the end (the validation split may be shorter than T)
        return train_args(a, data_dir, a.cp_d_model, a.cp_layers, T, batch, 1000, "--stop-after", str(steps),
                          *profile, *extra)

    runs: list[Run] = []
    baselines: set[int] = set()
    for T in a.long_seq_lens:
        for c in a.cp_sizes:
            shard, dp = T // c, a.gpus // c
            pair = [Run(f"cp_long-{T}-cp{c}", "cp_long", a.gpus, long(T, dp, "--context-parallel", str(c)),
                        {"gpus": a.gpus, "context_parallel": c, "data_parallel": dp, "seq_len": T,
                         "global_batch": dp, "shard_len": shard})]
            if shard not in baselines:
                baselines.add(shard)
                base = Run(f"cp_base-{shard}", "cp_base", a.gpus, long(shard, a.gpus),
                           {"gpus": a.gpus, "context_parallel": 1, "seq_len": shard, "global_batch": a.gpus})
                pair = pair + [base] if a.profile_long else [base] + pair  # profiling: the CP run's report first
            runs += pair
    return runs


def launch(run: Run, a: argparse.Namespace, timeout: float) -> str | None:
    """torchrun the run (its folder emptied first); None if it succeeded, else why not."""
    out = a.work / run.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(run.nproc),
           "-m", "loglinear.cli", "train", *run.args, "--out-dir", str(out)]
    (out / "command.txt").write_text(" ".join(cmd) + "\n")
    with (out / "log.txt").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(a.device), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            stop(proc)
            return f"timeout after {timeout:.0f} s"
        except BaseException:  # SIGTERM of this script (see main), Ctrl-C: leave no workers behind
            stop(proc)
            raise
    return None if code == 0 else f"exit code {code}: {first_error(out / 'log.txt')}"


def stop(proc: subprocess.Popen) -> None:
    """End torchrun and the workers it started (their own process group): SIGTERM, SIGKILL after 15 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def first_error(log: Path) -> str:
    """The log's first exception line (the root cause: OOM, NCCL, ...; not torchrun's summary), else its
    last line."""
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    errors = [x for x in lines if EXCEPTION.search(x) and "ChildFailedError" not in x]
    return (errors[:1] or lines[-1:] or ["(empty log)"])[0][:300]


def read_metrics(out: Path) -> tuple[list[dict], float | None]:
    """(the per-step training rows, the final validation loss or None) of a run's metrics.jsonl."""
    path = out / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    return [r for r in rows if "loss" in r], (val[-1] if val else None)


def steady_rate(rows: list[dict], skip: int) -> tuple[float, float] | None:
    """(tokens/s, s/step) from the end of step `skip` to the last step: the compile-free steady state."""
    after = [r for r in rows if r["step"] >= skip]
    if len(after) < 2:
        return None
    first, last = after[0], after[-1]
    seconds = last["elapsed_s"] - first["elapsed_s"]
    if seconds <= 0:
        return None
    return (last["tokens"] - first["tokens"]) / seconds, seconds / (last["step"] - first["step"])


def unprofiled(rows: list[dict]) -> list[dict]:
    """The per-step rows before the first profiled step (whose time, and every later step's elapsed_s,
    includes the profiler's)."""
    marks = [i for i, r in enumerate(rows) if r.get("profiled")]
    return rows[: marks[0]] if marks else rows


def copy_profiles(run: Run, a: argparse.Namespace) -> list[str]:
    """Copy the run's profile-rank<r>.txt to <out>/profile-<run>-rank<r>.txt; returns the new names."""
    names = []
    for path in sorted((a.work / run.name).glob("profile-rank*.txt")):
        names.append(f"profile-{run.name}-{path.name.removeprefix('profile-')}")
        shutil.copyfile(path, a.out / names[-1])
    return names


def max_diff(a: list[float], b: list[float]) -> float | None:
    """The largest |a_i - b_i| over the common steps (None without any)."""
    n = min(len(a), len(b))
    return max(abs(x - y) for x, y in zip(a[:n], b[:n])) if n else None


def planned_steps(args: list[str]) -> int:
    """The step a run ends at: --stop-after if given (every run starts at step 0), else --steps."""
    flag = "--stop-after" if "--stop-after" in args else "--steps"
    return int(args[args.index(flag) + 1])


def measure(run: Run, a: argparse.Namespace, error: str | None) -> dict:
    """The row of a finished (or failed) run, before the comparisons across runs. A run that logged its
    last step and then failed (seen on CPU: gloo processes aborting at exit) keeps its numbers; the
    failure goes to "exit_error"."""
    rows, val = read_metrics(a.work / run.name)
    losses = [r["loss"] for r in rows]
    row = {"part": run.part, "run": run.name, **run.info, "error": error, "steps": len(rows),
           "final_loss": losses[-1] if losses else None, "losses": losses, "val_loss": val}
    if error and rows and rows[-1]["step"] == planned_steps(run.args):
        row |= {"error": None, "exit_error": error}
    rate = steady_rate(unprofiled(rows), a.skip_steps)
    if rate is not None:
        row |= {"tok_per_s": round(rate[0]), "tok_per_s_per_gpu": round(rate[0] / run.nproc),
                "step_s": round(rate[1], 4)}
    if rows and "peak_mem_gib" in rows[-1]:
        row["peak_mem_gib"] = rows[-1]["peak_mem_gib"]
    return row


def compare(rows: list[dict]) -> list[dict]:
    """Fill in what needs other rows: fsdp efficiency and loss differences vs 1 GPU, cp_exact loss
    differences vs 1 GPU, cp_long overhead share vs its baseline."""
    by = {r["run"]: r for r in rows}
    for r in rows:
        if r["part"] in ("fsdp", "cp_exact"):
            one = by.get(f"{r['part']}-1")
            if one is None or r is one or r["error"] or one["error"]:
                continue
            r["max_loss_diff_vs_1gpu"] = max_diff(r["losses"], one["losses"])
            if r["val_loss"] is not None and one["val_loss"] is not None:
                r["val_loss_diff_vs_1gpu"] = abs(r["val_loss"] - one["val_loss"])
            if r["part"] == "fsdp" and "tok_per_s" in r and "tok_per_s" in one:
                r["efficiency"] = round(r["tok_per_s"] / (r["gpus"] * one["tok_per_s"]), 4)
        if r["part"] == "cp_long" and "step_s" in r:
            base = by.get(f"cp_base-{r['shard_len']}", {})
            if "step_s" in base:
                r["baseline_step_s"] = base["step_s"]
                r["cp_overhead_share"] = round(1 - base["step_s"] / r["step_s"], 4)
    if "fsdp-1" in by and "tok_per_s" in by["fsdp-1"]:
        by["fsdp-1"]["efficiency"] = 1.0
    return rows


def fits(run: Run, meta: dict) -> str | None:
    """Why the corpus cannot feed this run (None if it can): the trainer opens windows of seq_len + 1
    tokens in both splits."""
    need = run.info["seq_len"] + 1
    short = [s for s in ("train", "val") if meta[f"{s}_tokens"] < need]
    return f"the corpus' {'/'.join(short)} split has fewer than {need} tokens" if short else None


def execute(runs: list[Run], a: argparse.Namespace, meta: dict, report) -> list[dict]:
    """Launch the runs in order (a progress bar; results rewritten after each); a run that cannot start
    (corpus too short, budget spent) gets a row saying why."""
    deadline = None if a.budget is None else T0 + a.budget
    rows: list[dict] = []
    bar = tqdm(runs, desc="multigpu runs", dynamic_ncols=True)
    for run in bar:
        bar.set_postfix_str(run.name)
        skipped = fits(run, meta) or (deadline is not None and time.monotonic() > deadline and "budget spent")
        if skipped:
            rows.append({"part": run.part, "run": run.name, **run.info, "error": f"skipped: {skipped}"})
        else:
            left = a.run_timeout if deadline is None else min(a.run_timeout, deadline - time.monotonic() + 60)
            t = time.monotonic()
            error = launch(run, a, left)
            rows.append(measure(run, a, error))
            profiles = copy_profiles(run, a)
            if profiles:
                rows[-1]["profiles"] = profiles
            tqdm.write(f"[{time.monotonic() - T0:6.0f} s] {run.name}: {time.monotonic() - t:.0f} s, "
                       + (rows[-1]["error"] or _summary(rows[-1])))
        report(rows)
    return rows


def _summary(row: dict) -> str:
    keys = ("tok_per_s", "tok_per_s_per_gpu", "step_s", "peak_mem_gib")
    words = [f"{k} {row[k]}" for k in keys if k in row] + [f"loss {x:.4f}" for x in row["losses"][-1:]]
    if "exit_error" in row:
        words.append(f"then {row['exit_error']}")
    return ", ".join(words)


# ---------------------------------------------------------------------------------------------- report


def _fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1e-2 or abs(x) >= 1e5 else f"{x:.4g}"
    return str(x)


TABLES = {
    "fsdp": ("FSDP2 data parallel (same global batch)",
             ["gpus", "tok_per_s", "tok_per_s_per_gpu", "efficiency", "step_s", "peak_mem_gib", "final_loss",
              "max_loss_diff_vs_1gpu", "val_loss", "error"]),
    "cp_exact": ("Context parallel: exactness against one GPU",
                 ["gpus", "context_parallel", "seq_len", "final_loss", "max_loss_diff_vs_1gpu",
                  "val_loss_diff_vs_1gpu", "error"]),
    "cp_long": ("Context parallel: long sequences",
                ["seq_len", "gpus", "context_parallel", "data_parallel", "tok_per_s", "tok_per_s_per_gpu", "step_s",
                 "baseline_step_s", "cp_overhead_share", "peak_mem_gib", "error"]),
    "cp_base": ("Baselines: the same GPUs, each its own shard-length window, no context parallelism",
                ["seq_len", "gpus", "tok_per_s", "tok_per_s_per_gpu", "step_s", "peak_mem_gib", "error"]),
}


def markdown(doc: dict) -> str:
    """Tables per part; the header says what was run."""
    about = (f"{doc['date']}, torch {doc['torch']}, {doc['device']}. Throughput from step {doc['skip_steps']} on "
             "(compilation left out); cp_overhead_share = 1 - baseline_step_s / step_s.")
    lines = [f"# Multi-GPU runs: {doc['kind']}", "", f"`{doc['command']}`", "", about, ""]
    for part, (title, cols) in TABLES.items():
        rows = [r for r in doc["rows"] if r["part"] == part]
        if rows:
            lines += [f"## {title}", "", markdown_table(cols, [[_fmt(r.get(c)) for c in cols] for r in rows])]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    """Loss curves and scaling efficiency (fsdp); throughput per GPU and overhead share vs T (cp_long)."""
    plt = pyplot()
    rows = [r for r in doc["rows"] if not r.get("error")]
    fsdp = [r for r in rows if r["part"] == "fsdp"]
    long = [r for r in rows if r["part"] == "cp_long" and "tok_per_s" in r]
    fig, ax = plt.subplots(1, 4, figsize=(20, 4.2))
    for r, style in zip(fsdp, ("-", "--", "-.", ":")):  # dashed: the curves should lie on top of each other
        ax[0].plot(range(1, len(r["losses"]) + 1), r["losses"], style, label=f"{r['gpus']} GPU")
    ax[0].set(title="FSDP2: training loss", xlabel="step", ylabel="loss")
    scaled = [r for r in fsdp if "efficiency" in r]
    ax[1].plot([r["gpus"] for r in scaled], [r["efficiency"] for r in scaled], "o-")
    ax[1].set(title="FSDP2: scaling efficiency", xlabel="GPUs", ylabel="tok/s / (n * tok/s on 1)", ylim=(0, 1.1),
              xticks=[r["gpus"] for r in scaled])
    for c in sorted({r["context_parallel"] for r in long}):
        mine = sorted((r for r in long if r["context_parallel"] == c), key=lambda r: r["seq_len"])  # rows: run order
        xs = [r["seq_len"] for r in mine]
        ax[2].plot(xs, [r["tok_per_s_per_gpu"] for r in mine], "o-", label=f"cp {c}")
        ax[3].plot(xs, [r.get("cp_overhead_share") for r in mine], "o-", label=f"cp {c}")
    ax[2].set(title="CP: tokens/s per GPU", xlabel="sequence length")
    ax[3].set(title="CP: overhead share of the step", xlabel="sequence length", ylim=(0, 1))
    for axis in ax[2:]:
        axis.set_xscale("log", base=2)
    for axis in ax:
        if axis.get_legend_handles_labels()[0]:
            axis.legend()
    fig.suptitle(f"{doc['kind']} ({doc['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kept_if_skipped(row: dict, measured: dict[str, dict]) -> dict:
    """row, or the earlier measured row of its run when this call skipped it."""
    return measured.get(row["run"], row) if (row.get("error") or "").startswith("skipped") else row


def writer(a: argparse.Namespace, command: str, planned: set[str]):
    """report(rows): rewrite <out>/multigpu-<tag>.{json,md,png} with these rows and an existing json's rows
    of runs not planned now (their commands joined with '; '), the comparisons redone over all. A run this
    call skipped (budget spent) keeps the existing json's measured row of the same name."""
    files = {ext: a.out / f"multigpu-{a.tag}.{ext}" for ext in ("json", "md", "png")}
    old = json.loads(files["json"].read_text()) if files["json"].exists() else {"rows": []}
    kept = [r for r in old["rows"] if r["run"] not in planned]
    measured = {r["run"]: r for r in old["rows"] if not r.get("error")}
    device = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu (gloo)"

    def report(rows: list[dict]) -> None:
        rows = kept + [_kept_if_skipped(r, measured) for r in rows]
        reused = any(r is measured.get(r["run"]) for r in rows)
        doc = {"kind": a.tag, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
               "command": "; ".join(([old["command"]] if kept or reused else []) + [command]), "device": device,
               "skip_steps": a.skip_steps, "rows": compare(rows)}
        files["json"].write_text(json.dumps(doc, indent=1))
        files["md"].write_text(markdown(doc))
        plot(doc, files["png"])

    return report


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` ends a run's workers too (launch)
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    data_dir = a.work.parent / "data" / f"{Path(a.corpus).name}-bpe4096"
    t = time.monotonic()
    meta = prepare_corpus(a.corpus, data_dir, vocab_size=4096)  # once, before the runs
    print(f"corpus {a.corpus}: {meta['train_tokens']} train / {meta['val_tokens']} val tokens "
          f"({time.monotonic() - t:.0f} s) in {data_dir}", flush=True)
    plans = {"fsdp": plan_fsdp, "cp_exact": plan_cp_exact, "cp_long": plan_cp_long}
    wanted = set(a.parts) | ({"cp_exact", "cp_long"} if "cp" in a.parts else set())
    runs = [run for part, plan in plans.items() if part in wanted for run in plan(a, data_dir)]
    command = " ".join(["python benchmarks/experiments/run_multigpu.py", *(sys.argv[1:] if argv is None else argv)])
    execute(runs, a, meta, writer(a, command, {run.name for run in runs}))
    print(f"wrote {a.out / f'multigpu-{a.tag}'}.{{json,md,png}} ({time.monotonic() - T0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
