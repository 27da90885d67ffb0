#!/usr/bin/env bash
# Everything the GPU code paths need to show, in one call on a machine with CUDA GPUs:
#  1. the default job trained by GPU workers through psctl launch on a fresh CuPy kernel cache, twice
#     (the first run on a machine against the next: warm-up is reported apart from training time);
#  2. the model, loader and backend tests on CuPy (compared with NumPy) and the GPU data path on
#     every plane (shared memory page-locked for DMA, TCP, gRPC), and the pull-ahead's second device buffer;
#  3. benchmarks/gpu_workers.py: the 20M MLP with no servers, with 1 and 4 shards over shared memory
#     and over TCP, each pull and push against CuPy's pinned copy of the same bytes in the same run
#     (pull_ahead off, its default); then the pull-ahead's A/B: 4 shards over shared memory, async,
#     pull_ahead off and on in turn, 5 times each, beside no servers (medians, ratios to no servers);
#  4. psctl bench train on the GPU (MLP and CNN, async and sync, 4 host shards) beside no servers;
#  5. device shards and the CUDA IPC plane (benchmarks/gpu_device_shards.sh: its tests, worker figures,
#     bench train on device shards, the default job on them, the cost of a call and of a move between
#     GPU contexts, and the alternating figures without and under MPS);
#  6. the all-reduce baseline on the GPU (benchmarks/gpu_allreduce.sh);
#  7. your own script through psgrid.init against itself alone (benchmarks/gpu_scripts.sh: torchvision's
#     ResNet-18, a 27M torch.nn.TransformerEncoder and examples/train_cupy.py, psctl bench script);
#  8. the same models in one process, blocks alone and through psgrid in turn (benchmarks/gpu_script_ab.sh).
# Logs and JSON land in $OUT. PARTS="1 3" runs only those parts. On the lent device: wheels for
# what its image lacks travel in .whl/.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PARTS=${PARTS:-1 2 3 4 5 6 7 8}
part() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "cores $(nproc), $(grep MemTotal /proc/meminfo)"
python3 -c "import grpc, google.protobuf, cupy, numpy; print('grpc', grpc.__version__, 'protobuf', google.protobuf.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__)"
python3 -c "import grpc_health, tqdm, prometheus_client, threadpoolctl, matplotlib; print('imports ok')"

if part 1; then
echo "== 1. the default job on GPU workers, on a fresh CuPy kernel cache: a first run and a second"
export CUPY_CACHE_DIR=/tmp/cupy-fresh-cache
rm -rf "$CUPY_CACHE_DIR"
for run in first second; do
  rm -rf "/tmp/launch-$run"
  psctl launch --config examples/mnist.toml --device gpu --out "/tmp/launch-$run" --no-progress 2>&1 | tail -2 \
    | tee -a "$OUT/gpu-launch.log"
  cp "/tmp/launch-$run/summary.json" "$OUT/launch-$run-summary.json" 2>/dev/null
  [ "$run" = second ] || ls -la --time-style=+%s.%N "$CUPY_CACHE_DIR" > "$OUT/kernel-cache-after-first.txt" 2>&1
done
python3 - <<'PY' | tee -a "$OUT/gpu-launch.log"
import json
first, second = (json.load(open(f"/tmp/launch-{r}/summary.json")) for r in ("first", "second"))
for name, s in (("first", first), ("second", second)):
    starts = [json.loads(l) for l in open(f"/tmp/launch-{name}/metrics.jsonl") if '"event": "start"' in l]
    print(f"{name}: training {s['wall_s']:.2f} s, warm-up before joining {s['warmup_s']:.2f} s, "
          f"whole job {s['total_wall_s']:.2f} s, test accuracy {s['test_accuracy']:.4f}, "
          f"data planes {sorted({p for e in starts for p in e.get('data_planes') or []})}")
print(f"first run's training time / second run's: {first['wall_s'] / second['wall_s']:.2f}")
# Kernels CuPy compiled during the first run's training (after its first step started): the warm-up
# before joining should leave none. Each cache file is one compiled kernel; its time says when.
import os
events = [json.loads(l) for l in open("/tmp/launch-first/metrics.jsonl")]
steps = [e for e in events if e.get("event") == "step"]
t0 = min(e["started"] for e in steps)
cache = os.environ["CUPY_CACHE_DIR"]
late = sorted((os.path.getmtime(os.path.join(cache, f)) - t0, f) for f in os.listdir(cache)
              if os.path.getmtime(os.path.join(cache, f)) > t0 and not f.startswith("."))
print(f"kernels compiled after training started: {len(late)} of {len(os.listdir(cache))}")
for dt, name in late[:12]:
    print(f"  +{dt:6.2f} s {name}")
slow = sorted(steps, key=lambda e: -(e["pull_s"] + e["compute_s"] + e.get("push_s", 0)))[:8]
for e in slow:
    print(f"  slow step: rank {e['rank']} step {e['step']} at +{e['started'] - t0:.2f} s: pull {e['pull_s']:.3f} "
          f"compute {e['compute_s']:.3f} push {e.get('push_s', 0):.3f}")
PY
unset CUPY_CACHE_DIR
fi

if part 2; then
echo "== 2. GPU tests (CuPy against NumPy; the GPU data path on every plane)"
python3 -m pytest -q -p no:cacheprovider tests/test_models.py tests/test_data.py tests/test_backend.py \
  tests/test_gpu_data_path.py tests/test_pull_ahead.py -o addopts="--strict-markers -ra" 2>&1 | tee "$OUT/gpu-tests.log" | tail -6
fi

if part 3; then
echo "== 3. worker figures: no servers, shared memory and TCP, against CuPy's pinned copy"
python3 benchmarks/gpu_workers.py --json "$OUT/gpu-workers.jsonl" --planes shm,tcp --shards 1,4 --modes async,sync \
  --steps 80 "$@" 2>&1 | tee "$OUT/gpu-workers.log" | grep -v '^{'
echo "== 3b. the pull-ahead's A/B: 4 shards over shared memory, async, pull_ahead off and on alternating"
# 300 steps: the first ones (the first pull, the first mappings of the shards' buffers) weigh less in the whole
# run's samples/s, which the table gives beside the steady step's.
python3 benchmarks/gpu_workers.py --json "$OUT/gpu-pull-ahead.jsonl" --ab-pull-ahead "${AB_REPEATS:-5}" --steps 300 "$@" \
  2>&1 | tee "$OUT/gpu-pull-ahead.log" | grep -v '^{'
fi

if part 4; then
echo "== 4. psctl bench train on the GPU"
psctl bench train --device gpu --shard-device cpu --models mlp,cnn --hidden 4096,4096 --batch-size 512 --shards 4 \
  --workers 1 --modes async,sync --steps 80 2>&1 | tee "$OUT/gpu-bench-train.log"
fi

if part 5; then
echo "== 5. device shards and the CUDA IPC plane"
OUT="$OUT" bash benchmarks/gpu_device_shards.sh
fi

if part 6; then
echo "== 6. the all-reduce baseline on the GPU"
OUT="$OUT" bash benchmarks/gpu_allreduce.sh
fi

if part 7; then
echo "== 7. your own script through psgrid.init, against itself alone"
OUT="$OUT" PARTS="1 2" bash benchmarks/gpu_scripts.sh
fi
if part 8; then
echo "== 8. the same models alone and through psgrid.init, interleaved in one process (paired ratios)"
OUT="$OUT" bash benchmarks/gpu_script_ab.sh
fi
