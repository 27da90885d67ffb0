"""Train your own model on the shards with a few added lines.

Bring a function ``grad_fn(params, batch) -> (loss, grads)`` over named arrays
(NumPy or CuPy); the trainer pulls the shared weights before each step and
pushes your gradients after it::

    from psgrid import DistributedTrainer

    with DistributedTrainer(addresses, params=initial_params, grad_fn=grad_fn) as trainer:
        for batch in batches:
            loss = trainer.step(batch)

The optimizer and the consistency mode belong to the shards (``psctl server
--mode ssp --optimizer adam ...``); every worker of a job passes the same
parameter names and shapes, and the first one to arrive sets the initial weights.
"""

from __future__ import annotations

import os

import numpy as np

from psgrid.psserver.client import Client
from psgrid.psserver.spec import ModelSpec
from psgrid.worker.backend import array_module, to_host
from psgrid.worker.flat import FlatBuffers

ADDRESSES_ENV = "PSGRID_ADDRESSES"


def addresses_from_env() -> list[str]:
    """The shard addresses in ``$PSGRID_ADDRESSES`` (comma-separated), for scripts started by a job."""
    value = os.environ.get(ADDRESSES_ENV, "")
    if not value:
        raise RuntimeError(f"no shard addresses: pass addresses=[...] or set {ADDRESSES_ENV}=host:port,host:port")
    return [a.strip() for a in value.split(",") if a.strip()]


class DistributedTrainer:
    """Pull, compute with ``grad_fn``, push: one call of :meth:`step` per batch.

    Parameters
    ----------
    addresses : list of str or None
        Shard addresses in shard order; None reads ``$PSGRID_ADDRESSES``.
    params : dict of arrays
        Initial values, by name (the names and shapes define the model's layout).
        NumPy or CuPy; the trainer keeps its working copy on the same device.
    grad_fn : callable
        ``grad_fn(params, batch) -> (loss, grads)`` with ``grads`` a dict holding
        an array of each parameter's shape.
    **client_options
        Passed to :class:`psgrid.psserver.client.Client` (``world``, ``wire_dtype``,
        ``token``, ``deadline_s``, ...).
    """

    def __init__(self, addresses, params: dict, grad_fn, **client_options):
        if not params:
            raise ValueError("params must name at least one array")
        self.grad_fn = grad_fn
        self.xp = array_module(next(iter(params.values())))
        self.spec = ModelSpec((name, tuple(value.shape)) for name, value in params.items())
        self.buffers = FlatBuffers(self.spec, self.xp)
        self.params = self.buffers.param_views
        initial = {name: np.asarray(to_host(value), dtype=np.float32) for name, value in params.items()}
        self.client = Client(addresses if addresses is not None else addresses_from_env(), self.spec,
                             init=lambda: self.spec.pack(initial), **client_options)
        try:
            self.client.join()
        except BaseException:
            self.client.close()
            raise
        self.steps = 0

    def pull(self) -> dict:
        """Fetch the current weights (after this mode's consistency wait) into ``self.params``."""
        self.client.pull(self.buffers.host_params)
        self.buffers.upload_params()
        return self.params

    def step(self, batch):
        """One training step on ``batch``: pull, ``grad_fn``, push. Returns the loss."""
        self.pull()
        loss, grads = self.grad_fn(self.params, batch)
        missing = set(self.spec.names) - set(grads)
        if missing:
            raise ValueError(f"grad_fn returned no gradient for {sorted(missing)}")
        for name, grad in grads.items():
            if name not in self.buffers.grad_views:
                raise ValueError(f"grad_fn returned a gradient for unknown parameter {name!r}")
            self.buffers.grad_views[name][...] = grad
        self.buffers.download_grad()
        self.client.push(self.buffers.host_grad)
        self.steps += 1
        return loss

    def close(self) -> None:
        """Leave the job (so sync and ssp stop waiting for this worker) and close the connections."""
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
