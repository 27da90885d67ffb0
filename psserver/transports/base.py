"""The client's view of one shard: two small interfaces and a registry of data planes.

In the manner of dask's ``distributed/comm/core.py``: the client never sees gRPC or a
socket. It talks to a shard through a :class:`Control` (the calls every shard answers:
register, init, heartbeat, stats, checkpoint, shutdown) and a :class:`DataPlane` (how the
payloads of Pull and Push move). A transport module implements them and registers its
data plane under the name job files use (``data_plane = "tcp"``); the client picks one per
shard when it registers, from what the shard offers. Every failure is raised as a domain
exception of exceptions.py, with its reason; a lost connection is :class:`Unavailable`.
"""

from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import DEFAULT_CHUNK_BYTES, HeartbeatInfo, PushResult, Reason, Registration
from psgrid.psserver.security import check_token
from psgrid.psserver.spec import ModelSpec


@dataclass(frozen=True)
class ConnectOptions:
    """How to reach a job's shards: security material, chunking and the per-call deadline."""

    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    deadline_s: float = 60.0
    shared_memory: bool = True     # use a shard's shared memory when it is on this host
    memory: Any = field(default=None, compare=False)    # the client's ClientMemory (None: an observer's)

    def __post_init__(self):
        for name in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise InvalidArgument(f"{name} {path!r}: no such file", Reason.BAD_VALUE)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("tls_cert and tls_key must be given together", Reason.BAD_VALUE)
        check_token(self.token)

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)


class Control(ABC):
    """The calls every shard answers, to the shard at ``address``."""

    address: str

    @abstractmethod
    def register(self, *, spec_hash: str, worker_id: int, start_clock: int, host: str,
                 observer: bool = False) -> Registration: ...

    @abstractmethod
    def init(self, spec: ModelSpec, values: np.ndarray, begin: int) -> tuple[bool, int]:
        """Offer ``values`` (this shard's range, starting at element ``begin``); returns (applied, version)."""

    @abstractmethod
    def heartbeat(self, worker_id: int, *, leaving: bool = False, timeout_s: float | None = None) -> HeartbeatInfo: ...

    @abstractmethod
    def stats(self) -> dict: ...

    @abstractmethod
    def checkpoint(self) -> tuple[str, int]: ...

    @abstractmethod
    def shutdown(self, job_id: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class DataPlane(ABC):
    """How the payloads of Pull and Push move to and from one shard."""

    name: str
    reads_in_place = False      # a pull can hand over the shard's own memory (no copy of ours first)

    @abstractmethod
    def pull_into(self, out: np.ndarray, *, begin: int, worker_id: int, clock: int, timeout_s: float) -> int:
        """Fill ``out`` (this shard's range, from element ``begin``, float32) once the consistency rule
        allows; returns the version."""

    def pull_with(self, write: Callable[[int, int, np.ndarray], object], *, begin: int, end: int,
                  staging: Callable[[], np.ndarray], worker_id: int, clock: int, timeout_s: float) -> int:
        """Hand this shard's weights to ``write(begin, end, values)`` once the consistency rule allows.

        ``values`` are valid during the call only. A plane that reads in place hands over the
        shard's memory; the others first receive into ``staging()`` (the client's whole-model
        host buffer, from element ``begin``).
        """
        view = staging()[begin:end]
        version = self.pull_into(view, begin=begin, worker_id=worker_id, clock=clock, timeout_s=timeout_s)
        write(begin, end, view)
        return version

    @abstractmethod
    def push(self, grad: np.ndarray, *, begin: int, wire_dtype: int, worker_id: int, clock: int, version: int,
             timeout_s: float) -> PushResult:
        """Send ``grad`` (this shard's range, from element ``begin``, float32) as ``wire_dtype``."""

    @abstractmethod
    def close(self) -> None: ...


# A factory builds the data plane a registration offers, or returns None when the shard offers none.
DataPlaneFactory = Callable[[Control, Registration, ConnectOptions], "DataPlane | None"]
_DATA_PLANES: dict[str, str] = {     # name -> module that registers it when imported
    "grpc": "psgrid.psserver.transports.grpc_client",
    "tcp": "psgrid.psserver.transports.tcp_client",
    "shm": "psgrid.psserver.transports.shm_client",
}
_FACTORIES: dict[str, DataPlaneFactory] = {}


def register_data_plane(name: str, factory: DataPlaneFactory) -> None:
    _FACTORIES[name] = factory


def data_plane_factory(name: str) -> DataPlaneFactory:
    if name not in _FACTORIES:
        module = _DATA_PLANES.get(name)
        if module is None:
            raise ValueError(f"unknown data plane {name!r}; known: {sorted(_DATA_PLANES)}")
        importlib.import_module(module)
    return _FACTORIES[name]


def open_data_plane(preference: str, control: Control, registration: Registration,
                    options: ConnectOptions) -> DataPlane:
    """Shared memory when the shard offers it on this host, else the preferred network plane, else gRPC."""
    for name in dict.fromkeys(("shm", preference, "grpc") if options.shared_memory else (preference, "grpc")):
        plane = data_plane_factory(name)(control, registration, options)
        if plane is not None:
            return plane
    raise AssertionError("the gRPC data plane is always offered")


def open_control(address: str, options: ConnectOptions) -> Control:
    """The control connection to the shard at ``address`` (gRPC: the complete contract)."""
    from psgrid.psserver.transports.grpc_client import GrpcControl

    return GrpcControl(address, options)
