"""Compile the log-linear Mamba-2 kernels for sm_90 on any machine (no GPU): shared memory, registers, spills.

    PYTHONPATH=/path/to/triton36 python benchmarks/compile_mamba2_sm90.py            # bf16, whole tiles
    python benchmarks/compile_mamba2_sm90.py --dtype fp32 --split                      # the fp32 tiling

Paper setting (K = 128, V = 64, C = 64). Lists the kernels as the op launches them: the chunk-level
scans mamba2_fwd.py / mamba2_bwd.py and the chunk-parallel mamba2_chunk.py.
Uses the installed triton (compile with the GPU's version) and its bundled ptxas. A kernel whose shared
memory exceeds 232448 bytes fails to launch on an H100/H200.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402

from loglinear.ops.triton import mamba2, mamba2_bwd, mamba2_chunk, mamba2_fwd  # noqa: E402
from loglinear.ops.triton.common import MAX_CHUNK_LEVELS, dot_precision, launch_options  # noqa: E402
from sm90 import DTYPES, report  # noqa: E402


def signature(names: str, ptr: str, **special: str) -> dict:
    """Every name a pointer of type ptr unless given in special (runtime ints default to i32)."""
    return {n: special.get(n, "i32" if n in ("H", "G", "K", "V", "L", "J", "tokens") else ptr) for n in names.split()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--split", action="store_true",
                    help="split the reverse scan's tiles into K rows also with initial states (fp32's tiling)")
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--has-init", action="store_true", help="the variant for calls with initial states")
    args = ap.parse_args()
    P, f32, i32 = "*" + args.dtype, "*fp32", "*i32"
    prec = dot_precision(DTYPES[args.dtype])
    BK, BV, C = triton.next_power_of_2(args.K), triton.next_power_of_2(args.V), 64
    rows = BK if args.has_init and not args.split else mamba2.SCAN_ROWS  # the reverse scan's (_scan_rows)
    print(f"triton {triton.__version__}, {args.dtype}, K={args.K}, V={args.V}, C={C}, split={args.split}, "
          f"has_init={args.has_init}, {prec}")
    base = dict(C=C, LOG_C=6, BK=BK, BV=BV, PRECISION=prec, HAS_INIT=args.has_init)
    ints = dict(K=args.K, V=args.V)
    ptrs = dict(g=f32, lam=P, scale="fp32", starts=i32, ends=i32, bos_ptr=i32, eos_ptr=i32, chunk0_ptr=i32)

    scan = dict(base, BJ=MAX_CHUNK_LEVELS)
    bufs = dict(levels=f32, buckets=P, decays=f32, h0=f32, dq=P, dk=P, dv=P, dlam=P, qdq=f32, kdk=f32,
                d_levels=f32, d_buckets=P, d_deposits=P, chunks=i32, by_level=i32, seqs=i32, chunk0=i32, base_ptr=i32)
    chunk = "q k v g lam {} h0 buckets decays starts ends seqs chunks chunk0 scale {}H G K V L J"
    kernels = [  # (kernel, its arguments, constexprs, launch options)
        (mamba2_chunk.mamba2_deposit_kernel, "k v g buckets starts ends H G K V", base,
         mamba2_chunk.chunk_launch_options(4)),
        (mamba2_fwd.mamba2_fwd_kernel, "g levels buckets decays bos_ptr eos_ptr chunk0_ptr base_ptr H K V J",
         dict(scan, BKS=mamba2.SCAN_ROWS), launch_options(mamba2.SCAN_ROWS, BV)),
        (mamba2_chunk.mamba2_chunk_fwd_kernel, chunk.format("o", ""), dict(base, BJ=MAX_CHUNK_LEVELS),
         mamba2_chunk.chunk_launch_options(4, 2)),
        (mamba2_chunk.mamba2_chunk_bwd_dq_kernel, chunk.format("do", "dq dlam qdq "),
         dict(base, BL=32, BJ=MAX_CHUNK_LEVELS), mamba2_chunk.chunk_launch_options(4, 2)),
        (mamba2_chunk.mamba2_level_grad_kernel,
         "q g lam do decays starts ends chunks by_level d_buckets scale H G K V L J",
         dict(base, BJ=MAX_CHUNK_LEVELS), mamba2_chunk.chunk_launch_options(4, 3)),
        (mamba2_bwd.mamba2_bwd_scan_kernel,
         "q g lam do d_levels d_buckets bos_ptr eos_ptr chunk0_ptr base_ptr scale H G K V L J",
         dict(scan, BKS=rows), launch_options(rows, BV)),
        (mamba2_chunk.mamba2_chunk_bwd_dkv_kernel, "q k v g lam do d_deposits starts ends scale dk dv kdk H G K V L",
         base, mamba2_chunk.chunk_launch_options(4)),
    ]
    for fn, names, const, launch in kernels:
        const = {n: c for n, c in const.items() if n in fn.arg_names}
        sig = signature(names, P, **{n: t for n, t in {**bufs, **ptrs}.items() if n in names.split()})
        print(report(fn, {**sig, **dict.fromkeys(const, "constexpr")}, const, ints=ints, **launch))

if __name__ == "__main__":
    main()
