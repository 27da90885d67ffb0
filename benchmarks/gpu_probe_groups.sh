#!/usr/bin/env bash
# Settings probes of GPU jobs (issue 37: "defaults that converge"), one list of groups per GPU, the two
# lists side by side, in one call on a machine of two GPUs (GPUS="0 0" puts both on one):
#   GROUPS_A='examples/synthetic-cnn.toml|sync,async|1|0|4|job: nolap:overlap=false' \
#   GROUPS_B='examples/synthetic-50m.toml|async|4,8|0,1|3|lr1:lr=0.0001' \
#     bash benchmarks/gpu_probe_groups.sh
# A group is JOB|MODES|WORKERS|SEEDS|PARALLEL|SETTING SETTING ... (settings as mode_settings_probe.py takes
# them, no spaces inside one); groups are separated by ';' and run in turn on their GPU, each through
# gpu_job_defaults.sh (its table, and every run's figures and accuracy curve in $OUT/probe-*). The whole
# call stops at LIMIT_S (default 540); the runs that ended are kept.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
uptime
(while sleep 60; do uptime; done) &
ticker=$!
read -r gpu_a gpu_b <<< "${GPUS:-0 1}"

run_groups() {  # GPU TAG GROUPS
  local gpu=$1 tag=$2 n=0 group
  IFS=';' read -r -a groups <<< "$3"
  for group in "${groups[@]}"; do
    [ -n "${group// /}" ] || continue
    n=$((n + 1))
    IFS='|' read -r job modes workers seeds parallel settings <<< "$group"
    read -r -a each <<< "$settings"
    echo "== GPU $gpu, group $tag$n: $job $modes workers $workers seeds $seeds: ${each[*]}"
    CUDA_VISIBLE_DEVICES=$gpu SKIP_ENV=1 JOB=$job MODES=$modes WORKERS=$workers SEEDS=$seeds PARALLEL=$parallel \
      TAG=-$tag$n bash benchmarks/gpu_job_defaults.sh "${each[@]}"
  done
}

limit=${LIMIT_S:-540}
timeout -k 5 -s INT "$limit" bash -c "$(declare -f run_groups); run_groups $gpu_a a '${GROUPS_A:-}'" > "$OUT/groups-a.log" 2>&1 &
a=$!
timeout -k 5 -s INT "$limit" bash -c "$(declare -f run_groups); run_groups $gpu_b b '${GROUPS_B:-}'" > "$OUT/groups-b.log" 2>&1 &
b=$!
wait "$a" "$b"
kill "$ticker"
cat "$OUT/groups-a.log" "$OUT/groups-b.log"
for f in "$OUT"/probe-*.log; do echo "== $f"; grep '^{' "$f" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r["setting"], r["mode"], r["workers"], r["seed"], r.get("test_accuracy"), r.get("mean_staleness"), r.get("wall_s"), r.get("curve"),
          *(["FAILED:", r.get("lost"), r.get("failure") or r.get("message")] if r.get("lost") or r.get("test_accuracy") is None else []))
'; done
uptime
