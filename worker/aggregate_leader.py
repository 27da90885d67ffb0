"""The host's leader (local rank 0): the one client of the shards, summing its host's gradients before each push.

It owns every byte the host shares (shared_memory.py's sealed files, as a shard owns its own):
the weights, which the others may only read (sealed against every writer but the leader's own
mapping), and one gradient slot per follower, handed to that follower alone and sealed against
resizing, so that a follower can write its own slot and nothing else, and can never make the
leader fault (SIGBUS) by shrinking what it reads.

Who may join: a process of this user (unix_peers.peer_refusal) whose hello carries the job's token
(compared in constant time, as the shared-memory plane does), for a local rank nobody holds.
The meet reads every connection without blocking, each with its own deadline (its hello whole
within ``MESSAGE_S`` of accepting it), and the meet ends at its own deadline with whoever came:
a silent or trickling connection, garbage or a stranger is refused with a reason and closed,
and holds up nobody. At each step the same holds for the followers' words: a follower that
closes, says something malformed, or says nothing for a step's time is dropped, its slot left
out of the sum, and the host goes on (docs/reliability.md, "The failure contract").
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import numpy as np

from psgrid.psserver.protocol import ITEMSIZE
from psgrid.psserver.security import token_matches
from psgrid.psserver.shared_memory import FIXED_SIZE, READ_ONLY_TO_OTHERS, SharedArray, can_share_read_only, refused
from psgrid.psserver.transports.unix_peers import abstract_listener, peer_refusal
from psgrid.worker.aggregate_wire import (
    AGGREGATION,
    MESSAGE_S,
    AggregationError,
    Completed,
    Malformed,
    MessageReader,
    encode,
    expect,
    field,
    results_message,
    send,
)

log = logging.getLogger("psgrid.worker")
MAX_STRANGERS = 64  # connections still to say their hello; past it the oldest is dropped
READ_BYTES = 1 << 16


def say_refused(sock: socket.socket, reason: str) -> None:
    """Tell a peer why it is turned away, without waiting for it, and close."""
    try:
        sock.send(encode({"op": "refused", "reason": reason}), socket.MSG_DONTWAIT)
    except OSError:
        pass
    sock.close()


def read_some(sock: socket.socket, reader: MessageReader) -> list[dict] | None:
    """What has come from a peer the selector says is readable, as messages; None once it closed."""
    try:
        data = sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return []
    except OSError:
        return None
    return reader.feed(data) if data else None


@dataclass
class Member:
    """A follower that joined: its connection, its gradient slot, and what it has said of its next message."""

    local: int
    sock: socket.socket
    slot: SharedArray
    reader: MessageReader = dataclass_field(default_factory=MessageReader)


@dataclass
class Stranger:
    sock: socket.socket
    deadline: float
    reader: MessageReader = dataclass_field(default_factory=MessageReader)


class HostLeader:
    """Local rank 0: the host's one client of the shards, summing the host's gradients before each push."""

    def __init__(self, client, group, name: str, size: int, timeout_s: float, token: str | None):
        self.client, self.group, self.size, self.timeout_s, self.token = client, group, size, timeout_s, token
        self.members: dict[int, Member] = {}  # by local rank
        self.memory: SharedArray | None = None
        self.listener: socket.socket | None = None
        try:
            if not can_share_read_only():
                raise AggregationError(
                    'aggregate = "host" needs a kernel that seals shared memory against its '
                    'readers\' writes (F_SEAL_FUTURE_WRITE, Linux 5.1); use aggregate = "none"'
                )
            self.listener = abstract_listener(name, 128)  # before the shards' join: the others may connect meanwhile
            self.memory = self._shared(READ_ONLY_TO_OTHERS, "psgrid-host-weights")
        except BaseException:
            self.close()
            raise
        self.weights = self.memory.array

    # what the training loop reads of an exchange: the host's client's
    mode = property(lambda self: self.client.mode)
    worker_id = property(lambda self: self.client.worker_id)
    clock = property(lambda self: self.client.clock)
    data_planes = property(lambda self: self.client.data_planes)
    wire_dtype = property(lambda self: self.client.wire_dtype)

    def _shared(self, seals: int, name: str) -> SharedArray:
        try:
            return SharedArray(self.size, np.float32, name, seals=seals)
        except OSError as exc:
            raise AggregationError(f"host {self.group.host}: {refused(exc, 4 * self.size)}") from None

    def __enter__(self) -> HostLeader:
        try:
            self.client.__enter__()
            self._meet()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- the meet --------------------------------------------------------------------------------

    def _meet(self) -> None:
        """Take the host's other workers as their hellos come, until all are in or the meet's time is up."""
        deadline = time.monotonic() + self.timeout_s
        strangers: dict[socket.socket, Stranger] = {}
        self.listener.setblocking(False)
        with selectors.DefaultSelector() as selector:
            selector.register(self.listener, selectors.EVENT_READ)
            try:
                while len(self.members) < self.group.size - 1:
                    now = time.monotonic()
                    for stranger in [s for s in strangers.values() if s.deadline <= now]:
                        self._turn_away(
                            selector, strangers, stranger, f"no whole hello within {MESSAGE_S:g} s of connecting"
                        )
                    if now >= deadline:
                        break
                    wake = min([deadline, *(s.deadline for s in strangers.values())])
                    for key, _ in selector.select(max(0.0, wake - now)):
                        if key.fileobj is self.listener:
                            self._accept(selector, strangers)
                        elif key.fileobj in strangers:
                            self._hear(selector, strangers, strangers[key.fileobj])
            finally:
                for stranger in list(strangers.values()):
                    self._turn_away(selector, strangers, stranger, "the host's workers have met")
        self.listener.close()  # nobody joins later: a late follower pushes on its own
        missing = [k for k in range(1, self.group.size) if k not in self.members]
        if missing:
            log.warning(
                "host %d: local rank(s) %s did not join its aggregation within %g s; the host goes on without them",
                self.group.host,
                missing,
                self.timeout_s,
            )
        self.memory.close()  # every follower has its descriptors; the mappings stay

    def _accept(self, selector, strangers: dict) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the others are still heard
                log.warning("host %d: cannot accept a connection: %s", self.group.host, exc)
                return
            stranger = peer_refusal(sock, AGGREGATION)
            if stranger is not None:
                say_refused(sock, stranger)
                continue
            sock.setblocking(False)
            strangers[sock] = Stranger(sock, time.monotonic() + MESSAGE_S)
            selector.register(sock, selectors.EVENT_READ)
            if len(strangers) > MAX_STRANGERS:  # a flood only ever takes its own places
                self._turn_away(selector, strangers, next(iter(strangers.values())), "too many connections at once")

    def _hear(self, selector, strangers: dict, stranger: Stranger) -> None:
        try:
            messages = read_some(stranger.sock, stranger.reader)
            if messages is None:
                self._turn_away(selector, strangers, stranger, "closed")
            elif messages:
                selector.unregister(stranger.sock)
                del strangers[stranger.sock]
                self._admit(stranger.sock, messages)
        except AggregationError as exc:
            self._turn_away(selector, strangers, stranger, str(exc))

    def _turn_away(self, selector, strangers: dict, stranger: Stranger, reason: str) -> None:
        selector.unregister(stranger.sock)
        del strangers[stranger.sock]
        say_refused(stranger.sock, reason)

    def _admit(self, sock: socket.socket, messages: list[dict]) -> None:
        """A follower whose hello is right gets the weights (read-only) and a slot of its own; any other is refused."""
        try:
            if len(messages) != 1:
                raise Malformed("more than the hello before the welcome")
            hello = expect(messages[0], "hello")
            given = hello.get("token")
            if self.token and not (isinstance(given, str) and token_matches(given, self.token)):
                raise AggregationError("missing or wrong token: the job's token (PSGRID_TOKEN) is asked for")
            local = field(hello, "local", int)
            if not 0 < local < self.group.size:
                raise Malformed(f"local rank {local} is not a follower of this host (1..{self.group.size - 1})")
            if local in self.members:
                raise AggregationError(f"local rank {local} has joined already")
            slot = self._shared(FIXED_SIZE, f"psgrid-host-gradient-{local}")
        except AggregationError as exc:  # (no memory for its slot: it pushes on its own, as it is told)
            say_refused(sock, str(exc))
            return
        welcome = {
            "op": "welcome",
            "mode": self.mode,
            "worker_id": self.worker_id,
            "clock": self.clock,
            "planes": len(self.data_planes),
        }
        try:
            sock.settimeout(MESSAGE_S)
            send(sock, welcome, [self.memory.reader_fd(), slot.fd])
        except OSError:
            slot.close()
            sock.close()
            return
        slot.close()  # its descriptor is the follower's now; the leader keeps its mapping
        self.members[local] = Member(local, sock, slot)

    # ----- the steps ------------------------------------------------------------------------------

    def bytes_per_step(self, params: int) -> int:
        """The host's one pull (float32) and one push."""
        return params * (4 + ITEMSIZE[self.client.wire_dtype])

    def pull(self, out: np.ndarray, *, background: bool = False) -> Completed:
        t0 = time.perf_counter()
        versions = self.client.pull(out).wait()
        np.copyto(self.weights, out)
        self._tell({"op": "weights", "clock": self.clock})
        return Completed(versions, time.perf_counter() - t0)

    def push(self, grad: np.ndarray, *, background: bool = False) -> Completed:
        t0 = time.perf_counter()
        clock = self.clock
        self._gather(clock)
        total = self.client.gradient_buffer(0)  # shards on this host read it in place
        np.copyto(total, grad)
        for local in sorted(self.members):  # in local-rank order: the same sum every run
            np.add(total, self.members[local].slot.array, out=total)
        scale = self.group.scale(self.mode)
        if len(self.members) + 1 < self.group.size:  # a follower's share goes to those left: the host weighs the same
            scale *= self.group.size / (len(self.members) + 1)
        np.multiply(total, np.float32(scale), out=total)
        results = self.client.push(total).wait()
        self._tell(results_message(self.clock, results))
        return Completed(results, time.perf_counter() - t0)

    def _gather(self, clock: int) -> None:
        """Wait until every member said its gradient of ``clock`` is in its slot; drop those that cannot say so."""
        waiting = dict(self.members)
        until = time.monotonic() + self.timeout_s
        with selectors.DefaultSelector() as selector:
            for member in waiting.values():
                selector.register(member.sock, selectors.EVENT_READ, member)
            while waiting:
                now = time.monotonic()
                late = [m for m in waiting.values() if m.reader.deadline(until) <= now]
                for member in late:
                    selector.unregister(member.sock)
                    del waiting[member.local]
                    self._drop(
                        member,
                        "said nothing within a step's time"
                        if member.reader.begun_at is None
                        else f"did not finish a message within {MESSAGE_S:g} s",
                    )
                if not waiting:
                    break
                wake = min(m.reader.deadline(until) for m in waiting.values())
                for key, _ in selector.select(max(0.0, wake - now)):
                    member = key.data
                    reason = self._heard(member, clock)
                    if reason is not False:
                        selector.unregister(member.sock)
                        del waiting[member.local]
                        if reason:
                            self._drop(member, reason)

    def _heard(self, member: Member, clock: int) -> str | bool | None:
        """False: nothing whole yet; None: its gradient of ``clock`` is in; a reason to drop it otherwise."""
        try:
            messages = read_some(member.sock, member.reader)
            if messages is None:
                return "went away (its socket closed)"
            if not messages:
                return False
            if len(messages) > 1 or member.reader.buffer:
                raise Malformed("more than its gradient's word in one step")
            if field(expect(messages[0], "gradient"), "clock", int) != clock:
                raise Malformed(f"a gradient of clock {messages[0]['clock']} in step {clock} (out of step)")
        except AggregationError as exc:
            return f"said something that is not its gradient's word: {exc}"
        return None

    def _tell(self, message: dict) -> None:
        """Send every member ``message``; one that cannot take it is dropped."""
        for member in list(self.members.values()):
            try:
                send(member.sock, message)
            except OSError as exc:
                self._drop(member, f"cannot be told ({exc.strerror or exc})")

    def _drop(self, member: Member, why: str) -> None:
        log.warning(
            "host %d: the worker of local rank %d %s; the host goes on without it, its gradient left out",
            self.group.host,
            member.local,
            why,
        )
        self.members.pop(member.local, None)
        member.sock.close()

    def close(self) -> None:
        for member in self.members.values():
            member.sock.close()
        self.members = {}
        if self.listener is not None:
            self.listener.close()
        self.weights = None
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        self.client.close()
