#!/usr/bin/env bash
# psctl compare on a GPU machine, in one call: the 20M-parameter synthetic MLP and the digits CNN,
# every mode (sync, async, ssp:2 and the all-reduce baseline) with 1 and 2 workers on the GPUs there
# are (workers take GPU local_rank % count), the shards as CPU processes on the same host.
# Reports land in $OUT/gpu-mlp20m and $OUT/gpu-cnn (docs/experiments/gpu-* are copies of them).
# On the lent device: wheels for what its image lacks travel in .whl/ (MPICH and mpi4py among them).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
export HYDRA_IFACE=lo UCX_TLS=self,sm UCX_NET_DEVICES=lo FI_TCP_IFACE=lo
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc
python3 -c "import cupy, mpi4py; from mpi4py import MPI; print('cupy', cupy.__version__, 'mpi4py', mpi4py.__version__, MPI.Get_library_version().splitlines()[0])"
mpiexec -n 2 python3 -c "from mpi4py import MPI; c = MPI.COMM_WORLD; print('rank', c.rank, 'of', c.size, c.allreduce(c.rank))"
psctl() { python3 -m psgrid.cluster.cli "$@"; }

echo "== warm-up: CuPy compiles its kernels once per machine; keep that out of the timed runs"
for cfg in examples/synthetic-20m.toml examples/digits-cnn.toml; do
  rm -rf /tmp/warm && psctl launch --config "$cfg" --device gpu --steps 5 --epochs 0 --workers 1 --out /tmp/warm \
    --no-progress 2>&1 | tail -1
done

echo "== 20M-parameter MLP on synthetic data"
psctl compare --config examples/synthetic-20m.toml --device gpu --modes sync,async,ssp:2,allreduce \
  --workers 1,2 --steps 200 --eval-every 25 --out "$OUT/gpu-mlp20m" --no-progress "$@" 2>&1 | tail -12
echo "== CNN on digits"
psctl compare --config examples/digits-cnn.toml --device gpu --modes sync,async,ssp:2,allreduce \
  --workers 1,2 --epochs 0 --steps 300 --eval-every 25 --out "$OUT/gpu-cnn" --no-progress "$@" 2>&1 | tail -12
# Each run's folder is large (every step's metrics, logs): keep the experiment's own files only.
for d in "$OUT"/gpu-mlp20m "$OUT"/gpu-cnn; do
  tar -C "$d" -czf "$d/runs.tgz" runs && rm -rf "$d/runs"
done
