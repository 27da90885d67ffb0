#!/usr/bin/env bash
# Scaling on the GPUs of one host, in one call: psctl compare with 1, 2 and 4 workers (one per GPU;
# on a machine with fewer GPUs the workers share them, which measures contention, not scaling), every
# mode (sync, async, ssp:2 and the all-reduce baseline), 4 shards as CPU processes on the same host,
# for (a) the compute-bound CNN of examples/synthetic-cnn.toml and (b) the communication-bound 51.6M
# MLP of examples/synthetic-50m.toml. Beside them, CuPy's pinned copy of the MLP's bytes (the
# reference for its per-worker pull+push bandwidth). Reports land in $OUT/scaling-*.tgz.
#   bash benchmarks/gpu_scaling.sh                 # workers 1,2,4
#   WORKERS=1,2 STEPS=100 bash benchmarks/gpu_scaling.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
WORKERS=${WORKERS:-1,2,4}
STEPS=${STEPS:-200}
MODES=${MODES:-sync,async,ssp:2,allreduce}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "cores $(nproc); workers $WORKERS; steps $STEPS; modes $MODES"
python3 -c "import cupy; from mpi4py import MPI; print('cupy', cupy.__version__, MPI.Get_library_version().splitlines()[0])"

echo "== the reference: CuPy's pinned copy of the 51.6M MLP's bytes"
python3 - <<'PY' | tee "$OUT/scaling-reference.txt"
import statistics, time
import cupy, cupyx, numpy as np
n = 51_652_810
host, dev = cupyx.empty_pinned(n, np.float32), cupy.empty(n, np.float32)
h2d, d2h = [], []
for _ in range(12):
    t = time.perf_counter(); dev.set(host); cupy.cuda.Device().synchronize(); h2d.append(time.perf_counter() - t)
    t = time.perf_counter(); dev.get(out=host); d2h.append(time.perf_counter() - t)
h2d, d2h = statistics.median(h2d[2:]), statistics.median(d2h[2:])
print(f"pinned copy of {4 * n / 1e6:.0f} MB: host to device {1e3 * h2d:.2f} ms ({4 * n / h2d / 1e9:.1f} GB/s), "
      f"device to host {1e3 * d2h:.2f} ms ({4 * n / d2h / 1e9:.1f} GB/s); pull+push {1e3 * (h2d + d2h):.2f} ms")
PY

echo "== warm-up: CuPy compiles its kernels once per machine (each worker also warms up before joining)"
for cfg in examples/synthetic-cnn.toml examples/synthetic-50m.toml; do
  rm -rf /tmp/warm && psctl launch --config "$cfg" --steps 10 --eval-every 5 --workers 1 --out /tmp/warm \
    --no-progress 2>&1 | tail -1
done

for name in cnn 50m; do
  echo "== synthetic-$name: workers $WORKERS, modes $MODES"
  psctl compare --config "examples/synthetic-$name.toml" --modes "$MODES" --workers "$WORKERS" --shards 4 \
    --steps "$STEPS" --eval-every 50 --out "$OUT/scaling-$name" --no-progress 2>&1 | tail -4
  python3 - "$OUT/scaling-$name/summary.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
f = lambda r, k: float(r[k]) if r.get(k) else float("nan")
one = {r["mode"]: f(r, "samples_per_s") for r in rows if r["workers"] == "1"}
print(f"{'run':<22} {'samples/s':>10} {'efficiency':>10} {'pull ms':>8} {'compute ms':>10} {'push ms':>8} {'wait/worker s':>13}")
for r in rows:
    w = int(r["workers"]); base = one.get(r["mode"])
    eff = f(r, "samples_per_s") / (w * base) if base else float("nan")
    print(f"{r['run']:<22} {f(r, 'samples_per_s'):10.0f} {eff:10.2f} {1e3 * f(r, 'pull_s'):8.2f} "
          f"{1e3 * f(r, 'compute_s'):10.2f} {1e3 * f(r, 'push_s'):8.2f} {f(r, 'mean_wait_s'):13.2f}")
PY
  tar -C "$OUT" -czf "$OUT/scaling-$name-runs.tgz" "scaling-$name/runs" && rm -rf "$OUT/scaling-$name/runs"
  tar -C "$OUT" -czf "$OUT/scaling-$name.tgz" "scaling-$name" && rm -rf "$OUT/scaling-$name"
done
