#!/usr/bin/env bash
# psctl compare on a GPU machine, in one call: the 20M-parameter synthetic MLP and the digits CNN,
# every mode (sync, async, ssp:2 and the all-reduce baseline) with 1 and 2 workers on the GPUs there
# are (workers take GPU local_rank % count), the shards as CPU processes on the same host.
# Reports land in $OUT/gpu-mlp20m.tgz and $OUT/gpu-cnn.tgz (docs/experiments/gpu-* are copies of them),
# each run's own folder in $OUT/*-runs.tgz.
# On the lent device: wheels for what its image lacks travel in .whl/. The all-reduce runs use the
# machine's own MPI: the mpiexec beside python3, of the MPI that its mpi4py was built with.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc
python3 -c "import cupy, mpi4py; from mpi4py import MPI; print('cupy', cupy.__version__, 'mpi4py', mpi4py.__version__, MPI.Get_library_version().splitlines()[0])"
mpiexec -n 2 python3 -c "from mpi4py import MPI; c = MPI.COMM_WORLD; print('rank', c.rank, 'of', c.size, c.allreduce(c.rank))"

echo "== warm-up: CuPy compiles its kernels once per machine; keep that out of the timed runs"
for cfg in examples/synthetic-20m.toml examples/digits-cnn.toml; do
  rm -rf /tmp/warm && psctl launch --config "$cfg" --device gpu --steps 30 --eval-every 10 --epochs 0 --workers 1 \
    --out /tmp/warm --no-progress 2>&1 | tail -1
done

echo "== 20M-parameter MLP on synthetic data (float32 gradients: the job file's float16 costs more to encode than it saves)"
psctl compare --config examples/synthetic-20m.toml --device gpu --modes sync,async,ssp:2,allreduce \
  --workers 1,2 --steps 200 --eval-every 25 --wire-dtype float32 --target-accuracy 0.3 --out "$OUT/gpu-mlp20m" --no-progress "$@" 2>&1 | tail -12
echo "== CNN on digits"
psctl compare --config examples/digits-cnn.toml --device gpu --modes sync,async,ssp:2,allreduce \
  --workers 1,2 --epochs 0 --steps 300 --eval-every 25 --target-accuracy 0.9 --out "$OUT/gpu-cnn" --no-progress "$@" 2>&1 | tail -12
echo "== where a step's time went (means per step, seconds)"
for d in "$OUT"/gpu-mlp20m "$OUT"/gpu-cnn; do
  python3 - "$d/summary.csv" <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    f = lambda k: float(r[k]) if r[k] else float("nan")
    print(f"{r['run']:<18} {r['status']:<6} {f('samples_per_s'):>9.0f}/s pull {f('pull_s'):.4f} "
          f"compute {f('compute_s'):.4f} push {f('push_s'):.4f} wait/worker {f('mean_wait_s'):.2f} acc {f('final_test_accuracy'):.3f}")
PY
done
# Few files come back from the device: one archive per experiment, one for all runs' own folders.
for name in gpu-mlp20m gpu-cnn; do
  tar -C "$OUT" -czf "$OUT/$name-runs.tgz" "$name/runs" && rm -rf "$OUT/$name/runs"
  tar -C "$OUT" -czf "$OUT/$name.tgz" "$name" && rm -rf "$OUT/$name"
done
