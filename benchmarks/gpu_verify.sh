#!/usr/bin/env bash
# Everything the GPU issue asks to see, in one call on a machine with CUDA GPUs:
# the model and loader tests on CuPy (compared with NumPy), then benchmarks/gpu_workers.py.
# On the lent device: wheels for what its image lacks travel in .whl/ (see docs/architecture.md).
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
