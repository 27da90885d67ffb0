"""The planes a shard's payloads move on, both ends: two small client interfaces and two registries.

In the manner of dask's ``distributed/comm/core.py`` and ``registry.py``: the client never sees gRPC
or a socket. It talks to a shard through a :class:`Control` (the calls every shard answers:
register, init, heartbeat, stats, checkpoint, shutdown) and a :class:`DataPlane` (how the payloads
of Pull and Push move). A plane is one module per end, each registering itself under the plane's
name (the name job files use, ``data_plane = "tcp"``): the client end with
:func:`register_data_plane`, the server end (its listener) with :func:`register_listener`. A shard
starts every registered listener that its configuration asks for, its registration answers the
(plane, address) of each, and the client takes the first plane of its order of preference that
both ends know. Every failure is raised as a domain exception of exceptions.py, with its reason; a
lost connection is :class:`Unavailable`.
"""

from __future__ import annotations

import importlib
import os
import ssl
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import (
    CONTROL_PLANE,
    DEFAULT_CHUNK_BYTES,
    LOCAL_PLANES,
    PLANES,
    HeartbeatInfo,
    PushResult,
    Reason,
    Registration,
)
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
    shared_memory: bool = True  # use a shard's shared memory when it is on this host
    gpu: int | None = None  # the GPU the caller's arrays are on (a device shard's CUDA IPC plane); None: host
    memory: Any = field(default=None, compare=False)  # the client's ClientMemory (None: an observer's)

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
    def register(
        self, *, spec_hash: str, worker_id: int, start_clock: int, host: str, observer: bool = False
    ) -> Registration: ...

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
    title = "data plane"  # how messages name it ("shared-memory plane")
    reads_in_place = False  # a pull can hand over the shard's own memory (no copy of ours first)
    takes_device_arrays = False  # push takes a CuPy array, and pull_with may hand one to its writer
    posts = False  # has post_pull and post_push: calls in steps on the caller's thread (shm_posted.py)

    @abstractmethod
    def pull_into(self, out: np.ndarray, *, begin: int, worker_id: int, clock: int, timeout_s: float) -> int:
        """Fill ``out`` (this shard's range, from element ``begin``, float32) once the consistency rule
        allows; returns the version."""

    def pull_with(
        self,
        write: Callable[[int, int, np.ndarray], object],
        *,
        begin: int,
        end: int,
        staging: Callable[[], np.ndarray],
        worker_id: int,
        clock: int,
        timeout_s: float,
    ) -> int:
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
    def push(
        self,
        grad: np.ndarray,
        *,
        begin: int,
        wire_dtype: int,
        worker_id: int,
        clock: int,
        version: int,
        timeout_s: float,
    ) -> PushResult:
        """Send ``grad`` (this shard's range, from element ``begin``, float32) as ``wire_dtype``."""

    @abstractmethod
    def close(self) -> None: ...


# ----- the registries ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ListenContext:
    """What a shard's server hands every listener besides its service and configuration."""

    ssl_context: ssl.SSLContext | None = None  # the shard's TLS (None: plain)
    on_failure: Callable[[], None] | None = None  # a listener that died calls it (the shard turns NOT_SERVING)
    in_process_clients: bool = False  # serve clients of the shard's own process by calls (local plane)


@dataclass(frozen=True)
class Listening:
    """A plane's server end, built: the listener the shard starts and stops, and what registration offers."""

    listener: Any  # start() and stop(); RunningServer.<plane name> in tests and tools
    address: Callable[[], str | None]  # where clients reach it now, in the plane's own form; None: not offered


# The client end builds the data plane from the address the shard offers, or returns None when it cannot
# be used from here; the server end builds its listener (``service`` is the shard's ShardService,
# ``config`` its ServerConfig), or returns None when the configuration does not ask for the plane.
DataPlaneFactory = Callable[[Control, str, ConnectOptions], "DataPlane | None"]
ListenerFactory = Callable[[Any, Any, ListenContext], "Listening | None"]
_CLIENT_ENDS: dict[str, DataPlaneFactory] = {}
_SERVER_ENDS: dict[str, ListenerFactory] = {}


def _module(name: str, end: str) -> str:
    """The module that registers the built-in plane ``name``'s ``end`` ("client" or "server") when imported."""
    return f"psgrid.psserver.transports.{name}_{end}"


def register_data_plane(name: str, factory: DataPlaneFactory) -> None:
    """Register the client end of the plane ``name`` (a built-in plane's module does so when imported)."""
    _CLIENT_ENDS[name] = factory


def register_listener(name: str, factory: ListenerFactory) -> None:
    """Register the server end of the plane ``name``: every shard started from now on builds it."""
    _SERVER_ENDS[name] = factory


def unregister_plane(name: str) -> None:
    """Forget both ends of a plane that is not built in (a test's)."""
    if name in PLANES:
        raise ValueError(f"{name!r} is a built-in plane")
    _CLIENT_ENDS.pop(name, None)
    _SERVER_ENDS.pop(name, None)


def plane_names() -> tuple[str, ...]:
    """Every plane known here: the built-in ones, then those registered since, in that order."""
    return PLANES + tuple(n for n in dict.fromkeys([*_CLIENT_ENDS, *_SERVER_ENDS]) if n not in PLANES)


def client_planes() -> tuple[str, ...]:
    """The planes whose client end is known here: the built-in ones, then those registered since."""
    return PLANES + tuple(n for n in _CLIENT_ENDS if n not in PLANES)


def network_planes() -> tuple[str, ...]:
    """The planes a client may prefer: every client end known here but the local ones (chosen by shared_memory)."""
    return tuple(n for n in client_planes() if n not in LOCAL_PLANES)


def data_plane_factory(name: str) -> DataPlaneFactory:
    """The client end of the plane ``name``."""
    if name not in _CLIENT_ENDS:
        if name not in PLANES:
            raise ValueError(f"unknown data plane {name!r}; known: {client_planes()}")
        importlib.import_module(_module(name, "client"))
    return _CLIENT_ENDS[name]


def listener_factories() -> dict[str, ListenerFactory]:
    """The server end of every plane beside the control plane (the gRPC server is built by the shard itself)."""
    for name in PLANES:
        if name != CONTROL_PLANE and name not in _SERVER_ENDS:
            importlib.import_module(_module(name, "server"))
    return {name: _SERVER_ENDS[name] for name in plane_names() if name in _SERVER_ENDS}


def open_data_plane(
    preference: str, control: Control, registration: Registration, options: ConnectOptions
) -> DataPlane:
    """The first plane the shard offers and this client knows, in the client's order of preference.

    That order is: a local plane (shared memory) when the shard offers it on this host, else the
    preferred network plane, else gRPC, which every shard serves (offered or not).
    """
    local = LOCAL_PLANES if options.shared_memory else ()
    for name in dict.fromkeys((*local, preference, CONTROL_PLANE)):
        address = registration.address(name)
        if address is None and name == CONTROL_PLANE:
            address = ""
        if address is None or name not in client_planes():
            continue
        plane = data_plane_factory(name)(control, address, options)
        if plane is not None:
            return plane
    raise AssertionError("the gRPC data plane always serves")
