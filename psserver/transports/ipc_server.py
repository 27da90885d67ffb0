"""The CUDA IPC data plane, server side: workers on this host read and write a device shard's GPU memory.

A shard whose weights are on a GPU (``shard_device = "gpu"``, state/device.py) offers this plane
instead of the shared-memory one. It is that plane's socket and checks (an abstract Unix socket,
peers of the shard's own user only, the job's token, TLS then plain frames: shm_server.py), with
device memory where that plane hands over files:

* ``OPEN`` gives the connection a slot in the ring's table of marks, in shared memory as on the
  shared-memory plane: a reader marks the buffer it copies and clears the mark when its copy is done;
* ``MAP`` answers the CUDA IPC handle of a ring buffer (a payload of 64 bytes);
* ``ATTACH`` (dtype byte: float32 and the slot's index, 0 or 1) allocates one of the connection's
  two gradient slots on the shard's GPU and answers its IPC handle;
* ``PULL`` is the shared-memory plane's: the index of the buffer that holds the version;
* ``PUSH`` (the same dtype byte) says the gradient is in that slot.

The shard owns every buffer it reads or serves: a worker maps the shard's allocations, never the
other way round, so a worker that dies (or frees what it mapped) cannot take memory from under the
shard. CUDA maps them writable only; the shard never reads the ring buffers it publishes (it
updates weights of its own and copies each version out: state/updater.py ``DeviceUpdater``), so a
peer that writes one changes what readers of that version copy, nothing the shard keeps. A push is copied
out of the worker's slot before it is checked and applied (:class:`DeviceSlot`, the intake's source), so a
worker writing its slot meanwhile changes nothing it was not already sending.
A connection's slots are freed when it closes: a worker that dies closes it, and its lease
ends as on any plane. The offer names the shard's process and its GPU's PCI bus id, so a worker of
the same process (which cannot map its own handles) or one that cannot reach that GPU takes
another plane. What a connected peer can and cannot do: docs/reliability.md, "The CUDA IPC plane's
threat model".
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable

from psgrid.psserver.exceptions import InvalidArgument, Unavailable
from psgrid.psserver.intake import non_finite
from psgrid.psserver.protocol import FLOAT32, ITEMSIZE, Reason
from psgrid.psserver.service import ShardService
from psgrid.psserver.shared_memory import can_share_read_only
from psgrid.psserver.transports.base import ListenContext, Listening, register_listener
from psgrid.psserver.transports.shm_server import Reader, ShmDataServer
from psgrid.psserver.transports.stream_frames import ATTACH, MAP, OPEN, PULL, PUSH, Request
from psgrid.psserver.transports.stream_server import DEFAULT_MAX_CONNECTIONS, Connection

MAX_SLOTS = 128  # gradient slots at once on one shard (two per worker): far past any host's workers
FREE_MARGIN = 256 << 20  # GPU memory a new slot leaves free, for the shard's own updates


def ipc_address(socket_name: str, pid: int, pci_bus_id: str) -> str:
    """The plane's offer: its socket, the shard's process and its GPU (``@name|pid|bus id``)."""
    return f"{socket_name}|{pid}|{pci_bus_id}"


class DeviceSlot:
    """A push's gradient in a worker's slot on the shard's GPU, handed to the intake (intake.py ``GradientSource``).

    Copied first into a buffer the worker cannot reach, and checked for NaN and infinity in the
    same pass: the worker may write its slot again at any time, and must not change a gradient
    between its check and its update.
    """

    __slots__ = ("slot", "arrays")

    def __init__(self, slot, arrays):
        self.slot, self.arrays = slot, arrays  # the slot (a device array of the range) and the shard's GpuArrays

    @property
    def nbytes(self) -> int:
        return self.slot.nbytes

    def check(self, size: int) -> None:
        """Nothing to refuse: the slot is the shard's own allocation of its range, in float32."""

    def lend(self) -> None:
        return None

    def copy_into(self, destination) -> bool:
        if not self.arrays.copy_checked(destination, self.slot):
            raise non_finite("payload")
        return True

    def queue_into(self, destination):
        """The checked copy, queued on the shard's stream; returns its flag, for the update queued after it."""
        return self.arrays.check_into(destination, self.slot)


class IpcDataServer(ShmDataServer):
    """Serves one device shard's Pull and Push through CUDA IPC to processes of this host and user."""

    name = "CUDA IPC plane"

    def __init__(
        self,
        service: ShardService,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        *,
        handlers: int = 128,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        on_failure: Callable[[], None] | None = None,
    ):
        super().__init__(
            service, token, ssl_context, handlers=handlers, max_connections=max_connections, on_failure=on_failure
        )
        self.socket_name = self.address
        self.address = ipc_address(self.socket_name, os.getpid(), service.shard.arrays.pci_bus_id)
        self.operations = {OPEN: self._open, MAP: self._map, ATTACH: self._attach, PULL: self._pull, PUSH: self._push}
        self.slots = 0  # gradient slots allocated, over all connections

    def _operation(self, conn: Connection, request: Request) -> bool:
        op = request.op
        if op not in self.operations or request.nbytes:
            return super(ShmDataServer, self)._operation(conn, request)  # refused: no payload comes here
        if conn.state is None:
            conn.state = Reader()
        self._answer(conn.sock, self.operations[op], conn.sock, conn.state, request)
        return True

    def _released(self, conn) -> None:
        reader = conn.state
        if reader is not None and reader.segments:
            with self.lock:
                self.slots -= len(reader.segments)
            reader.segments.clear()  # the slots' memory goes with the last reference
        super()._released(conn)

    def _map(self, sock, reader: Reader, request: Request) -> None:
        """The CUDA IPC handle of the device ring's buffer ``index``, and its size in bytes."""
        ring = self.service.shard.device_ring()
        index = request.buffer_index
        if not 0 <= index < len(ring.arrays):
            raise InvalidArgument(f"no weight buffer {index}", Reason.BAD_VALUE)
        self._reply(sock, version=ring.size * ITEMSIZE[FLOAT32], payload=ring.ipc_handle(index))

    def _attach(self, sock, reader: Reader, request: Request) -> None:
        if request.wire_dtype != FLOAT32 or request.file_index not in (0, 1):
            raise InvalidArgument(
                f"dtype byte {request.dtype} names no gradient slot (float32, slot 0 or 1)", Reason.BAD_DTYPE
            )
        ring = self.service.shard.device_ring()
        slot = reader.segments.get(request.dtype)
        if slot is None:
            slot = self._new_slot(ring.size)
            reader.segments[request.dtype] = slot
        self._reply(sock, version=ring.size * ITEMSIZE[FLOAT32], payload=ring.device.ipc_handle(slot))

    def _new_slot(self, size: int):
        """A gradient slot on the shard's GPU; refused (the worker takes a network plane) when the GPU is full."""
        arrays = self.service.shard.arrays
        with self.lock:
            if self.slots >= MAX_SLOTS:
                raise Unavailable(
                    f"this shard serves at most {MAX_SLOTS // 2} workers over CUDA IPC; use a network plane",
                    Reason.TOO_MANY_CONNECTIONS,
                )
            self.slots += 1
        try:
            if arrays.free_bytes() < size * ITEMSIZE[FLOAT32] + FREE_MARGIN:
                raise Unavailable(
                    "the shard's GPU has no room for another gradient slot; use a network plane",
                    Reason.TOO_MANY_CONNECTIONS,
                )
            return arrays.empty(size)
        except BaseException:
            with self.lock:
                self.slots -= 1
            raise

    def _push(self, sock, reader: Reader, request: Request) -> None:
        slot = reader.segments.get(request.dtype)
        if slot is None:
            raise InvalidArgument(
                f"no gradient slot {request.file_index} attached to this connection: ATTACH it first", Reason.BAD_DTYPE
            )
        result = self.service.push(
            worker_id=request.worker,
            clock=request.clock,
            version=request.version,
            source=DeviceSlot(slot, self.service.shard.arrays),
        )
        self._reply_push(sock, result)


# ----- the plane's server end, registered (transports/base.py) ---------------------------------------


def _listen(service: ShardService, config, context: ListenContext) -> Listening | None:
    """The CUDA IPC plane, on a device shard whose ``shared_memory`` is on (its marks are shared memory)."""
    if not (config.shared_memory and service.shard.arrays.on_gpu and can_share_read_only()):
        return None
    server = IpcDataServer(
        service,
        config.token,
        context.ssl_context,
        handlers=config.threads,
        max_connections=config.tcp_max_connections,
        on_failure=context.on_failure,
    )
    return Listening(server, address=lambda: server.address)


register_listener("ipc", _listen)
