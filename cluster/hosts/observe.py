"""Save a job's weights as they are now, from inside an emulated host (the root namespace cannot reach shards).

Run by :meth:`EmulatedJob.run <psgrid.cluster.hosts.job.EmulatedJob.run>` as
``ip netns exec HOST python -c ... --config JOB --addresses A,B --out weights.npy``; the token
comes from the environment, as for every process of the job.
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv: list[str] | None = None) -> int:
    from psgrid.psserver.lifeline import watch

    watch()  # a child of the job's holder: it must not outlive it
    from psgrid.cluster.job.config import load_job
    from psgrid.worker.loop import make_admin

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--addresses", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    job = load_job(args.config, redacted_ok=True)
    import dataclasses

    from psgrid.psserver.security import job_token

    train = dataclasses.replace(job.train, token=job_token(None))
    with make_admin(train, args.addresses.split(","), deadline_s=10.0, retry_s=2.0) as admin:
        np.save(args.out, admin.pull().out)
    return 0
