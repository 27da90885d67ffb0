"""Domain exceptions, one per failure a caller can act on, each with a status and a structured reason.

A shard raises them; every transport puts ``(status, reason, message)`` on the wire
(:meth:`PSError.refusal`), and the client raises the same class again on its side
(:func:`error_from_wire`). Callers branch on the class or on ``reason``, never on the text.
"""

from __future__ import annotations

from psgrid.psserver.protocol import Reason, Refusal, Status


class PSError(Exception):
    """Base class for every error this package raises on purpose.

    Attributes
    ----------
    status : Status
        The gRPC status code it travels as.
    reason : Reason
        Which rule was broken.
    shard : int or None
        The shard that refused, when the client knows it.
    """

    status = Status.UNKNOWN
    default_reason = Reason.NONE

    def __init__(self, message: str, reason: Reason | None = None, *, shard: int | None = None):
        super().__init__(message)
        self.message = message
        self.reason = self.default_reason if reason is None else reason
        self.shard = shard

    def refusal(self) -> Refusal:
        return Refusal(self.status, self.reason, self.message)


class InvalidArgument(PSError, ValueError):
    """Bad input: offsets, sizes, dtypes, chunk counts, non-finite values, numbers out of range."""

    status = Status.INVALID_ARGUMENT
    default_reason = Reason.BAD_VALUE


class FailedPrecondition(PSError):
    """The request is well formed but the shard is not in a state to take it."""

    status = Status.FAILED_PRECONDITION


class SpecMismatch(FailedPrecondition):
    """A worker or an Init brought a model spec other than the shard's."""

    default_reason = Reason.SPEC_MISMATCH


class UnknownWorker(FailedPrecondition):
    """The worker id was never registered, or its lease ran out and it was evicted: register again."""

    default_reason = Reason.UNKNOWN_WORKER


class NotInitialized(FailedPrecondition):
    """Weights were pulled or pushed before any Init set them."""

    default_reason = Reason.NOT_INITIALIZED


class WrongJob(FailedPrecondition):
    """A Shutdown that does not name the job this shard belongs to."""

    default_reason = Reason.WRONG_JOB


class Unauthenticated(PSError):
    """Missing or wrong bearer token."""

    status = Status.UNAUTHENTICATED
    default_reason = Reason.UNAUTHENTICATED


class Unavailable(PSError, ConnectionError):
    """The shard cannot serve now (it is stopping); retrying later may succeed."""

    status = Status.UNAVAILABLE
    default_reason = Reason.SHUTTING_DOWN


class ShardUnavailable(Unavailable):
    """The client gave up on a shard after retrying for ``retry_s`` seconds (raised by the client alone)."""

    default_reason = Reason.UNREACHABLE


class CheckpointFailed(FailedPrecondition):
    """A checkpoint could not be written (no checkpoint directory, or the disk refused it)."""

    default_reason = Reason.CHECKPOINT_FAILED


class WaitTimeout(PSError, TimeoutError):
    """A consistency wait outlived the caller's deadline."""

    status = Status.DEADLINE_EXCEEDED
    default_reason = Reason.WAIT_TIMEOUT


class BadReply(PSError):
    """A shard answered something that breaks the wire contract (client side)."""

    status = Status.UNKNOWN
    default_reason = Reason.BAD_REPLY


_BY_REASON = {
    Reason.SPEC_MISMATCH: SpecMismatch,
    Reason.UNKNOWN_WORKER: UnknownWorker,
    Reason.NOT_INITIALIZED: NotInitialized,
    Reason.NO_CHECKPOINT_DIR: CheckpointFailed,
    Reason.CHECKPOINT_FAILED: CheckpointFailed,
    Reason.BAD_REPLY: BadReply,
    Reason.WRONG_JOB: WrongJob,
}
_BY_STATUS = {
    Status.INVALID_ARGUMENT: InvalidArgument,
    Status.FAILED_PRECONDITION: FailedPrecondition,
    Status.UNAUTHENTICATED: Unauthenticated,
    Status.UNAVAILABLE: Unavailable,
    Status.DEADLINE_EXCEEDED: WaitTimeout,
}


def error_from_wire(status: int, reason: Reason, message: str, *, shard: int | None = None) -> PSError:
    """The exception a refusal read off the wire stands for (the class the shard raised)."""
    try:
        status = Status(status)
    except ValueError:
        status = Status.UNKNOWN
    cls = _BY_REASON.get(reason) or _BY_STATUS.get(status, PSError)
    exc = cls(message, None if reason is Reason.NONE else reason, shard=shard)
    if cls is PSError:
        exc.status = status
    return exc
