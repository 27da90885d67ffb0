#!/usr/bin/env bash
# Does asynchrony-aware momentum help Adam in the stale modes (issue 37)? W asynchronous workers add about
# 1 - 1/W of momentum by themselves (Mitliagkas et al. 2016; psserver/kernels/compensation.py), which
# `async_momentum = "auto"` takes off SGD's momentum. Here Adam's beta1 is lowered the same way by hand,
# beta1 = max(0, 0.9 - (1 - 1/W)): 0.4 at 2 workers, 0.15 at 4, 0.025 at 8, one probe setting per count.
# On a machine of two GPUs (nvidia-h200-x2) synthetic-cnn runs on GPU 0 and synthetic-20m on GPU 1 at the
# same time; on one GPU, set GPUS="0 0". Every run's figures: $OUT/probe-*/probe.csv and $OUT/probe-*.log.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
uptime
read -r gpu_cnn gpu_20m <<< "${GPUS:-0 1}"
b1=('b1@2:beta1=0.4' 'b1@4:beta1=0.15' 'b1@8:beta1=0.025')
limit=${LIMIT_S:-520}
export SKIP_ENV=1
CUDA_VISIBLE_DEVICES=$gpu_cnn JOB=examples/synthetic-cnn.toml MODES=async,ssp:2 WORKERS=2,4,8 SEEDS=0,1 \
  PARALLEL=${PARALLEL:-4} timeout -k 10 -s INT "$limit" bash benchmarks/gpu_job_defaults.sh "${b1[@]}" &
CUDA_VISIBLE_DEVICES=$gpu_20m JOB=examples/synthetic-20m.toml MODES=async,ssp:2 WORKERS=2,4,8 SEEDS=0,1 \
  PARALLEL=${PARALLEL:-4} timeout -k 10 -s INT "$limit" bash benchmarks/gpu_job_defaults.sh "${b1[@]}" &
wait
uptime
