#!/usr/bin/env bash
# Issue 37: synthetic-20m's stale modes at the job's own settings, 5 seeds at 2, 4 and 8 workers, with few
# jobs at a time. The earlier probes ran 8-10 jobs at once on 32 cores (load average 52-93 at their end):
# here two at a time on each GPU, 8 workers on GPU 0 and 2 and 4 on GPU 1 (on one GPU set GPUS="0 0"),
# so that what spreads is the training, not the machine. The load is printed every 30 s.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nproc
(while sleep 30; do uptime; done) &
ticker=$!
read -r gpu_a gpu_b <<< "${GPUS:-0 1}"
limit=${LIMIT_S:-470}
export SKIP_ENV=1 JOB=examples/synthetic-20m.toml MODES=async,ssp:2 SEEDS=0,1,2,3,4 PARALLEL=${PARALLEL:-2}
CUDA_VISIBLE_DEVICES=$gpu_a WORKERS=8 TAG=-w8 timeout -k 10 -s INT "$limit" bash benchmarks/gpu_job_defaults.sh 'job:' &
a=$!
CUDA_VISIBLE_DEVICES=$gpu_b WORKERS=2,4 TAG=-w24 timeout -k 10 -s INT "$limit" bash benchmarks/gpu_job_defaults.sh 'job:' &
b=$!
wait "$a" "$b"
kill "$ticker"
uptime
