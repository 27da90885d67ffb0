"""A training script of the user API, for the tests (run as a job's command; not a test module).

    python tests/user_script.py STEPS [FAIL]

Each worker pushes a constant gradient, its rank + 1, for STEPS steps and prints, as one JSON
line, the first weight after every pull: in sync mode with learning rate 1, round k moves it by
minus the mean of the job's gradients. FAIL ``exit-before-join:R`` makes worker R exit with code 3
before it joins (R ``all``: every worker).
"""

from __future__ import annotations

import json
import sys

import numpy as np

import psgrid

steps = int(sys.argv[1])
fail, _, fail_rank = (sys.argv[2] if len(sys.argv) > 2 else "").partition(":")
rank = psgrid.job_env().rank
if fail == "exit-before-join" and fail_rank in ("all", str(rank)):
    sys.exit(3)
w = np.zeros(4, np.float32)
ps = psgrid.init({"w": w})
seen = []
for step in range(ps.first_step, steps):
    ps.pull()
    seen.append(float(w[0]))
    ps.push({"w": np.full(4, ps.rank + 1, np.float32)}, loss=1.0 / (step + 1), samples=1)
ps.pull()
seen.append(float(w[0]))
ps.close()
print(json.dumps({"rank": ps.rank, "world": ps.world, "seen": seen}), flush=True)
