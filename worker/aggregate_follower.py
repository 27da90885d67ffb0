"""A follower of the host's leader (local rank k > 0): it takes the weights the leader pulled and gives it its gradient.

It proves itself with the job's token, maps the weights read-only and its own gradient slot
(both files the leader made and sealed; checked as the shards check a file they are handed:
shared_memory.unsafe_to_map), and says when its gradient is in. Every wait on the leader is
bounded (a step's time for a word to begin, ``MESSAGE_S`` for it to end).

When the leader is gone (its socket closed, it said nothing for a step's time, or said
something that is not its part) the follower does not end: as any worker whose peer dies, it
goes on, as a client of the shards of its own (a new worker id; ``connect`` makes the client), so
that the host's other workers finish the job as the failure contract says (docs/reliability.md).
The step in flight then is counted as dropped: the leader may have pushed it before it went, and
a gradient applied twice would be worse than one left out.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.protocol import Outcome, PushResult
from psgrid.psserver.shared_memory import map_fd, unsafe_to_map
from psgrid.psserver.transports.unix_peers import abstract_address, peer_refusal, unix_connection
from psgrid.worker.aggregate_wire import (
    AGGREGATION,
    MESSAGE_S,
    MODES,
    AggregationError,
    Completed,
    Malformed,
    expect,
    field,
    receive,
    results_of,
    send,
)

log = logging.getLogger("psgrid.worker")
CONNECT_POLL_S = 0.05


class HostFollower:
    """Local rank k > 0: gives its gradient to the host's leader and takes the weights it pulled; on its own once
    the leader is gone."""

    def __init__(self, group, name: str, size: int, connect, wire_dtype: str, timeout_s: float, token: str | None):
        self.group, self.name, self.size, self.timeout_s, self.token = group, name, size, timeout_s, token
        self.connect = connect  # connect(None, None): a client of the shards of this worker's own
        self._wire_dtype = wire.wire_dtype(wire_dtype)
        self.sock: socket.socket | None = None
        self.weights = self.slot = None
        self.direct = None  # that client, once the leader is gone
        self._mode, self._clock, self._planes = "", 0, 0

    # what the training loop reads of an exchange: the leader's, or this worker's own client's
    mode = property(lambda self: self.direct.mode if self.direct else self._mode)
    worker_id = property(lambda self: self.direct.worker_id if self.direct else self.group.host)
    clock = property(lambda self: self.direct.clock if self.direct else self._clock)
    data_planes = property(lambda self: self.direct.data_planes if self.direct else ["host"] * self._planes)
    wire_dtype = property(lambda self: self.direct.wire_dtype if self.direct else self._wire_dtype)

    def __enter__(self) -> HostFollower:
        try:
            try:
                self._join()
            except AggregationError as exc:
                self._go_direct(f"could not join its host's leader ({exc})")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _join(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        self.sock = sock = self._reach(deadline)
        stranger = peer_refusal(sock, AGGREGATION)  # whoever bound the name first may be anyone
        if stranger is not None:
            raise AggregationError(f"the host's rendezvous socket is another user's: {stranger}")
        try:
            sock.settimeout(MESSAGE_S)
            send(sock, {"op": "hello", "local": self.group.local, "token": self.token})
        except OSError as exc:
            raise AggregationError(f"its hello did not go ({exc.strerror or exc})") from None
        message, fds = receive(sock, max(0.0, deadline - time.monotonic()), fds=2)
        try:
            welcome = expect(message, "welcome")
            mode = field(welcome, "mode", str)
            if mode not in MODES:
                raise Malformed(f"a welcome naming mode {mode[:20]!r}")
            if len(fds) != 2:
                raise Malformed("a welcome without the weights and a gradient slot")
            for fd in fds:
                problem = unsafe_to_map(fd)
                if problem is not None:
                    raise AggregationError(f"the leader's shared memory is not safe to map: {problem}")
            try:
                self.weights = map_fd(fds[0], self.size, writable=False)
                self.slot = map_fd(fds[1], self.size, writable=True)
            except (ValueError, OSError) as exc:
                raise AggregationError(f"cannot map the leader's shared memory: {exc}") from None
            self._mode, self._clock = mode, field(welcome, "clock", int)
            self._planes = field(welcome, "planes", int)
        finally:
            for fd in fds:
                os.close(fd)

    def _reach(self, deadline: float) -> socket.socket:
        """Connect to the leader's socket, which it binds as it starts (maybe after this worker)."""
        while True:
            try:
                return unix_connection(abstract_address(self.name), MESSAGE_S)
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise AggregationError(
                        f"its leader (local rank 0) did not listen within {self.timeout_s:g} s ({exc.strerror or exc})"
                    ) from None
                time.sleep(CONNECT_POLL_S)

    def bytes_per_step(self, params: int) -> int:
        return 0  # nothing of this worker's crosses the network: the leader's step carries it

    def pull(self, out: np.ndarray, *, background: bool = False):
        if self.direct is None:
            t0 = time.perf_counter()
            try:
                message, _ = receive(self.sock, self.timeout_s)
                self._clock = field(expect(message, "weights"), "clock", int)
                np.copyto(out, self.weights)
                return Completed([self._clock], time.perf_counter() - t0)
            except AggregationError as exc:
                self._go_direct(f"lost its leader while waiting for the weights ({exc})")
        return self.direct.pull(out, background=background)

    def push(self, grad: np.ndarray, *, background: bool = False):
        if self.direct is not None:
            return self.direct.push(grad, background=background)
        t0 = time.perf_counter()
        try:
            np.copyto(self.slot, grad)
            try:
                self.sock.settimeout(MESSAGE_S)
                send(self.sock, {"op": "gradient", "clock": self._clock})
            except OSError as exc:
                raise AggregationError(f"its word did not go ({exc.strerror or exc})") from None
            pushed = expect(receive(self.sock, self.timeout_s)[0], "pushed")
            results = results_of(pushed)
            self._clock = field(pushed, "clock", int)
            return Completed(results, time.perf_counter() - t0)
        except AggregationError as exc:
            self._go_direct(f"lost its leader while waiting for its push's answer ({exc})")
            return Completed([PushResult(Outcome.DROPPED_LATE, 0, -1, self.direct.clock)], time.perf_counter() - t0)

    def _go_direct(self, why: str) -> None:
        """Leave the host's aggregation and join the shards as a worker of its own."""
        where = f"host {self.group.host}: the worker of local rank {self.group.local}"
        self._leave_host()
        if self.connect is None:
            raise AggregationError(f"{where} {why}")
        log.warning("%s %s; it pushes to the shards on its own from now on", where, why)
        client = self.connect(None, None)
        client.__enter__()  # a client that cannot join closes itself and raises
        self.direct = client

    def _leave_host(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.weights = self.slot = None  # the mappings go with the last view of them

    def close(self) -> None:
        self._leave_host()
        if self.direct is not None:
            self.direct.close()
