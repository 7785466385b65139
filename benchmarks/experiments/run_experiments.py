"""All experiments on one machine, within a wall-clock budget (the GPU run):

  1. the MQAR sweep (`loglinear mqar --preset gpu`: seq 256, 4-64 KV pairs, widths 16/32/64, seeds x
     learning rates), many small runs packed concurrently in worker processes, no run started after its
     budget, runs still training 60 s later stopped and evaluated;
  2. the language models (--archs; default all five: LL Mamba-2, Mamba-2, LL GDN, GDN, Transformer) trained
     concurrently, spread over the visible GPUs, on the Python standard library's source with the SAME token
     budget: a probe of --probe-steps steps (which
     also pays Triton's compilation), then the step budget that lets the slowest model finish before the
     deadline, continued from the probe's checkpoint (exact resume: identical to one run of that length);
  3. evaluation of them, concurrently: per-position loss on long windows, needle-in-a-haystack.

Writes <out>/{mqar,lm,niah}-<tag>.{json,md,png}, the runs' metrics, and <out>/results.tar.gz of them all.
--merge keeps the lm / niah rows of an earlier call's <out> for the models this call has no result for (the step
count is set by a call's slowest model, so fast and slow models can train in separate calls; the table then
says that the token counts differ).

    python benchmarks/experiments/run_experiments.py --out runs/exp --tag h200 --budget 320
    python benchmarks/experiments/run_experiments.py --smoke --out runs/exp-smoke --tag cpu   # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from loglinear.data.text import prepare_corpus  # noqa: E402
from loglinear.eval.command import lm_report, niah_report  # noqa: E402
from loglinear.train.mqar import slot_device  # noqa: E402

LM_ARCHS = ["ll_mamba2", "mamba2", "ll_gated_deltanet", "gated_deltanet", "transformer"]
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def cli(*args: str, log_to: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "loglinear.cli", *args], env=env, cwd=ROOT,
                            stdout=log_to.open("a"), stderr=subprocess.STDOUT)


def wait_all(procs: dict[str, subprocess.Popen], what: str, deadline: float | None = None) -> list[str]:
    """Wait (ending at the monotonic deadline the processes still running); return the names that failed."""
    failed = []
    for name, p in procs.items():
        try:
            code = p.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
            code = p.wait()
            log(f"{what}: {name} stopped at the deadline")
        if code != 0:
            failed.append(name)
    log(f"{what}: done" + (f", FAILED: {failed}" if failed else ""))
    return failed


def merged(rows: list[dict], path: Path) -> list[dict]:
    """rows plus those of an earlier call's json at path for the models rows has none of, in LM_ARCHS order
    (stable: a model's rows keep their order)."""
    have = {r["arch"] for r in rows}
    old = [r for r in json.loads(path.read_text()) if r["arch"] not in have] if path.exists() else []
    return sorted(old + rows, key=lambda r: LM_ARCHS.index(r["arch"]))


def sec_per_step(run_dir: Path) -> float:
    """Seconds per step between the last two metric lines of a run (after compilation)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "elapsed_s" in r]
    a, b = rows[-2], rows[-1]
    return (b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="h200")
    p.add_argument("--budget", type=float, default=320, help="wall-clock seconds for everything")
    p.add_argument("--device", default="cuda")
    p.add_argument("--corpus", default="python", help="'python' (stdlib + installed packages), 'stdlib' or a folder")
    p.add_argument("--data-dir", default=None, help="default: runs/data/<corpus>-bpe4096")
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0, help="the trainers' seed (initialisation and data order)")
    p.add_argument("--probe-steps", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--needle-rate", type=float, default=0.1)
    p.add_argument("--eval-len", type=int, default=16384)
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--niah-lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--niah-depths", nargs="+", type=float, default=[0.0, 0.5, 1.0])
    p.add_argument("--niah-samples", type=int, default=4)
    p.add_argument("--eval-seconds", type=float, default=55, help="time kept for evaluation at the end")
    p.add_argument("--mqar-workers", type=int, default=8, help="MQAR runs at once (beside the LM trainers)")
    p.add_argument("--mqar-args", default="--preset gpu", help="arguments of the `loglinear mqar` sweep")
    p.add_argument("--archs", nargs="+", default=LM_ARCHS, choices=LM_ARCHS,
                   help="the language models (fewer per call: more tokens each)")
    p.add_argument("--no-mqar", action="store_true", help="language models only")
    p.add_argument("--merge", action="store_true", help="keep an earlier call's lm / niah rows of other models")
    p.add_argument("--smoke", action="store_true", help="tiny sizes for a CPU check of the whole pipeline")
    a = p.parse_args()
    if a.smoke:
        a.device, a.d_model, a.layers, a.seq_len, a.global_batch, a.max_steps = "cpu", 32, 1, 128, 2, 12
        a.probe_steps, a.eval_len, a.eval_windows, a.niah_lengths, a.niah_samples = 4, 256, 2, [256], 1
        a.niah_depths = [0.5]
        a.mqar_workers, a.eval_seconds, a.corpus = 2, 20, "stdlib"
        a.mqar_args = ("--widths 16 --seeds 0 --lrs 3e-3 --seq-len 32 --kv-pairs 4 --vocab-size 64 "
                       "--train-examples 128 --test-examples 32 --epochs 1 --batch-size 32 "
                       "--archs transformer ll_mamba2")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    end = T0 + a.budget
    train_end = end - a.eval_seconds

    mqar = None if a.no_mqar else cli("mqar", *a.mqar_args.split(), "--device", a.device,
               "--workers", str(a.mqar_workers), "--budget", str(max(10, train_end - 100 - time.monotonic())),
               "--grace", "60", "--out", str(out / f"mqar-{a.tag}"), log_to=logs / "mqar.log")
    log("mqar sweep " + ("skipped" if mqar is None else "started"))

    a.data_dir = str(ROOT / (a.data_dir or f"runs/data/{Path(a.corpus).name}-bpe4096"))  # trainers run in ROOT
    meta = prepare_corpus(a.corpus, a.data_dir, vocab_size=4096)  # once, before the trainers start
    log(f"corpus: {meta['train_tokens'] / 1e6:.1f}M train / {meta['val_tokens'] / 1e6:.2f}M val tokens")
    common = ["--d-model", str(a.d_model), "--layers", str(a.layers), "--seq-len", str(a.seq_len),
              "--global-batch", str(a.global_batch), "--lr", str(a.lr), "--seed", str(a.seed),
              "--warmup", str(2 * a.probe_steps),
              "--needle-rate", str(a.needle_rate), "--corpus", a.corpus, "--data-dir", a.data_dir,
              "--log-every", str(a.probe_steps // 2), "--eval-batches", "2", "--no-progress"]
    runs = {arch: out / "lm" / arch for arch in a.archs}
    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    device = {arch: slot_device(a.device, i, gpus) for i, arch in enumerate(a.archs)}  # spread over the GPUs
    probe = {arch: cli("train", "--arch", arch, "--out-dir", str(d), "--overwrite", "--steps", str(a.max_steps),
                       "--stop-after", str(a.probe_steps), "--device", device[arch], *common,
                       log_to=logs / f"train-{arch}.log")
             for arch, d in runs.items()}
    failed = wait_all(probe, "LM probe")
    alive = {k: v for k, v in runs.items() if k not in failed}
    if not alive:
        raise SystemExit("every LM probe failed; see the logs")
    rates = {arch: sec_per_step(d) for arch, d in alive.items()}
    left = train_end - time.monotonic() - 15  # restart: imports, model build, checkpoint load
    # 0.85: the probe's rates are noisy; --max-seconds below ends a slower run at the deadline anyway
    steps = int(min(a.max_steps, max(a.probe_steps + 1, a.probe_steps + 0.85 * left / max(rates.values()))))
    log(f"LM s/step under load: { {k: round(v, 3) for k, v in rates.items()} } -> {steps} steps each "
        f"({steps * a.global_batch * a.seq_len / 1e6:.1f}M tokens)")
    budget = str(max(1.0, train_end - time.monotonic() - 15))
    main_runs = {arch: cli("train", "--arch", arch, "--out-dir", str(d), "--steps", str(steps), "--resume",
                           "--max-seconds", budget, "--device", device[arch], *common,
                           log_to=logs / f"train-{arch}.log")
                 for arch, d in alive.items()}
    failed += wait_all(main_runs, "LM training")
    alive = {k: v for k, v in runs.items() if k not in failed}

    evals = {arch: cli("eval", str(d), "--eval-len", str(a.eval_len), "--windows", str(a.eval_windows),
                       "--batch-size", "2", "--smooth", "64", "--niah-lengths", *map(str, a.niah_lengths),
                       "--niah-depths", *map(str, a.niah_depths),
                       "--niah-samples", str(a.niah_samples), "--device", device[arch],
                       "--out", str(out / "eval" / arch),
                       "--tag", a.tag, log_to=logs / f"eval-{arch}.log") for arch, d in alive.items()}
    failed += wait_all(evals, "LM eval", deadline=end - 10)
    records, niah = [], []
    for arch in alive:
        if arch not in failed:
            records += json.loads((out / "eval" / arch / f"lm-{a.tag}.json").read_text())
            niah += json.loads((out / "eval" / arch / f"niah-{a.tag}.json").read_text())
    if a.merge:
        records, niah = merged(records, out / f"lm-{a.tag}.json"), merged(niah, out / f"niah-{a.tag}.json")
    if records:
        print(lm_report(records, out / f"lm-{a.tag}", f"Language modelling, {a.corpus} corpus ({a.tag})"))
        print(niah_report(niah, out / f"niah-{a.tag}", f"Needle in a haystack ({a.tag})"))
    try:
        if mqar is not None:
            log(f"mqar: done (exit {mqar.wait(timeout=max(1.0, end - time.monotonic()))})")
    except subprocess.TimeoutExpired:
        mqar.terminate()
        log("mqar: stopped at the budget; its report holds the runs finished so far")
    mqar_md = out / f"mqar-{a.tag}.md"
    if mqar is not None and mqar_md.exists():
        print(mqar_md.read_text())
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        for f in sorted(out.glob(f"*-{a.tag}.*")) + sorted(out.glob("lm/*/metrics.jsonl")) + \
                sorted(out.glob("lm/*/train_config.json")) + sorted(logs.glob("*.log")):
            tar.add(f, arcname=str(f.relative_to(out)))
    log(f"done; failed: {failed or 'none'}")


if __name__ == "__main__":
    main()
