#!/usr/bin/env bash
# A script's copies fused into its own tensors (worker/fused_copies.py: pulls scattered into the parameters,
# sync pushes gathered into the shard's CUDA IPC slot) against the tree before, in one call on a CUDA GPU:
#  1. the change's GPU tests and those of the paths it touches (SKIP_TESTS=1 skips them);
#  2. benchmarks/script_step_ab.py (each model's step alone and through psgrid.init interleaved in one
#     process, the device shard in a process of its own) in REV's tree unpacked in .prev/ (carried:
#     git archive REV | tar -x -C .prev) and in this one, each installed editable in turn, ROUNDS rounds;
#  3. with MPS=1, this tree once more under an MPS daemon of its own.
# MODELS (default "cupy-mlp:3 cupy-mlp:1 resnet18 transformer"; cupy-mlp:L is L hidden layers of 4096),
# MODES, BLOCKS and STEPS narrow it. The log lands in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee "$OUT/gpu-fused-ab.log") 2>&1
date -u +"%Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,utilization.gpu --format=csv,noheader
uptime
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== 1. GPU tests"
  python3 -m pytest -q -p no:cacheprovider tests/test_fused_copies.py tests/test_api.py tests/test_dlpack.py \
    tests/test_worker_core.py tests/test_device_shard.py tests/test_pull_ahead.py -m "not mpi" \
    -o addopts="--strict-markers -ra" 2>&1 | tail -8
fi
run_models() {
  for entry in ${MODELS:-cupy-mlp:3 cupy-mlp:1 resnet18 transformer}; do
    model=${entry%%:*}
    extra=()
    [[ $entry == *:* ]] && extra=(--layers "${entry#*:}")
    echo "-- $entry"
    python3 benchmarks/script_step_ab.py "$model" "${extra[@]}" --modes "${MODES:-sync,async}" --placements process \
      --blocks "${BLOCKS:-3}" --steps "${STEPS:-60}" 2>&1 | grep -v "^psgrid shard" | tail -n +2
  done
}
install() { python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e "$1"; }
for round in $(seq "${ROUNDS:-1}"); do
  for tree in .prev .; do
    echo "== 2. round $round: $([ "$tree" = . ] && echo 'this tree' || echo "the tree before (.prev)")"
    install "$tree" && (cd "$tree" && run_models)
  done
done
install .
if [ -n "${MPS:-}" ]; then
  echo "== 3. this tree under an MPS daemon"
  mps_on && run_models
  mps_off
fi
