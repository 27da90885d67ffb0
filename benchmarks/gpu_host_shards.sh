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
#  4. the shards' check of a gradient for NaN, NumPy's min and max (theirs) against BLAS's dot product
#     (the one before, shard_variants.py): host_bandwidth.py by threads, host_contention.py beside the
#     worker's step, and host_step_parts.py's pull-ahead in training, each check in turn.
# Logs land in $OUT. PARTS="3" runs only that part.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PARTS=${PARTS:-1 2 3 4}
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
if part 4; then
  echo "== 4. the shards' check for NaN: NumPy's min and max against BLAS's dot product"
  python3 benchmarks/host_bandwidth.py --params 20M --threads 4,8,16 --json "$OUT/host-bandwidth.jsonl" \
    2>&1 | tee "$OUT/host-bandwidth.log"
  python3 benchmarks/host_contention.py --updates 4x4 --checks none,numpy,blas --no-uploads \
    --json "$OUT/host-contention-checks.jsonl" 2>&1 | tee "$OUT/host-contention-checks.log"
  python3 benchmarks/host_step_parts.py --repeats "${AB_REPEATS:-3}" --variants ahead-posted --checks numpy,blas \
    --json "$OUT/host-step-parts-checks.jsonl" 2>&1 | tee "$OUT/host-step-parts-checks.log" | grep -v '^{'
fi
