#!/usr/bin/env bash
# Device shards (shard_device = "gpu") and the CUDA IPC plane, in one call on a machine with a CUDA GPU:
#  1. the GPU tests: the device shard against the host shard, its checkpoints, the IPC plane's
#     contract (other processes), the device optimizers, and the GPU data path of the other planes;
#  2. benchmarks/gpu_workers.py on the 20M MLP: no servers, device shards over CUDA IPC (1 and 4),
#     host shards over shared memory (4, async: the reference), and two workers sharing the GPU;
#  3. psctl bench train on the GPU with device shards: the MLP and the digits CNN, async and sync;
#  4. the default job (mnist) with GPU workers on device shards, to its test accuracy;
#  5. where a push and a pull over CUDA IPC spend their time (benchmarks/ipc_latency.py), and what
#     a move of the GPU between two processes' contexts costs (benchmarks/gpu_context_switch.py);
#  6. the alternating figures (gpu_workers.py --repeats, MLP and CNN, device shards beside no servers),
#     then they and part 5's measurements again under MPS: a control daemon of this script's own (a
#     private pipe directory, so only the processes started here use it), quit when the script ends;
#  7. where a step's time goes, without MPS then with it: each step's parts per repeat (gpu_workers.py
#     --repeats prints them), whether a worker's matrix products slow down right after another
#     process used the GPU (gpu_context_switch.py --mlp), and a profile of the worker's Python in sync.
#  8. GeePS' placement: the device shard in the worker's own process (the in-process plane) beside a
#     shard process of its own (CUDA IPC) and no servers, MLP and CNN, without MPS then under it; then
#     whole jobs (psctl bench train --shard-placement process,worker), one worker and two sharing the GPU.
#  9. the shard in the worker's process against no servers in alternating blocks of steps of one
#     process (benchmarks/placement_interleaved.py: the machine's drift between runs cancels), MLP and CNN.
# Logs land in $OUT. PARTS="1 2" runs only those parts.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PARTS=${PARTS:-1 2 3 4 5 6 8 9}     # 7 only when asked (PARTS=7): diagnostics
REPEATS=${REPEATS:-3}
STEPS=${STEPS:-80}
part() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "cores $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"

if part 1; then
echo "== 1. GPU tests"
python3 -m pytest -q -p no:cacheprovider tests/test_device_shard.py tests/test_device_optim.py \
  tests/test_gpu_data_path.py tests/test_pull_ahead.py -o addopts="--strict-markers -ra" -x 2>&1 | tee "$OUT/device-tests.log" | tail -25
fi

if part 2; then
echo "== 2. worker figures, 20M MLP: device shards over CUDA IPC against no servers"
python3 benchmarks/gpu_workers.py --json "$OUT/device-workers.jsonl" --planes ipc --shards 1,4 --modes async,sync \
  --workers 2 --no-overlap --steps "$STEPS" --skip-two-gpu 2>&1 | tee "$OUT/device-workers.log" | grep -v '^{'
fi

if part 3; then
echo "== 3. psctl bench train on device shards: MLP and CNN, async and sync"
psctl bench train --device gpu --shard-device gpu --models mlp,cnn --hidden 4096,4096 --batch-size 512 --shards 1 \
  --workers 1 --modes async,sync,ssp --steps "$STEPS" 2>&1 | tee "$OUT/device-bench-train.log"
fi

if part 4; then
echo "== 4. the default job on GPU workers and device shards"
sed 's/^\[server\]/[server]\nshard_device = "gpu"/' examples/mnist.toml > /tmp/mnist-device.toml
grep -q '^shard_device' /tmp/mnist-device.toml || printf '\n[server]\nshard_device = "gpu"\n' >> /tmp/mnist-device.toml
rm -rf /tmp/launch-device
psctl launch --config /tmp/mnist-device.toml --device gpu --out /tmp/launch-device --no-progress 2>&1 | tail -3 \
  | tee "$OUT/device-launch.log"
python3 - <<'PY' | tee -a "$OUT/device-launch.log"
import json
s = json.load(open("/tmp/launch-device/summary.json"))
starts = [json.loads(l) for l in open("/tmp/launch-device/metrics.jsonl") if '"event": "start"' in l]
print(f"test accuracy {s['test_accuracy']:.4f}, training {s['wall_s']:.2f} s, "
      f"data planes {sorted({p for e in starts for p in e.get('data_planes') or []})}")
PY
fi

if part 5; then
echo "== 5. a push and a pull over CUDA IPC: a tiny model (the fixed cost) and the 20M one"
for mode in sync async; do python3 benchmarks/ipc_latency.py --mode "$mode" --repeat 200; done 2>&1 | tee "$OUT/ipc-latency.log"
python3 benchmarks/gpu_context_switch.py --repeat 400 --json "$OUT/context-switch.jsonl" 2>&1 | tee -a "$OUT/ipc-latency.log"
fi

if part 6; then
echo "== 6. alternating figures, then the same under MPS (one GPU context for the workers and the shard)"
python3 benchmarks/gpu_workers.py --repeats "$REPEATS" --modes async,sync --workers 2 --steps 150 \
  --json "$OUT/device-ab-mlp.jsonl" 2>&1 | tee "$OUT/ab.log" | grep -v '^{'
python3 benchmarks/gpu_workers.py --model cnn --repeats "$REPEATS" --modes async,sync --steps 150 \
  --json "$OUT/device-ab-cnn.jsonl" 2>&1 | tee -a "$OUT/ab.log" | grep -v '^{'
mps_on
python3 benchmarks/gpu_context_switch.py --repeat 400 --json "$OUT/context-switch-mps.jsonl" 2>&1 | tee "$OUT/mps.log"
echo "MPS servers: $(echo get_server_list | nvidia-cuda-mps-control)" | tee -a "$OUT/mps.log"
python3 benchmarks/ipc_latency.py --mode sync --repeat 200 2>&1 | tee -a "$OUT/mps.log"
python3 benchmarks/gpu_workers.py --repeats "$REPEATS" --modes async,sync --workers 2 --steps 150 \
  --json "$OUT/device-ab-mlp-mps.jsonl" 2>&1 | tee -a "$OUT/mps.log" | grep -v '^{'
python3 benchmarks/gpu_workers.py --model cnn --repeats "$REPEATS" --modes async,sync --steps 150 \
  --json "$OUT/device-ab-cnn-mps.jsonl" 2>&1 | tee -a "$OUT/mps.log" | grep -v '^{'
mps_off
fi

if part 7; then
echo "== 7. where a step's time goes: without MPS, then with it"
for mps in off on; do
  [ $mps = on ] && mps_on
  echo "-- MPS $mps"
  python3 benchmarks/gpu_context_switch.py --sizes 1024 --mlp --repeat 300 --json "$OUT/step-parts.jsonl" 2>&1 | tee -a "$OUT/step-parts.log"
  python3 benchmarks/gpu_workers.py --repeats "$REPEATS" --modes sync,async --steps 150 2>&1 | grep '"repeat"' \
    | sed "s/^{/{\"mps\": \"$mps\", /" | tee -a "$OUT/step-parts.jsonl"
  [ $mps = off ] && python3 benchmarks/gpu_workers.py --profile 30 --modes sync --steps 150 2>&1 | tee "$OUT/profile-sync.log" | head -45
done
mps_off
fi

if part 8; then
echo "== 8. the shard in the worker's process (local) beside a shard process (ipc): without MPS, then under it"
# PLACEMENT_AB=0 or PLACEMENT_BENCH=0 leaves out the alternating figures or the whole jobs.
for mps in off on; do
  [ $mps = on ] && mps_on
  for model in mlp cnn; do
    [ "${PLACEMENT_AB:-1}" = 0 ] && continue
    echo "-- $model, MPS $mps"
    python3 benchmarks/gpu_workers.py --model $model --repeats "$REPEATS" --modes async,sync --device-planes ipc,local \
      --steps 150 --json "$OUT/placement-$model-mps-$mps.jsonl" 2>&1 | tee -a "$OUT/placement.log" | grep -v '^{'
  done
  [ $mps = off ] && [ "${PLACEMENT_BENCH:-1}" != 0 ] && psctl bench train --device gpu --shard-device gpu --shard-placement process,worker \
    --models mlp,cnn --hidden 4096,4096 --batch-size 512 --shards 1 --workers 1,2 --modes async,sync \
    --steps 300 --repeats "${BENCH_REPEATS:-$REPEATS}" 2>&1 | tee "$OUT/placement-bench-train.log"
done
mps_off
fi

if part 9; then
echo "== 9. the shard in the worker's process against no servers, alternating blocks of one process"
for model in mlp cnn; do
  python3 benchmarks/placement_interleaved.py --model $model --pairs "${PAIRS:-20}" --block "${BLOCK:-50}" \
    --json "$OUT/interleaved-$model.jsonl" 2>&1 | tee -a "$OUT/interleaved.log" | grep -v '^{'
done
fi
