"""What a pull or a push returns: a handle to wait on, in the manner of ps-lite's Wait(timestamp).

A call made where it is issued is done when it returns; one run in the background (``background=True``)
is done once every shard has answered, and its buffer is the call's until then. A posted call (:func:`defer`)
has sent its requests and is finished by whoever first waits for it, in that thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from psgrid.psserver.exceptions import WaitTimeout
from psgrid.psserver.protocol import Reason

T = TypeVar("T")


class Handle(Generic[T]):
    """A pull or push: :meth:`wait` returns its result or raises its failure; ``seconds`` its duration.

    ``out`` is the array a pull fills (``Client.pull(out)``'s, or the one ``Admin.pull()`` made);
    None for a push or a pull ``into=`` a callable.
    """

    def __init__(
        self,
        run: Callable[[], T],
        background: bool,
        *,
        deferred: bool = False,
        advance: Callable[[], object] | None = None,
    ):
        self.started = time.perf_counter()
        self.deferred = deferred  # run by the first wait(), never by a client thread
        self._advance = advance
        self.finished: float | None = None
        self.out: np.ndarray | None = None
        self._run = run
        self._result: T | None = None
        self._error: BaseException | None = None
        # Only work another thread may run needs these; a call that runs where it is made does not.
        self._claim = threading.Lock() if background else None
        self._done = threading.Event() if background else None

    def _execute(self) -> None:
        """Run the work, unless someone already does (a background thread or a waiting caller)."""
        if self._claim is not None and not self._claim.acquire(blocking=False):
            return
        try:
            self._result = self._run()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._error = exc
        finally:
            self.finished = time.perf_counter()  # before done is set, so wait() sees it
            if self._done is not None:
                self._done.set()

    def advance(self) -> None:
        """A posted call's middle step, made now if it has one and it is not made yet (a pull's answers
        read and its copies started): for a caller with time for it before it waits. ``wait()`` makes it
        otherwise."""
        step, self._advance = self._advance, None
        if step is not None:
            step()

    @property
    def seconds(self) -> float | None:
        """From the call to the last shard's answer (None while in flight)."""
        return None if self.finished is None else self.finished - self.started

    def done(self) -> bool:
        return self.finished is not None if self._done is None else self._done.is_set()

    def wait(self, timeout: float | None = None) -> T:
        """Block until every shard answered; the result, or the first shard's domain exception.

        A background call that no client thread has picked up yet is run here (without a
        timeout only: with one, the caller waits for a thread and keeps its limit).
        """
        if self._done is not None:
            if timeout is None or self.deferred:
                self._execute()
            if not self._done.wait(timeout):
                raise WaitTimeout(f"still waiting for the shards after {timeout} s", Reason.WAIT_TIMEOUT)
        if self._error is not None:
            raise self._error
        return self._result


def settle(handle: Handle | None) -> None:
    """Wait for a handle in flight; its failure belongs to whoever waits on it."""
    if handle is not None and not handle.done():
        try:
            handle.wait()
        except Exception:  # noqa: BLE001 - reported through the handle itself
            pass


def defer(run: Callable[[], T], advance: Callable[[], object] | None = None) -> Handle[T]:
    """A handle for the rest of a call posted without a thread (transports/shm_posted.py): ``run`` is made
    by the first ``wait()``, in the waiter's thread, after ``advance`` unless :meth:`Handle.advance` made it
    before. ``seconds`` then runs from the call to the end of that wait."""
    return Handle(run, True, deferred=True, advance=advance)


def launch(run: Callable[[], T], background: bool, executor=None) -> Handle[T]:
    """A handle for ``run``: started on ``executor``'s threads with ``background``, else run here (done)."""
    handle = Handle(run, background)
    if background:
        executor.submit(handle._execute)
    else:
        handle._execute()  # here, in the caller's thread: no hand-off to another thread
    return handle
