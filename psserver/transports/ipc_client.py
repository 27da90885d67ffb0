"""The CUDA IPC data plane, client side: a GPU worker copies a device shard's weights GPU to GPU.

Chosen before shared memory by a client whose arrays are on a GPU (``ConnectOptions.gpu``) when a
shard on this host keeps its weights on a GPU this process can reach: the same GPU, or one with
peer access to it. A pull is the shared-memory plane's (shm_client.py), with the ring buffer
mapped through its IPC handle: the writer gets the shard's device array and copies it where it
wants it (a device-to-device copy, finished before the writer returns), then the mark is
checked and cleared. A push copies the gradient (a device array, or host memory) into one of the
connection's two gradient slots, which the shard allocated on its GPU and this process mapped,
and sends a header; the shard copies it out before it checks and applies it (ipc_server.py).

Nothing here is imported by a client without a GPU: the plane's factory declines first.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.exceptions import BadReply
from psgrid.psserver.protocol import BFLOAT16, FLOAT16, FLOAT32, ITEMSIZE, Outcome, PushResult
from psgrid.psserver.transports.base import ConnectOptions, Control, register_data_plane
from psgrid.psserver.transports.shm_client import ShmConnection, ShmDataPlane, answering
from psgrid.psserver.transports.stream_frames import (
    attach_request,
    dtype_byte,
    map_request,
    push_request,
    read_reply,
    recv_exact,
)

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess: map a peer GPU's memory too


class _IpcConnection(ShmConnection):
    __slots__ = ("slots",)

    def __init__(self, sock: socket.socket):
        super().__init__(sock)
        self.slots: dict[int, object] = {}  # this connection's gradient slots (dtype byte -> device array)


class IpcDataPlane(ShmDataPlane):
    """Pulls and pushes of one device shard's range through CUDA IPC, from GPU ``gpu`` of this process."""

    name = "ipc"
    title = "CUDA IPC plane"
    takes_device_arrays = True
    posts = False  # its pulls hand over device arrays, copied device to device where they are called
    connection_class = _IpcConnection

    def __init__(self, address: str, options: ConnectOptions, host: str, gpu: int):
        super().__init__(address.split("|", 1)[0], options, host)
        import cupy

        self.cupy = cupy
        self.gpu = gpu
        self.replier = f"shard CUDA IPC at {self.address}"
        self.opened: list[int] = []  # device pointers this plane mapped (closed with it)
        with cupy.cuda.Device(gpu):
            self.stream = cupy.cuda.Stream(non_blocking=True)

    # ----- mapping the shard's memory -----------------------------------------------------------

    def _map_handle(self, sock, size: int):
        """Read a MAP or ATTACH answer's handle and map it: a device array of ``size`` float32."""
        reply = read_reply(sock, self.replier)
        if reply.nbytes != IPC_HANDLE_BYTES or reply.buffer_bytes != size * ITEMSIZE[FLOAT32]:
            raise BadReply(
                f"{self.replier} offers {reply.buffer_bytes} bytes ({reply.nbytes}-byte handle) for a "
                f"range of {size} elements"
            )
        handle = bytearray(IPC_HANDLE_BYTES)
        recv_exact(sock, memoryview(handle))
        cupy = self.cupy
        with cupy.cuda.Device(self.gpu):
            pointer = cupy.cuda.runtime.ipcOpenMemHandle(bytes(handle), LAZY_PEER_ACCESS)
            with self.map_lock:
                self.opened.append(pointer)
            memory = cupy.cuda.UnownedMemory(pointer, size * 4, owner=self, device_id=self.gpu)
            return cupy.ndarray((size,), cupy.float32, cupy.cuda.MemoryPointer(memory, 0))

    def mapped(self, conn: _IpcConnection, index: int, size: int):
        buffer = self.buffers.get(index)
        if buffer is not None and len(buffer) == size:
            return buffer
        conn.sock.sendall(map_request(index))
        buffer = self._map_handle(conn.sock, size)
        with self.map_lock:
            self.buffers[index] = buffer
        return buffer

    def _slot(self, conn: _IpcConnection, kind: int, size: int):
        slot = conn.slots.get(kind)
        if slot is None:
            conn.sock.sendall(attach_request(kind, 0))
            slot = conn.slots[kind] = self._map_handle(conn.sock, size)
        return slot

    # ----- calls --------------------------------------------------------------------------------

    def pull_into(self, out: np.ndarray, *, begin: int, worker_id: int, clock: int, timeout_s: float) -> int:
        def copy(values) -> None:
            with self.cupy.cuda.Device(self.gpu):
                values.get(stream=self.stream, out=out)
                self.stream.synchronize()

        return self._pull(copy, len(out), worker_id, clock, timeout_s)

    def pull_with(
        self, write: Callable, *, begin: int, end: int, staging, worker_id: int, clock: int, timeout_s: float
    ) -> int:
        """``write(begin, end, values)`` gets the shard's device array: it must finish its copy before it returns."""
        return self._pull(lambda values: write(begin, end, values), end - begin, worker_id, clock, timeout_s)

    def push(
        self, grad, *, begin: int, wire_dtype: int, worker_id: int, clock: int, version: int, timeout_s: float
    ) -> PushResult:
        kind = dtype_byte(FLOAT32, clock % 2)  # two slots: a push's copy never meets the one before

        def call(conn: _IpcConnection) -> PushResult:
            slot = self._slot(conn, kind, len(grad))
            self._fill(slot, grad, wire_dtype)
            conn.sock.sendall(push_request(kind, worker_id, clock, version, 0, timeout_s))
            reply = read_reply(conn.sock, self.replier)
            return PushResult(Outcome(reply.outcome), reply.version, reply.staleness, reply.next_clock)

        return self.pool.round_trip(timeout_s, call)

    def _fill(self, slot, grad, wire_dtype: int) -> None:
        """Copy ``grad`` into ``slot``, rounded as ``wire_dtype`` would round it on a network plane; done on return."""
        cupy = self.cupy
        with cupy.cuda.Device(self.gpu), self.stream:
            if wire_dtype == BFLOAT16 or isinstance(grad, np.ndarray):
                host = cupy.asnumpy(grad) if not isinstance(grad, np.ndarray) else grad
                if wire_dtype != FLOAT32:
                    rounded = np.empty(len(host), np.float32)
                    wire.decode_into(rounded, wire.encode(host, wire_dtype), wire_dtype)
                    host = rounded
                slot.set(host, stream=self.stream)
            elif wire_dtype == FLOAT16:
                slot[...] = grad.astype(cupy.float16)
            else:
                slot.data.copy_from_device_async(grad.data, slot.nbytes, self.stream)
            self.stream.synchronize()

    def close(self) -> None:
        # The mappings go first: the shard frees a connection's slots when it closes, and memory must not
        # be freed by its owner while another process still has it mapped.
        with self.map_lock:
            opened, self.opened = self.opened, []
            self.buffers = {}
        with self.cupy.cuda.Device(self.gpu):
            self.cupy.cuda.Device(self.gpu).synchronize()
            for pointer in opened:
                try:
                    self.cupy.cuda.runtime.ipcCloseMemHandle(pointer)
                except self.cupy.cuda.runtime.CUDARuntimeError:
                    pass
        super().close()


def reachable_gpu(pci_bus_id: str, gpu: int) -> int | None:
    """The ordinal, in this process, of the shard's GPU ``pci_bus_id`` if GPU ``gpu`` can reach its memory."""
    try:
        import cupy

        runtime = cupy.cuda.runtime
        for ordinal in range(runtime.getDeviceCount()):
            if runtime.deviceGetPCIBusId(ordinal).lower() == pci_bus_id.lower():
                return ordinal if ordinal == gpu or runtime.deviceCanAccessPeer(gpu, ordinal) else None
    except Exception:  # noqa: BLE001 - no CuPy, no driver: this client cannot use the plane
        return None
    return None


def _offered(control: Control, address: str, options: ConnectOptions) -> IpcDataPlane | None:
    """The shard's GPU memory, for a GPU client of another process on this host that can reach that GPU."""
    if not (options.shared_memory and options.gpu is not None and address.count("|") == 2):
        return None
    _, pid, pci_bus_id = address.split("|")
    if pid == str(os.getpid()) or reachable_gpu(pci_bus_id, options.gpu) is None:
        return None  # a process cannot map its own handles; another GPU without peer access cannot map them
    return answering(IpcDataPlane(address, options, control.address.rsplit(":", 1)[0].strip("[]"), options.gpu))


register_data_plane("ipc", _offered)
