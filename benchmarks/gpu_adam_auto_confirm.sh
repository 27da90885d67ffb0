#!/usr/bin/env bash
# Issue 37, after async and ssp took async_momentum = "auto" for Adam (beta1 lowered by 1 - 1/W) as their
# default: synthetic-20m's async and ssp:2 at 2, 4 and 8 workers over 5 seeds, the job as shipped ('job:'),
# on GPU 1; beside it on GPU 0, rates for synthetic-cnn's stale modes (with the new default under them).
# On one GPU set GPUS="0 0". Every run's figures: $OUT/probe-*/probe.csv and $OUT/probe-*.log.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
uptime
git log --oneline -1 2>/dev/null || true
read -r gpu_cnn gpu_20m <<< "${GPUS:-0 1}"
limit=${LIMIT_S:-540}
export SKIP_ENV=1
CUDA_VISIBLE_DEVICES=$gpu_20m JOB=examples/synthetic-20m.toml MODES=async,ssp:2 WORKERS=2,4,8 SEEDS=0,1,2,3,4 \
  PARALLEL=${PARALLEL_20M:-6} timeout -k 10 -s INT "$limit" bash benchmarks/gpu_job_defaults.sh 'job:' &
CUDA_VISIBLE_DEVICES=$gpu_cnn JOB=examples/synthetic-cnn.toml MODES=async,ssp:2 WORKERS=2,8 SEEDS=0 \
  PARALLEL=${PARALLEL_CNN:-4} timeout -k 10 -s INT "$limit" bash benchmarks/gpu_job_defaults.sh 'lr5:lr=0.0005' \
  'lr3:lr=0.0003' &
wait
uptime
