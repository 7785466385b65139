"""``loglinear demo``: every registered variant in all three forms agrees, and the decoding state grows as log T.

Runs on random inputs in float64 (materialized = quadratic, recurrent = token-by-token decoding,
chunkwise = the training path), prints the largest differences, then the memory a decoder keeps per
layer and head as context grows: log-linear levels vs one linear-attention state vs a KV cache.
"""

from __future__ import annotations

import argparse
import time

import torch

from loglinear import reference as R
from loglinear.fenwick import levels_needed
from loglinear.inputs import check_positive_ints
from loglinear.ops import attention
from loglinear.variants import MAMBA2, REGISTRY, Variant


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", type=int, default=200, help="tokens in the agreement check")
    parser.add_argument("--heads", type=int, default=4,
                        help="heads of the values, gates and level weights (q, k: one head, shared)")
    parser.add_argument("--key-dim", type=int, default=16, help="K, the dimension of the queries and keys")
    parser.add_argument("--value-dim", type=int, default=16, help="V, the dimension of the values")
    parser.add_argument("--chunk-size", type=int, default=16, help="chunk length of the chunkwise form")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--table-key-dim", type=int, default=128, help="K of the memory table (paper: 128)")
    parser.add_argument("--table-value-dim", type=int, default=64, help="V of the memory table (paper: 64)")


def _inputs(variant: Variant, T: int, H: int, K: int, V: int, gen: torch.Generator) -> dict:
    """Random float64 arguments of ``attention(variant, ...)`` for one sequence: q, k, v, gates, level_scales."""
    kw = dict(dtype=torch.float64, generator=gen)
    return {
        "q": torch.randn(1, T, 1, K, **kw),
        "k": torch.randn(1, T, 1, K, **kw) / K**0.5,
        "v": torch.randn(1, T, H, V, **kw),
        "gates": variant.sample_gates(1, T, H, K, **kw),
        "level_scales": 0.2 + torch.rand(1, T, H, levels_needed(T), **kw),
    }


def _agreement(args: argparse.Namespace) -> bool:
    """Every registered variant (q/k l2-normalised in the op) in its three forms."""
    gen = torch.Generator().manual_seed(args.seed)
    forms = {}
    for variant in REGISTRY.values():
        x = _inputs(variant, args.seq_len, args.heads, args.key_dim, args.value_dim, gen)
        forms[variant.name] = (
            lambda v=variant, x=x: R.materialized(v, **x, use_qk_l2norm=True),
            lambda v=variant, x=x: R.recurrent(v, **x, use_qk_l2norm=True)[0],
            lambda v=variant, x=x: attention(v, **x, use_qk_l2norm=True, chunk_size=args.chunk_size)[0],
        )
    print(f"Agreement on random input (float64, T={args.seq_len}, H={args.heads}, K={args.key_dim}, "
          f"V={args.value_dim}, chunk={args.chunk_size}):")
    print(f"  {'variant':<16}{'materialized':>14}{'recurrent':>12}{'chunkwise':>12}"
          f"{'max|rec-mat|':>15}{'max|chunk-mat|':>16}")
    ok = True
    for name, (mat, rec, chunk) in forms.items():
        times, outs = [], []
        for fn in (mat, rec, chunk):
            t0 = time.perf_counter()
            outs.append(fn())
            times.append(time.perf_counter() - t0)
        d_rec = (outs[1] - outs[0]).abs().max().item()
        d_chunk = (outs[2] - outs[0]).abs().max().item()
        ok &= d_rec < 1e-9 and d_chunk < 1e-9
        print(f"  {name:<16}{times[0]*1e3:>12.1f}ms{times[1]*1e3:>10.1f}ms{times[2]*1e3:>10.1f}ms"
              f"{d_rec:>15.2e}{d_chunk:>16.2e}")
    print("  -> all three forms agree" if ok else "  -> MISMATCH")
    return ok


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"


def _state_growth(K: int, V: int, gen_steps: int = 64) -> None:
    """Decode for real up to a few hundred tokens (state levels measured), then the formula to 1M."""
    print(f"\nDecoding memory per layer and head (fp32 states, K={K}, V={V}; KV cache in bf16, K+V per token):")
    gen = torch.Generator().manual_seed(1)
    x = _inputs(MAMBA2, gen_steps, 1, K, V, gen)
    step = lambda t: {n: u[:, t : t + 1] for n, u in x.items() if n != "gates"} | {  # noqa: E731
        "gates": {n: u[:, t : t + 1] for n, u in x["gates"].items()}}
    _, state = attention(MAMBA2, **step(0), output_final_state=True)
    measured = {1: state.num_levels}
    for t in range(1, gen_steps):
        _, state = attention(MAMBA2, **step(t), initial_state=state, output_final_state=True)
        measured[t + 1] = state.num_levels
    print(f"  {'T':>9}{'levels':>8}{'log-linear':>13}{'linear':>11}{'KV cache':>12}{'LL / KV':>10}")
    for T in (1, 2, 8, 64, 1024, 16384, 2**20):
        levels = measured.get(T, levels_needed(T))
        ll = levels * K * V * 4
        kv = T * (K + V) * 2
        tag = " (measured)" if T in measured else ""
        print(f"  {T:>9}{levels:>8}{_human(ll):>13}{_human(K * V * 4):>11}{_human(kv):>12}{ll / kv:>9.2%}{tag}")


def run(args: argparse.Namespace) -> int:
    check_positive_ints(**{f"--{name.replace('_', '-')}": getattr(args, name) for name in (
        "seq_len", "heads", "key_dim", "value_dim", "table_key_dim", "table_value_dim")})
    ok = _agreement(args)
    _state_growth(args.table_key_dim, args.table_value_dim)
    return 0 if ok else 1
