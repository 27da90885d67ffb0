"""A client's posted calls, one per shard: how they are made, landed and finished, and where they fail.

A plane that posts (transports/shm_posted.py) makes a call in steps on the caller's thread. The
client posts to every shard whose plane does, then finishes each: a call that failed in any step,
whose copy the shard took back, or that was never posted (its plane does not post, or is being
chosen again) is made once more the usual way, with the failure taken as its first attempt's
(:func:`failing_first`), so the retries it earns are made and a refusal is not asked for twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from psgrid.psserver.exceptions import PSError, Unavailable
from psgrid.psserver.protocol import Reason

T = TypeVar("T")
FAILURES = (PSError, OSError)  # what a posted step may meet on the wire; anything else is a bug, raised


class PostedCalls:
    """Shard -> its posted call, or the failure that ended it.

    ``post(shard, plane, begin, end)`` posts one; ``planes`` and ``ranges`` are the client's, per shard.
    """

    def __init__(self, planes, ranges, post: Callable):
        self.ranges = ranges
        self.calls: dict[int, object] = {}
        for shard, plane in enumerate(planes):
            if plane is not None and plane.posts:
                try:
                    self.calls[shard] = post(shard, plane, *ranges[shard])
                except FAILURES as exc:
                    self.calls[shard] = exc

    def land(self, landing) -> None:
        """Land every posted pull not landed yet: ``landing.queue(begin, end, values)`` starts its copy."""
        for shard, call in list(self.calls.items()):
            if isinstance(call, BaseException) or call.landed:
                continue
            begin, end = self.ranges[shard]
            try:
                call.land(lambda values: landing.queue(begin, end, values))
            except FAILURES as exc:
                call.abandon()
                self.calls[shard] = exc

    def finish(self, shards: int, again: Callable[[int, BaseException | None], T]) -> list[T]:
        """Every shard's result: its posted call's last step, else ``again(shard, failure)``, the usual way
        (``failure`` None where the copy was torn or nothing was posted). A failure is raised once every
        shard's call has ended."""
        results, error = [], None
        for shard in range(shards):
            call = self.calls.pop(shard, None)
            try:
                result, failure = None, call if isinstance(call, BaseException) else None
                if call is not None and failure is None:
                    try:
                        result = call.finish()
                    except FAILURES as exc:
                        call.abandon()
                        failure = exc
                results.append(again(shard, failure) if result is None else result)
            except BaseException as exc:  # noqa: BLE001 - raised once every call has ended
                error = error or exc
        if error is not None:
            raise error
        return results


def failing_first(failed: BaseException | None, call: Callable[[], T]) -> Callable[[], T]:
    """``call``, whose first attempt is taken to have failed with ``failed`` (a posted call's failure), if any.

    A socket's error counts as the shard out of reach, as in a round trip.
    """
    if failed is None:
        return call
    pending = [
        failed
        if isinstance(failed, PSError)
        else Unavailable(f"a shared-memory connection was lost: {failed}", Reason.UNREACHABLE)
    ]

    def attempt() -> T:
        if pending:
            raise pending.pop()
        return call()

    return attempt
