"""Ctrl-C and SIGTERM for the commands that run jobs: heard from the first line of ``psctl``, never lost.

A signal's exception lands wherever the main thread happens to be, and some code there
swallows it: tqdm catches it while starting its monitor thread, and CPython prints and
ignores an exception raised inside a weakref callback, such as the one importlib runs
when a module lock is released ("Exception ignored in: ... _get_module_lock ... cb"), so a
Ctrl-C that lands while ``psctl launch --resume`` is still importing was gone and the job
trained on. So every signal is also recorded: the launcher's loops call
:func:`check_interrupted`, which raises it again, and a signal that came before the
launcher listened (:func:`hear_early`, from ``psctl``'s first line) is carried into the job
by :func:`listen_for_interrupts`.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_defer = {"depth": 0, "pending": None, "received": None, "early": None, "early_at": 0.0}


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


AGAIN_S = 1.0  # a second Ctrl-C this soon after the first is remembered, not raised


def _early(signum, frame):
    # A second Ctrl-C right after the first lands in its unwinding, where CPython prints the exception of a
    # weakref callback as a traceback ("Exception ignored in: <function WeakSet...>"): it is remembered only.
    # Later ones raise again: the first may have been swallowed, and a command that never starts a job (psctl
    # worker) must still stop.
    now = time.monotonic()
    soon = _defer["early"] is not None and now - _defer["early_at"] < AGAIN_S
    _defer["early"], _defer["early_at"] = signum, now
    if not soon:
        raise KeyboardInterrupt


def hear_early():
    """From now on (psctl's first line) a Ctrl-C raises KeyboardInterrupt and is remembered for the job.

    Returns the handler it replaced (None off the main thread, where signals cannot be set).
    """
    _defer["early"] = None
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, _early)


def heard_early() -> int | None:
    """The signal heard since :func:`hear_early` and not yet handed to a job (None: none)."""
    return _defer["early"]


def _raise_interrupted(signum, frame):
    # Also kept: code on the way may catch the exception and carry on; check_interrupted() raises it again.
    _defer["received"] = signum
    if _defer["depth"]:
        _defer["pending"] = signum
    else:
        raise Interrupted(signum)


def listen_for_interrupts() -> dict:
    """Make Ctrl-C and SIGTERM raise Interrupted from now on; returns the handlers they had.

    A signal heard before (see :func:`hear_early`) counts as received: the next
    :func:`check_interrupted` raises it. One received by an earlier job of this process does not.
    """
    _defer["received"], _defer["early"] = _defer["early"], None
    return {sig: signal.signal(sig, _raise_interrupted) for sig in SIGNALS}


def signal_heard() -> int | None:
    """The signal received since :func:`listen_for_interrupts` (None: none), swallowed or not."""
    return _defer["received"]


def check_interrupted() -> None:
    """Raise Interrupted if a signal came and its exception was swallowed on the way (the loops call this)."""
    if _defer["received"] is not None and not _defer["depth"]:
        raise Interrupted(_defer["received"])


@contextmanager
def deferred_signals():
    """Hold Ctrl-C and SIGTERM until the block ends; a signal mask would be inherited by the children."""
    _defer["depth"] += 1
    try:
        yield
    finally:
        _defer["depth"] -= 1
        pending, _defer["pending"] = _defer["pending"], None
        if pending is not None and not _defer["depth"]:
            raise Interrupted(pending)


def _note(signum, frame):
    _defer["received"] = signum


def note_signals() -> dict:
    """Make Ctrl-C only recorded from now on (:func:`signal_heard`); returns the handler it had.

    For the ranks of one all-reduce, which must stop together between two collectives
    (worker/allreduce.py ``_stop_together``), never in the middle of one. SIGTERM keeps what it did
    (a scheduler's, which must also end a rank stuck in a collective whose peer hung).
    """
    _defer["received"], _defer["early"] = _defer["early"], None
    return {signal.SIGINT: signal.signal(signal.SIGINT, _note)}


def _stop_rank(signum, frame):
    _defer["received"] = signum
    raise KeyboardInterrupt


def stop_on_signals() -> dict:
    """Make Ctrl-C and SIGTERM raise KeyboardInterrupt from now on; returns the handlers they had.

    For an MPI rank (cluster/mpi/job.py), where the training loop runs in this process: no
    ``except Exception`` on the way (a retry loop, a gRPC wrapper) can swallow it.
    :func:`received_signal` says which came.
    """
    _defer["received"] = None
    return {sig: signal.signal(sig, _stop_rank) for sig in SIGNALS}


def received_signal() -> int:
    """The signal that stopped the job (SIGINT when psctl's own first-line handler heard it)."""
    return _defer["received"] or signal.SIGINT


def ignore_signals() -> None:
    # Cleanup is bounded by its own timeouts; a second Ctrl-C must not cut it short and orphan children.
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
