#!/usr/bin/env bash
# The pull-ahead against device shards over CUDA IPC, one worker, async, in one call: the built-in 20M MLP
# (psctl bench train, without and with --pull-ahead) and examples/train_cupy.py's 3 x 4096 MLP (psctl bench
# script, pull_ahead false and true); each repeat beside a run with no servers. REPEATS (default 3). Log in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee "$OUT/gpu-pull-ahead.log") 2>&1
date -u +"%Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
uptime
for ahead in "" --pull-ahead; do
  echo "== the built-in 20M MLP, async ${ahead:-(no pull-ahead)}"
  psctl bench train --device gpu --shard-device gpu --models mlp --hidden 4096,4096 --batch-size 512 --shards 1 \
    --workers 1 --modes async --steps 300 --repeats "${REPEATS:-3}" $ahead 2>&1 | grep -v "^psgrid shard"
done
for ahead in false true; do
  echo "== examples/train_cupy.py 3 x 4096, async, pull_ahead = $ahead"
  psctl bench script --device gpu --modes async --workers 1 --repeats "${REPEATS:-3}" --skip 30 \
    --set pull_ahead=$ahead -- python examples/train_cupy.py --steps 300 --hidden 4096 --layers 3 \
    --batch-size 512 --eval-every 0 2>&1 | grep -v "^psgrid shard"
done
uptime
