#!/usr/bin/env bash
# Issue 37: does a decaying rate (lr_schedule = "cosine", the shards' schedule over the job's updates)
# settle a GPU job's final accuracy across seeds in every mode? One call:
#  1. the device shard's GPU tests that the schedule touches (the rate on the device kernel, 0 included);
#  2. JOB (default synthetic-20m) with --set lr_schedule=cosine, every mode at 2, 4 and 8 workers, seeds
#     0-2 on one GPU and 3-4 on the other (SEEDS_A, SEEDS_B; GPUS="0 0" on one GPU), cut at LIMIT_S
#     (finished runs are kept).
# SETTINGS overrides the probe's settings (default 'cosine:lr_schedule="cosine"'); SKIP_TESTS=1 leaves out part 1.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
uptime
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider -o addopts="--strict-markers -ra" \
    tests/test_device_shard.py -k "applies_what_a_host_shard_applies" tests/test_device_optim.py 2>&1 | tail -3
fi
(while sleep 60; do uptime; done) &
ticker=$!
read -r gpu_a gpu_b <<< "${GPUS:-0 1}"
limit=${LIMIT_S:-420}
export SKIP_ENV=1 JOB=${JOB:-examples/synthetic-20m.toml} MODES=${MODES:-sync,async,ssp:2} WORKERS=${WORKERS:-2,4,8}
read -r -a settings <<< "${SETTINGS:-cosine:lr_schedule=\"cosine\"}"
CUDA_VISIBLE_DEVICES=$gpu_a SEEDS=${SEEDS_A:-0,1,2} PARALLEL=${PARALLEL_A:-3} TAG=-a timeout -k 5 -s INT "$limit" \
  bash benchmarks/gpu_job_defaults.sh "${settings[@]}" &
a=$!
CUDA_VISIBLE_DEVICES=$gpu_b SEEDS=${SEEDS_B:-3,4} PARALLEL=${PARALLEL_B:-2} TAG=-b timeout -k 5 -s INT "$limit" \
  bash benchmarks/gpu_job_defaults.sh "${settings[@]}" &
b=$!
wait "$a" "$b"
kill "$ticker"
uptime
