#!/usr/bin/env bash
# psctl bench train on a CUDA GPU with its no-servers reference beside each repeat: the built-in 20M MLP
# (784-4096-4096-10, batch 512), one device shard in a process of its own and in the worker's, one worker,
# async and sync, 300 steps, REPEATS repeats (default 3). The log lands in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee "$OUT/gpu-paired-train.log") 2>&1
date -u +"%Y-%m-%d %H:%M UTC"; git log --oneline -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
uptime
psctl bench train --device gpu --shard-device gpu --models mlp --hidden 4096,4096 --batch-size 512 --shards 1 \
  --workers 1 --modes async,sync --steps 300 --repeats "${REPEATS:-3}" --shard-placement process,worker 2>&1 \
  | grep -v "^psgrid shard"
uptime
