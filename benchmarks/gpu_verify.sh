#!/usr/bin/env bash
# Everything the GPU code paths need to show, in one call on a machine with CUDA GPUs:
# the model and loader tests on CuPy (compared with NumPy), benchmarks/gpu_workers.py, and the
# default job trained by GPU workers through psctl launch (twice: a first and a warm run).
# On the lent device: wheels for what its image lacks travel in .whl/ (see the device notes).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import grpc, google.protobuf, cupy; print('grpc', grpc.__version__, 'protobuf', google.protobuf.__version__, 'cupy', cupy.__version__)"
echo "== GPU tests (CuPy against NumPy) and the model/data/backend tests on this machine"
python3 -m pytest -q -p no:cacheprovider tests/test_models.py tests/test_data.py tests/test_backend.py \
  -o addopts="--strict-markers -ra" 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
echo "== worker figures"
python3 benchmarks/gpu_workers.py --json "$OUT/gpu-workers.jsonl" "$@" 2>&1 | tee "$OUT/gpu-workers.log"
echo "== the default job on GPU workers (psctl launch), a first run and a second"
for run in first second; do
  rm -rf "/tmp/launch-$run"
  python3 -m psgrid.cluster.cli launch --config examples/mnist.toml --device gpu --out "/tmp/launch-$run" \
    --no-progress 2>&1 | tail -2 | tee -a "$OUT/gpu-launch.log"
  cp "/tmp/launch-$run/summary.json" "$OUT/launch-$run-summary.json" 2>/dev/null
done
