#!/usr/bin/env bash
# benchmarks/ipc_step_timeline.py on a CUDA GPU: where examples/train_cupy.py's step over CUDA IPC spends its time,
# worker and shard on one clock; sync and async, then both under an MPS daemon of this script's own. LAYERS,
# STEPS, MODES narrow it. The log lands in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/gpu-timeline.log") 2>&1
date -u +"%Y-%m-%d %H:%M UTC"; git log --oneline -1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
uptime
run() { python3 benchmarks/ipc_step_timeline.py --layers "${LAYERS:-3}" --steps "${STEPS:-300}" "$@" 2>&1 | grep -v "^psgrid shard"; }
for mode in ${MODES:-sync async}; do run --mode "$mode"; done
mps_on && echo "== under MPS" && for mode in ${MODES:-sync async}; do run --mode "$mode"; done
mps_off
