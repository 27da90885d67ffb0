#!/usr/bin/env bash
# Issue 37: does async_momentum = "auto" (Adam's beta1 lowered by 1 - 1/W) make synthetic-20m's stale
# modes steadier than beta1 0.9? Both settings side by side (the probe runs a point's settings together),
# async and ssp:2, 5 seeds: 2 workers on GPU 0 and 4 on GPU 1 (on one GPU set GPUS="0 0"). First the
# device optimizers' GPU tests, beta1 changed between steps among them.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
uptime
python3 -m pytest -q -o addopts="--strict-markers -ra" -p no:cacheprovider -m gpu tests/test_device_optim.py 2>&1 | tail -3
read -r gpu_a gpu_b <<< "${GPUS:-0 1}"
limit=${LIMIT_S:-500}
export SKIP_ENV=1 JOB=examples/synthetic-20m.toml MODES=async,ssp:2 SEEDS=0,1,2,3,4 PARALLEL=${PARALLEL:-5}
ab=('off:async_momentum="off"' 'auto:async_momentum="auto"')
CUDA_VISIBLE_DEVICES=$gpu_a WORKERS=2 TAG=-w2 timeout -k 10 -s INT "$limit" bash benchmarks/gpu_job_defaults.sh "${ab[@]}" &
CUDA_VISIBLE_DEVICES=$gpu_b WORKERS=4 TAG=-w4 timeout -k 10 -s INT "$limit" bash benchmarks/gpu_job_defaults.sh "${ab[@]}" &
wait
uptime
