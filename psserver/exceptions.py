"""Domain exceptions, one per failure a caller can act on.

The servicer maps each to a gRPC status code (``STATUS_CODES``); nothing below
the servicer knows about gRPC.
"""


class PSError(Exception):
    """Base class for every error this package raises on purpose."""


class InvalidArgument(PSError, ValueError):
    """Bad input: offsets, sizes, dtypes, chunk counts, non-finite values."""


class SpecMismatch(PSError):
    """A worker or an Init brought a model spec other than the shard's."""


class UnknownWorker(PSError):
    """The worker id was never registered, or its lease ran out and it was evicted."""


class NotInitialized(PSError):
    """Weights were pulled or pushed before any Init set them."""


class Unauthenticated(PSError):
    """Missing or wrong bearer token."""


class Restoring(PSError):
    """The shard is restoring a checkpoint and cannot serve yet."""


class WaitTimeout(PSError, TimeoutError):
    """A consistency wait outlived the caller's deadline."""


class RemoteError(PSError):
    """A shard refused a control call (Stats, Checkpoint, Shutdown); ``code`` is the gRPC status name."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code


class ShardUnavailable(PSError, ConnectionError):
    """The client gave up on a shard after retrying for ``retry_s`` seconds."""
