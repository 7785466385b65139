"""The one launch-config rule: num_warps / num_stages (and a register cap where set) of every kernel launch, from
one per-kernel table (launch_options), and the one way to launch (launch: a build over an SM's shared memory at
fewer stages).

Under TRITON_INTERPRET=1 every kernel gets one fixed config (no device queries, no autotune benchmarking on
CPU tensors). On the GPU the table's values were tuned on an H200 (sm_90, triton 3.6; compile with
benchmarks/profiling/compile_sm90.py, time with benchmarks/profiling/tune_gdn_local.py and tune_mamba2.py):

  * Mamba-2 chunk kernels (mamba2/chunk.py): at bf16, K = 128, V = 64 every one fits 4 warps (the dq and dk / dv
    kernels at 255 registers, two programs per SM, spilling 20 / 232 B, the latter summing 48 heads); those with a
    loop over levels or readers pipeline its loads (num_stages > 1: the next bucket / reader chunk is in flight
    during the current one's GEMM), and so does the dk / dv kernel's loop over a group's heads, but only on the
    log-linear path (224 B of spills and 107 KB of shared memory against 200 B and 57 KB at one stage; measured on an
    H100 at 8K / 32K / 128K per forward + backward: 2.62 -> 2.58, 10.48 -> 10.32, 43.21 -> 42.56 ms); plain Mamba-2
    ran 6% slower with it (6.40 -> 6.79 ms at 32K) and GLA the same (``plain``, ``channel``: one stage). The
    initial levels' gradient (calls with a state) is capped at 168 registers (``max_registers``: 212-217 by
    ptxas's choice, two programs per SM; at 168 three, without spills in bf16, and 5.6 KB of spills in fp32
    against 19 KB uncapped): 0.343 -> 0.270 ms at 32K on an H100 (one process per tree, alternating, two rounds).
    The level gradient takes the same cap (205 by ptxas's choice since its readers' rows are masked at the
    sequence's first token too; at 168 no spills in bf16 and 418 instructions per reader against 442 before the
    mask; fp32 5.5 KB of spills; not timed on a GPU). The deposit kernel, whose programs walk a block of four
    chunks with two fp32 [128, 64] tiles (255 registers, no spills), takes 4 warps and one stage: on an H100 at
    32K, 8 warps gave the same for Mamba-2 and GLA 2% slower, 8 warps and two stages 3% / 7% slower, rows in two
    programs of 64 1.6% slower (mamba2/backend.py DEPOSIT_ROWS).
  * The same chunk kernels with fp32 operands (``fp32``; tf32x3 products, whose split operands double a pipeline
    stage's shared memory): the chunk forward, dq and dk / dv kernels at one stage, the level gradient at 8 warps,
    one stage and no cap (under the cap it spills 5.5 KB in fp32). Timed one kernel at a time at 8K on an H100
    (benchmarks/results/tune-mamba2-fp32-H100-80GB-HBM3.md: fp32 forward + backward 19.2 ms at the 16-bit
    launches; level gradient 16.7, dk / dv 17.8, dq 18.2, chunk forward 19.1, gradients equal to the bit), together
    14.2 ms. The per-channel and plain builds keep their configs in fp32.
  * Mamba-2 scans (mamba2/fwd.py, mamba2/bwd.py): one program per (sequence, head, block of 16 state rows), 4
    warps. The gate gradient's sums over later chunks (mamba2_gate_later_kernel, one program per (sequence,
    head)): 4 warps, not tuned (0.07 ms at 32K); so are the seeded first chunks' reads (mamba2/seeds.py: one wave
    of programs per call; the backward at 8 warps, 252 registers without spills at bf16, K = 128, V = 64:
    compile_sm90.py mamba2 --has-init).
  * The same chunk kernels with a per-channel gate (GLA, C = 64) take 4 warps too, two programs per SM (248-255
    registers; the dq and dk / dv kernels spill 48 / 636 B; at 152 / 528 B they ran 25% / 23% faster than at 8
    warps without spills on the H200 at 32K, and over 10x faster than at 2 warps); the level gradient's readers take
    8 warps and one stage (``channel``: 114 registers; 1.75 ms per forward + backward at 32K, 2.13 with three stages).
    The in-chunk kernels (shared/intra_channel.py) take 4 warps (80-142 registers, no spills, several programs per
    SM) but the dQ kernel 2 (149 registers; 3.6 ms at 32K against 4.6 at 4 warps, where 2 warps made the scores
    and dK kernels slower).
  * Gated DeltaNet chunk-local kernels (gated_deltanet/local.py): at 4 warps the inverse (167 registers),
    the forward and the [C, C] backward (255 registers each) run 3, 2 and 2 programs per SM, which hide each
    other's products. The [C, C] backward spills 8 B at 4 warps and none at 8 (one program per SM), yet runs
    4.0 ms per forward + backward at 32K at 4 warps against 7.2 at 8 on the H200. The key backward takes 4
    warps, with a group's heads per program (which hold the heads' sums of dQ and dK) at key block 32
    (gated_deltanet/local.py: plain Gated DeltaNet at 32K 15.11 ms per forward + backward on the H200 against 15.42
    at 8 warps and key block 128, and 16.30 at 4 warps and 128), with one head per program (G = H, as in the
    training models: the op at 12 heads of K = 64, 4 x 16K tokens) at the whole key: 6.24-6.32 ms plain and
    9.33-9.41 log-linear against 6.66-6.68 and 9.81 at 8 warps.
  * Gated DeltaNet scan kernels (gated_deltanet/scan.py): 8 warps for the sequential chains' [K, BV] states (at 4
    they spill 1.3-1.8 KB); on the plain schedule (``plain``: the state in registers, two products per chunk) 4
    warps and three stages: plain Gated DeltaNet 16.73 -> 16.30 ms per forward + backward at 32K, 66.2 -> 64.6 at
    128K against the Wm form at 8 warps (chains 1.61 + 1.76 -> 1.46 + 1.49 ms at 32K; 2 warps spill and run 9x
    slower, one stage 3% slower); the chunk-parallel grads kernel takes 4 (254 registers, no spills: 3.1 ms per forward
    + backward at 32K against 4.5 at 8 warps), the readout backward 4, two programs per SM without spills.
  * Their fp32 builds (``fp32``): the readout at 4 warps, the dh chain and the readout backward at one stage, the
    [C, C] local backward at two (benchmarks/results/tune-gdn-fp32-H100-80GB-HBM3.md, one kernel at a time at 8K
    on an H100; together 58.9 ms per fp32 forward + backward against 65.1 at the 16-bit launches, gradients equal
    to the bit). The fp32 builds spill at every launch tried; the gain is occupancy.
  * Gradients of q and k with G < H (Mamba-2's dk / dv kernel, and its dq kernel on the plain path; a scalar gate):
    one program loops over ``heads_per_program`` heads of one q/k group and sums their dk / dq in registers, so the
    per-head gradients ([tokens, H, K], written and summed again in torch: 0.21 ms each at 32K) never reach memory;
    as many heads per program as keep CHUNK_PROGRAMS programs in flight (about four waves of two programs on an
    H200's 132 SMs). Measured at 32K on the H200 (per forward + backward): plain Mamba-2 6.61 -> 5.97 ms (dq kernel
    1.18 -> 1.15, dk / dv 1.80 -> 1.61, no sums in torch); log-linear 10.30 -> 10.13 with the dq kernel per head,
    which spills when it also carries the heads' sum (255 registers, 272 B against 16; 3.51 ms against 2.76).
  * The decode step (decode.py): the level kernel at 2 warps for a [32, 64] tile (a decay-only transition's row
    block: 10-30% faster than 4 warps, and than 64- or 128-row blocks, at batch 16 and 64K on the H200), 4 for
    whole-column tiles (the delta rule, the plain step); the finish kernel (the readout sum and the log-scales),
    the key window's query kernel and its turn kernel, 4 warps (the turn at 1 stage: 96-117 registers compiled for
    sm_90 at K = 192, 168 at 2 stages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.runtime.errors import OutOfResources

from loglinear.ops.triton.shared.common import alloc, interpreting

INTERPRETER = {"num_warps": 1, "num_stages": 1}
# A pipeline stage holds one loop iteration's operand tiles, [C, block] each: with a key or value block above
# WIDE_BLOCK a kernel takes at most WIDE_STAGES stages (the table's stages were tuned at K = 128, V = 64; plain Gated
# DeltaNet's chains at three stages of K = 256 tiles need 300 KB of shared memory, an H100 / H200 SM has 227 KB)
WIDE_BLOCK = 128
WIDE_STAGES = 2
WIDE_STATE_TILE = 128 * 32  # state-tile elements above which a kernel with wide_warps takes them
# launch(): a build over the SM's shared memory is launched again at one stage fewer (off in the tuning scripts, which
# report a candidate that does not fit instead of timing another build under its name)
STEP_DOWN = True
CHUNK_PROGRAMS = 1024  # fewest programs a chunk kernel summing a group's heads is cut into (heads_per_program)


@dataclass(frozen=True)
class Launch:
    """A kernel's GPU launch config: num_warps, num_stages, (scans over state tiles) the warps for a state tile
    of more than WIDE_STATE_TILE elements, (chunk kernels with a PER_CHANNEL switch) (num_warps, num_stages)
    with a per-channel gate, (kernels with a plain build: the delta-rule chains, Mamba-2's dk / dv kernel) on the
    plain path (None: the same as the general build's), the general build's register cap per thread (ptxas's
    maxnreg; None: ptxas's own choice), and (num_warps, num_stages) of the general build for fp32 operands, without
    a register cap (None: the 16-bit build's config)."""

    num_warps: int
    num_stages: int
    wide_warps: int | None = None
    channel: tuple[int, int] | None = None
    plain: tuple[int, int] | None = None
    max_registers: int | None = None
    fp32: tuple[int, int] | None = None


LAUNCH: dict[str, Launch] = {
    # Mamba-2
    "mamba2_deposit_kernel": Launch(4, 1),
    "mamba2_fwd_kernel": Launch(4, 2),
    "mamba2_chunk_fwd_kernel": Launch(4, 2, fp32=(4, 1)),
    "mamba2_chunk_bwd_dq_kernel": Launch(4, 2, fp32=(4, 1)),
    "mamba2_level_grad_kernel": Launch(4, 3, channel=(8, 1), max_registers=168, fp32=(8, 1)),
    "mamba2_initial_grad_kernel": Launch(4, 3, channel=(8, 3), max_registers=168),
    "mamba2_initial_reads_kernel": Launch(4, 1),
    "mamba2_bwd_scan_kernel": Launch(4, 2),
    "mamba2_chunk_bwd_dkv_kernel": Launch(4, 2, channel=(4, 1), plain=(4, 1), fp32=(4, 1)),
    "mamba2_gate_grad_kernel": Launch(4, 1),
    "mamba2_gate_later_kernel": Launch(4, 3),
    # a state inside a chunk: the seeded first chunks' reads (mamba2/seeds.py), one program per (sequence, head)
    "seed_reads_kernel": Launch(4, 1),
    "seed_reads_bwd_kernel": Launch(8, 1),
    # the in-chunk block with a per-channel gate (GLA)
    "channel_cumsum_kernel": Launch(4, 1),
    "channel_scores_kernel": Launch(4, 1),
    "channel_dq_kernel": Launch(2, 1),
    "channel_dk_kernel": Launch(4, 1),
    # Gated DeltaNet, chunk-local stage
    "_chunk_inverse_kernel": Launch(4, 2),
    "_chunk_local_kernel": Launch(4, 2),
    "_chunk_local_bwd_cc_kernel": Launch(4, 1, fp32=(4, 2)),
    "_chunk_local_bwd_k_kernel": Launch(4, 2),
    # Gated DeltaNet, Fenwick delta scan
    "_scan_fwd_kernel": Launch(8, 2, plain=(4, 3)),
    "_scan_readout_kernel": Launch(8, 2, fp32=(4, 2)),
    "_scan_dh_kernel": Launch(8, 2, plain=(4, 3), fp32=(8, 1)),
    "_scan_grads_kernel": Launch(4, 2),
    "_scan_readout_bwd_kernel": Launch(4, 2, fp32=(4, 1)),
    # the fused decode step: its levels, then the readout sum and the lazy levels' log-scales; the key window's
    # projected queries before them and its turn beside them
    "_decode_level_kernel": Launch(2, 3, wide_warps=4),
    "_decode_finish_kernel": Launch(4, 1),
    "_decode_query_kernel": Launch(4, 1),
    "_decode_turn_kernel": Launch(4, 1),
}


def launch_options(kernel, state_tile: int = 0, per_channel: bool = False, plain: bool = False,
                   fp32: bool = False, block: int = 0) -> dict[str, int]:
    """num_warps / num_stages (and maxnreg: a general build's max_registers) for launching ``kernel`` (a @triton.jit
    function, looked up in LAUNCH by name); state_tile: the elements of the state tile one program holds (kernels
    with wide_warps); per_channel: the kernel runs with a per-channel gate (kernels with a ``channel`` config);
    plain: the kernel's build for the plain path (kernels with a ``plain`` config); fp32: its operands are fp32
    (kernels with an ``fp32`` config, on the general build); block: the widest key or value block of the tiles its
    loop loads (above WIDE_BLOCK: at most WIDE_STAGES stages). The fixed INTERPRETER config under
    TRITON_INTERPRET=1."""
    config = LAUNCH[kernel.__name__]
    if interpreting():
        return dict(INTERPRETER)
    special = config.channel if per_channel else config.plain if plain else config.fp32 if fp32 else None
    options: dict[str, int]
    if special is not None:
        options = {"num_warps": special[0], "num_stages": special[1]}
    else:
        warps = config.num_warps
        if config.wide_warps is not None and state_tile > WIDE_STATE_TILE:
            warps = config.wide_warps
        options = {"num_warps": warps, "num_stages": config.num_stages}
        if config.max_registers is not None:
            options["maxnreg"] = config.max_registers
    if block > WIDE_BLOCK:
        options["num_stages"] = min(options["num_stages"], WIDE_STAGES)
    return options


def _build(kernel, args: tuple, kwargs: dict) -> tuple:
    """What picks a kernel's compiled build, as far as its shared memory goes: the kernel, its keyword arguments
    (constexprs and launch options) but num_stages, and the dtypes of its tensors."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k != "num_stages" and not isinstance(v, torch.Tensor)))
    return kernel, options, tuple(t.dtype for t in tensors)


_STAGES: dict[tuple, int] = {}  # launch(): the stages a build stepped down to (_build), so later calls start there


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), kwargs holding its launch_options. A build whose pipeline stages need more shared
    memory than the device's SM has (Triton's OutOfResources, raised when the compiled kernel is loaded, before
    anything runs) is launched again at one stage fewer, down to one: the table's stages were tuned at the paper's
    widths, and a wider key or value (Mamba-2's dk / dv at K = 256, V = 128; GLA's fp32 dq at K = V = 128) must
    still run. The stages it ran at are kept per build (Triton raises again at every launch of a build that does not
    fit), and later launches of that build start there. compile_sm90.py reports the stages each build launches at."""
    if _STAGES and STEP_DOWN:  # (no key is formed until some build has stepped down)
        stages = _STAGES.get(_build(kernel, args, kwargs))
        if stages is not None:
            kwargs = {**kwargs, "num_stages": min(kwargs.get("num_stages", 1), stages)}
    while True:
        try:
            kernel[grid](*args, **kwargs)
            return
        except OutOfResources as error:
            stages = kwargs.get("num_stages", 1)
            if not STEP_DOWN or stages <= 1 or error.name != "shared memory":
                raise
            kwargs = {**kwargs, "num_stages": stages - 1}
            _STAGES[_build(kernel, args, kwargs)] = stages - 1


def heads_per_program(rows: int, heads: int, groups: int, per_head: bool = False) -> int:
    """How many value heads of one q/k group a program of a group-summing chunk kernel loops over: the largest
    divisor of heads // groups that leaves rows * heads / it >= CHUNK_PROGRAMS programs (1 if none does, or when
    ``per_head``: a gradient that must stay per head). rows: the kernel's chunk rows."""
    group = heads // groups
    if per_head:
        return 1
    fits = [d for d in range(1, group + 1) if group % d == 0 and rows * heads // d >= CHUNK_PROGRAMS]
    return max(fits, default=1)


def group_parts(rows: int, lead: tuple[int, ...], heads: int, groups: int, K: int, dtype: torch.dtype,
                device: torch.device, per_head: bool = False) -> tuple[int, torch.Tensor]:
    """The heads per program HP of a group-summing chunk kernel (heads_per_program) and its output
    [*lead, heads / HP, K], each program's sum over its heads: in dtype when that is one head or a whole group, else
    fp32 (summed again per group after the kernel, common.group_sum)."""
    HP = heads_per_program(rows, heads, groups, per_head)
    return HP, alloc((*lead, heads // HP, K), dtype if HP in (1, heads // groups) else torch.float32, device)
