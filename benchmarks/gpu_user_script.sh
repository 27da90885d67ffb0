#!/usr/bin/env bash
# Your own training script on GPU workers, in one call on a machine with CUDA GPUs, PyTorch and CuPy:
# the DLPack path on the GPU (a CUDA tensor viewed by CuPy without a copy; a PyTorch model's weights
# pulled into its own CUDA tensors, checked against the shards'), then examples/train_torch.py and
# examples/train_cupy.py under psctl launch (2 GPU workers) and psctl mpi (mpiexec -n 4: 1 shard,
# 2 workers). Everything is written to $OUT/gpu-user-script.log (for benchmarks/results/) and each
# job's summary to $OUT/user-*-summary.json.
# On the lent device: wheels for what its image lacks travel in .whl/ (see the device notes).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
LOG="$OUT/gpu-user-script.log"
exec > >(tee "$LOG") 2>&1

date -u +"%Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), '| cupy', cupy.__version__)"

echo "== the user API's tests on this machine"
python3 -m pytest -q -p no:cacheprovider tests/test_api.py tests/test_dlpack.py -o addopts="--strict-markers -ra" 2>&1 | tail -3

echo "== DLPack on the GPU: views, not copies; a torch model's CUDA weights pulled in place"
python3 - <<'PY'
import numpy as np
import torch
from torch import nn

import psgrid
from psgrid.psserver.client.admin import Admin
from psgrid.worker import dlpack

t = torch.randn(1000, device="cuda:0", requires_grad=True)
v = dlpack.view(t)
assert type(v).__module__.startswith("cupy") and v.data.ptr == t.data_ptr(), "copied"
print("a CUDA tensor that requires grad is a CuPy view of its own memory:", v.data.ptr == t.data_ptr())
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10)).cuda()
pointers = [p.data_ptr() for p in model.parameters()]
with psgrid.LocalCluster(shards=2, mode="sync", lr=0.1) as cluster:
    with cluster.init(model) as ps:
        for _ in range(20):
            ps.pull()
            loss = nn.functional.cross_entropy(model(torch.randn(64, 784, device="cuda")),
                                               torch.randint(0, 10, (64,), device="cuda"))
            model.zero_grad()
            loss.backward()
            ps.push(loss=loss, samples=64)
        ps.pull()
        with Admin(cluster.addresses, token=cluster.token) as admin:
            shards, _ = admin.pull()
        ours = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu().numpy()
        assert np.array_equal(shards, ours), "the model's weights are not the shards'"
        assert [p.data_ptr() for p in model.parameters()] == pointers, "a parameter was reallocated"
        print(f"20 sync steps on {ps.names}: the model's CUDA tensors hold the shards' weights, in place; "
              f"last step {ps.last_step['pull_s'] * 1e3:.1f} ms pull, {ps.last_step['compute_s'] * 1e3:.1f} ms "
              f"compute, {ps.last_step['push_s'] * 1e3:.1f} ms push")
PY

for example in train_torch train_cupy; do
  echo "== psctl launch --workers 2 --device gpu -- python examples/$example.py"
  rm -rf "/tmp/user-$example-launch"
  psctl launch --workers 2 --device gpu --no-progress --out "/tmp/user-$example-launch" -- \
    python "examples/$example.py" --steps 500
  cp "/tmp/user-$example-launch/summary.json" "$OUT/user-$example-launch-summary.json" 2>/dev/null
done

if python3 -c "import mpi4py" 2>/dev/null; then
  echo "== mpiexec -n 4 psctl mpi --shards 1 --device gpu -- python examples/train_torch.py"
  rm -rf /tmp/user-torch-mpi
  # one GPU here: the two workers share it (--oversubscribe; psctl mpi refuses that otherwise)
  mpiexec -n 4 python3 -m psgrid.cluster.cli mpi --shards 1 --device gpu --oversubscribe --no-progress \
    --out /tmp/user-torch-mpi -- \
    python examples/train_torch.py --steps 500
  cp /tmp/user-torch-mpi/summary.json "$OUT/user-train_torch-mpi-summary.json" 2>/dev/null
else
  echo "== no mpi4py here: the psctl mpi run is skipped"
fi
python3 - "$OUT" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/user-*-summary.json")):
    s = json.load(open(path))
    print(f"{path.split('/')[-1]}: {s['status']}, {s['steps']} steps, {s['samples_per_s'] or 0:.0f} samples/s, "
          f"test accuracy {s['test_accuracy']}")
PY
