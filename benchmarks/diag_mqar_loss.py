"""Diagnosis: one MQAR run with its loss printed every N steps, on any device and backend.

Session 11's GPU sweep left every recurrent model at ln(V/2) (no learning) and the GDN runs at d = 16 at NaN,
while the same LL GDN run learns on the CPU with the torch path. Run it per backend and precision:

    python benchmarks/diag_mqar_loss.py --archs ll_gated_deltanet --widths 16 --lrs 3e-3 --device cpu
    LOGLINEAR_BACKEND=torch  python benchmarks/diag_mqar_loss.py --archs ll_gated_deltanet --widths 16 --lrs 3e-3
    LOGLINEAR_BACKEND=triton python benchmarks/diag_mqar_loss.py --archs ll_gated_deltanet --widths 16 --lrs 3e-3

Takes `loglinear mqar`'s arguments, defaulting to the GPU sweep's (`--preset gpu`, mqar.GPU_SWEEP_ARGS: seq 256,
4-64 KV pairs, vocab 8192, 100K examples, batch 256, a step cap, the test set checked every --eval-every steps
with early stop, chunk 64), and runs the first arch, width, seed and lr given. bf16 autocast on CUDA (as the
sweep), off with --fp32. Stops at the first non-finite loss and says where; prints the periodic test accuracies.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loglinear.train.mqar import GPU_SWEEP_ARGS, add_arguments, base_run, train_mqar  # noqa: E402


class NonFinite(Exception):
    pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--every", type=int, default=100, help="print the loss every this many steps")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast on CUDA")
    a = p.parse_args(GPU_SWEEP_ARGS.split() + sys.argv[1:])
    run = replace(base_run(a), arch=a.archs[0], d_model=a.widths[0], seed=a.seeds[0], lr=a.lrs[0], bf16=not a.fp32)
    t0 = time.perf_counter()

    def on_step(step: int, loss: torch.Tensor) -> None:
        if step % a.every == 0 or step == 1:
            value = float(loss)
            print(f"step {step}: loss {value:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            if not math.isfinite(value):
                raise NonFinite(f"non-finite loss at step {step} (first seen within the last {a.every} steps)")

    try:
        row = train_mqar(run, on_step=on_step)
    except NonFinite as e:
        raise SystemExit(str(e)) from None
    print(f"test accuracy at steps {row['evals']}")
    print(f"accuracy {row['accuracy']:.4f} (by KV pairs {row['accuracy_by_kv']}), final loss {row['final_loss']:.4f}, "
          f"{row['steps']} steps (stopped: {row['stopped']}), {row['seconds']} s")


if __name__ == "__main__":
    main()
