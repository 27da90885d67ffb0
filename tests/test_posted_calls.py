"""Calls posted without a client thread (transports/shm_posted.py): what a GPU worker's overlap takes.

A posted pull has its copies started by the caller and is finished by ``wait()``; a posted push has
its headers sent and its answers read by ``wait()``. Where a posted call fails or its copy is
torn, the call is made again the usual way, and a refusal is not asked for twice.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import Outcome, Reason
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports import shm_client
from psgrid.psserver.transports.stream_frames import NO_MARK, REVOKED

SPEC = ModelSpec([("w", (40,)), ("b", (3,))])
ONES = np.ones(SPEC.size, np.float32)
INIT = np.arange(SPEC.size, dtype=np.float32)


class HostLanding:
    """A landing in host memory, as FlatBuffers' Landing is on a GPU: it records who copied what, and when."""

    def __init__(self, size: int):
        self.target = np.zeros(size, np.float32)
        self.queued: list[tuple[int, int]] = []  # (thread, begin) of each copy started
        self.copied: list[int] = []  # begin of each copy made the usual way
        self.waits = 0

    def queue(self, begin, end, values):
        self.queued.append((threading.get_ident(), begin))
        self.target[begin:end] = values

    def wait(self):
        self.waits += 1

    def __call__(self, begin, end, values):
        self.copied.append(begin)
        self.target[begin:end] = values


def posted_calls(monkeypatch, kind: str) -> list:
    """Every call the shared-memory plane posts from now on (``kind``: "pull" or "push"), as it is made."""
    made = []
    original = getattr(shm_client.ShmDataPlane, f"post_{kind}")

    def post(self, *args, **kw):
        made.append(original(self, *args, **kw))
        return made[-1]

    monkeypatch.setattr(shm_client.ShmDataPlane, f"post_{kind}", post)
    return made


@pytest.mark.timeout(30)
def test_only_the_shared_memory_plane_posts(cluster):
    c = cluster(2, mode="async")
    with c.client(SPEC, init=INIT) as client:
        assert client.posts() is (c.data_plane == "shm")
        handle = client.push(ONES, background=True)
        assert handle.deferred is (c.data_plane == "shm")
        assert [r.outcome for r in handle.wait()] == [Outcome.APPLIED] * 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_an_async_posted_pull_starts_every_copy_on_the_callers_thread_and_ends_on_wait(cluster):
    c = cluster(3, mode="async", lr=1.0)
    with c.client(SPEC, init=INIT) as client:
        client.push(ONES).wait()
        landing = HostLanding(SPEC.size)
        handle = client.post_pull(landing)
        assert landing.queued == []  # requests sent; answers read when the caller has time
        handle.advance()
        # In async the shards answered at once: every copy started here, and each buffer is still marked.
        assert landing.queued == [(threading.get_ident(), begin) for begin, _ in client.ranges]
        handle.advance()  # made once
        assert len(landing.queued) == 3 and not handle.done() and landing.waits == 0
        planes = client._conn.planes
        assert all((plane.marks != NO_MARK).sum() == 1 for plane in planes)
        assert handle.wait() == [1, 1, 1] and client.versions == [1, 1, 1]
        np.testing.assert_array_equal(landing.target, INIT - 1)
        assert landing.waits == 1 and landing.copied == []
        assert all((plane.marks == NO_MARK).all() for plane in planes), "a mark outlived its copy"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_a_sync_posted_pull_reads_its_answers_when_waited_for(cluster):
    # A sync (or ssp) shard may hold a pull's answer until the round closes: reading it would block the caller.
    c = cluster(2, mode="sync", lr=1.0)
    with c.client(SPEC, init=INIT, world=1) as client:
        client.push(ONES).wait()
        landing = HostLanding(SPEC.size)
        handle = client.post_pull(landing)
        handle.advance()  # nothing to do before the wait in sync
        assert landing.queued == []
        assert handle.wait() == [1, 1]
        assert sorted(begin for _, begin in landing.queued) == [0, client.ranges[1][0]]
        np.testing.assert_array_equal(landing.target, INIT - 1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_a_posted_copy_the_shard_took_back_is_pulled_again(cluster):
    c = cluster(2, mode="async", lr=1.0)
    with c.client(SPEC, init=INIT) as client:
        landing = HostLanding(SPEC.size)
        handle = client.post_pull(landing)
        handle.advance()
        landing.target[:] = 99.0  # as a torn copy would leave it
        plane = client._conn.planes[1]
        plane.marks[plane.marks != NO_MARK] = REVOKED  # what the shard writes when it takes a buffer back
        assert handle.wait() == [0, 0]
        assert landing.copied == [client.ranges[1][0]]  # shard 1 only, read again the usual way
        np.testing.assert_array_equal(landing.target[client.ranges[1][0] :], INIT[client.ranges[1][0] :])
        assert (landing.target[: client.ranges[0][1]] == 99.0).all()  # shard 0's copy stood


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_a_posted_push_whose_answer_is_lost_is_made_again_and_applied_once(cluster, monkeypatch):
    c = cluster(1, mode="async", lr=1.0)
    with c.client(SPEC, init=SPEC.flat()) as client:
        made = posted_calls(monkeypatch, "push")
        handle = client.push(ONES, background=True)
        assert len(made) == 1 and handle.deferred
        made[0].conn.sock.shutdown(socket.SHUT_RDWR)  # the header went; the answer cannot come back
        [result] = handle.wait()
        assert result.outcome in (Outcome.APPLIED, Outcome.DUPLICATE)
        np.testing.assert_array_equal(c.shard().weights, -1.0)
        assert c.shard().stats()["applied_updates"] == 1
        assert client.clock == 1
        assert [r.outcome for r in client.push(ONES, background=True).wait()] == [Outcome.APPLIED]
        np.testing.assert_array_equal(c.shard().weights, -2.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_a_posted_push_that_is_refused_is_refused_once(cluster, monkeypatch):
    c = cluster(2, mode="async", lr=0.5)
    with c.client(SPEC, init=SPEC.flat()) as client:
        made = posted_calls(monkeypatch, "push")
        bad = ONES.copy()
        bad[-1] = np.nan  # in shard 1's range only
        handle = client.push(bad, background=True)
        with pytest.raises(InvalidArgument) as err:
            handle.wait()
        assert err.value.reason is Reason.NON_FINITE
        assert len(made) == 2 and c.shard(1).stats()["rejected"] == 1
        assert [c.shard(i).version for i in range(2)] == [1, 0]
        # As when the push is made in the usual way: the next one goes on (test_client.py).
        assert [r.outcome for r in client.push(ONES, background=True).wait()] == [Outcome.APPLIED] * 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_a_posted_pull_of_a_shard_that_went_away_is_made_the_usual_way(cluster, monkeypatch):
    c = cluster(2, mode="async", lr=1.0)
    with c.client(SPEC, init=INIT) as client:
        made = []
        landing = HostLanding(SPEC.size)
        # The answer is read at once in async: break shard 0's connection before the client reads it.
        original = shm_client.ShmDataPlane.post_pull

        def post_then_break(self, **kw):
            call = original(self, **kw)
            if not made:
                call.conn.sock.shutdown(socket.SHUT_RDWR)
            made.append(call)
            return call

        monkeypatch.setattr(shm_client.ShmDataPlane, "post_pull", post_then_break)
        handle = client.post_pull(landing)
        handle.advance()
        assert [begin for _, begin in landing.queued] == [client.ranges[1][0]]
        assert handle.wait() == [0, 0] and landing.copied == [0]
        np.testing.assert_array_equal(landing.target, INIT)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_a_plane_is_closed_only_once_a_posted_pulls_copies_have_ended(cluster, monkeypatch):
    # Closing a plane unregisters and unmaps the shard's memory its copies may still be reading (a failed
    # push's retry drops the plane while the pull-ahead's copies run).
    c = cluster(2, mode="async")
    with c.client(SPEC, init=INIT) as client:
        landing, events = HostLanding(SPEC.size), []
        monkeypatch.setattr(landing, "wait", lambda: events.append("copies ended"))
        plane = client._conn.planes[0]
        close = plane.close
        monkeypatch.setattr(plane, "close", lambda: (events.append("plane closed"), close()))
        handle = client.post_pull(landing)
        handle.advance()
        client._conn.drop_plane(0)
        assert events == ["copies ended", "plane closed"]
        assert handle.wait() == [0, 0]
        np.testing.assert_array_equal(landing.target, INIT)
        events.clear()
        client._conn.drop_plane(1)  # nothing in flight now: closed without a wait
        assert events == []
