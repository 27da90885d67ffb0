#!/usr/bin/env bash
# Your own model through psgrid.init, against the same script alone, in one call on a machine with a CUDA
# GPU, PyTorch, torchvision and CuPy (issue: "your own model is first-class"):
#  1. the user API's tests on this GPU (tests/test_api.py, tests/test_dlpack.py, the worker core's);
#  2. psctl bench script on torchvision's ResNet-18 and a 27M torch.nn.TransformerEncoder
#     (benchmarks/torch_models.py) and examples/train_cupy.py: device shards (shard_device auto), sync
#     and async, 1 worker and 2 sharing the GPU, each repeat's ratio to the script alone (torch.optim.SGD);
#  3. the built-in trainer's 20M MLP, async, on a device shard (no regression: >= 0.9x of no servers).
# REPEATS (default 3), STEPS (default 300), PARTS ("1 2 3"), MODELS ("resnet18 transformer"), PLACEMENTS
# (shard_placement: "process", or "process,worker" for the shard in the worker's process too) and CUPY_LAYERS
# ("1 3"; empty: none) narrow it; MODELS="" runs no torch model. MPS=1 runs it all under an MPS control daemon
# of the script's own (device_env.sh mps_on), the alone runs included. Logs land in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PARTS=${PARTS:-1 2 3}
REPEATS=${REPEATS:-3}
STEPS=${STEPS:-300}
part() { [[ " $PARTS " == *" $1 "* ]]; }
LOG="$OUT/gpu-scripts.log"
exec > >(tee "$LOG") 2>&1
date -u +"%Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, torchvision, cupy; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'cupy', cupy.__version__)"
if [ "${MPS:-0}" = 1 ]; then
  mps_on || exit 1
  echo "under an MPS control daemon of this script's own ($CUDA_MPS_PIPE_DIRECTORY)"
fi

if part 1; then
  echo "== 1. the user API's tests on the GPU"
  python3 -m pytest -q -p no:cacheprovider tests/test_api.py tests/test_dlpack.py tests/test_worker_core.py \
    -m "not mpi" -o addopts="--strict-markers -ra" 2>&1 | tail -4
fi
if part 2; then
  for model in ${MODELS-resnet18 transformer}; do
    echo "== 2. psctl bench script: $model through psgrid.init (device shards) against torch.optim.SGD alone"
    psctl bench script --device gpu --modes "${SCRIPT_MODES:-sync,async}" --workers "${SCRIPT_WORKERS:-1,2}" \
      --repeats "$REPEATS" --skip 30 --shard-placement "${PLACEMENTS:-process}" \
      -- python benchmarks/torch_models.py "$model" --steps "$STEPS"
  done
  for layers in ${CUPY_LAYERS-1 3}; do
    echo "== 2. psctl bench script: examples/train_cupy.py, its own CuPy MLP, $layers hidden layer(s) of 4096"
    psctl bench script --device gpu --modes "${SCRIPT_MODES:-sync,async}" --workers "${SCRIPT_WORKERS:-1,2}" \
      --repeats "$REPEATS" --skip 30 --shard-placement "${PLACEMENTS:-process}" \
      -- python examples/train_cupy.py --steps "$STEPS" --hidden 4096 --layers $layers --batch-size 512 \
      --eval-every 0
  done
fi
if part 3; then
  echo "== 3. the built-in 20M MLP on a device shard, async (psctl bench train)"
  psctl bench train --device gpu --shard-device gpu --models mlp --hidden 4096,4096 --batch-size 512 --shards 1 \
    --workers 1 --modes async,sync --steps 300 --repeats "$REPEATS" --shard-placement "${PLACEMENTS:-process}"
fi
