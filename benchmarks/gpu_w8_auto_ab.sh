#!/usr/bin/env bash
# Issue 37: at 8 workers, where beta1 0.9 and the implicit momentum of asynchrony (0.875) add up most, does
# async_momentum = "auto" (beta1 0.025) help synthetic-20m? Both settings side by side, async and ssp:2,
# seeds 0-2 on GPU 0 and 3-4 on GPU 1 (on one GPU set GPUS="0 0"), cut at LIMIT_S (finished runs are kept).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=index,name --format=csv,noheader
(while sleep 30; do uptime; done) &
ticker=$!
read -r gpu_a gpu_b <<< "${GPUS:-0 1}"
limit=${LIMIT_S:-190}
export SKIP_ENV=1 JOB=examples/synthetic-20m.toml MODES=${MODES:-async} WORKERS=8 PARALLEL=${PARALLEL:-3}
ab=('off:async_momentum="off"' 'auto:async_momentum="auto"')
CUDA_VISIBLE_DEVICES=$gpu_a SEEDS=0,1,2 TAG=-a timeout -k 5 -s INT "$limit" bash benchmarks/gpu_job_defaults.sh "${ab[@]}" &
a=$!
CUDA_VISIBLE_DEVICES=$gpu_b SEEDS=3,4 TAG=-b timeout -k 5 -s INT "$limit" bash benchmarks/gpu_job_defaults.sh "${ab[@]}" &
b=$!
wait "$a" "$b"
kill "$ticker"
uptime
