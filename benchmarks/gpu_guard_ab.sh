#!/usr/bin/env bash
# A device shard's async push before and after a change, interleaved in one call on a CUDA GPU: REV's tree
# unpacked in .prev/ (git archive REV | tar -x -C .prev, carried) and this tree, each installed editable in
# turn. First the GPU tests of device shards on this tree (TESTS=0 skips them); then per round and tree:
# where a push's time goes on the shard (benchmarks/ipc_step_timeline.py --mode async, this tree's copy),
# examples/train_cupy.py 3 x 4096 through psctl bench script, and the built-in 20M MLP through psctl bench
# train, async, one device shard in a process of its own, REPEATS repeats each beside runs alone. ROUNDS
# (default 1). The log lands in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee "$OUT/gpu-guard-ab.log") 2>&1
date -u +"%Y-%m-%d %H:%M UTC"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; uptime
if [ "${TESTS:-1}" = 1 ]; then
  echo "== the device shards' GPU tests (this tree)"
  python3 -m pytest -q -p no:cacheprovider tests/test_device_shard.py tests/test_device_optim.py tests/test_updater.py \
    tests/test_planes.py -o addopts="--strict-markers -ra" 2>&1 | tail -4
fi
timeline=$PWD/benchmarks/ipc_step_timeline.py
for round in $(seq "${ROUNDS:-1}"); do
  for tree in .prev .; do
    echo "== round $round: $([ "$tree" = . ] && echo 'this tree' || echo 'the previous tree (.prev)')"
    (cd "$tree" && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . \
      && python3 "$timeline" --mode async --layers 3 --steps 300 2>&1 | grep -v "^psgrid shard" \
      && python3 -m psgrid.cluster.cli bench script --device gpu --modes async --workers 1 --repeats "${REPEATS:-3}" \
           --skip 30 -- python examples/train_cupy.py --steps 300 --hidden 4096 --layers 3 --batch-size 512 \
           --eval-every 0 2>&1 | grep -v "^psgrid shard\|^\[300 steps\]" | tail -2 \
      && python3 -m psgrid.cluster.cli bench train --device gpu --shard-device gpu --models mlp --hidden 4096,4096 \
           --batch-size 512 --shards 1 --workers 1 --modes async --steps 300 --repeats "${REPEATS:-3}" 2>&1 \
         | grep -v "^psgrid shard" | tail -2)
  done
done
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e .
uptime
