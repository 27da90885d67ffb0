#!/usr/bin/env bash
# The built-in 20M MLP (batch 512, one device shard in a process of its own) under two trees in turn, in
# one call on a CUDA GPU: REV's tree unpacked in .prev/ (git archive REV | tar -x -C .prev, carried) and
# this one, each installed editable before its run, ROUNDS rounds (default 4) of: the previous tree's job,
# this tree's job, then the model with no servers (this tree). Each line is one run's JSON
# (benchmarks/tree_ab_train.py); the log lands in $OUT. MODE (default async).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee "$OUT/gpu-tree-ab.log") 2>&1
date -u +"%Y-%m-%d %H:%M UTC"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; uptime
driver=$PWD/benchmarks/tree_ab_train.py
install() { (cd "$1" && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e .); }
for round in $(seq "${ROUNDS:-4}"); do
  for tree in .prev .; do
    install "$tree" && (cd "$tree" && python3 "$driver" --mode "${MODE:-async}" --tree "$tree" 2>&1 | grep '^{')
  done
  python3 "$driver" --reference 2>&1 | grep '^{'
done
uptime
