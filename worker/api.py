"""Train your own model on the shards with a few added lines.

Bring a function ``grad_fn(params, batch) -> (loss, grads)`` over named arrays
(NumPy or CuPy); the trainer pulls the shared weights before each step and
pushes your gradients after it::

    from psgrid.worker.api import DistributedTrainer

    trainer = DistributedTrainer(servers, params=initial_params, grad_fn=grad_fn)
    for batch in batches:
        loss = trainer.step(batch)
    trainer.close()

The optimizer and the consistency mode belong to the shards (``psctl server
--mode ssp --optimizer adam ...``); every worker of a job passes the same
parameter names and shapes, and the first one to arrive sets the initial weights.
"""

from __future__ import annotations

import os

import numpy as np

from psgrid.psserver.client import ShardedClient
from psgrid.psserver.spec import ModelSpec
from psgrid.worker.backend import array_module, pinned_empty

SERVERS_ENV = "PSGRID_SERVERS"


def servers_from_env() -> list[str]:
    """The shard addresses in ``$PSGRID_SERVERS`` (comma-separated), for scripts started by a job."""
    value = os.environ.get(SERVERS_ENV, "")
    if not value:
        raise RuntimeError(f"no shard addresses: pass servers=[...] or set {SERVERS_ENV}=host:port,host:port")
    return [a.strip() for a in value.split(",") if a.strip()]


class DistributedTrainer:
    """Pull, compute with ``grad_fn``, push: one call of :meth:`step` per batch.

    Parameters
    ----------
    servers : list of str or None
        Shard addresses in shard order; None reads ``$PSGRID_SERVERS``.
    params : dict of arrays
        Initial values, by name (the names and shapes define the model's layout).
        NumPy or CuPy; the trainer keeps its working copy on the same device.
    grad_fn : callable
        ``grad_fn(params, batch) -> (loss, grads)`` with ``grads`` a dict holding
        an array of each parameter's shape.
    **client_options
        Passed to :class:`psserver.client.ShardedClient` (``wire_dtype``,
        ``token``, ``deadline_s``, ...).
    """

    def __init__(self, servers, params: dict, grad_fn, heartbeat_s: float = 1.0, **client_options):
        if not params:
            raise ValueError("params must name at least one array")
        self.grad_fn = grad_fn
        self.xp = array_module(next(iter(params.values())))
        self.spec = ModelSpec((name, tuple(value.shape)) for name, value in params.items())
        self.client = ShardedClient(servers if servers is not None else servers_from_env(), **client_options)
        self.host_params = pinned_empty(self.spec.size, np.float32, self.xp)
        self.host_grad = pinned_empty(self.spec.size, np.float32, self.xp)
        self.flat = self.host_params if self.xp is np else self.spec.flat(self.xp)
        self.params = self.spec.views(self.flat)
        self.steps = 0
        try:
            self.worker_id = self.client.register(self.spec)
            self.client.start_heartbeats(heartbeat_s)
            host = {k: np.asarray(v.get() if self.xp is not np else v, dtype=np.float32) for k, v in params.items()}
            self.client.init(self.spec.pack(host))
        except BaseException:
            self.client.close()
            raise

    def pull(self) -> dict:
        """Fetch the current weights (after this mode's consistency wait) into ``self.params``."""
        self.client.pull(self.host_params)
        if self.xp is not np:
            self.flat.set(self.host_params)
        return self.params

    def step(self, batch):
        """One training step on ``batch``: pull, ``grad_fn``, push. Returns the loss."""
        self.pull()
        loss, grads = self.grad_fn(self.params, batch)
        missing = set(self.spec.names) - set(grads)
        if missing:
            raise ValueError(f"grad_fn returned no gradient for {sorted(missing)}")
        views = self.spec.views(self.host_grad)
        for name, grad in grads.items():
            if name not in views:
                raise ValueError(f"grad_fn returned a gradient for unknown parameter {name!r}")
            views[name][...] = grad.get() if self.xp is not np else grad
        self.client.push(self.host_grad)
        self.steps += 1
        return loss

    def close(self) -> None:
        """Leave the job (so sync and ssp stop waiting for this worker) and close the connections."""
        try:
            self.client.leave()
        finally:
            self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
