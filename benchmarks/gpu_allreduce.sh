#!/usr/bin/env bash
# The all-reduce baseline on the GPU (issue 20), in one call on a machine with CUDA GPUs:
#  1. the GPU tests of the device optimizers (fused CuPy kernels against the host optimizers) and of
#     the all-reduce on the device (one rank against the host optimizer; two ranks under mpiexec,
#     NCCL where they have GPUs of their own, the host's MPI with a one-line note where they share one);
#  2. benchmarks/gpu_allreduce.py: psctl allreduce with one rank against no servers (local SGD on the
#     GPU) on the 20M and 51.6M MLPs at batch 512, and two ranks sharing the GPU.
# Logs and JSON land in $OUT. On the lent device: wheels for what its image lacks travel in .whl/.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import cupy; from mpi4py import MPI; print('cupy', cupy.__version__, MPI.Get_library_version().splitlines()[0])"
python3 -c "from cupy.cuda import nccl; print('nccl', nccl.get_version())" || echo "cupy.cuda.nccl: not available"

echo "== 1. GPU tests: device optimizers against the host ones, the all-reduce on the device"
python3 -m pytest -q -p no:cacheprovider tests/test_device_optim.py tests/test_allreduce.py \
  -o addopts="--strict-markers -ra" 2>&1 | tee "$OUT/gpu-allreduce-tests.log" | tail -8

echo "== 2. psctl allreduce on the GPU against no servers"
for b in "" "--bind-to none"; do mpiexec -n 1 $b python3 -c "import os; print(\"mpiexec -n 1 $b: cores a rank may use:\", len(os.sched_getaffinity(0)))"; done
python3 benchmarks/gpu_allreduce.py --json "$OUT/gpu-allreduce.jsonl" --steps "${STEPS:-500}" --runs-out /tmp/gpu-allreduce-runs "$@" 2>&1 \
  | tee "$OUT/gpu-allreduce.log"
tar -C /tmp -czf "$OUT/gpu-allreduce-runs.tgz" gpu-allreduce-runs 2>/dev/null
