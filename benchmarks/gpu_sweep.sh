#!/usr/bin/env bash
# samples/s and the step's breakdown (pull, compute, push, wait) against model size and shard count,
# on one GPU, in one call: psctl bench train for the MLP at 1.9M, 5.8M, 20.0M and 51.6M parameters,
# 1, 2 and 4 shards, async and sync, one worker, beside the same model with no servers. One JSON
# line per run in $OUT/gpu-sweep.jsonl (docs/performance.md plots them).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader
for hidden in 1024,1024 2048,2048 4096,4096 6800,6800; do
  python3 -m psgrid.cluster.cli bench train --device gpu --models mlp --hidden "$hidden" --batch-size 512 \
    --shards 1,2,4 --workers 1 --modes async,sync --steps ${STEPS:-60} --json | tee -a "$OUT/gpu-sweep.jsonl"
done
