#!/usr/bin/env bash
# The built-in trainer before and after a change, interleaved in one call on a CUDA GPU: REV's tree unpacked
# in .prev/ (git archive REV | tar -x -C .prev, carried) and this tree, each installed editable in turn, run
# benchmarks/gpu_workers.py's repeated 20M-MLP figures (device shard in a process of its own over CUDA IPC,
# and in the worker's process; each repeat beside no servers). ROUNDS (default 2) rounds of both.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee "$OUT/gpu-core-ab.log") 2>&1
for round in $(seq "${ROUNDS:-2}"); do
  for tree in .prev .; do
    echo "== round $round: $([ "$tree" = . ] && echo 'this tree' || echo 'the previous tree (.prev)')"
    (cd "$tree" && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . \
      && python3 benchmarks/gpu_workers.py --model mlp --repeats 2 --modes async,sync --device-planes ipc,local \
         --steps 150 2>&1 | tail -6)
  done
done
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e .
