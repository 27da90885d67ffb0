#!/usr/bin/env bash
# psctl mpi's placement on a machine with CUDA GPUs, in one call: the GPU test (one worker per GPU,
# each on a GPU of its own; one rank too many refused), and a default job of 2 + G ranks during
# which nvidia-smi must list exactly G compute processes: the coordinator and the shard ask CUDA
# for the GPUs' bus ids only and never hold a context (or GPU memory).
# On the lent device: wheels for what its image lacks travel in .whl/ (see the device notes).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv,noheader
echo "== the GPU placement test"
python3 -m pytest -q -p no:cacheprovider tests/test_mpi.py -k gpu_of_its_own -o addopts="--strict-markers -ra" \
  2>&1 | tee "$OUT/gpu-placement-test.log" | tail -5
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
ranks=$(( 2 + gpus ))
echo "== mpiexec -n $ranks psctl mpi --shards 1 --device gpu: compute processes seen during the run (want $gpus)"
rm -rf /tmp/placement-run
mpiexec -n "$ranks" python3 -m psgrid.cluster.cli mpi --config mnist --shards 1 --device gpu --steps 3000 \
  --no-progress --out /tmp/placement-run > "$OUT/gpu-placement-run.log" 2>&1 &
job=$!
most=0
for _ in $(seq 1 120); do
  sleep 1
  seen=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)
  [ "$seen" -gt "$most" ] && most=$seen
  kill -0 "$job" 2>/dev/null || break
done
wait "$job"; echo "exit $?; at most $most compute processes at once (GPUs: $gpus)" | tee -a "$OUT/gpu-placement-run.log"
tail -3 "$OUT/gpu-placement-run.log"
python3 -c "import json; print('worker devices:', sorted((e['rank'], e['device']) for e in map(json.loads, open('/tmp/placement-run/metrics.jsonl')) if e.get('event') == 'start'))" \
  | tee -a "$OUT/gpu-placement-run.log"
