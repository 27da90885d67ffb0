#!/usr/bin/env bash
# benchmarks/script_step_ab.py on a CUDA GPU: each model's step alone and through psgrid, interleaved in one
# process (device shard in a process of its own and in the worker's), with the paired ratios and, with
# PROFILE=1, where the worker's time goes. MODELS (default "cupy-mlp:1 cupy-mlp:3 resnet18 transformer";
# cupy-mlp:L is L hidden layers of 4096), MODES, PLACEMENTS, BLOCKS, STEPS narrow it. Logs land in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee "$OUT/gpu-script-ab.log") 2>&1
date -u +"%Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,utilization.gpu --format=csv,noheader
uptime
for entry in ${MODELS:-cupy-mlp:1 cupy-mlp:3 resnet18 transformer}; do
  model=${entry%%:*}
  extra=()
  [[ $entry == *:* ]] && extra=(--layers "${entry#*:}")
  echo "== $entry"
  python3 benchmarks/script_step_ab.py "$model" "${extra[@]}" --modes "${MODES:-async,sync}" \
    --placements "${PLACEMENTS:-process,worker}" --blocks "${BLOCKS:-5}" --steps "${STEPS:-100}" \
    ${PROFILE:+--profile} 2>&1 | grep -v "^psgrid shard"
done
