"""What the workers of one host say to each other (worker/aggregate.py), and how it is read: bounded in size and time.

A message is a little-endian 32-bit length and that many bytes of JSON, an object with an ``op``.
Nothing a peer sends is trusted: a length past :data:`MAX_MESSAGE`, bytes that are not JSON, a
field of the wrong type or a message begun and not finished within :data:`MESSAGE_S` is refused
with a reason (:class:`Malformed`, an :class:`AggregationError`), never a crash. A message's first
byte may be waited for as long as the step may take; once it has come the rest must follow at
once (a message is at most 64 KiB, so :data:`MESSAGE_S` is a rate of 21 KiB/s at least), so a peer
that trickles bytes is cut as one that says nothing.

========  ====================  ================================================================
op        from                  fields
========  ====================  ================================================================
hello     a follower            ``local`` (its local rank), ``token`` (the job's, or null)
welcome   the leader            ``mode``, ``worker_id``, ``clock``, ``planes``; with two descriptors:
                                the weights (read-only) and the follower's own gradient slot
refused   the leader            ``reason``; the connection then closes
weights   the leader            ``clock``: the weights of this step are in the weights file
gradient  a follower            ``clock``: its gradient of this step is in its slot
pushed    the leader            ``clock`` (the next), ``results`` ([outcome, version, staleness,
                                next_clock] per shard)
========  ====================  ================================================================
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

from psgrid.psserver.protocol import Outcome, PushResult
from psgrid.psserver.transports.unix_peers import receive_with_fds, send_with_fds

# What a new connection has for its hello: the data planes' handshake time (transports/stream_frames.py).
HANDSHAKE_S = 3.0

LENGTH = struct.Struct("<I")
MAX_MESSAGE = 1 << 16  # longest message: the largest, ``pushed``, is 4 numbers per shard
MESSAGE_S = HANDSHAKE_S  # a message (a hello included) must be whole this long after its first byte
MODES = ("sync", "async", "ssp")
AGGREGATION = "this host's aggregation"  # what a peer of another user is told it may not join


class AggregationError(RuntimeError):
    """The host's workers could not meet, or one of them went away."""


class Malformed(AggregationError):
    """A peer said something that is not one of this exchange's messages."""


class Completed:
    """A finished pull or push, with the handle surface the training loop reads."""

    def __init__(self, result, seconds: float):
        self._result, self.seconds = result, seconds

    def wait(self, timeout: float | None = None):
        return self._result


def encode(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return LENGTH.pack(len(data)) + data


def send(sock: socket.socket, message: dict, fds=()) -> None:
    """Send one message (OSError when the peer is gone or reads nothing for the socket's timeout)."""
    if fds:
        send_with_fds(sock, encode(message), fds)
    else:
        sock.sendall(encode(message))


class MessageReader:
    """One peer's bytes as they come (read without blocking), cut into messages; what is malformed is refused
    as soon as it shows."""

    def __init__(self):
        self.buffer = bytearray()
        self.begun_at: float | None = None  # when the first byte of the message being read came

    def feed(self, data: bytes) -> list[dict]:
        """The messages ``data`` completes (Malformed: the peer must be dropped)."""
        if data and self.begun_at is None:
            self.begun_at = time.monotonic()
        self.buffer += data
        messages = []
        while len(self.buffer) >= LENGTH.size:
            length = length_of(self.buffer)
            if len(self.buffer) < LENGTH.size + length:
                break
            messages.append(decode(bytes(self.buffer[LENGTH.size : LENGTH.size + length])))
            del self.buffer[: LENGTH.size + length]
            self.begun_at = time.monotonic() if self.buffer else None
        return messages

    def deadline(self, waiting_until: float) -> float:
        """When this peer must have said something: ``waiting_until``, or sooner for a message it has begun."""
        return waiting_until if self.begun_at is None else min(waiting_until, self.begun_at + MESSAGE_S)


def length_of(head: bytes | bytearray) -> int:
    (length,) = LENGTH.unpack_from(head)
    if length > MAX_MESSAGE:
        raise Malformed(f"a message of {length} bytes (at most {MAX_MESSAGE})")
    return length


def decode(data: bytes) -> dict:
    try:
        message = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise Malformed("a message that is not JSON") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise Malformed("a message that is not an object with an op")
    return message


def receive(sock: socket.socket, wait_s: float, *, fds: int = 0) -> tuple[dict, list[int]]:
    """One message from ``sock`` (blocking): its first byte within ``wait_s``, the rest within :data:`MESSAGE_S`.

    Reads exactly the message, nothing of the next. With ``fds``, up to that many descriptors that came
    with it (the caller closes them). Raises AggregationError when the peer closes or is too slow,
    Malformed for what is not a message.
    """
    data, need, begun_at = bytearray(), LENGTH.size, None
    received: list[int] = []
    deadline = time.monotonic() + wait_s
    try:
        while len(data) < need:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AggregationError(
                    "it said nothing within the time a step may take"
                    if begun_at is None
                    else f"it did not finish a message within {MESSAGE_S:g} s"
                )
            sock.settimeout(left)
            try:
                if fds and not data:
                    chunk, got = receive_with_fds(sock, need, fds)
                    received += got
                else:
                    chunk = sock.recv(need - len(data))
            except TimeoutError:
                continue
            except OSError as exc:
                raise AggregationError(f"its socket failed ({exc.strerror or exc})") from None
            if not chunk:
                raise AggregationError("its socket closed")
            if begun_at is None:
                begun_at = time.monotonic()
                deadline = min(deadline, begun_at + MESSAGE_S)
            data += chunk
            if need == LENGTH.size and len(data) == need:
                need += length_of(data)
        return decode(bytes(data[LENGTH.size :])), received
    except BaseException:
        for fd in received:
            os.close(fd)
        raise


def field(message: dict, name: str, kind: type):
    """``message[name]``, refused unless it is a ``kind`` (an int is never a bool here)."""
    value = message.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise Malformed(f"{message.get('op')!r} needs {name!r} as {kind.__name__}, got {type(value).__name__}")
    return value


def expect(message: dict, op: str) -> dict:
    """``message``, refused unless its op is ``op`` (a ``refused`` says why the peer closed)."""
    if message["op"] == "refused" and op != "refused":
        raise AggregationError(f"refused: {str(message.get('reason'))[:500]}")
    if message["op"] != op:
        raise Malformed(f"{message['op']!r} where {op!r} was due (out of step)")
    return message


def results_message(clock: int, results: list[PushResult]) -> dict:
    return {
        "op": "pushed",
        "clock": clock,
        "results": [[int(r.outcome), r.version, r.staleness, r.next_clock] for r in results],
    }


def results_of(message: dict) -> list[PushResult]:
    """The shards' answers a ``pushed`` carries, each checked."""
    results = field(message, "results", list)
    parsed = []
    for result in results:
        if (
            not isinstance(result, list)
            or len(result) != 4
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in result)
            or result[0] not in Outcome._value2member_map_
        ):
            raise Malformed(f"a push result that is not [outcome, version, staleness, next_clock]: {result!r:.100}")
        parsed.append(PushResult(Outcome(result[0]), *result[1:]))
    return parsed
