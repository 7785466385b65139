"""Compile the log-linear kernels for sm_90 on any machine (no GPU) and report what ptxas says: shared memory,
registers, stack, spills, the static SASS instruction count and the length of each loop body (a loop over levels or
reader chunks: what each of its iterations issues), per kernel at the op's block and launch choices.

    PYTHONPATH=/path/to/triton36 python benchmarks/profiling/compile_sm90.py mamba2       # bf16
    python benchmarks/profiling/compile_sm90.py mamba2 --dtype fp32 --has-init --plain     # fp32, plain + states
    python benchmarks/profiling/compile_sm90.py gla                # the same kernels with a per-channel gate
    python benchmarks/profiling/compile_sm90.py gdn                # bf16, K = 128, V = 64, the op's block choices
    python benchmarks/profiling/compile_sm90.py gdn --dtype fp32 --K 256
    python benchmarks/profiling/compile_sm90.py gdn --l2norm       # the chunk-local kernels normalising q/k rows
    python benchmarks/profiling/compile_sm90.py mamba2 --sass /tmp/sass   # and each kernel's SASS listing
    python benchmarks/profiling/compile_sm90.py mamba2 --chunk 32         # at chunk_size 32
    python benchmarks/profiling/compile_sm90.py gla --decode       # the decode step's kernels, each of its paths
    python benchmarks/profiling/compile_sm90.py gdn --decode --batch 1 --key-window 32

Paper setting by default (K = 128, V = 64, the op's chunk: 64 for Mamba-2 and GLA, Gated DeltaNet's rule).
Mamba-2 / GLA: the chunk-level scans mamba2/fwd.py, mamba2/bwd.py and the chunk-parallel mamba2/chunk.py (GLA:
PER_CHANNEL), with --has-init the seeded first chunks' reads (mamba2/seeds.py); Gated DeltaNet:
the scan kernels (gated_deltanet/scan.py) and the chunk-local ones (gated_deltanet/local.py).
--decode: instead, the decode step's kernels (decode.py) as fused_decode_step launches them, recorded from a call on
meta tensors (its tiles, flags and launch options, nothing recomputed here), q / k / v in --dtype, the gates fp32, on
each path: one-token op calls (out of place, fp32 levels), CUDA-graph decoding (in place, lazy levels in fp32 and in
bf16; Gated DeltaNet with its key window: the query kernel, level 0's and the kept levels' passes, the turn) and the
plain step (one level), for --batch sequences of --heads heads at --context tokens.
Uses the installed triton (compile with the GPU's version, e.g. a triton 3.6 wheel on PYTHONPATH) and the bundled
ptxas its compiler runs for sm_90. A build whose shared memory exceeds SHARED_LIMIT does not load on an H100/H200: the
op launches it at one pipeline stage fewer until it fits (shared/launch.py's launch), and so does this report
("launched at N stages"); one over the limit at one stage ("OVER THE SHARED LIMIT") cannot run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: loglinear

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

from loglinear.cli import check_script_options, refuse  # noqa: E402
from loglinear.fenwick import levels_needed  # noqa: E402
from loglinear.ops.decode import KEY_WINDOW, MAX_KEY_WINDOW, KeyWindow, key_window_size_ok  # noqa: E402
from loglinear.ops.finite import LOG_DECAY_FLOOR  # noqa: E402
from loglinear.ops.triton import decode  # noqa: E402
from loglinear.ops.triton.gated_deltanet import local, scan  # noqa: E402
from loglinear.ops.triton.gated_deltanet import backend as gdn_backend  # noqa: E402
from loglinear.ops.triton.gated_deltanet import chunking  # noqa: E402
from loglinear.ops.triton.gated_deltanet.chunking import Chunking  # noqa: E402
from loglinear.ops.triton.mamba2 import backend as mamba2  # noqa: E402
from loglinear.ops.triton.mamba2 import bwd as mamba2_bwd  # noqa: E402
from loglinear.ops.triton.mamba2 import chunk as mamba2_chunk  # noqa: E402
from loglinear.ops.triton.mamba2 import fwd as mamba2_fwd  # noqa: E402
from loglinear.ops.triton.mamba2 import seeds  # noqa: E402
from loglinear.ops.triton.shared import intra_channel  # noqa: E402
from loglinear.ops.triton.shared.common import MAX_CHUNK_LEVELS  # noqa: E402
from loglinear.ops.triton.shared.launch import heads_per_program, launch_options  # noqa: E402
from loglinear.ops.triton.shared.levels import BLOCK_LEVELS  # noqa: E402
from loglinear.ops.triton.shared.rules import dot_precision, kernel_chunk_size  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHARED_LIMIT = 232448
SASS_DIR: Path | None = None  # --sass: where each kernel's SASS listing goes


def unspecialised(fn) -> set[str]:
    """The arguments the JIT does not specialise on their values (the kernel's do_not_specialize)."""
    return {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}


def aligned(fn, signature: dict, ints: dict) -> dict:
    """The JIT's specialisation on a launch: pointers (torch allocations) and specialised ints that are
    multiples of 16 carry tt.divisibility = 16 (without it loads are not vectorised: a pointer per element)."""
    keep = unspecialised(fn)
    div16 = [n for n, ty in signature.items() if ty.startswith("*")
             or (n in ints and n not in keep and ints[n] % 16 == 0)]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}


def constant_ones(fn, signature: dict, constexprs: dict, ints: dict) -> tuple[dict, dict]:
    """The JIT's other specialisation: a runtime int equal to 1 becomes a constant (unless unspecialised), as at the
    paper setting's one q/k group. Returns the signature and constexprs with those ints as constants."""
    ones = {n: 1 for n, x in ints.items() if x == 1 and n in signature and n not in unspecialised(fn)
            and signature[n] in ("i32", "i64")}
    return {**signature, **dict.fromkeys(ones, "constexpr")}, {**constexprs, **ones}


def report(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, ints: dict | None = None,
           maxnreg: int | None = None, sass_name: str | None = None) -> str:
    """One line: warps, stages, shared memory, then ptxas's registers / stack / spills for the compiled kernel (the
    build at num_stages, or at fewer where that is over the SM's shared memory, as the op launches it).
    ints: the runtime integer arguments' values (for the JIT's specialisations: divisibility by 16, constants of
    1); sass_name: the SASS listing's file name (--sass; default the kernel's name)."""
    ints = ints or {}
    signature, constexprs = constant_ones(fn, signature, constexprs, ints)
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned(fn, signature, ints))
    stages, over = num_stages, []
    while True:
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": num_warps, "num_stages": stages, "maxnreg": maxnreg})
        if kernel.metadata.shared <= SHARED_LIMIT or stages == 1:
            break
        over.append(f"{kernel.metadata.shared} at {stages}")
        stages -= 1
    ptxas = get_ptxas(90).path  # the ptxas the compiler used for sm_90 (a newer one than bin/ptxas in some versions)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    info = [line.split("info    :")[-1].strip() for line in (out.stdout + out.stderr).splitlines()
            if "stack frame" in line or "Used" in line]
    fits = "  OVER THE SHARED LIMIT" if kernel.metadata.shared > SHARED_LIMIT else ""
    stepped = f"  (launched at {stages} stage{'s' * (stages > 1)}: {', '.join(over)} over the limit)" if over else ""
    return (f"{fn.__name__:28s} warps={num_warps} stages={stages} shared={kernel.metadata.shared:6d}  "
            + "; ".join(info) + f"; {sass_summary(sass_name or fn.__name__, kernel.asm['cubin'])}" + fits + stepped)


def sass_summary(name: str, cubin: bytes) -> str:
    """The kernel's static SASS instruction count (cuobjdump of the cubin; a loop's body counted once) and the
    length of each loop body, e.g. "2848 SASS instructions, loop bodies 288"; the listing goes to
    SASS_DIR/<name>.sass when SASS_DIR is set (--sass)."""
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    if SASS_DIR is not None:
        (SASS_DIR / f"{name}.sass").write_text(sass)
    listing = instructions(sass)
    bodies = loop_bodies(listing)
    return f"{len(listing)} SASS instructions" + (", loop bodies " + " / ".join(map(str, bodies)) if bodies else "")


INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+([^;]*);")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of each instruction of a cuobjdump -sass listing."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(INSTRUCTION.match, sass.splitlines()) if m]


def loop_bodies(listing: list[tuple[int, str]]) -> list[int]:
    """The instruction count of each loop of a listing (instructions()), in order: a branch back to a lower address
    closes a loop whose body runs from that address to the branch (a kernel's final self-branch is not a loop)."""
    bodies = []
    for address, text in listing:
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address:
            start = int(m.group(1), 16)
            bodies.append(sum(1 for a, _ in listing if start <= a <= address))
    return bodies


def signature(names: str, ptr: str, **special: str) -> dict:
    """Every name a pointer of type ptr unless given in special (runtime ints default to i32)."""
    ints = ("H", "G", "K", "V", "L", "J", "J0", "N", "NC", "S", "tokens")
    return {n: special.get(n, "i32" if n in ints else ptr) for n in names.split()}


def mamba2_reports(args: argparse.Namespace) -> list[str]:
    """The Mamba-2 kernels as the op launches them (fwd scan, chunk kernels, reverse scan, the initial levels'
    gradient); for gla with PER_CHANNEL."""
    dtype, P, f32, i32 = DTYPES[args.dtype], "*" + args.dtype, "*fp32", "*i32"
    prec = dot_precision(dtype, mamba2.FP32_DOT)
    per_channel = args.variant == "gla"
    BK, BV = triton.next_power_of_2(args.K), triton.next_power_of_2(args.V)
    C = args.chunk or mamba2.chunk_cap(dtype, args.K)
    print(f"triton {triton.__version__}, {args.variant}, {args.dtype}, K={args.K}, V={args.V}, C={C}, "
          f"plain={args.plain}, "
          f"has_init={args.has_init}, {prec}")
    base = dict(C=C, LOG_C=C.bit_length() - 1, BK=BK, BV=BV, PRECISION=prec, HAS_INIT=args.has_init, PLAIN=args.plain,
                PER_CHANNEL=per_channel, S=intra_channel.SUB_CHUNK, KB=min(intra_channel.KEY_BLOCK, BK),
                FLOOR=LOG_DECAY_FLOOR[torch.float32], HP=1 if per_channel else args.heads_per_program)
    dq_heads = base["HP"] if args.plain else 1  # the log-linear dq kernel runs per head (backend._dq_grads)
    ints = dict(K=args.K, V=args.V, H=48, G=1)  # the paper setting's heads and q/k groups
    ptrs = dict(g=f32, lam=P, scale="fp32", starts=i32, lows=i32, ends=i32, bos_ptr=i32, eos_ptr=i32, chunk0_ptr=i32)

    scan_const = dict(base, BJ=MAX_CHUNK_LEVELS)
    bufs = dict(levels=f32, buckets=P, decays=f32, h0=P, h0_held="*i8", dq=P, dk=P, dv=P, dlam=P, qdq=f32, q_dec=P,
                d_levels=f32, d_buckets=P, d_deposits=P, d_init=f32, d_gate=f32, totals=f32, final_terms=f32,
                later=f32, dg=f32, chunks=i32, order=i32, seqs=i32, chunk0=i32, base_ptr=i32)
    bufs.update(scores=P, dq_in=P, dk_in=P, cum=f32, o=P, d_o=P, layout="*i64")
    chunk = ("q k v g lam {} h0 h0_held buckets decays scores {}starts lows ends seqs chunks chunk0 scale "
             "{}H G K V L J{}")
    kernels = [  # (kernel, its arguments, constexprs)
        (mamba2_chunk.mamba2_deposit_kernel, "k v g buckets totals starts lows ends seqs chunks chunk0 H G K V",
         dict(base, BK=min(mamba2.DEPOSIT_ROWS, BK), BB=0 if args.plain else BLOCK_LEVELS)),
        (mamba2_fwd.mamba2_fwd_kernel, "levels buckets decays totals bos_ptr eos_ptr chunk0_ptr base_ptr H K V J",
         dict(scan_const, BKS=mamba2.SCAN_ROWS, BB=BLOCK_LEVELS)),
        (mamba2_chunk.mamba2_chunk_fwd_kernel, chunk.format("o", "", "", ""), dict(base, BJ=MAX_CHUNK_LEVELS)),
        (mamba2_chunk.mamba2_chunk_bwd_dq_kernel, chunk.format("do", "dq_in ", "dq dlam qdq q_dec ", ""),
         dict(base, BL=32, BJ=MAX_CHUNK_LEVELS, HP=dq_heads)),
        (mamba2_chunk.mamba2_level_grad_kernel,
         "q g lam do decays starts lows ends chunks order d_buckets scale H G K V L J",
         dict(base, BJ=MAX_CHUNK_LEVELS)),
        (mamba2_chunk.mamba2_initial_grad_kernel,
         "q g lam do decays bos_ptr eos_ptr chunk0_ptr base_ptr lows d_init scale N S J0 H G K V L J", base),
        (mamba2_bwd.mamba2_bwd_scan_kernel, "totals d_levels d_buckets bos_ptr eos_ptr chunk0_ptr base_ptr H K V J",
         dict(scan_const, BKS=mamba2.SCAN_ROWS, BB=BLOCK_LEVELS)),
        (mamba2_chunk.mamba2_chunk_bwd_dkv_kernel,
         "q k v g lam do d_deposits scores dk_in starts lows ends seqs eos_ptr final_terms scale dk dv d_gate totals "
         "H G K V L", base),
        (mamba2_chunk.mamba2_gate_later_kernel, "totals later base_ptr H K N NC",
         dict(base, R=mamba2.GATE_LATER_BLOCK, BK=BK if per_channel else 16)),
        (mamba2_chunk.mamba2_gate_grad_kernel, "d_gate later g cum dg starts lows ends H K", base),
    ]
    if args.has_init:  # what the chunk kernels read of the initial levels; a state inside a chunk: the seeded first
        # chunks' reads (dq per head, as the dq kernel's)
        const = dict(base, BL=16, **seeds.kernel_sizes(dtype, args.K, args.V, C))
        kernels += [
            (mamba2_chunk.mamba2_initial_reads_kernel, "levels h0 h0_held J0 J H K V",
             dict(CONVERT=dtype != torch.float32, BLOCK=mamba2.INITIAL_READS_BLOCK)),
            (seeds.seed_reads_kernel, "o q g lam levels layout scale H G K V L", const),
            (seeds.seed_reads_bwd_kernel, "d_o q g lam levels layout scale dq qdq dlam d_levels H G K V L", const),
        ]
    if per_channel:
        kernels += [
            (intra_channel.channel_cumsum_kernel, "g cum starts lows ends H K", base),
            (intra_channel.channel_scores_kernel, "q k cum scores starts lows ends H G K", base),
            (intra_channel.channel_dq_kernel, "q k v cum lam do dq_in starts lows ends scale H G K V L", base),
            (intra_channel.channel_dk_kernel, "q k v cum lam do dk_in starts lows ends scale H G K V L", base),
        ]
    # the chunk and scan kernels take the op's rule (backend._launch: the plan's path, the operands' dtype and
    # blocks), the others launch_options alone
    through_op = {mamba2_chunk.mamba2_deposit_kernel, mamba2_fwd.mamba2_fwd_kernel,
                  mamba2_chunk.mamba2_chunk_fwd_kernel, mamba2_chunk.mamba2_chunk_bwd_dq_kernel,
                  mamba2_chunk.mamba2_level_grad_kernel, mamba2_chunk.mamba2_initial_grad_kernel,
                  mamba2_bwd.mamba2_bwd_scan_kernel, mamba2_chunk.mamba2_chunk_bwd_dkv_kernel}
    plan = SimpleNamespace(per_channel=per_channel, plain=args.plain)
    keys, values = torch.empty(1, 1, args.K, dtype=dtype, device="meta"), torch.empty(1, 1, args.V, device="meta")
    out = []
    for fn, names, const in kernels:
        const = {n: c for n, c in const.items() if n in fn.arg_names}
        sig = signature(names, P, **{n: t for n, t in {**bufs, **ptrs}.items() if n in names.split()})
        options = (mamba2._launch(fn, plan, keys, values) if fn in through_op
                   else launch_options(fn, per_channel=per_channel, plain=args.plain, fp32=dtype == torch.float32))
        out.append(report(fn, {**sig, **dict.fromkeys(const, "constexpr")}, const, ints=ints, **options))
    return out


def scan_ints(C: int, plain: bool, T: int = 8192, H: int = 48) -> dict[str, int]:
    """The scan kernels' runtime ints in the first chain segment of a B = 2 call of T tokens from position 0 (the
    JIT specialises them: the plain schedule's one level J = 1 is a constant)."""
    N = T // C
    J = 1 if plain else max(N - 1, 1).bit_length()
    merge = gdn_backend._plain_targets(N) if plain else gdn_backend._merge_targets(0, N)
    sched = scan.schedule(merge, J, 0, torch.device("cpu"))
    i1 = scan._segments(N, sched, True)[0][1]
    return dict(N=N, J=J, Tp=N * C, S=sched.slots, SD=sched.at[i1] + sched.count(i1), T=T, front=0, H=H, i0=0, i1=i1,
                first=0)


def gdn_scan_reports(K: int, V: int, C: int, dtype: torch.dtype, P: str, prec: str, plain: bool) -> list[str]:
    """The five Gated DeltaNet scan kernels (the forward with and without snapshots) at the op's block choices;
    plain: the chains' build for the plain schedule (ONE)."""
    f32 = "*fp32"
    BK, BV, NV = scan._blocks(K, V, dtype)
    const = dict(K=K, V=V, C=C, BK=BK, BV=BV, PREC=prec)
    rows = dict(T="i32", front="i32", H="i32", scale="fp32")
    ints = scan_ints(C, plain)
    fp32 = dtype == torch.float32
    out = []
    sig = dict(qt=P, wt=P, kt=P, u=P, decay=f32, lam=f32, merge="*i32", lev="*i32", snap_at="*i32", states=f32,
               snap=P, o_intra=f32, o=P, N="i32", J="i32", Tp="i32", S="i32", first="i32", **rows, i0="i32",
               i1="i32", **{n: "constexpr" for n in [*const, "SNAP", "TM", "ONE"]})
    fits = scan.square_fits(BK, dtype)
    for snap in (True, False):
        options = launch_options(scan._scan_fwd_kernel, plain=plain, fp32=fp32, block=BK)
        out.append(report(scan._scan_fwd_kernel, sig, dict(const, SNAP=snap, TM=fits, ONE=plain), ints=ints,
                          **options) + f"  (SNAP={snap})")
    sig = dict(qt=P, lam=f32, live="*i32", snap_at="*i32", snap=P, o_intra=f32, o=P, J="i32", Tp="i32", S="i32",
               first="i32", **rows, i0="i32", **{n: "constexpr" for n in [*const, "NV"]})
    out.append(report(scan._scan_readout_kernel, sig, dict(const, NV=NV), ints=ints,
                      **launch_options(scan._scan_readout_kernel, fp32=fp32, block=BK)))
    sig = dict(qt=P, wt=P, kt=P, decay=f32, lam=f32, merge="*i32", lev="*i32", snap_at="*i32", do=P,
               dstates=f32, dsnap=P, do_intra=f32, N="i32", J="i32", Tp="i32", S="i32", **rows, i0="i32", i1="i32",
               **{n: "constexpr" for n in [*const, "TM", "ONE"]})
    out.append(report(scan._scan_dh_kernel, sig, dict(const, TM=fits, ONE=plain), ints=ints,
                      **launch_options(scan._scan_dh_kernel, plain=plain, fp32=fp32, block=BK)))
    sig = dict(wt=P, kt=P, u=P, merge="*i32", live="*i32", snap_at="*i32", lev="*i32", snap=P, dsnap=P, dwt=P,
               dkt=P, du=P, dd=f32, N="i32", Tp="i32", S="i32", SD="i32", i0="i32",
               **{n: "constexpr" for n in [*const, "NV", "TZ"]})
    out.append(report(scan._scan_grads_kernel, sig, dict(const, NV=NV, TZ=fits), ints=ints,
                      **launch_options(scan._scan_grads_kernel, fp32=fp32, block=BK)))
    sig = dict(qt=P, lam=f32, snap_at="*i32", lev="*i32", snap=P, do_intra=f32, dqt=P, dlam=f32, J="i32", Tp="i32",
               S="i32", i0="i32", **{n: "constexpr" for n in [*const, "NV"]})
    out.append(report(scan._scan_readout_bwd_kernel, sig, dict(const, NV=NV), ints=ints,
                      **launch_options(scan._scan_readout_bwd_kernel, fp32=fp32, block=BK)))
    return out


def gdn_local_reports(K: int, V: int, C: int, dtype: torch.dtype, P: str, norm: bool, plain: bool) -> list[str]:
    """The four chunk-local kernels (q and k in the operand dtype; norm: their rows normalised in the kernels;
    plain: the plain path's build, no lambda)."""
    f32 = "*fp32"
    meta = local._meta(Chunking(b=2, T=8192, H=48, front=0, C=C), K, V, 1, None if plain else 18, dtype, norm)
    HP = heads_per_program(2 * meta["N"], 48, 1)  # the key backward's heads per program (fp32 sums below a group)
    parts = P if HP == 48 else f32
    runtime = dict(T="i32", front="i32", Tp="i32", N="i32", H="i32", NG="i32", L="i32", eps="fp32", n0="i32",
                   NS="i32")
    pointers = [
        (local._chunk_inverse_kernel, dict(k=P, g=P, beta=P, tg=P)),
        (local._chunk_local_kernel, dict(q=P, k=P, v=P, g=P, beta=P, lam=P, tg=P, o=f32, qt=P, wt=P, kt=P, u=P,
                                         qkg=P, decay=f32)),
        (local._chunk_local_bwd_cc_kernel, dict(v=P, g=P, beta=P, lam=P, tg=P, qkg=P, wt=P, u=P, do=f32, dqt=P,
                                                dwt=P, du=P, dv=P, dlam=P, scratch=P, dGp=f32, dbp=f32, dbk=P,
                                                Gs=f32)),
        (local._chunk_local_bwd_k_kernel, dict(q=P, k=P, g=P, beta=P, dqt=P, dkt=P, ddecay=f32, scratch=P, dGp=f32,
                                               dbp=f32, dbk=P, Gs=f32, dq=parts, dk=parts, dg=P, dbeta=P)),
    ]
    out = []
    for kernel, sig in pointers:
        args = local.kernel_meta(kernel, dict(meta, n0=0, NS=meta["N"], HP=HP))
        sig = dict(sig, **{n: runtime.get(n, "constexpr") for n in args})
        const = {n: x for n, x in args.items() if n not in runtime}
        ints = {n: x for n, x in args.items() if runtime.get(n) == "i32"}
        out.append(report(kernel, sig, const, ints=ints, **launch_options(kernel, fp32=meta["fp32"])))
    return out


def gdn_reports(args: argparse.Namespace) -> list[str]:
    """The Gated DeltaNet scan and chunk-local kernels at the op's chunk and block choices."""
    dtype, K, V = DTYPES[args.dtype], args.K, args.V
    C = kernel_chunk_size(64, chunking.chunk_cap(dtype, K))
    P, prec = "*" + args.dtype, dot_precision(dtype, chunking.FP32_DOT)
    print(f"triton {triton.__version__}, gated_deltanet, {args.dtype}, K={K}, V={V}, C={C}, precision {prec}"
          + ", q/k l2norm in the kernels" * args.l2norm)
    local_reports = gdn_local_reports(K, V, C, dtype, P, args.l2norm, args.plain)
    return gdn_scan_reports(K, V, C, dtype, P, prec, args.plain) + local_reports


class KernelRecorder:
    """Stands in for a kernel of decode.py: ``kernel[grid](*args, **kwargs)`` appends (kernel, args, kwargs) to
    ``launches`` instead of launching it."""

    def __init__(self, fn: JITFunction, launches: list[tuple[JITFunction, tuple, dict]]) -> None:
        self.fn, self.launches, self.__name__ = fn, launches, fn.__name__  # launch_options looks kernels up by name

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def recorded_launches(step: Callable[[], object]) -> list[tuple[JITFunction, tuple, dict]]:
    """The launches of decode.py's kernels that step() makes, recorded instead of run, in launch order: (kernel, its
    positional arguments, its keywords: constexprs and launch options)."""
    launches: list[tuple[JITFunction, tuple, dict]] = []
    kernels = {n: x for n, x in vars(decode).items() if isinstance(x, JITFunction) and n.endswith("_kernel")}
    with contextlib.ExitStack() as stack:
        for name, fn in kernels.items():
            stack.enter_context(mock.patch.object(decode, name, KernelRecorder(fn, launches)))
        step()
    return launches


def launch_build(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """A recorded launch's build: its signature (tensors pointers to their dtype, floats fp32, ints i32, i64 past
    that range), constexprs, runtime ints (report specialises them as the JIT does: aligned, constant_ones) and launch
    options (num_warps, num_stages, maxnreg)."""
    names = fn.arg_names[:len(args)]
    types = {n: mangle_type(x, specialize=False) for n, x in zip(names, args)}
    const = {n: x for n, x in kwargs.items() if n in fn.arg_names}
    sig = {n: "constexpr" if n in const else types[n] for n in fn.arg_names}
    ints = {n: x for n, x in zip(names, args) if type(x) is int}
    return sig, const, ints, {n: x for n, x in kwargs.items() if n not in fn.arg_names}


def decode_paths(args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    """Each path of the decode step (label -> a call of fused_decode_step on meta tensors) for --batch sequences N
    of --heads heads H at --context tokens: q, k [N, G, K] and v [N, H, V] in --dtype (G = 1 for Mamba-2, else H, as
    in the models), the gates, lambda [N, H, L], log-scales and window fp32 (the models' dtypes); Gated DeltaNet
    with q / k normalised in the kernels, as its models run."""
    N, H, K, V, x = args.batch, args.heads, args.K, args.V, DTYPES[args.dtype]
    G, L, gdn = 1 if args.variant == "mamba2" else H, levels_needed(args.context + 1), args.variant == "gdn"
    channels = (K,) if args.variant == "gla" else ()  # GLA: a decay per key channel
    meta = dict(device="meta")
    q, k, v = (torch.empty(N, G, K, dtype=x, **meta), torch.empty(N, G, K, dtype=x, **meta),
               torch.empty(N, H, V, dtype=x, **meta))
    g, lam, positions = (torch.empty(N, H, *channels, **meta), torch.empty(N, H, L, **meta),
                         torch.empty(N, dtype=torch.int64, **meta))
    beta = torch.empty(N, H, **meta) if gdn else None

    def step(dtype: torch.dtype, in_place: bool, lazy: bool, fenwick: bool = True) -> Callable[[], object]:
        levels = torch.empty(N, L if fenwick else 1, H, K, V, dtype=dtype, **meta)
        log_scales = torch.empty(N, L, H, *channels, **meta) if lazy else None
        window = KeyWindow.empty_at(positions, args.key_window, G, H, K, V, torch.float32) if lazy and gdn else None
        return lambda: decode.fused_decode_step(q, k, v, g, beta, lam, levels, positions, 1.0, fenwick=fenwick,
                                                l2norm_qk=gdn, out=levels if in_place else None,
                                                log_scales=log_scales, window=window)

    return {
        "log-linear, out of place, fp32 levels (one-token op calls)": step(torch.float32, False, False),
        "log-linear, in place, lazy fp32 levels (CUDA-graph decoding)": step(torch.float32, True, True),
        "log-linear, in place, lazy bf16 levels (CUDA-graph decoding's level_dtype)": step(torch.bfloat16, True, True),
        "plain, out of place": step(torch.float32, False, False, fenwick=False),
        "plain, in place (CUDA-graph decoding)": step(torch.float32, True, False, fenwick=False),
    }


def decode_reports(args: argparse.Namespace) -> list[str]:
    """Each decode path's label, then a report line per kernel launch in launch order, with the launch's tile
    constexprs (ints but BK) and the flags that are on; a build that an earlier path launched is not compiled again.
    --sass: build i's listing is <i>_<kernel>.sass."""
    print(f"triton {triton.__version__}, {args.variant} decode step, {args.dtype} q/k/v, K={args.K}, V={args.V}, "
          f"{args.batch} sequences x {args.heads} heads, {levels_needed(args.context + 1)} levels (context "
          f"{args.context})" + f", key window {args.key_window}" * (args.variant == "gdn"))
    out, built = [], {}
    for label, step in decode_paths(args).items():
        out.append(label + ":")
        for fn, call_args, kwargs in recorded_launches(step):
            sig, const, ints, options = build = launch_build(fn, call_args, kwargs)
            key = repr((fn.__name__, build))
            if key not in built:
                tiles = [f"{n}={x}" for n, x in const.items() if type(x) is int and n in kwargs and n != "BK"]
                flags = [n for n, x in const.items() if x is True]
                line = report(fn, sig, const, ints=ints, sass_name=f"{len(built)}_{fn.__name__}", **options)
                built[key] = line + f"  ({' '.join(tiles)}; {' '.join(flags)})"
            out.append("  " + built[key])
    return out


def check_args(args: argparse.Namespace) -> None:
    """Refuse (one line, status 2) options the script would not honour or could not build."""
    if args.decode and (args.has_init or args.plain or args.chunk is not None or args.l2norm):
        refuse("compile_sm90.py", "--has-init, --plain, --chunk and --l2norm apply to the training kernels; "
               "--decode builds every path of the decode step")
    check_script_options("compile_sm90.py", {"--batch": (args.batch, 1), "--heads": (args.heads, 1),
                                             "--context": (args.context, 0)})
    if not key_window_size_ok(args.key_window):
        refuse("compile_sm90.py",
               f"--key-window must be a power of two from 2 to {MAX_KEY_WINDOW}, got {args.key_window}")
    if args.chunk is not None and args.variant == "gdn":
        refuse("compile_sm90.py", "--chunk applies to mamba2 and gla; gdn compiles at its own chunk rule")
    if args.chunk is not None and (args.chunk & (args.chunk - 1) or not 16 <= args.chunk <= mamba2.MAX_CHUNK):
        refuse("compile_sm90.py", f"--chunk must be a power of two from 16 to {mamba2.MAX_CHUNK}, got {args.chunk}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant", choices=["mamba2", "gla", "gdn"])
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--has-init", action="store_true", help="mamba2, gla: the build for calls with initial states")
    ap.add_argument("--plain", action="store_true",
                    help="the plain path's build (level_scales=None; gdn: the chains' ONE, the chunk-local PLAIN)")
    ap.add_argument("--heads-per-program", type=int, default=48,
                    help="mamba2: heads the dk / dv (plain: and dq) kernel sums per program (48: paper setting, 32K)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="mamba2, gla: the kernels' chunk (the op's chunk_size, 16 to 64; default 64)")
    ap.add_argument("--l2norm", action="store_true", help="gdn: the chunk-local kernels with NORM (use_qk_l2norm)")
    ap.add_argument("--sass", type=Path, default=None, help="write each kernel's SASS listing into this folder")
    ap.add_argument("--decode", action="store_true",
                    help="the decode step's kernels (decode.py) on each of its paths instead of the training ones")
    ap.add_argument("--batch", type=int, default=16, help="--decode: sequences decoding together")
    ap.add_argument("--heads", type=int, default=48, help="--decode: value heads (48: paper setting)")
    ap.add_argument("--context", type=int, default=1 << 16, help="--decode: tokens before the step (its levels)")
    ap.add_argument("--key-window", type=int, default=KEY_WINDOW, help="--decode, gdn: tokens of the key window")
    args = ap.parse_args()
    check_args(args)
    if args.sass is not None:
        global SASS_DIR
        SASS_DIR = args.sass
        SASS_DIR.mkdir(parents=True, exist_ok=True)
    reports = decode_reports if args.decode else gdn_reports if args.variant == "gdn" else mamba2_reports
    for line in reports(args):
        print(line)


if __name__ == "__main__":
    main()
