"""Op benchmark: log-linear Mamba-2 (ours) against fla's log-linear op, fla's linear Mamba-2 and SDPA flash.

Rows: loglinear (our kernels), loglinear_plain (our plain op, level_scales=None: the one-level path),
loglinear_state (our kernels continuing an incoming state at position T, as a context-parallel rank does: the
state from T tokens of the same kind, its gradient taken too), loglinear_state_inside (the same from a state at
T - 24, inside a chunk: a split that is not a multiple of the chunk, a chunked prefill; only when named),
loglinear_packed (the same tokens as 8 packed sequences per row, cu_seqlens; only when named), loglinear_fp32 (our
kernels on the same inputs in fp32: what an fp32 call costs against the bf16 one; only when named),
loglinear_torch (our torch chunk path, only when named), fla_log_linear, fla_mamba2 / fla_gdn, sdpa_flash.

    python benchmarks/bench_ops.py                       # paper setting, all impls, T = 2K..128K
    python benchmarks/bench_ops.py --T 4096 8192 --impls loglinear fla_mamba2
    python benchmarks/bench_ops.py --check               # also: kernels vs the torch chunk path (fp32), 2^20 tokens
    python benchmarks/bench_ops.py --impls loglinear loglinear_state --name ops-mamba2-state   # incoming-state cost
    python benchmarks/bench_ops.py --impls loglinear loglinear_state loglinear_state_inside --name ops-mamba2-state
    python benchmarks/bench_ops.py --variant gdn --impls loglinear loglinear_packed --name ops-gdn-packed
    python benchmarks/bench_ops.py --T 4096 2048 --merge   # re-measure two T, keep the file's other rows
    python benchmarks/bench_ops.py --impls loglinear loglinear_fp32 --T 32768 8192 --name ops-mamba2-fp32
    python benchmarks/bench_ops.py --impls loglinear --chunk-size 32 --name ops-mamba2-c32   # another chunk size

Paper setting: B = 2, 48 value heads, one q/k group, K = 128, V = 64, bf16. Forward and forward+backward
medians (triton.testing.do_bench) and the peak memory of one forward+backward, all impls in one process
on one GPU. Writes benchmarks/results/ops-mamba2-<gpu>.{json,md,png}; --check writes the variant's section of
correctness-<gpu>.log (the other variant's section is kept).

--variant gdn: log-linear Gated DeltaNet (ours, use_qk_l2norm) against fla `chunk_gated_delta_rule` (linear GDN,
"fla_gdn", q/k L2-normalised in its kernel) and SDPA flash; beta in [0.05, 0.95]. Writes ops-gdn-<gpu>.*.
--variant gla: log-linear GLA (a decay per key channel: the Mamba-2 kernels with their per-channel switch) against
fla `chunk_gla` (linear GLA, "fla_gla") and SDPA flash; g = logsigmoid(N(0, 1)) / 16 per channel, fla's GLA gate.
Writes ops-gla-<gpu>.*.

fla 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1 (a correctness guard in
fla/ops/common/chunk_o.py); --lift-fla-guard (on by default) lifts it for timing only and the results say so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loglinear import FenwickState, log_linear_gated_deltanet, log_linear_gla, log_linear_mamba2  # noqa: E402
from loglinear.cli import check_script_options, refuse  # noqa: E402
from loglinear.fenwick import levels_needed  # noqa: E402
from loglinear.report import machine_name, pyplot  # noqa: E402

OURS = ("loglinear", "loglinear_plain", "loglinear_state", "loglinear_state_inside", "loglinear_packed",
        "loglinear_fp32")
IMPLS = (*OURS, "loglinear_torch", "fla_log_linear", "fla_mamba2", "sdpa_flash")
IMPLS_GDN = (*OURS, "loglinear_torch", "fla_gdn", "sdpa_flash")
IMPLS_GLA = (*OURS, "fla_gla", "sdpa_flash")
# run only when --impls names them
NAMED_ONLY = ("loglinear_torch", "loglinear_state_inside", "loglinear_packed", "loglinear_fp32")
PACKED = 8  # loglinear_packed: sequences per row
INSIDE = 24  # loglinear_state_inside: the state's position T - INSIDE, inside a 64-token chunk
OUR_BACKENDS = {**{impl: "triton" for impl in OURS}, "loglinear_torch": "torch"}  # -> backend=
PAPER = dict(B=2, H=48, G=1, K=128, V=64)
SHAPE = dict(PAPER)  # what measure() runs: the paper setting unless --shape
OURS_KW: dict = {}  # options of our ops from the command line (--chunk-size), on every row of ours


def make_inputs(T: int, B: int, H: int, G: int, K: int, V: int, dtype: torch.dtype, seed: int = 0,
                device: str = "cuda") -> dict:
    """Fresh random inputs (never zeros): q, k [B, T, G, K] (k unit-ish norm), v [B, T, H, V], g < 0, lambda > 0."""
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=gen)
    L = levels_needed(T)
    return {
        "q": torch.randn(B, T, G, K, **kw).to(dtype),
        "k": (torch.randn(B, T, G, K, **kw) / math.sqrt(K)).to(dtype),
        "v": torch.randn(B, T, H, V, **kw).to(dtype),
        "g": -(0.01 + 0.1 * torch.rand(B, T, H, **kw)),
        "level_scales": (0.2 + torch.rand(B, T, H, L, **kw)).to(dtype),
    }


def widened(x: dict, end: int) -> dict:
    """x with lambda [B, T, H, L] widened to the levels of positions up to ``end`` (its top level repeated)."""
    lam = x["level_scales"]
    return {**x, "level_scales": torch.cat([lam] + [lam[..., -1:]] * (levels_needed(end) - lam.shape[-1]), -1)}


def continued(x: dict, op: Callable, short: int = 0, **kw) -> tuple[dict, FenwickState]:
    """x as the continuation of T - short tokens of its own kind: the state the op leaves after x's first T - short
    tokens (positions T - short, a leaf that takes a gradient) and lambda widened to the levels of positions up to 2T
    (its top level repeated)."""
    with torch.no_grad():
        _, state = op(**{n: t[:, : t.shape[1] - short] for n, t in x.items()}, output_final_state=True, **kw)
    return widened(x, 2 * x["q"].shape[1]), FenwickState(state.levels, state.positions)


def lift_fla_guard() -> None:
    """Timing only: let fla run its gated backward on Hopper with triton < 3.7.1."""
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True


Built = tuple[Callable[[], torch.Tensor], list[torch.Tensor]]  # the forward closure, the leaves needing gradients


def ours(impl: str, op: Callable, x: dict, names: tuple[str, ...], **kw) -> Built:
    """Our op on x's tensors ``names`` and level_scales (None for loglinear_plain) on the impl's backend;
    loglinear_state continues the state the op leaves after x (``continued``), whose levels are a leaf too;
    loglinear_state_inside the state after x's first T - INSIDE tokens; loglinear_packed runs x's rows as PACKED
    sequences each, packed into one row (cu_seqlens); loglinear_fp32 runs x in fp32. kw: the op's options, with
    OURS_KW's."""
    kw = {**kw, **OURS_KW}
    x, state = (x, None)
    if impl == "loglinear_fp32":
        x = {n: t.float() for n, t in x.items()}
    if impl in ("loglinear_state", "loglinear_state_inside"):
        x, state = continued(x, op, INSIDE if impl == "loglinear_state_inside" else 0, **kw)
    if impl == "loglinear_packed":
        B, T = x["q"].shape[:2]
        x = {n: t.reshape(1, B * T, *t.shape[2:]) for n, t in x.items()}
        kw["cu_seqlens"] = torch.linspace(0, B * T, B * PACKED + 1, device=x["q"].device).round().long()
    args = [x[n] for n in names]
    lam = x["level_scales"] if impl != "loglinear_plain" else None
    backend = OUR_BACKENDS[impl]
    leaves = args + ([lam] if lam is not None else []) + ([state.levels] if state is not None else [])
    return (lambda: op(*args, lam, initial_state=state, backend=backend, **kw)[0]), leaves


def heads_qk(x: dict, H: int, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [B, T, G, K] repeated to the H value heads, as fla's ops take them: [B, T, H, K] each."""
    return tuple(x[n].repeat_interleave(H // G, dim=2).contiguous() for n in ("q", "k"))


def build(impl: str, x: dict, H: int, G: int) -> Built:
    """The forward closure of an impl and the leaf tensors that need gradients."""
    if impl in OUR_BACKENDS:
        return ours(impl, log_linear_mamba2, x, ("q", "k", "v", "g"))
    if impl == "fla_log_linear":
        from fla.ops.log_linear_attn import chunk_log_linear_attn

        args = [x["q"], x["k"], x["v"], x["g"], x["level_scales"]]
        return (lambda: chunk_log_linear_attn(*args, scale=None)[0]), args
    if impl == "fla_mamba2":
        from fla.ops.simple_gla import chunk_simple_gla

        q, k = heads_qk(x, H, G)
        args = [q, k, x["v"], x["g"]]
        return (lambda: chunk_simple_gla(*args, scale=None)[0]), args
    if impl == "sdpa_flash":
        B, T, _, V = x["v"].shape
        qkv = [torch.randn(B, H, T, V, device=x["v"].device, dtype=x["v"].dtype) for _ in range(3)]

        def run():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(*qkv, is_causal=True)

        return run, qkv
    raise ValueError(f"unknown impl {impl!r}, expected one of {IMPLS}")


def gdn_inputs(T: int, B: int, H: int, G: int, K: int, V: int, dtype: torch.dtype, seed: int = 0,
               device: str = "cuda") -> dict:
    """make_inputs plus beta [B, T, H] in [0.05, 0.95] (never zeros)."""
    x = make_inputs(T, B, H, G, K, V, dtype, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x["beta"] = (0.05 + 0.9 * torch.rand(B, T, H, device=device, generator=gen)).to(dtype)
    return x


def build_gdn(impl: str, x: dict, H: int, G: int) -> Built:
    """build() for --variant gdn: ours, fla's linear chunk_gated_delta_rule, or SDPA flash."""
    if impl in OUR_BACKENDS:
        return ours(impl, log_linear_gated_deltanet, x, ("q", "k", "v", "g", "beta"), use_qk_l2norm=True)
    if impl == "fla_gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        q, k = heads_qk(x, H, G)
        args = [q, k, x["v"], x["g"], x["beta"]]
        return (lambda: chunk_gated_delta_rule(*args, scale=None, use_qk_l2norm_in_kernel=True)[0]), args
    if impl == "sdpa_flash":
        return build(impl, x, H, G)
    raise ValueError(f"unknown impl {impl!r}, expected one of {IMPLS_GDN}")


def gla_inputs(T: int, B: int, H: int, G: int, K: int, V: int, dtype: torch.dtype, seed: int = 0,
               device: str = "cuda") -> dict:
    """make_inputs with g [B, T, H, K] = logsigmoid(N(0, 1)) / 16: fla's GLA gate, one log-decay per key channel."""
    x = make_inputs(T, B, H, G, K, V, dtype, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    x["g"] = F.logsigmoid(torch.randn(B, T, H, K, device=device, generator=gen)) / 16
    return x


def build_gla(impl: str, x: dict, H: int, G: int) -> Built:
    """build() for --variant gla: ours, fla's linear chunk_gla, or SDPA flash."""
    if impl in OUR_BACKENDS:
        return ours(impl, log_linear_gla, x, ("q", "k", "v", "g"))
    if impl == "fla_gla":
        from fla.ops.gla import chunk_gla

        q, k = heads_qk(x, H, G)
        args = [q, k, x["v"], x["g"]]
        return (lambda: chunk_gla(*args, scale=None)[0]), args
    if impl == "sdpa_flash":
        return build(impl, x, H, G)
    raise ValueError(f"unknown impl {impl!r}, expected one of {IMPLS_GLA}")


@dataclass(frozen=True)
class OpBench:
    """One variant's op benchmark: its rows, inputs, closures, fla's linear baseline, its gates in words, and our op
    with the options the benchmark calls it with (the checks' too)."""

    title: str
    impls: tuple[str, ...]
    inputs: Callable[..., dict]  # (T, B, H, G, K, V, dtype, seed=0, device="cuda") -> dict
    build: Callable[[str, dict, int, int], Built]  # (impl, inputs, H, G)
    linear: str
    gates: str
    op: Callable
    op_kw: dict = field(default_factory=dict)


BENCHES = {
    "mamba2": OpBench("log-linear Mamba-2", IMPLS, make_inputs, build, "fla_mamba2", "g = -(0.01..0.11)",
                      log_linear_mamba2),
    "gdn": OpBench("log-linear Gated DeltaNet", IMPLS_GDN, gdn_inputs, build_gdn, "fla_gdn",
                   "g = -(0.01..0.11); beta in [0.05, 0.95], q/k L2-normalised inside the ops",
                   log_linear_gated_deltanet, {"use_qk_l2norm": True}),
    "gla": OpBench("log-linear GLA", IMPLS_GLA, gla_inputs, build_gla, "fla_gla",
                   "g = logsigmoid(N(0, 1)) / 16 per key channel (fla's GLA gate)", log_linear_gla),
}


def settle(fn: Callable[[], object], calls: int = 12) -> None:
    """Run fn `calls` times before timing: on an H200 the first ~8 calls at a fresh shape took several times
    longer than the rest, which a short do_bench warmup does not absorb."""
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()


def measure(impl: str, T: int, dtype: torch.dtype, warmup: int, rep: int, variant: str = "mamba2") -> dict:
    """fwd_ms, fwdbwd_ms (medians), peak_gib of one forward+backward and alloc_retries: how often the caching
    allocator found no free block during the forward+backward timing and released its cache to retry (memory near
    the card's capacity; each retry synchronizes and costs time that is not the op's)."""
    p, bench = SHAPE, BENCHES[variant]
    x = bench.inputs(T, p["B"], p["H"], p["G"], p["K"], p["V"], dtype)
    fn, leaves = bench.build(impl, x, p["H"], p["G"])
    for t in leaves:
        t.requires_grad_(True)
    with torch.no_grad():
        settle(fn)
        fwd = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    out = fn()
    grad = torch.randn_like(out)
    del out

    def step():
        fn().backward(grad)

    settle(step)
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    fwdbwd = triton.testing.do_bench(step, warmup=warmup, rep=rep, grad_to_none=leaves, return_mode="median")
    torch.cuda.synchronize()
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    return {"impl": impl, "T": T, "fwd_ms": round(fwd, 4), "fwdbwd_ms": round(fwdbwd, 4), "peak_gib": round(peak, 3),
            "alloc_retries": retries}


def write_section(path: Path, variant: str, lines: list[str]) -> None:
    """Replace the ``## <variant>`` section of path (a log with one section per variant) by lines."""
    sections = {}
    if path.exists():
        for block in path.read_text().split("\n## ")[1:]:
            name, _, body = block.partition("\n")
            sections[name] = body
    sections[variant] = "\n".join(lines) + "\n"
    path.write_text("".join(f"\n## {name}\n{body}" for name, body in sorted(sections.items())))


def write_results(rows: list[dict], meta: dict, out: Path, variant: str = "mamba2") -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    Ts = sorted({r["T"] for r in rows})
    bench = BENCHES[variant]
    impls = [i for i in bench.impls if any(r["impl"] == i for r in rows)]
    cell = {(r["impl"], r["T"]): r for r in rows}
    name, linear = bench.title, bench.linear
    ratios = [("loglinear", linear), ("loglinear_plain", linear), ("loglinear", "loglinear_plain"),
              ("loglinear_state", "loglinear"), ("loglinear_state_inside", "loglinear"),
              ("loglinear_packed", "loglinear"), ("loglinear_fp32", "loglinear"), ("loglinear", "fla_log_linear"),
              ("loglinear", "sdpa_flash")]
    runs = meta.get("runs", [])
    when = (f"{meta['date']}; `{meta['command']}`" if len(runs) < 2 else
            "; ".join(f"rows at {', '.join(f'{t // 1024}K' for t in r['T'])}: {r['date']}, `{r['command']}`"
                      for r in runs))
    lines = [f"# Op benchmark, {name} ({meta['gpu']})", "", f"torch {meta['torch']}, triton {meta['triton']}, {when}",
             "", meta["setting"], "", f"{meta['notes']} PYTORCH_CUDA_ALLOC_CONF: {meta.get('allocator', 'unset')}.", ""]
    if meta.get("missing"):
        lines += ["Not measured: " + "; ".join(meta["missing"]) + ".", ""]
    for key, title in (("fwdbwd_ms", "forward+backward, ms (median)"), ("fwd_ms", "forward, ms (median)"),
                       ("peak_gib", "peak memory of one forward+backward, GiB")):
        lines += [f"## {title}", "", "| impl | " + " | ".join(f"{t // 1024}K" for t in Ts) + " |",
                  "|---" * (len(Ts) + 1) + "|"]
        for i in impls:
            vals = [cell.get((i, t), {}).get(key) for t in Ts]
            lines.append(f"| {i} | " + " | ".join("—" if v is None else f"{v:g}" for v in vals) + " |")
        lines.append("")
    retried = [f"{r['impl']} at {r['T'] // 1024}K: {r['alloc_retries']}" for r in rows if r.get("alloc_retries")]
    if retried:
        lines += ["Caching-allocator retries during the forward+backward timing (memory near the card's capacity: "
                  "the allocator released its cache and retried, which synchronizes; the row's time includes it): "
                  + "; ".join(retried) + ".", ""]
    ratios = [(a, b) for a, b in ratios if a in impls and b in impls]
    if ratios:
        lines += ["## ratios (forward+backward)", "", "| T | " + " | ".join(f"{a} / {b}" for a, b in ratios) + " |",
                  "|---" * (len(ratios) + 1) + "|"]
        for t in Ts:
            ratio = lambda a, b: (  # noqa: E731
                f"{cell[(a, t)]['fwdbwd_ms'] / cell[(b, t)]['fwdbwd_ms']:.2f}"
                if cell.get((a, t), {}).get("fwdbwd_ms") and cell.get((b, t), {}).get("fwdbwd_ms") else "—"
            )
            lines.append(f"| {t // 1024}K | " + " | ".join(ratio(a, b) for a, b in ratios) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key in zip(axes, ("fwd_ms", "fwdbwd_ms")):
        for i in impls:
            pts = sorted((r["T"], r[key]) for r in rows if r["impl"] == i and r.get(key))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=i)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("ms")
        ax.set_title(key.replace("_ms", "").replace("fwdbwd", "forward+backward").replace("fwd", "forward"))
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # (a file written before any row has none)
            ax.legend()
    fig.suptitle(f"{name} ops, B={SHAPE['B']} H={SHAPE['H']} G={SHAPE['G']} K={SHAPE['K']} V={SHAPE['V']} bf16, "
                 f"{meta['gpu']}")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def merge_previous(path: Path, meta: dict, Ts: list[int]) -> list[dict]:
    """--merge: the rows of the result file ``path`` (.json) at the T this run does not measure, so that each T's
    rows come from one run (its ratios compare impls measured together); meta["runs"] gets the runs they came from
    and this one ({date, command, T}). Raises ValueError when the file was measured on another GPU, software or
    setting."""
    runs = [{"date": meta["date"], "command": meta["command"], "T": sorted(Ts)}]
    if not path.exists():
        meta["runs"] = runs
        return []
    old = json.loads(path.read_text())
    old.setdefault("allocator", "unset")  # files from before the allocator was recorded
    differ = [key for key in ("gpu", "torch", "triton", "setting", "notes", "allocator")
              if old.get(key) != meta.get(key, "unset")]
    if differ:
        raise ValueError(f"--merge: {path} was measured with another {', '.join(differ)} "
                         f"({'; '.join(str(old.get(key)) for key in differ)})")
    kept = [r for r in old["rows"] if r["T"] not in Ts]
    kept_T = {r["T"] for r in kept}
    earlier = old.get("runs") or [{"date": old["date"], "command": old["command"],
                                   "T": sorted({r["T"] for r in old["rows"]})}]
    earlier = [dict(r, T=[t for t in r["T"] if t in kept_T]) for r in earlier]
    meta["runs"] = [r for r in earlier if r["T"]] + runs
    return kept


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run_backend(backend: str, x: dict, cot: tuple | None, op: Callable = log_linear_mamba2, **kw) -> tuple:
    """(o, final levels, grads, seconds) of op on one backend; cot = (d_o, d_state) cotangents or None. An
    initial_state in kw is a leaf too (its gradient: grads["state"])."""
    leaves = {n: t.detach().clone().requires_grad_(cot is not None) for n, t in x.items()}
    if kw.get("initial_state") is not None:
        state = kw["initial_state"]
        leaves["state"] = state.levels.detach().clone().requires_grad_(cot is not None)
        kw = {**kw, "initial_state": FenwickState(leaves["state"], state.positions)}
    t0 = time.time()
    o, st = op(**{n: t for n, t in leaves.items() if n != "state"}, output_final_state=True, backend=backend, **kw)
    if cot is not None:
        ((o.float() * cot[0]).sum() + (st.levels * cot[1]).sum()).backward()
    torch.cuda.synchronize()
    return o, st.levels, {n: t.grad for n, t in leaves.items()}, time.time() - t0


def _compare_backends(log: Callable[[str], None], label: str, x: dict, op: Callable = log_linear_mamba2,
                      exact: bool = False, **kw) -> None:
    """Log op's triton-vs-torch relative errors on inputs x: o without gradients (o_nograd: the forward that keeps
    no snapshots), then o, final state, every gradient (same cotangents); exact: the torch path in float64 on the
    same (rounded) inputs, else in its fp32 compute."""
    o, st = op(**x, output_final_state=True, **kw)
    cot = (torch.randn_like(o, dtype=torch.float32), torch.randn_like(st.levels))
    o1, s1, g1, t1 = _run_backend("triton", x, cot, op, **kw)
    if exact:
        x = {n: t.double() for n, t in x.items()}
        cot = tuple(c.double() for c in cot)
        if kw.get("initial_state") is not None:
            kw = {**kw, "initial_state": kw["initial_state"].to(torch.float64)}
    o2, s2, g2, t2 = _run_backend("torch", x, cot, op, **kw)
    errs = {"o_nograd": rel(o, o2), "o": rel(o1, o2), "state": rel(s1, s2), **{f"d{n}": rel(g1[n], g2[n]) for n in g1}}
    log(f"{label}: rel err vs torch chunk path{' (float64)' if exact else ''} "
        + " ".join(f"{k}={v:.2e}" for k, v in errs.items()) + f"  [triton {t1:.2f}s, torch {t2:.2f}s]")


# (K, V) of the MQAR models at d_model 16 and 64 (one head): narrow 16-bit heads once miscomputed on triton 3.6
SMALL_HEADS = {"mamba2": ((64, 32), (64, 128)), "gla": ((64, 32), (64, 128)), "gdn": ((16, 32), (64, 128))}


def check_small_heads(log: Callable[[str], None], variant: str, dtypes: list[torch.dtype]) -> None:
    """Kernels vs the torch chunk path at the MQAR models' shapes (B = 64, T = 256, H = 1): o, state, all grads."""
    bench = BENCHES[variant]
    op, inputs, kw = bench.op, bench.inputs, bench.op_kw
    for dtype in dtypes:
        for K, V in SMALL_HEADS[variant]:
            x = inputs(256, 64, 1, 1, K, V, dtype, seed=K + V)
            _compare_backends(log, f"small heads {variant} {dtype} T=256 B=64 H=1 K={K} V={V}", x, op, **kw)


# (K, V) past the paper's: Mamba-2's dk / dv kernel over an SM's shared memory at two stages (launched at one), values
# in slices (64 x 512; fla's GLA head, 256 x 512; fp32 GLA's dq kernel at one stage), Gated DeltaNet's wide-key chains
WIDE_HEADS = {"mamba2": ((256, 128), (64, 512)), "gla": ((256, 512), (128, 128)), "gdn": ((256, 512), (192, 384))}


def check_wide_heads(log: Callable[[str], None], variant: str, dtypes: list[torch.dtype]) -> None:
    """Kernels vs the torch chunk path at wide heads (WIDE_HEADS; T = 3000, B = 2, H = 4, G = 2): log-linear from a
    state inside a chunk, then plain; o (with and without gradients), state, all gradients."""
    bench = BENCHES[variant]
    for dtype in dtypes:
        for K, V in WIDE_HEADS[variant]:
            shape = f"{variant} {dtype} T=3000 B=2 H=4 G=2 K={K} V={V}"
            x = bench.inputs(3000, 2, 4, 2, K, V, dtype, seed=K + V)
            xs, state = continued(x, bench.op, INSIDE, **bench.op_kw)
            _compare_backends(log, f"wide heads {shape} from a state at T - {INSIDE}", xs, bench.op,
                              initial_state=state, **bench.op_kw)
            x.pop("level_scales")
            _compare_backends(log, f"wide heads plain {shape}", x, bench.op, level_scales=None, **bench.op_kw)


def check_plain(log: Callable[[str], None], variant: str, dtypes: list[torch.dtype]) -> None:
    """The plain path (level_scales=None) vs the torch chunk path in float64 on the same rounded inputs: outputs,
    final states and all gradients at the benchmark's shape, then GQA + varlen + one-level states at unaligned
    positions."""
    p = PAPER
    bench = BENCHES[variant]
    op, inputs, kw = bench.op, bench.inputs, bench.op_kw
    for dtype in dtypes:
        for T, B, H in ((8192, 2, 48), (3000, 1, 8)):
            x = inputs(T, B, H, p["G"], p["K"], p["V"], dtype, seed=T)
            x.pop("level_scales")
            _compare_backends(log, f"plain {variant} {dtype} T={T} B={B} H={H} G=1 K=128 V=64", x, op, exact=True,
                              level_scales=None, **kw)
    for dtype in dtypes:
        x = inputs(4000, 1, 8, 2, p["K"], p["V"], dtype, seed=5)
        x.pop("level_scales")
        state = FenwickState(torch.randn(3, 1, 8, p["K"], p["V"], device="cuda"), torch.tensor([100, 0, 7]))
        _compare_backends(log, f"plain {variant} varlen+state {dtype} T=4000 H=8 G=2 K=128 V=64", x, op,
                          exact=True, level_scales=None, initial_state=state,
                          cu_seqlens=torch.tensor([0, 1000, 2500, 4000], device="cuda"), **kw)


def check_packed_states(log: Callable[[str], None], variant: str, dtype: torch.dtype) -> None:
    """Kernels vs the torch chunk path in float64 (same rounded inputs): four packed sequences (one of a single
    token) continuing the states at positions 100, 37, 7 (inside chunks) and 0 that the op leaves, G = 2 < H = 8."""
    p, bench = PAPER, BENCHES[variant]
    pre = bench.inputs(144, 1, 8, 2, p["K"], p["V"], dtype, seed=12)
    with torch.no_grad():
        _, st = bench.op(**pre, output_final_state=True, cu_seqlens=torch.tensor([0, 100, 137, 144], device="cuda"))
    state = FenwickState(torch.cat([st.levels, torch.zeros_like(st.levels[:1])]), torch.tensor([100, 37, 7, 0]))
    T = 2900
    x = widened(bench.inputs(T, 1, 8, 2, p["K"], p["V"], dtype, seed=13), T + 100)
    cu = torch.tensor([0, 1000, 1001, 2500, T], device="cuda")
    _compare_backends(log, f"{variant} {dtype} packed T={T} (1000 + 1 + 1499 + 400) H=8 G=2 K=128 V=64 from states "
                      "at 100 / 37 / 7 / 0", x, bench.op, exact=True, initial_state=state, cu_seqlens=cu)


def check(log: Callable[[str], None], variant: str, long_T: int, dtypes: list[torch.dtype]) -> None:
    """Kernels vs the torch chunk path (fp32 compute) at benchmark sizes on the same inputs (outputs,
    states and all gradients; from states at a chunk boundary and inside one; packed sequences from states,
    check_packed_states), then a long forward (stability: finite, and vs the torch path). Mamba-2 and GLA
    (the same kernels, a scalar or a per-channel gate)."""
    p, bench = PAPER, BENCHES[variant]
    for dtype in dtypes:
        for T, B, H in ((8192, 2, 48), (3000, 2, 8)):
            x = bench.inputs(T, B, H, p["G"], p["K"], p["V"], dtype, seed=T)
            _compare_backends(log, f"{variant} {dtype} T={T} B={B} H={H} G=1 K=128 V=64", x, bench.op)
            for short in (0, INSIDE) if T == 3000 else (0,):  # a state at a chunk boundary, and inside a chunk
                xs, state = continued(x, bench.op, short)
                _compare_backends(log, f"{variant} {dtype} T={T} B={B} H={H} G=1 K=128 V=64 from a state at "
                                  f"T{f' - {short}' if short else ''}", xs, bench.op, initial_state=state)
        check_packed_states(log, variant, dtype)
    x = bench.inputs(long_T, 1, 2, 1, 64, 64, torch.float32, seed=1)
    x["g"] = -(0.001 + 0.2 * torch.rand_like(x["g"]))
    o_ref, s_ref, _, _ = _run_backend("torch", x, None, bench.op, chunk_size=512)
    for dtype in dtypes:
        xd = {n: t.to(dtype) if n != "g" else t for n, t in x.items()}
        o1, s1, _, t1 = _run_backend("triton", xd, None, bench.op)
        log(f"long {dtype} T={long_T} B=1 H=2 K=V=64: finite={bool(torch.isfinite(o1).all())} levels={s1.shape[1]} "
            f"rel err vs torch chunk path (fp32) o={rel(o1, o_ref):.2e} state={rel(s1, s_ref):.2e}  [triton {t1:.2f}s]")


def check_gdn(log: Callable[[str], None], long_T: int, dtypes: list[torch.dtype]) -> None:
    """check() for --variant gdn: kernels vs the torch chunk path at the benchmark's shape in each 16-bit dtype
    of dtypes (the kernels' 16-bit products: the chains' transition matrices, the Z gradients), then in fp32
    (outputs, states, all gradients, the initial state's too) at benchmark sizes, unaligned T, GQA + varlen +
    states; in each dtype from the state at a chunk boundary and inside a chunk; then a long forward."""
    def both(x, state=None, **kw):
        res = {}
        for backend in ("triton", "torch"):
            leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
            st = None if state is None else FenwickState(state.levels.detach().clone().requires_grad_(),
                                                         state.positions)
            t0 = time.time()
            o, fin = log_linear_gated_deltanet(**leaves, initial_state=st, output_final_state=True, backend=backend,
                                               **kw)
            ((o * do).sum() + (fin.levels * dst).sum()).backward()
            torch.cuda.synchronize()
            grads = {f"d{n}": t.grad for n, t in leaves.items()} | ({"dstate": st.levels.grad} if st else {})
            res[backend] = (o, fin.levels, grads, time.time() - t0)
        return res

    p = PAPER
    for dtype in (d for d in dtypes if d != torch.float32):
        x = gdn_inputs(8192, 2, 48, 1, p["K"], p["V"], dtype, seed=8192)
        _compare_backends(log, f"{dtype} T=8192 B=2 H=48 G=1 K=128 V=64 l2norm", x, log_linear_gated_deltanet,
                          use_qk_l2norm=True)
    for dtype in dtypes:  # from a state at a chunk boundary (T = 4096), and inside a chunk; two rows
        for T, short in ((4096, 0), (3000, INSIDE)):
            x = gdn_inputs(T, 2, 8, 1, p["K"], p["V"], dtype, seed=T)
            xs, state = continued(x, log_linear_gated_deltanet, short, use_qk_l2norm=True)
            _compare_backends(log, f"{dtype} T={T} B=2 H=8 G=1 K=128 V=64 l2norm from a state at "
                              f"T{f' - {short}' if short else ''}", xs, log_linear_gated_deltanet,
                              initial_state=state, use_qk_l2norm=True)
    cases = [((8192, 2, 48, 1), {}), ((3000, 2, 8, 1), {}), ((4000, 1, 8, 2), {"varlen_state": True})]
    for (T, B, H, G), opts in cases:
        x = gdn_inputs(T, B, H, G, p["K"], p["V"], torch.float32, seed=T)
        state, kw = None, dict(chunk_size=64, use_qk_l2norm=True)
        if opts.get("varlen_state"):
            kw["cu_seqlens"] = torch.tensor([0, 1000, 2500, T], device="cuda")
            pre = gdn_inputs(1500, 3, H, G, p["K"], p["V"], torch.float32, seed=7)
            pre = {n: t[:, :700] for n, t in pre.items()}
            _, state = log_linear_gated_deltanet(**pre, output_final_state=True, use_qk_l2norm=True)
            state = FenwickState(state.levels.detach(), state.positions)
        probe = log_linear_gated_deltanet(**x, initial_state=state, output_final_state=True, backend="torch", **kw)
        do, dst = torch.randn_like(probe[0]), torch.randn_like(probe[1].levels)
        r = both(x, state, **kw)
        (o1, s1, g1, t1), (o2, s2, g2, t2) = r["triton"], r["torch"]
        errs = {"o": rel(o1, o2), "state": rel(s1, s2), **{n: rel(g1[n], g2[n]) for n in g1}}
        log(f"fp32 T={T} B={B} H={H} G={G} K=128 V=64 {'varlen+state ' if state else ''}l2norm: rel err vs torch chunk "
            "path " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()) + f"  [triton {t1:.2f}s, torch {t2:.2f}s]")
    x = gdn_inputs(long_T, 1, 2, 1, 128, 64, torch.float32, seed=1)
    x["g"] = -(0.001 + 0.2 * torch.rand_like(x["g"]))
    outs = {}
    for backend in ("triton", "torch"):
        t0 = time.time()
        outs[backend] = log_linear_gated_deltanet(**x, output_final_state=True, use_qk_l2norm=True, backend=backend)
        torch.cuda.synchronize()
        outs[backend + "_s"] = time.time() - t0
    (o1, st1), (o2, st2) = outs["triton"], outs["torch"]
    log(f"long fp32 T={long_T} B=1 H=2 K=128 V=64: finite={bool(torch.isfinite(o1).all())} "
        f"levels={st1.levels.shape[1]} "
        f"rel err vs torch chunk path o={rel(o1, o2):.2e} state={rel(st1.levels, st2.levels):.2e}  "
        f"[triton {outs['triton_s']:.2f}s, torch {outs['torch_s']:.2f}s]")
    ob, _ = log_linear_gated_deltanet(**{n: t.to(torch.bfloat16) if n != "g" else t for n, t in x.items()},
                                      use_qk_l2norm=True, backend="triton")
    log(f"long bf16 T={long_T}: finite={bool(torch.isfinite(ob).all())} rel err vs fp32 torch path={rel(ob, o2):.2e}")


def profile(T: int, variant: str, impls: list[str], log: Callable[[str], None]) -> None:
    """Where our forward+backward spends its time: CUDA time per kernel (torch.profiler), at the benchmark's shape
    (the paper setting unless --shape), for each of our impls among ``impls``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    p, bench = SHAPE, BENCHES[variant]
    x = bench.inputs(T, p["B"], p["H"], p["G"], p["K"], p["V"], torch.bfloat16)
    for impl in (i for i in impls if i in OUR_BACKENDS):
        fn, leaves = bench.build(impl, x, p["H"], p["G"])
        for t in leaves:
            t.requires_grad_(True)
        grad = torch.randn_like(fn())

        def step() -> None:  # as the timings: the leaves' gradients set, not accumulated
            for t in leaves:
                t.grad = None
            fn().backward(grad)

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        log(f"profile {impl} T={T} {' '.join(f'{n}={p[n]}' for n in 'BHGKV')}, 3 x forward+backward, "
            f"CUDA time by kernel:")
        log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[2048 * 2**i for i in range(7)])
    ap.add_argument("--variant", choices=sorted(BENCHES), default="mamba2")
    ap.add_argument("--impls", nargs="+", default=None, choices=sorted(set(IMPLS + IMPLS_GDN + IMPLS_GLA)),
                    help="default: every impl of the variant")
    ap.add_argument("--sdpa-max-T", type=int, default=65536, help="skip sdpa_flash above this T (quadratic)")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--no-lift-fla-guard", action="store_true")
    ap.add_argument("--check", action="store_true", help="kernels vs torch chunk path, and a long sequence")
    ap.add_argument("--long-T", type=int, default=2**20)
    ap.add_argument("--check-dtypes", nargs="+", default=["float32", "bfloat16"],
                    help="dtypes of the mamba2 check and of both variants' small-heads check")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--name", default=None, help="result file stem (default ops-<variant>; e.g. ops-mamba2-state "
                    "for --impls loglinear loglinear_state)")
    ap.add_argument("--merge", action="store_true", help="keep the result file's rows at the T this run does not "
                    "measure (same GPU, versions and setting; the file names each run)")
    ap.add_argument("--profile-T", type=int, default=0, help="profile our kernels at this T (0: no), at --shape, "
                    "into profile-<result file stem>-<gpu>.log")
    ap.add_argument("--shape", type=int, nargs=5, metavar=("B", "H", "G", "K", "V"), default=None,
                    help="override the paper setting (B=2, H=48, G=1, K=128, V=64); sdpa_flash uses H x V")
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="our ops' chunk_size: 16, 32 or 64, the kernels' chunks for bf16 (default: the op's, 64)")
    args = ap.parse_args(argv)
    if args.shape:
        SHAPE.update(zip("BHGKV", args.shape))
    # loglinear_torch (our torch path: minutes per row at long T) and loglinear_state_inside run only when named
    bench = BENCHES[args.variant]
    args.impls = args.impls or [i for i in bench.impls if i not in NAMED_ONLY]
    unknown = [i for i in args.impls if i not in bench.impls]
    if unknown:
        refuse("bench_ops.py", f"--impls {' '.join(unknown)}: not rows of --variant {args.variant} "
                               f"({', '.join(bench.impls)})")
    check_script_options("bench_ops.py", {"--T": (args.T, 1), "--warmup": (args.warmup, 1), "--rep": (args.rep, 1),
                                          "--long-T": (args.long_T, 1), "--profile-T": (args.profile_T, 0)})
    if args.chunk_size is not None:
        if args.chunk_size not in (16, 32, 64):  # the ops clamp others into the kernels' range: not what would run
            refuse("bench_ops.py", f"--chunk-size must be 16, 32 or 64 (the kernels' chunks for bf16), "
                                   f"got {args.chunk_size}")
        if args.check:
            refuse("bench_ops.py", "--chunk-size times our rows; --check runs at the ops' own chunk sizes: "
                                   "run them separately")
        OURS_KW["chunk_size"] = args.chunk_size
    if not torch.cuda.is_available():
        refuse("bench_ops.py", "needs a CUDA GPU (it times the kernels and fla's on one); none is visible")
    gpu = machine_name()
    out_dir = Path(args.out)
    stem = args.name or f"ops-{args.variant}"  # the result files' name, and the profile's
    command = "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))
    if args.check:
        out_dir.mkdir(parents=True, exist_ok=True)
        lines = [f"# {command}  ({gpu}, torch {torch.__version__}, triton {triton.__version__}, "
                 f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)"]

        log_path = out_dir / f"correctness-{gpu}.log"

        def log(s: str) -> None:  # the section is rewritten after every line: a time limit keeps what ran
            print(s, flush=True)
            lines.append(s)
            write_section(log_path, args.variant, [*lines, "# cut here: the cases after this line did not run"])

        dtypes = [getattr(torch, d) for d in args.check_dtypes]
        try:
            check_plain(log, args.variant, dtypes)
            check_small_heads(log, args.variant, dtypes)
            if args.variant == "gdn":
                check_gdn(log, args.long_T, dtypes)
            else:
                check(log, args.variant, args.long_T, dtypes)
            check_wide_heads(log, args.variant, dtypes)  # last: new shapes compile first (a time limit keeps the rest)
        except Exception as e:  # keep the log and go on to the timings
            log(f"check failed: {type(e).__name__}: {e}")
        finally:
            write_section(log_path, args.variant, lines)
    if args.profile_T:
        log_lines = []

        def log_line(line: str) -> None:
            print(line, flush=True)
            log_lines.append(line)

        profile(args.profile_T, args.variant, args.impls, log_line)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"profile-{stem}-{gpu}.log").write_text(f"# {command}\n" + "\n".join(log_lines) + "\n")
    if args.no_bench:
        return
    lifted = False
    if any(i.startswith("fla") for i in args.impls) and not args.no_lift_fla_guard:
        lift_fla_guard()
        lifted = True
    notes = ("fla's Hopper/triton<3.7.1 guard on its gated backward was LIFTED for timing only; "
             "fla results were not checked." if lifted else "fla's guard was left in place.")
    meta = {
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "command": command,
        "setting": f"B={SHAPE['B']}, {SHAPE['H']} value heads, q/k groups {SHAPE['G']}, K={SHAPE['K']}, "
                   f"V={SHAPE['V']}, bf16; {bench.gates}; lambda in [0.2, 1.2]; "
                   + f"sdpa_flash: {SHAPE['H']} heads x {SHAPE['V']}, causal. "
                   + ("loglinear_state: the same call continuing the state left by T tokens of the same kind (at "
                      "position T, as context-parallel rank 1 of 2), the state's gradient taken too. "
                      if "loglinear_state" in args.impls else "")
                   + (f"loglinear_state_inside: the same from the state left by T - {INSIDE} tokens (inside a "
                      "chunk). " if "loglinear_state_inside" in args.impls else "")
                   + (f"loglinear_packed: the same tokens as {PACKED} sequences per row, packed (cu_seqlens). "
                      if "loglinear_packed" in args.impls else "")
                   + ("loglinear_fp32: the same inputs in fp32 (q, k, v, lambda). "
                      if "loglinear_fp32" in args.impls else "")
                   + (f"Our ops at chunk_size {args.chunk_size}. " if args.chunk_size is not None else "")
                   + "Median of triton.testing.do_bench.",
        "notes": notes, "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "unset",
    }
    result = out_dir / f"{stem}-{gpu}"
    try:
        kept = merge_previous(result.with_suffix(".json"), meta, args.T) if args.merge else []
    except ValueError as e:
        refuse("bench_ops.py", str(e))
    rows, failed = [], {}
    planned = [(impl, T) for T in args.T for impl in args.impls if not (impl == "sdpa_flash" and T > args.sdpa_max_T)]

    def missing() -> list[str]:
        """This run's rows without a measurement, and why."""
        done = {(r["impl"], r["T"]) for r in rows}
        return [f"{impl} at {T // 1024}K ({failed.get((impl, T), 'the run ended before it was timed')})"
                for impl, T in planned if (impl, T) not in done]

    for impl, T in planned:
        # before every row: a crash or a time limit keeps what was measured and names what was not
        write_results(kept + rows, {**meta, "missing": missing()}, result, args.variant)
        try:
            row = measure(impl, T, torch.bfloat16, args.warmup, args.rep, args.variant)
        except Exception as e:  # an impl that cannot run a size (OOM, its own limits) gets no row
            failed[impl, T] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{impl} T={T}: {failed[impl, T]}", flush=True)
            torch.cuda.empty_cache()
            continue
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_results(kept + rows, {**meta, "missing": missing()}, result, args.variant)


if __name__ == "__main__":
    main()
