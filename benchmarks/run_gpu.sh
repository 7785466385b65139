#!/bin/bash
# Every GPU benchmark and experiment of the repository, in parts of under 10 minutes each (checks: one variant at a
# time). Run from the repository root; extra options go to the part's main command (e.g. `mqar --threads 2 --merge`,
# `multigpu --parts fsdp cp_exact cp_long`).
#
#   bash benchmarks/run_gpu.sh checks         # Triton kernels vs the torch path (bf16, fp32), every variant, one
#                                             #   section each within its step's limit (7-8 min; Triton compiles on
#                                             #   a fresh machine: `checks mamba2` took 6 min on an H100, `checks
#                                             #   gla` more than 5); `checks mamba2|gdn|gla`: one variant's section
#   bash benchmarks/run_gpu.sh bench-mamba2   # ~6 min: ops-mamba2-<gpu>.* and the profile at 32K
#   bash benchmarks/run_gpu.sh bench-gdn      # ~8-9 min: ops-gdn-<gpu>.* (8K-128K, then 2K-4K merged in)
#   bash benchmarks/run_gpu.sh profile-gdn    # ~4 min: profile-gdn-<gpu>.md and profile-gdn-plain-<gpu>.md
#                                             #   (beside fla's kernels)
#   bash benchmarks/run_gpu.sh bench-gla      # ~7 min: ops-gla-<gpu>.* (16K-128K, against fla's chunk_gla), the profile at 32K
#   bash benchmarks/run_gpu.sh bench-gla-wide # < 10 min (8 on an H100): ops-gla-wide-<gpu>.* and the profile,
#                                             #   profile-ops-gla-wide-<gpu>.log (fla's GLA head shape: 4 heads,
#                                             #   K = 256, V = 512, at 32K; fla's chunk_gla compiles and autotunes
#                                             #   there for over 5 min on a fresh machine)
#   bash benchmarks/run_gpu.sh state          # ~4 min: ops-{mamba2,gdn}-state-<gpu>.* and profile-state-<gpu>.md
#                                             #   (calls with an incoming state, and where their cost goes)
#   bash benchmarks/run_gpu.sh packed         # ~3 min: ops-{gdn,mamba2}-packed-<gpu>.* (the same tokens as packed
#                                             #   sequences, cu_seqlens)
#   bash benchmarks/run_gpu.sh fp32           # ~6 min: ops-{mamba2,gla,gdn}-fp32-<gpu>.* (fp32 calls against the
#                                             #   same inputs in bf16)
#   bash benchmarks/run_gpu.sh tune-mamba2    # ~5 min: tune-mamba2-<gpu>.* (the Mamba-2 chunk kernels' launch
#                                             #   choices, one kernel at a time; `tune-mamba2 --variant gla --plain`,
#                                             #   `tune-mamba2 --dtype float32 --T 8192`: the fp32 builds')
#   bash benchmarks/run_gpu.sh tune-gdn       # ~3 min: tune-gdn-local-<gpu>.* (the GDN chunk-local kernels' launches
#                                             #   and key blocks; `tune-gdn --dtype float32 --T 8192`: the fp32
#                                             #   builds' launches, scan kernels included: tune-gdn-fp32-<gpu>.*)
#   bash benchmarks/run_gpu.sh train          # ~3 min: train-<gpu>.* (12 x d768 training steps, five models)
#   bash benchmarks/run_gpu.sh convert-fla    # ~6 min: convert-fla-<gpu>.* (fla checkpoints vs our conversions)
#   bash benchmarks/run_gpu.sh decode         # ~5 min: decode-<gpu>.* (per-token latency and cache memory)
#   bash benchmarks/run_gpu.sh mqar           # ~5 min on 2 GPUs per seed: mqar-h200.* (MQAR_SEEDS="0 1 2"; more
#                                             #   models into the committed sweep: mqar --archs gla ll_gla --merge)
#   bash benchmarks/run_gpu.sh lm             # ~9.5 min, all GPUs: five LMs (same tokens), per-position loss, NIAH
#   bash benchmarks/run_gpu.sh cp-profile     # ~4 min, 2+ GPUs: one profiled context-parallel step per rank
#   bash benchmarks/run_gpu.sh multigpu       # ~8 min, 2+ GPUs: context parallel exactness, 128K-1M tokens
#
# Parts can run side by side on one machine, each on its own GPUs with its own RESULTS; limit each one's CPU
# threads (with CPU-heavy work beside them on the host, the ops' small-T rows become host-bound):
#   export OMP_NUM_THREADS=4
#   (CUDA_VISIBLE_DEVICES=0 RESULTS=/tmp/r0 bash benchmarks/run_gpu.sh checks > /tmp/g0.log 2>&1) &
#   (CUDA_VISIBLE_DEVICES=1 RESULTS=/tmp/r1 bash benchmarks/run_gpu.sh bench-gdn > /tmp/g1.log 2>&1) &
#   wait
#
# Results go to $RESULTS (default /tmp/gpu-results) as they come, with one log per step, and are packed into
# $PACK_DIR/results-<part>.tgz (default: under $RESULTS) after every step, so a cut keeps what finished; copy the
# result files into benchmarks/results. FLA_WHEELS=<dir> installs the fla wheels from that folder first (fla-core
# is the baselines' package; the `bench` extra installs it from the index instead). Every step has its own time
# limit; the op benchmarks list our impl first and the largest T first (fla compiles for > 100 s on a fresh machine).
#
# On machines that start fresh each time, TRITON_CACHE_TGZ=<file.tgz> carries the compiled kernels (ours and fla's,
# with fla's autotuning choices) from one machine to the next: the file, when it exists, is unpacked into
# /tmp/triton-cache (TRITON_CACHE_DIR; the cache records absolute paths, so the folder is fixed) before the part,
# and the cache is packed back into it after the part. Unchanged kernels then load instead of compiling.
set -u
PART=${1:?usage: run_gpu.sh checks|bench-mamba2|bench-gdn|profile-gdn|bench-gla|bench-gla-wide|state|packed|fp32|tune-mamba2|tune-gdn|train|convert-fla|decode|mqar|lm|cp-profile|multigpu [extra options]}
shift
EXTRA=("$@")
R=${RESULTS:-/tmp/gpu-results}
PACK=${PACK_DIR:-$R}/results-$PART.tgz
mkdir -p "$R" "$(dirname "$PACK")"
if [ -n "${FLA_WHEELS:-}" ]; then
  # installed once: parts running side by side share it
  [ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$FLA_WHEELS"/*.whl
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
if [ -n "${TRITON_CACHE_TGZ:-}" ]; then
  export TRITON_CACHE_DIR=/tmp/triton-cache
  mkdir -p "$TRITON_CACHE_DIR"
  [ -f "$TRITON_CACHE_TGZ" ] && tar xzf "$TRITON_CACHE_TGZ" -C /tmp
  # packed on exit, through a temporary file: parts side by side each write a whole file
  trap 'tar czf "$TRITON_CACHE_TGZ.$$" -C /tmp triton-cache && mv "$TRITON_CACHE_TGZ.$$" "$TRITON_CACHE_TGZ"' EXIT
fi
TS="131072 65536 32768 16384 8192 4096 2048"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# checkpoints (the lm part's, ~180 MB per model) stay behind: metrics, reports and logs are what is packed
pack() {
  tar czf "/tmp/results-$PART.tgz" -C "$R" --exclude "results-*.tgz" --exclude "*.pt" . && mv "/tmp/results-$PART.tgz" "$PACK"
}
step() {  # step <seconds> <log name> <command...>
  local limit=$1 name=$2
  shift 2
  say "$name: $*"
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  say "$name: exit $?"
  grep -v -i "warn" "$R/$name.log" | tail -12
  pack
}

# CUDA MPS lets the MQAR sweep's many small processes per GPU run their kernels side by side instead of
# time-slicing the GPU; off again if a CUDA client cannot start.
mps_start() {
  command -v nvidia-cuda-mps-control > /dev/null || { say "no MPS"; return; }
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  # the daemon sees every GPU, so a client's CUDA_VISIBLE_DEVICES means the same
  env -u CUDA_VISIBLE_DEVICES nvidia-cuda-mps-control -d && timeout 60 python -c "import torch; torch.ones(1, device='cuda').sum().item()" \
    && { say "MPS on"; return; }
  say "MPS failed, off"; mps_stop
}
mps_stop() { echo quit | nvidia-cuda-mps-control 2> /dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }

case $PART in
  checks)  # GDN first (bf16 at the benchmark's shape), then Mamba-2, then GLA; or the variants named
    cp benchmarks/results/correctness-*.log "$R"/ 2>/dev/null  # the sections not redone are kept
    variants=("${EXTRA[@]}")
    [ ${#variants[@]} -gt 0 ] || variants=(gdn mamba2 gla)
    for variant in "${variants[@]}"; do
      case $variant in
        gdn) step 420 check-gdn python benchmarks/bench_ops.py --variant gdn --check --no-bench \
               --check-dtypes bfloat16 float32 --long-T 131072 --out "$R" ;;
        mamba2) step 500 check-mamba2 python benchmarks/bench_ops.py --check --no-bench --check-dtypes bfloat16 \
                  float32 --long-T 262144 --out "$R" ;;
        gla) step 420 check-gla python benchmarks/bench_ops.py --variant gla --check --no-bench \
               --check-dtypes bfloat16 float32 --long-T 262144 --out "$R" ;;
        *) echo "unknown variant $variant for checks (gdn|mamba2|gla)" >&2; exit 2 ;;
      esac
    done
    ;;
  bench-mamba2)  # largest T first: 128K is always reached
    step 400 bench-mamba2 python benchmarks/bench_ops.py --impls loglinear loglinear_plain fla_mamba2 fla_log_linear \
      sdpa_flash --T $TS --sdpa-max-T 32768 --profile-T 32768 --out "$R" "${EXTRA[@]}"
    ;;
  bench-gdn)  # fla_gdn compiles for ~2 min on a fresh machine: the large T first, the small ones merged in after
    gdn=(python benchmarks/bench_ops.py --variant gdn --impls loglinear loglinear_plain fla_gdn sdpa_flash
      --sdpa-max-T 32768 --out "$R")
    step 440 bench-gdn "${gdn[@]}" --T 131072 65536 32768 16384 8192 "${EXTRA[@]}"
    step 100 bench-gdn-small "${gdn[@]}" --T 4096 2048 --merge "${EXTRA[@]}"
    ;;
  profile-gdn)
    step 150 profile-gdn python benchmarks/profiling/profile_gdn.py --T 32768 131072 --ab --one-stream-ab --out "$R"
    step 150 profile-gdn-plain python benchmarks/profiling/profile_gdn.py --plain --fla --T 32768 --out "$R"
    ;;
  bench-gla)  # fla's chunk_gla compiles and autotunes for minutes on a fresh machine
    step 480 bench-gla python benchmarks/bench_ops.py --variant gla --impls loglinear loglinear_plain fla_gla \
      sdpa_flash --T 131072 65536 32768 16384 --sdpa-max-T 32768 --profile-T 32768 --out "$R" "${EXTRA[@]}"
    ;;
  bench-gla-wide)  # ours first: fla's compile and autotuning at this shape take most of the part
    step 570 bench-gla-wide python benchmarks/bench_ops.py --variant gla --impls loglinear loglinear_plain fla_gla \
      --shape 2 4 4 256 512 --T 32768 --profile-T 32768 --name ops-gla-wide --out "$R" "${EXTRA[@]}"
    ;;
  state)  # the cost of an incoming state (a context-parallel rank's call) against the same call without one
    # expandable segments: at 128K a Gated DeltaNet call with a state comes near an 80 GB card's capacity, where the
    # default allocator's retries would be timed too
    step 140 state-mamba2 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/bench_ops.py \
      --impls loglinear loglinear_state loglinear_state_inside --T 131072 32768 8192 --name ops-mamba2-state --out "$R"
    step 170 state-gdn env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/bench_ops.py \
      --variant gdn --impls loglinear loglinear_state loglinear_state_inside --T 131072 32768 8192 \
      --name ops-gdn-state --out "$R"
    step 120 profile-state python benchmarks/profiling/profile_state.py --out "$R"
    ;;
  packed)  # packed sequences (cu_seqlens) against the same tokens as rows
    step 120 packed-gdn python benchmarks/bench_ops.py --variant gdn --impls loglinear loglinear_packed \
      --T 32768 8192 --name ops-gdn-packed --out "$R"
    step 60 packed-mamba2 python benchmarks/bench_ops.py --impls loglinear loglinear_packed --T 32768 8192 \
      --name ops-mamba2-packed --out "$R"
    ;;
  fp32)  # the loglinear_fp32 row (fp32 calls, tf32x3 products) beside bf16 on the same inputs, every variant
    for variant in mamba2 gla gdn; do
      step 200 fp32-$variant python benchmarks/bench_ops.py --variant $variant --impls loglinear loglinear_fp32 \
        --T 32768 8192 --name ops-$variant-fp32 --out "$R"
    done
    ;;
  tune-mamba2)  # a row per candidate, each with its own baseline: a cut keeps what ran
    step 330 tune-mamba2 python benchmarks/profiling/tune_mamba2.py --T 32768 --budget 270 --out "$R" "${EXTRA[@]}"
    ;;
  tune-gdn)  # written after every candidate: a cut keeps what ran
    step 240 tune-gdn python benchmarks/profiling/tune_gdn_local.py --T 32768 --budget 150 --out "$R" "${EXTRA[@]}"
    ;;
  train)
    step 200 train python benchmarks/bench_train.py --archs transformer mamba2 ll_mamba2 gated_deltanet \
      ll_gated_deltanet --out "$R" "${EXTRA[@]}"
    ;;
  convert-fla)  # fla's models: the bench extra, or FLA_WHEELS holding both fla wheels (fla-core, flash-linear-attention)
    step 400 convert-fla python benchmarks/experiments/check_fla_conversion.py --out "$R"
    ;;
  decode)
    step 560 decode python benchmarks/bench_decode.py --steps 15 --out "$R" "${EXTRA[@]}"
    ;;
  mqar)  # one seed of the MQAR sweep at the paper's setting on two GPUs; more seeds: MQAR_SEEDS, --merge
    cp benchmarks/results/mqar-h200.json "$R"/ 2>/dev/null  # what --merge keeps (rewritten without it)
    mps_start
    step 560 mqar python -m loglinear.cli mqar --preset gpu --seeds ${MQAR_SEEDS:-0} --budget 420 --grace 60 \
      --out "$R/mqar-h200" "${EXTRA[@]}"
    mps_stop
    ;;
  lm)  # the five language models spread over the GPUs, then their evaluation
    step 570 lm python benchmarks/experiments/run_experiments.py --no-mqar --budget 540 --out "$R/exp" \
      --tag h200-seed0 "${EXTRA[@]}"
    ;;
  cp-profile)  # one profiled step per rank of context parallelism at 128K and of its 64K baseline
    cp benchmarks/results/multigpu-*.json "$R"/ 2>/dev/null
    step 290 cp-profile python benchmarks/experiments/run_multigpu.py --parts cp_long --long-seq-lens 131072 \
      --profile-long --budget 200 --out "$R"
    ;;
  multigpu)  # the rows not redone (e.g. FSDP2) are kept from the committed json
    cp benchmarks/results/multigpu-*.json "$R"/ 2>/dev/null
    step 560 multigpu python benchmarks/experiments/run_multigpu.py --parts cp_exact cp_long \
      --long-seq-lens 131072 262144 524288 1048576 --budget 470 --out "$R" "${EXTRA[@]}"
    ;;
  *)
    echo "unknown part $PART (checks|bench-mamba2|bench-gdn|profile-gdn|bench-gla|bench-gla-wide|state|packed|fp32|tune-mamba2|tune-gdn|train|convert-fla|decode|mqar|lm|cp-profile|multigpu)" >&2
    exit 2
    ;;
esac
say "done"
