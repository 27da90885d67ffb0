"""A worker loop of your own against running shards: the client around your gradient, no threads.

    psctl server --mode sync --lr 0.1 --address-file /tmp/shard-0 &
    python examples/own_worker.py "$(head -1 /tmp/shard-0)"      # line 1: the address; line 2: the job id

Run it several times at once (the same addresses) and the shards average their gradients. With
several shards, give each `psctl server` its --shard and --num-shards and one --job-id for all
(`psctl server --shard 1 --num-shards 2 --job-id j1 ...`), so Admin.shutdown("j1") stops them all;
pass their addresses comma-separated.
"""

import sys

import numpy as np

import psgrid

rng = np.random.default_rng(0)
x = rng.normal(size=(1000, 20)).astype(np.float32)
y = x @ rng.normal(size=20).astype(np.float32)

spec = psgrid.ModelSpec([("w", (20,))])
params = spec.flat()
with psgrid.Client(sys.argv[1].split(","), spec, init=np.zeros(20, np.float32)) as client:
    grad = client.gradient_buffer()                  # shards on this host read it in place: no push copies
    for _ in range(300):
        client.pull(params)                          # returns with the shards' weights, once the mode allows
        batch = rng.integers(0, len(x), 64)
        np.matmul(x[batch].T, x[batch] @ params - y[batch], out=grad)
        grad /= 64
        client.push(grad)                            # returns once every shard has taken it
print(f"worker {client.worker_id}: loss {np.mean((x @ params - y) ** 2):.6f}")
