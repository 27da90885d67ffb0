#!/usr/bin/env bash
# Host shards beside a GPU worker, in one call on a machine with a CUDA GPU: where a step of the 20M
# MLP loses its time when 4 host shards update over shared memory (async), and whether the pull-ahead
# pays at fewer update threads a shard.
#  1. benchmarks/host_contention.py: the worker's compute + gradient copy alone, beside a copy to the
#     GPU (a thread of its own process, then another process), beside S x T update threads, and both;
#  2. gpu_workers.py --ab-pull-ahead: pull_ahead off and on in turn beside no servers, for each
#     --apply-threads value (APPLY_THREADS, default "0,2,1"; 0 is the shards' default);
#  3. benchmarks/host_step_parts.py: each step's compute cut into its kernel launches, the wait for
#     them and the gradient's copy, pull_ahead off and on (its pull on one thread and a thread a shard).
# Logs land in $OUT. PARTS="3" runs only that part.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PARTS=${PARTS:-1 2 3}
part() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "cores $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"
if part 1; then
  echo "== 1. what slows the step: the host's memory, PCIe or the interpreter lock"
  python3 benchmarks/host_contention.py --updates "${UPDATES:-4x4,4x2,4x1}" --json "$OUT/host-contention.jsonl" \
    2>&1 | tee "$OUT/host-contention.log"
fi
if part 2; then
  echo "== 2. the pull-ahead A/B by the shards' update threads: 4 host shards over shared memory, async"
  python3 benchmarks/gpu_workers.py --ab-pull-ahead "${AB_REPEATS:-3}" --apply-threads "${APPLY_THREADS:-0,2,1}" \
    --steps 150 --json "$OUT/host-pull-ahead.jsonl" 2>&1 | tee "$OUT/host-pull-ahead.log" | grep -v '^{'
fi
if part 3; then
  echo "== 3. a step's parts: launches, the wait for the kernels, the gradient's copy"
  python3 benchmarks/host_step_parts.py --repeats "${AB_REPEATS:-3}" --json "$OUT/host-step-parts.jsonl" \
    2>&1 | tee "$OUT/host-step-parts.log" | grep -v '^{'
fi
