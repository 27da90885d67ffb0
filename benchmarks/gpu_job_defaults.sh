#!/usr/bin/env bash
# Which settings train a GPU job in every mode (issue 37: "defaults that converge"), in one call:
# benchmarks/mode_settings_probe.py over settings x modes x worker counts x seeds, PARALLEL jobs at a
# time on the GPU (each job's accuracy after its fixed steps does not depend on the others).
#   JOB=examples/synthetic-20m.toml MODES=sync,async,ssp:2 WORKERS=2,4,8 SEEDS=0,1 PARALLEL=3 \
#     bash benchmarks/gpu_job_defaults.sh 'job:' 'adam:optimizer="adam",lr=0.0003'
# A setting is NAME:KEY=VALUE,... as the probe takes it ('job:' is the job file's own). Set SKIP_ENV=1
# when calling it again in the same command. The table is printed last; every run's figures are in
# $OUT/probe-NAME/probe.csv and probe-NAME.log.
set -uo pipefail
if [ -z "${SKIP_ENV:-}" ]; then
  source "$(dirname "$0")/device_env.sh"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  uptime
fi
JOB=${JOB:-examples/synthetic-20m.toml}
name=$(basename "$JOB" .toml)${TAG:-}
settings=()
for s in "$@"; do settings+=(--setting "$s"); done
python3 -m psgrid.cluster.cli launch --config "$JOB" --workers 1 --steps 20 --eval-every 10 --out "/tmp/warm-$name" \
  --no-progress --overwrite 2>&1 | tail -1   # CuPy compiles its kernels once per machine and model
python3 benchmarks/mode_settings_probe.py --config "$JOB" --modes "${MODES:-sync,async,ssp:2}" \
  --workers "${WORKERS:-2,4,8}" --seeds "${SEEDS:-0,1}" "${settings[@]}" --parallel "${PARALLEL:-3}" \
  --out "$OUT/probe-$name" > "$OUT/probe-$name.log" 2>&1
grep -A 100 '^setting' "$OUT/probe-$name.log"
rm -rf "$OUT/probe-$name/runs"
