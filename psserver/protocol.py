"""What both ends of the wire share: limits, status codes, reasons, push outcomes, names.

Nothing here imports gRPC or NumPy. The numbers of :class:`Status` are gRPC's status
codes (so the gRPC adapters convert by value, and the TCP data plane sends the same
numbers); those of :class:`Outcome` and the wire dtypes are the ones in proto/ps.proto.
A :class:`Reason` says which rule a refused request broke, so a client acts on it
without reading the message text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import NamedTuple

MODES = ("sync", "async", "ssp")
OPTIMIZERS = ("sgd", "adam")

# Where a shard keeps its weights, optimizer state and update: "auto" is resolved by the launcher (the GPU
# when the job's workers compute on one there); a shard started alone with "auto" keeps to the CPU.
SHARD_DEVICES = ("cpu", "gpu", "auto")
# The built-in data planes, the one list of their names (transports/base.py finds each end's module by it).
# gRPC carries the control calls always, and Pull and Push where no other plane serves; a local plane
# serves only processes on the shard's host, and is chosen by ``shared_memory``, never named in a job file:
# The shard's own process first (a worker that hosts its shard: calls, no socket, no copy of a gradient),
# then CUDA IPC (a GPU worker and a shard whose weights are on a GPU it can reach), then shared memory.
CONTROL_PLANE = "grpc"
LOCAL_PLANES = ("local", "ipc", "shm")
DATA_PLANES = ("tcp", CONTROL_PLANE)  # the network planes: what a job file's data_plane may name
PLANES = LOCAL_PLANES + DATA_PLANES  # every built-in plane, in a client's order of preference

# Element types of a chunk, numbered as proto/ps.proto's DType.
FLOAT32, FLOAT16, BFLOAT16 = 1, 2, 3
WIRE_DTYPES = {"float32": FLOAT32, "float16": FLOAT16, "bfloat16": BFLOAT16}
ITEMSIZE = {FLOAT32: 4, FLOAT16: 2, BFLOAT16: 2}

DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024  # a chunk stays under gRPC's 4 MiB default message limit
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 16)  # a chunk and its header
# What a shard's gRPC server reads before its handler sees a message: well past any chunk a shard
# takes, so an oversized one is answered with reason chunk_too_large; a message past it is refused
# by gRPC itself (RESOURCE_EXHAUSTED, no ps-reason), as proto/ps.proto says.
MAX_RECEIVE_BYTES = 16 * 1024 * 1024
# Both ends of a gRPC channel: message limits, and two servers never silently sharing a port.
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
GRPC_SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
)
SERVICE = "ps.ParameterServer"
# Trailing metadata key that carries a refusal's Reason (its lowercase name) beside the status code.
REASON_KEY = "ps-reason"
# A consistency wait answers this long before the caller's deadline, so the caller reads the
# DEADLINE_EXCEEDED reply instead of timing out on its own.
REPLY_MARGIN_S = 0.05
# The marks table a shard's weight ring shares with readers on its host (state/weight_ring.py): one
# little-endian int64 per reader slot, the index of the buffer the shard handed that slot, or one of these.
MARK_BYTES = 8
NO_MARK = -1  # its reader holds nothing (written by the reader once its copy is done)
REVOKED = -2  # the shard took the buffer back before the reader was done: its copy may be torn, read again


@dataclass(frozen=True)
class ModeRules:
    """What a consistency mode does, asked by name of capability, never by comparing mode names.

    The shard's policy (state/policy.py) answers these for its own mode; a client, a worker or the
    launcher that must know asks :func:`mode_rules`.
    """

    accumulates: bool  # a push is held for its round, whose mean is applied once (sync)
    waits_on_pull: bool  # a pull may wait for slower workers (sync, ssp); otherwise it returns at once
    bounded: bool  # the wait is the staleness bound: the slowest live clock at least c - s (ssp)


MODE_RULES = {
    "sync": ModeRules(accumulates=True, waits_on_pull=True, bounded=False),
    "async": ModeRules(accumulates=False, waits_on_pull=False, bounded=False),
    "ssp": ModeRules(accumulates=False, waits_on_pull=True, bounded=True),
}


def mode_rules(mode: str) -> ModeRules:
    """The rules of consistency mode ``mode`` (ValueError naming the modes for any other)."""
    try:
        return MODE_RULES[mode]
    except KeyError:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}") from None


class Status(IntEnum):
    """gRPC status codes, by number; the TCP data plane sends the same numbers."""

    OK = 0
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    FAILED_PRECONDITION = 9
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


class Reason(IntEnum):
    """Which rule a refused request broke (numbered for the TCP plane; named in gRPC metadata)."""

    NONE = 0
    MALFORMED = 1  # a message that does not decode
    BAD_SIZE = 2  # a payload that is not this shard's range: too many or too few elements
    BAD_OFFSET = 3  # chunks that do not tile the range in order
    BAD_DTYPE = 4  # an unknown element type, or one not allowed here
    NON_FINITE = 5  # NaN or infinity in a gradient or in initial weights
    BAD_CHUNK_COUNT = 6  # a stream that carried other than the chunks it declared
    BAD_VALUE = 7  # a number or setting out of its range
    BAD_SPEC = 8  # a model spec that is not well formed, or whose hash does not match it
    SPEC_MISMATCH = 9  # a spec other than the one the shard holds
    UNKNOWN_WORKER = 10  # never registered, evicted, or forgotten: register again
    NOT_INITIALIZED = 11  # no weights yet: a worker must Init first
    UNAUTHENTICATED = 12  # missing or wrong bearer token
    SHUTTING_DOWN = 13  # the shard is stopping
    WAIT_TIMEOUT = 14  # a consistency wait outlived the caller's deadline
    NO_CHECKPOINT_DIR = 15  # a checkpoint asked of a shard that has nowhere to write it
    UNREACHABLE = 16  # (client side) no connection to the shard, or it broke
    BAD_REPLY = 17  # (client side) the shard answered something that breaks the contract
    TIMED_OUT = 18  # (client side) a call outlived its deadline without the shard's answer
    CHECKPOINT_FAILED = 19  # the shard could not write its checkpoint (a full disk, say)
    RESTORING = 20  # the shard is restoring its checkpoint: retry shortly
    WRONG_JOB = 21  # a Shutdown that does not name this shard's job
    TOO_MANY_CONNECTIONS = 22  # the data plane holds its most connections: retry later
    CHUNK_TOO_LARGE = 23  # a chunk of more bytes than the shard takes (RegisterReply.max_chunk_bytes)
    FUTURE_VERSION = 24  # a push computed from a version this shard never published
    FUTURE_CLOCK = 25  # async/ssp: a push past the worker's clock here, which no restart explains

    @property
    def wire_name(self) -> str:
        return self.name.lower()

    @classmethod
    def from_code(cls, code: int) -> Reason:
        try:
            return cls(code)
        except ValueError:
            return cls.NONE

    @classmethod
    def from_wire_name(cls, name: str | None) -> Reason:
        try:
            return cls[(name or "none").upper()]
        except KeyError:
            return cls.NONE


# Reasons a client gives its own failures; no shard sends them.
CLIENT_SIDE_REASONS = frozenset({Reason.NONE, Reason.UNREACHABLE, Reason.BAD_REPLY, Reason.TIMED_OUT})


class Outcome(IntEnum):
    """What a shard did with a push (proto/ps.proto's PushReply.Outcome)."""

    APPLIED = 0  # applied to the weights (async, ssp, or the push that closed a sync round)
    ACCUMULATED = 1  # sync: held until the round closes
    DROPPED_LATE = 2  # sync: the round had already closed; counted, not applied
    DUPLICATE = 3  # this (worker, clock) was already received; not applied again


class PushResult(NamedTuple):
    """A shard's answer to one push (a named tuple: one is made for every push)."""

    outcome: Outcome
    version: int  # the shard's version after the push
    staleness: int  # version at apply time minus version used (-1 when not applied)
    next_clock: int  # the clock the worker's next push must carry


@dataclass(frozen=True)
class Refusal:
    """A refused request, as every transport puts it on the wire."""

    status: Status
    reason: Reason
    message: str


@dataclass(frozen=True)
class Registration:
    """What a shard tells a worker (or an observer) that registers."""

    worker_id: int
    start_clock: int
    mode: str
    staleness: int
    backup_workers: int
    lease_s: float
    begin: int
    end: int
    total_size: int
    shard_index: int
    num_shards: int
    initialized: bool
    version: int
    planes: tuple[tuple[str, str], ...] = ()  # (plane, address) the shard serves now (RegisterReply.planes)
    max_chunk_bytes: int = 0  # the largest chunk of a gRPC Init or Push the shard takes (0: not said)
    job_tag: str = ""  # job_tag() of the shard's job id: equal on every shard of one job ("": not said)

    def address(self, plane: str) -> str | None:
        """Where the shard serves ``plane`` (in the plane's own form), or None when it does not offer it."""
        return next((address for name, address in self.planes if name == plane), None)

    def without(self, plane: str, address: str) -> Registration:
        """This registration, less the offer of ``plane`` at ``address`` (one the client passes over)."""
        return replace(self, planes=tuple(offer for offer in self.planes if offer != (plane, address)))


@dataclass(frozen=True)
class HeartbeatInfo:
    """A shard's answer to a heartbeat."""

    known: bool
    lease_s: float
    min_clock: int
    version: int


def job_tag(job_id: str | None) -> str:
    """What a shard tells whoever registers about its job: a digest that compares equal on the shards
    of one job, and does not give away the id (which stops the shards: ``Admin.shutdown``)."""
    if not job_id:
        return ""
    return hashlib.sha256(b"psgrid job " + job_id.encode()).hexdigest()[:16]


# ----- the address file a shard publishes (psctl server --address-file) ---------------------------


def format_address_file(address: str, job_id: str, metrics_port: int | None = None) -> str:
    """``host:port`` on the first line, ``job JOB_ID`` on the second, ``metrics PORT`` where it serves metrics."""
    metrics = "" if metrics_port is None else f"metrics {metrics_port}\n"
    return f"{address}\njob {job_id}\n{metrics}"


def parse_address_file(text: str) -> tuple[str, str | None]:
    """(address, job id) from an address file; the job id is None in a file of one line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    address = lines[0] if lines else ""
    job = next((line[4:].strip() for line in lines[1:] if line.startswith("job ")), None)
    return address, job


def parse_metrics_port(text: str) -> int | None:
    """The port an address file says its shard serves metrics on (the bound one, where 0 was asked), or None."""
    for line in text.splitlines():
        if line.startswith("metrics ") and line[8:].strip().isdigit():
            return int(line[8:].strip())
    return None
