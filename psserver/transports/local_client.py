"""The in-process plane, client side: a worker calls the shard it hosts (local_server.py).

Chosen first, when the shard offers it and its service is in this process. A pull lends the
shard's current buffer to the caller's writer (a device array for a worker on a device shard's own
GPU: one device-to-device copy in one CUDA context, no move between contexts) and gives it back
when the writer returns. A push hands the caller's gradient to the shard, which reads it where it
lies during the call: no slot, no copy out of one, no frame. Every refusal is the shard's own
exception, as a remote client would receive it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.protocol import FLOAT32, PushResult
from psgrid.psserver.transports.base import ConnectOptions, Control, DataPlane, register_data_plane
from psgrid.psserver.transports.local_gradient import CallerArray
from psgrid.psserver.transports.local_registry import hosted_service


class LocalDataPlane(DataPlane):
    """Pulls and pushes of one shard's range by calls into its service, in this process."""

    name = "local"
    title = "in-process plane"
    reads_in_place = True

    def __init__(self, service, gpu: int | None):
        self.service = service  # the shard's ShardService, called as its transports call it
        arrays = service.shard.arrays
        # The caller's device arrays are the shard's to read only on the shard's own GPU.
        self.takes_device_arrays = bool(arrays.on_gpu and gpu is not None and gpu == arrays.index)

    def pull_into(self, out: np.ndarray, *, begin: int, worker_id: int, clock: int, timeout_s: float) -> int:
        with self.service.pull(worker_id=worker_id, clock=clock, timeout_s=timeout_s, device=True) as snapshot:
            if isinstance(snapshot.values, np.ndarray):
                np.copyto(out, snapshot.values)
            else:
                self.service.shard.arrays.download(snapshot.values, out)
            return snapshot.version

    def pull_with(
        self, write: Callable, *, begin: int, end: int, staging, worker_id: int, clock: int, timeout_s: float
    ) -> int:
        """``write(begin, end, values)`` gets the shard's own buffer (a device array only where we take them)."""
        with self.service.pull(worker_id=worker_id, clock=clock, timeout_s=timeout_s, device=True) as snapshot:
            values = snapshot.values
            if not (isinstance(values, np.ndarray) or self.takes_device_arrays):
                values = self.service.shard.arrays.download(values, staging()[begin:end])
            write(begin, end, values)
            return snapshot.version

    def push(
        self, grad, *, begin: int, wire_dtype: int, worker_id: int, clock: int, version: int, timeout_s: float
    ) -> PushResult:
        if wire_dtype != FLOAT32:  # rounded as a network plane's payload would be
            host = grad if isinstance(grad, np.ndarray) else grad.get()
            grad = np.empty(len(host), np.float32)
            wire.decode_into(grad, wire.encode(host, wire_dtype), wire_dtype)
        return self.service.push(worker_id=worker_id, clock=clock, version=version, source=CallerArray(grad))

    def close(self) -> None:
        """Nothing to release: the plane holds no connection, and every lent buffer went back with its call."""


def _offered(control: Control, address: str, options: ConnectOptions) -> LocalDataPlane | None:
    """The shard's service, where it lives in this process."""
    if not options.shared_memory:
        return None
    service = hosted_service(address)
    return None if service is None else LocalDataPlane(service, options.gpu)


register_data_plane("local", _offered)
