"""Calls of the shared-memory plane made in steps on the caller's own thread: no client thread waits.

Why: a GPU worker's background calls ran on the client's threads, and each time one of them woke (an
answer came, a copy ended) it took the interpreter lock from the thread that launches the model's
kernels. With the pull-ahead's pull and the push both in the background, a step's launches took twice
as long (benchmarks/host_step_parts.py). A call here is split where it would wait instead, and the
caller makes each step when it has time:

* a pull sends its request (:class:`PostedPull`), reads the answer and hands the shard's buffer to
  ``queue``, which starts a device copy from it and returns (:meth:`PostedPull.land`); once the copy has
  ended the caller checks the mark and gives the connection back (:meth:`PostedPull.finish`);
* a push sends its header (:class:`PostedPush`); its answer is read when the caller needs it
  (:meth:`PostedPush.finish`), by then usually waiting in the socket.

A step that fails leaves its call to the client, which makes it again in the usual way (a pull
is read again; a push carries the same clock, which a shard that took it answers as a duplicate):
:meth:`abandon` closes the connection, whose state is then unknown. The connection is the call's
from its first step to its last, so two calls in flight hold two.
"""

from __future__ import annotations

import numpy as np

from psgrid.psserver.protocol import FLOAT32, PushResult
from psgrid.psserver.transports.stream_frames import pull_request, read_reply


class PostedCall:
    """What both posted calls share: the plane, the connection they hold, and how they end."""

    def __init__(self, plane, timeout_s: float):
        self.plane = plane
        self.conn = plane.pool.borrow(timeout_s)

    def _give_back(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            self.plane.pool.give(conn)

    def abandon(self) -> None:
        """Close the connection (its frames may be out of step); the client makes the call again."""
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


class PostedPull(PostedCall):
    """A pull of one shard's range: request sent on construction, then :meth:`land` and :meth:`finish`.

    Between ``land`` and ``finish`` the shard's buffer is marked as this connection's (weight_ring.py):
    the shard writes other buffers meanwhile, or takes this one back, which ``finish`` then sees.
    """

    def __init__(self, plane, *, size: int, worker_id: int, clock: int, timeout_s: float):
        super().__init__(plane, timeout_s)
        self.size = size
        self.index: int | None = None
        self.version: int | None = None
        try:
            if self.conn.slot < 0:
                plane.open_slot(self.conn)
            self.conn.sock.sendall(pull_request(FLOAT32, worker_id, clock, timeout_s))
        except BaseException:
            self.abandon()
            raise

    @property
    def landed(self) -> bool:
        return self.index is not None

    def land(self, queue) -> None:
        """Read the answer (waiting, in sync and ssp, until the mode allows) and ``queue(values)`` the copy."""
        reply = read_reply(self.conn.sock, self.plane.replier)
        buffer = self.plane.mapped(self.conn, reply.buffer_index, self.size)
        self.index, self.version = reply.buffer_index, reply.version
        queue(buffer)

    def finish(self) -> int | None:
        """Once the queued copy has ended: the version pulled, or None where the shard took the buffer back
        meanwhile (the copy may be torn: the client reads again)."""
        intact = self.plane.still_marked(self.conn, self.index)
        self.plane.unmark(self.conn)
        self._give_back()
        return self.version if intact else None

    def abandon(self) -> None:
        """As for any call; a pull that landed has its copy ended first (the caller waits for it)."""
        if self.conn is not None and self.index is not None:
            self.plane.unmark(self.conn)
        super().abandon()


class PostedPush(PostedCall):
    """A push of one shard's range from a shared gradient file: header sent on construction, then :meth:`finish`."""

    def __init__(
        self,
        plane,
        grad: np.ndarray,
        *,
        begin: int,
        wire_dtype: int,
        worker_id: int,
        clock: int,
        version: int,
        timeout_s: float,
    ):
        kind, segment, fd = plane.stage(grad, begin, wire_dtype)
        super().__init__(plane, timeout_s)
        try:
            plane.send_push(
                self.conn, kind, segment, fd, worker_id=worker_id, clock=clock, version=version, timeout_s=timeout_s
            )
        except BaseException:
            self.abandon()
            raise

    def finish(self) -> PushResult:
        """The shard's answer (read now; it came while the caller computed, unless the update is slower)."""
        result = self.plane.push_answer(self.conn)
        self._give_back()
        return result
