#!/usr/bin/env bash
# [job] mps on a CUDA GPU, in one call: what one GPU context for the shard and the workers changes.
#  1. its tests: the stand-in daemon's (tests/test_job_mps.py) and the real daemon's under psctl launch --mps
#     (tests/test_device_shard.py), beside the job without MPS;
#  2. each model's step through psgrid.init against itself alone, interleaved in one process
#     (benchmarks/script_step_ab.py, the device shard in a process of its own, over CUDA IPC): without MPS,
#     then under a control daemon of this script's own (a private pipe folder, as [job] mps makes), per model;
#  3. psctl bench script: the Transformer, two workers sharing the GPU, their total against one alone,
#     without MPS and with --set mps=true;
#  4. psctl bench train: the built-in 20M MLP on a device shard, async, 1 worker, without and with mps.
# PARTS ("1 2 3 4"), MODELS (part 2; default "cupy-mlp:3 resnet18 transformer"), BLOCKS, STEPS, REPEATS narrow it.
# Logs land in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PARTS=${PARTS:-1 2 3 4}
REPEATS=${REPEATS:-2}
part() { [[ " $PARTS " == *" $1 "* ]]; }
exec > >(tee -a "$OUT/gpu-mps.log") 2>&1
date -u +"%Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,utilization.gpu,compute_mode --format=csv,noheader
uptime

if part 1; then
  echo "== 1. tests"
  python3 -m pytest -q -p no:cacheprovider tests/test_job_mps.py tests/test_device_shard.py \
    -k "mps or over_cuda_ipc" -o addopts="--strict-markers -ra" 2>&1 | tail -8
fi
if part 2; then
  for entry in ${MODELS:-cupy-mlp:3 resnet18 transformer}; do
    model=${entry%%:*}
    extra=()
    [[ $entry == *:* ]] && extra=(--layers "${entry#*:}")
    for mps in off on; do
      echo "== 2. $entry, MPS $mps"
      [ "$mps" = on ] && mps_on
      python3 benchmarks/script_step_ab.py "$model" "${extra[@]}" --modes async,sync --placements process \
        --blocks "${BLOCKS:-3}" --steps "${STEPS:-60}" 2>&1 | grep -v "^psgrid shard"
      [ "$mps" = on ] && mps_off
    done
  done
fi
if part 3; then
  for mps in false true; do
    echo "== 3. psctl bench script: the Transformer, 2 workers sharing the GPU, mps = $mps"
    psctl bench script --device gpu --modes async,sync --workers 2 --repeats "$REPEATS" --skip 30 \
      --set mps=$mps -- python benchmarks/torch_models.py transformer --steps 200
  done
fi
if part 4; then
  for mps in false true; do
    echo "== 4. psctl bench train: the built-in 20M MLP, device shard, 1 worker, mps = $mps"
    psctl bench train --device gpu --shard-device gpu --models mlp --hidden 4096,4096 --batch-size 512 --shards 1 \
      --workers 1 --modes async --steps 300 --repeats 3 --set mps=$mps
  done
fi
