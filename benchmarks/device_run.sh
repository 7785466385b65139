#!/bin/bash
# The device work of issues 3, 5, 6 and 8 in parts of under 10 minutes each (extra options go to the part's
# main command, e.g. `mqar --threads 2 --merge`, `multigpu --parts fsdp cp_exact cp_long`).
#
#   bash benchmarks/device_run.sh checks         # ~5 min: kernel checks, GDN first (bf16 at the benchmark shape)
#   bash benchmarks/device_run.sh bench-mamba2   # ~6 min: host time per call, then the same-run Mamba-2 table
#   bash benchmarks/device_run.sh bench-gdn      # ~7 min: the same-run GDN table, then its profile with the A/B
#   bash benchmarks/device_run.sh mqar           # ~5 min on 2 GPUs per seed: the MQAR sweep (MQAR_SEEDS="0 1 2")
#   bash benchmarks/device_run.sh lm             # ~9.5 min, all GPUs: five LMs (same tokens), per-position loss, NIAH
#   bash benchmarks/device_run.sh cp-profile     # ~4 min, 2+ GPUs: where a context-parallel step's time goes (issue 8)
#   bash benchmarks/device_run.sh multigpu       # ~8 min, 2+ GPUs: context parallel, 128K-1M tokens (issue 8)
#
# Parts run side by side on one machine, each on its own GPUs with its own RESULTS and OUT (session 14 on
# nvidia-h200-x4: checks on GPU 0, bench-gdn on GPU 1, mqar on GPUs 2-3); limit each one's CPU threads
# (session 12: with CPU-heavy work beside it on the host our ops' small-T rows were host-bound):
#   export OMP_NUM_THREADS=4
#   (CUDA_VISIBLE_DEVICES=0 RESULTS=/tmp/r0 OUT=$OUT/g0 bash benchmarks/device_run.sh checks > $OUT/g0.log 2>&1) &
#   (CUDA_VISIBLE_DEVICES=1 RESULTS=/tmp/r1 OUT=$OUT/g1 bash benchmarks/device_run.sh bench-gdn > $OUT/g1.log 2>&1) &
#   wait
#
# Run from the repository root. Results go to $RESULTS (default /tmp/device-results) as they come, and are packed
# into $OUT/results-<part>.tgz (or under $RESULTS) after every step, so a cut keeps what finished. FLA_WHEELS=<dir>
# installs the fla wheel first (the baselines; see the device README on carrying wheels). Every step has its own
# time limit; the benchmarks list our impl first and the largest T first (fla compiles for >100 s on a fresh machine).
set -u
PART=${1:?usage: device_run.sh checks|bench-mamba2|bench-gdn|mqar|lm|cp-profile|multigpu [extra options]}
shift
EXTRA=("$@")  # appended to the part's main command (e.g. mqar --threads 2, multigpu --gpus 4)
R=${RESULTS:-/tmp/device-results}
PACK=${OUT:-$R}/results-$PART.tgz
mkdir -p "$R" "$(dirname "$PACK")"
if [ -n "${FLA_WHEELS:-}" ]; then
  # installed once: on a two-GPU machine the parts run side by side (CUDA_VISIBLE_DEVICES=0 / 1)
  [ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$FLA_WHEELS"/*.whl
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
TS="131072 65536 32768 16384 8192 4096 2048"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# checkpoints (the lm part's, ~180 MB per model) stay behind: the metrics, reports and logs are what comes back
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

# CUDA MPS lets the MQAR sweep's 8 processes per GPU run their small kernels side by side instead of
# time-slicing the GPU (session 13, without it: 65-100 ms per step); off again if a CUDA client cannot start.
mps_start() {
  command -v nvidia-cuda-mps-control > /dev/null || { say "no MPS"; return; }
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  # the daemon sees every GPU, so a client's CUDA_VISIBLE_DEVICES (e.g. 2,3 beside benchmarks on 0,1) means the same
  env -u CUDA_VISIBLE_DEVICES nvidia-cuda-mps-control -d && timeout 60 python -c "import torch; torch.ones(1, device='cuda').sum().item()" \
    && { say "MPS on"; return; }
  say "MPS failed, off"; mps_stop
}
mps_stop() { echo quit | nvidia-cuda-mps-control 2> /dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }

case $PART in
  checks)  # ~5 min: GDN first (bf16 at the benchmark's shape: the session-13 kernel changes), then Mamba-2
    step 200 check-gdn python benchmarks/bench_ops.py --variant gdn --check --no-bench --check-dtypes bfloat16 float32 \
      --long-T 131072 --out "$R"
    step 100 check-mamba2 python benchmarks/bench_ops.py --check --no-bench --check-dtypes bfloat16 float32 \
      --long-T 262144 --out "$R"
    ;;
  bench-mamba2)  # ~6 min: host time per call, then the same-run table (largest T first: 128K is always reached)
    step 40 diag-host python benchmarks/diag_host_overhead.py --T 8192
    step 330 bench-mamba2 python benchmarks/bench_ops.py --impls loglinear fla_mamba2 fla_log_linear sdpa_flash \
      --T $TS --sdpa-max-T 32768 --profile-T 32768 --out "$R"
    ;;
  bench-gdn)  # ~8 min (session 13: 230 s reached 32K only; fla_gdn compiles for ~2 min on a fresh machine)
    step 400 bench-gdn python benchmarks/bench_ops.py --variant gdn --impls loglinear fla_gdn sdpa_flash \
      --T $TS --sdpa-max-T 16384 --out "$R"
    step 90 profile-gdn python benchmarks/profile_gdn.py --T 32768 131072 --ab --out "$R"
    ;;
  mqar)  # ~9 min on two GPUs (issue 6): one seed of the Zoology-style sweep, docs/experiments.md "Next GPU run"
    mps_start
    step 560 mqar python -m loglinear.cli mqar --preset gpu --seeds ${MQAR_SEEDS:-0} --budget 420 --grace 60 \
      --out "$R/mqar-h200" "${EXTRA[@]}"
    mps_stop
    ;;
  lm)  # ~9.5 min, all GPUs (issue 6): the five language models spread over the GPUs, then their evaluation
    step 570 lm python benchmarks/run_experiments.py --no-mqar --budget 540 --out "$R/exp" --tag h200 "${EXTRA[@]}"
    ;;
  cp-profile)  # ~4 min, 2 GPUs (issue 8): one profiled step per rank of CP at 128K and of its 64K baseline
    cp benchmarks/results/multigpu-*.json "$R"/ 2>/dev/null
    step 290 cp-profile python benchmarks/run_multigpu.py --parts cp_long --long-seq-lens 131072 --profile-long \
      --budget 200 --out "$R"
    ;;
  multigpu)  # ~8 min on two or more GPUs (issue 8): context parallel after e81b40f, then the long lengths
    cp benchmarks/results/multigpu-*.json "$R"/ 2>/dev/null  # the rows not redone (FSDP2) are kept
    step 560 multigpu python benchmarks/run_multigpu.py --parts cp_exact cp_long \
      --long-seq-lens 131072 262144 524288 1048576 --budget 470 --out "$R" "${EXTRA[@]}"
    ;;
  *)
    echo "unknown part $PART (checks|bench-mamba2|bench-gdn|mqar|lm|cp-profile|multigpu)" >&2
    exit 2
    ;;
esac
say "done"
