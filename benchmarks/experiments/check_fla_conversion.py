"""fla checkpoints converted by ``loglinear convert`` against fla's own models on a GPU (fla's CUDA paths).

    python benchmarks/experiments/check_fla_conversion.py            # one GPU, about a minute after compiles

Builds a random fla GatedDeltaNetForCausalLM, Mamba2ForCausalLM (one q/k group) and LogLinearMamba2ForCausalLM
(two q/k groups), each with its weights moved off their init, saves it, converts it, and compares the logits of
fla's model and ours (both on the GPU, float32: fla's chunked kernels past 64 tokens, ours on our kernels) at each
--T; both are also compared with our converted model in float64 (the torch path), which says which side a
difference comes from. Writes <out>/convert-fla-<gpu>.{json,md} with the command, versions and date. On the CPU
the same conversions are tested by tests/models/test_convert_fla.py (fla's kernels under the Triton interpreter).

fla's Triton kernels leave the precision of their float32 dot products to Triton's default, TF32 on NVIDIA GPUs
(about 1e-3 relative), so this script sets TRITON_F32_DEFAULT=ieee unless it is set: both models then compute in
full float32 and the comparison measures the conversion, not TF32 rounding.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # before any kernel compiles

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loglinear.models.convert import convert  # noqa: E402
from loglinear.report import machine_name, markdown_table, write_json  # noqa: E402

SHAPE = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=2)


def fla_models() -> dict[str, object]:
    """name -> a fresh random fla model (float32, on the GPU)."""
    import fla.models as fla

    mamba = dict(num_heads=8, head_dim=64, state_size=64, fuse_cross_entropy=False)
    return {
        "gated_deltanet": fla.GatedDeltaNetForCausalLM(fla.GatedDeltaNetConfig(
            **SHAPE, num_heads=4, head_dim=64, expand_v=2.0, fuse_cross_entropy=False)),
        # one group: without mamba_ssm installed fla runs its torch path, which maps heads to groups as h % G
        # (its CUDA kernels, like ours, as h // (H / G))
        "mamba2": fla.Mamba2ForCausalLM(fla.Mamba2Config(**SHAPE, **mamba, n_groups=1, chunk_size=64, norm_eps=1e-6)),
        "log_linear_mamba2": fla.LogLinearMamba2ForCausalLM(fla.LogLinearMamba2Config(**SHAPE, **mamba, n_groups=2)),
    }


def check(name: str, model: torch.nn.Module, lengths: list[int], work: Path) -> list[dict]:
    """Save the model (weights perturbed), convert it, and compare logits at each length."""
    from transformers import AutoModelForCausalLM

    model = model.cuda().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(work / name)
    target = convert(work / name, work / f"{name}-ours")
    ours = AutoModelForCausalLM.from_pretrained(work / f"{name}-ours").cuda().eval()
    exact = AutoModelForCausalLM.from_pretrained(work / f"{name}-ours").cuda().double().eval()  # torch path, fp64
    rows = []
    for T in lengths:
        ids = torch.randint(0, SHAPE["vocab_size"], (2, T), device="cuda")
        with torch.no_grad():
            theirs, mine, ref = model(ids).logits.float(), ours(ids).logits.float(), exact(ids).logits
        rows.append({"fla model": name, "ours": target, "T": T, "relative logit error": relative(theirs, mine),
                     "fla vs ours in float64": relative(theirs, ref), "ours vs ours in float64": relative(mine, ref)})
        print(rows[-1], flush=True)
    return rows


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (in float64)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[64, 1000], help="sequence lengths to compare at")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"), help="result folder")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_fla_conversion.py needs a GPU (fla's models run their CUDA paths); on the CPU run "
              "tests/models/test_convert_fla.py", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in fla_models().items():
            rows += check(name, model, args.T, Path(tmp))
    import fla
    import transformers
    import triton

    gpu = machine_name()
    command = "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))
    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "fla": getattr(fla, "__version__", "?"),
            "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "command": command,
            "TRITON_F32_DEFAULT": os.environ["TRITON_F32_DEFAULT"]}
    out = Path(args.out) / f"convert-fla-{gpu}"
    write_json(out.with_suffix(".json"), {**meta, "rows": rows})
    table = markdown_table(list(rows[0]), [[f"{x:.2e}" if isinstance(x, float) else x for x in r.values()]
                                           for r in rows])
    out.with_suffix(".md").write_text(
        f"# fla checkpoints converted, against fla's models ({gpu})\n\n"
        f"torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, fla {meta['fla']}, "
        f"{meta['date']}; `{command}` (TRITON_F32_DEFAULT={meta['TRITON_F32_DEFAULT']})\n\n"
        f"{SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, random weights moved off their init, "
        "float32, batch 2.\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
