"""Compile the Gated DeltaNet kernels for sm_90 on any machine (no GPU): shared memory, registers, spills.

    python benchmarks/compile_gdn_sm90.py                 # bf16, K = 128, V = 64, the op's block choices
    python benchmarks/compile_gdn_sm90.py --dtype fp32 --K 256
    python benchmarks/compile_gdn_sm90.py --l2norm          # the chunk-local kernels normalising q/k rows (NORM)

Uses the installed triton (compile with the GPU's triton version: e.g. a triton 3.6 wheel on PYTHONPATH)
and its bundled ptxas. A kernel whose shared memory exceeds 232448 bytes fails to launch on an H100/H200.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402

from loglinear.ops.triton import gated_deltanet_local as local  # noqa: E402
from loglinear.ops.triton import gated_deltanet_scan as scan  # noqa: E402
from loglinear.ops.triton.gated_deltanet import kernel_chunk_size  # noqa: E402
from loglinear.ops.triton.gated_deltanet_common import Chunking, dot_precision  # noqa: E402
from sm90 import DTYPES, report  # noqa: E402


def scan_reports(K: int, V: int, C: int, dtype: torch.dtype, P: str, prec: str) -> list[str]:
    """The five scan kernels (the forward with and without snapshots) at the op's block choices."""
    f32 = "*fp32"
    BK, BV, NV = scan._blocks(K, V, dtype)
    launch = dict(num_warps=8, num_stages=2)
    const = dict(K=K, V=V, C=C, BK=BK, BV=BV, PREC=prec)
    rows = dict(T="i32", front="i32", H="i32", scale="fp32")
    out = []
    sig = dict(qt=P, wt=P, kt=P, u=P, decay=f32, lam=f32, merge="*i32", lev="*i32", snap_at="*i32", states=f32,
               snap=P, o_intra=f32, o=P, N="i32", J="i32", Tp="i32", S="i32", **rows,
               **{n: "constexpr" for n in [*const, "SNAP", "TM"]})
    fits = scan.square_fits(BK, dtype)
    for snap in (True, False):
        out.append(report(scan._scan_fwd_kernel, sig, dict(const, SNAP=snap, TM=fits), **launch) + f"  (SNAP={snap})")
    sig = dict(qt=P, lam=f32, live="*i32", snap_at="*i32", snap=P, o_intra=f32, o=P, J="i32", Tp="i32", S="i32",
               **rows, **{n: "constexpr" for n in [*const, "NV"]})
    out.append(report(scan._scan_readout_kernel, sig, dict(const, NV=NV), **launch))
    sig = dict(qt=P, wt=P, kt=P, decay=f32, lam=f32, merge="*i32", lev="*i32", snap_at="*i32", do=P,
               dstates=f32, dsnap=P, do_intra=f32, N="i32", J="i32", Tp="i32", S="i32", **rows, i0="i32", i1="i32",
               **{n: "constexpr" for n in [*const, "TM"]})
    out.append(report(scan._scan_dh_kernel, sig, dict(const, TM=fits), **launch))
    sig = dict(wt=P, kt=P, u=P, merge="*i32", live="*i32", snap_at="*i32", lev="*i32", snap=P, dsnap=P, dwt=P,
               dkt=P, du=P, dd=f32, N="i32", Tp="i32", S="i32", SD="i32", i0="i32",
               **{n: "constexpr" for n in [*const, "NV", "TZ"]})
    out.append(report(scan._scan_grads_kernel, sig, dict(const, NV=NV, TZ=fits), **launch))
    sig = dict(qt=P, lam=f32, snap_at="*i32", lev="*i32", snap=P, do_intra=f32, dqt=P, dlam=f32, J="i32", Tp="i32",
               S="i32", **{n: "constexpr" for n in [*const, "NV"]})
    out.append(report(scan._scan_readout_bwd_kernel, sig, dict(const, NV=NV), **scan._launch(scan.READOUT_BWD_WARPS)))
    return out


def local_reports(K: int, V: int, C: int, dtype: torch.dtype, P: str, norm: bool) -> list[str]:
    """The four chunk-local kernels (q and k in the operand dtype; norm: their rows normalised in the kernels)."""
    f32 = "*fp32"
    meta = local._meta(Chunking(b=2, T=8192, H=48, front=0, C=C), K, V, 1, 18, dtype, norm)
    runtime = dict(T="i32", front="i32", Tp="i32", N="i32", H="i32", NG="i32", L="i32", eps="fp32")
    pointers = [
        (local._chunk_inverse_kernel, dict(k=P, g=P, beta=P, tg=P)),
        (local._chunk_local_kernel, dict(q=P, k=P, v=P, g=P, beta=P, lam=P, tg=P, o=f32, qt=P, wt=P, kt=P, u=P,
                                         qkg=P, decay=f32)),
        (local._chunk_local_bwd_cc_kernel, dict(v=P, g=P, beta=P, lam=P, tg=P, qkg=P, wt=P, u=P, do=f32, dqt=P,
                                                dwt=P, du=P, dv=P, dlam=P, scratch=P, dGp=f32, dbp=f32, dbk=P)),
        (local._chunk_local_bwd_k_kernel, dict(q=P, k=P, g=P, beta=P, dqt=P, dkt=P, ddecay=f32, scratch=P, dGp=f32,
                                               dbp=f32, dbk=P, dq=P, dk=P, dg=P, dbeta=P)),
    ]
    out = []
    for kernel, sig in pointers:
        args = local.kernel_meta(kernel, meta)
        sig = dict(sig, **{n: runtime.get(n, "constexpr") for n in args})
        const = {n: x for n, x in args.items() if n not in runtime}
        out.append(report(kernel, sig, const, **local.launch_options(kernel)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--l2norm", action="store_true", help="the chunk-local kernels with NORM (use_qk_l2norm)")
    args = ap.parse_args()
    dtype, K, V = DTYPES[args.dtype], args.K, args.V
    C = kernel_chunk_size(64, dtype, K)
    P, prec = "*" + args.dtype, dot_precision(dtype)
    print(f"triton {triton.__version__}, {args.dtype}, K={K}, V={V}, C={C}, precision {prec}"
          + ", q/k l2norm in the kernels" * args.l2norm)
    for line in scan_reports(K, V, C, dtype, P, prec) + local_reports(K, V, C, dtype, P, args.l2norm):
        print(line)


if __name__ == "__main__":
    main()
