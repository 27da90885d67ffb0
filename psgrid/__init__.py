"""psgrid: sharded parameter servers for data-parallel training (sync, async, stale-synchronous).

The user API, imported lazily so that ``psctl --help`` does not pay for NumPy and gRPC::

    import psgrid

    spec = psgrid.ModelSpec([("w", (784, 10)), ("b", (10,))])
    with psgrid.Client(addresses, spec, world=2, init=initial_weights) as client:
        grad = client.gradient_buffer()     # shards on this host read it in place: a push copies nothing
        client.pull(params)                 # returns once the weights are in params
        ...
        client.push(grad)                   # returns once every shard has it

``psgrid.init(model)`` joins the job a script was started in (``psctl launch -- python train.py``)
and exchanges the model's parameters and gradients with its shards, in about five added lines;
``LocalCluster`` starts a job's shards in the background (for notebooks); ``psgrid.serve(ServerConfig(...))``
starts a shard in this process; ``Admin`` reads and steers a running job.

In the wheel the subpackages live inside this folder. In a source checkout they sit beside it at
the top of the repository (``psserver/``, ``worker/``, ``cluster/``), mapped in by setuptools'
``package-dir``: a checkout is used through an editable install (``pip install -e .``), never by
putting its root on the path.
"""

from __future__ import annotations

import importlib

# name -> module that defines it
_EXPORTS = {
    "Client": "psgrid.psserver.client.client",
    "Handle": "psgrid.psserver.client.client",
    "Admin": "psgrid.psserver.client.admin",
    "ModelSpec": "psgrid.psserver.spec",
    "ServerConfig": "psgrid.psserver.config",
    "serve": "psgrid.psserver.server",
    "init": "psgrid.cluster.run.hosted_script",  # psgrid.worker.api.init, or a script hosting a shard
    "Session": "psgrid.worker.api",
    "job_env": "psgrid.worker.env",
    "JobEnv": "psgrid.worker.env",
    "LocalCluster": "psgrid.cluster.run.local",
    "TrainConfig": "psgrid.worker.config",
    "PSError": "psgrid.psserver.exceptions",
    "Reason": "psgrid.psserver.protocol",
    "Outcome": "psgrid.psserver.protocol",
    "PushResult": "psgrid.psserver.protocol",
    "parse_address_file": "psgrid.psserver.protocol",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'psgrid' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
