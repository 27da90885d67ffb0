"""The consistency policy as a pure state machine: no sockets, no threads, no clocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psgrid.psserver.exceptions import InvalidArgument, UnknownWorker
from psgrid.psserver.state.policy import MODES, ConsistencyPolicy, Outcome, PushDecision

FAST = settings(max_examples=150, deadline=None)


def make(mode, n, **kw):
    policy = ConsistencyPolicy(mode, **kw)
    for w in range(n):
        assert policy.join(w) == 0
    return policy


# ----- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["bsp", "SYNC", "", "asp", None])
def test_bad_mode_raises(mode):
    with pytest.raises(InvalidArgument):
        ConsistencyPolicy(mode)


@pytest.mark.parametrize("kw", [{"staleness": -1}, {"backup_workers": -1}])
def test_negative_parameters_raise(kw):
    with pytest.raises(InvalidArgument):
        ConsistencyPolicy("ssp", **kw)


@pytest.mark.parametrize("mode", MODES)
def test_empty_policy(mode):
    policy = ConsistencyPolicy(mode)
    assert policy.slowest_clock() == 0
    assert policy.fastest_clock() == 0
    assert list(policy.rounds_to_close()) == []
    assert not policy.is_live(0)


# ----- sync -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_sync_barrier_round_by_round(n):
    policy = make("sync", n)
    for c in range(4):
        # Every worker may pull at c (round c-1 closed), none at c+1.
        for w in range(n):
            assert policy.may_pull(w, c)
            assert not policy.may_pull(w, c + 1)
        for w in range(n):
            decision = policy.on_push(w, c)
            assert decision == PushDecision(Outcome.ACCUMULATED, c, c + 1)
            if w < n - 1:
                # the round is still open: nobody may pull at c+1, nothing closes
                assert list(policy.rounds_to_close()) == []
                for v in range(n):
                    assert not policy.may_pull(v, c + 1)
        assert policy.pushers(c) == set(range(n))
        assert list(policy.rounds_to_close()) == [c]
        assert list(policy.rounds_to_close()) == []  # closes exactly once
        assert policy.closed_rounds == c + 1
        for w in range(n):
            assert policy.may_pull(w, c + 1)
            assert not policy.may_pull(w, c + 2)


def test_sync_retried_push_is_duplicate():
    policy = make("sync", 2)
    assert policy.on_push(0, 0).outcome is Outcome.ACCUMULATED
    # retried push of clock 0 by worker 0: already taken
    assert policy.on_push(0, 0) == PushDecision(Outcome.DUPLICATE, 0, 1)
    assert policy.pushers(0) == {0}
    assert list(policy.rounds_to_close()) == []
    assert policy.on_push(1, 0).outcome is Outcome.ACCUMULATED
    assert list(policy.rounds_to_close()) == [0]
    # a retry of an old, closed round is still a duplicate, not a late drop
    assert policy.on_push(1, 0) == PushDecision(Outcome.DUPLICATE, 0, 1)
    assert policy.clocks == {0: 1, 1: 1}
    assert list(policy.rounds_to_close()) == []


def test_sync_pushes_of_next_round_accumulate_before_close():
    policy = make("sync", 2)
    policy.on_push(0, 0)
    # worker 0 races ahead (a fast-forwarding client could do this) and pushes round 1
    assert policy.on_push(0, 1).outcome is Outcome.ACCUMULATED
    assert list(policy.rounds_to_close()) == []
    policy.on_push(1, 0)
    assert list(policy.rounds_to_close()) == [0]
    assert policy.pushers(1) == {0}
    policy.on_push(1, 1)
    assert list(policy.rounds_to_close()) == [1]


@pytest.mark.parametrize("n,b", [(3, 1), (4, 2), (5, 1)])
def test_sync_backup_workers(n, b):
    policy = make("sync", n, backup_workers=b)
    assert policy.quorum() == n - b
    fast = list(range(n - b))
    slow = list(range(n - b, n))
    for w in fast[:-1]:
        policy.on_push(w, 0)
        assert list(policy.rounds_to_close()) == []
    policy.on_push(fast[-1], 0)
    assert policy.pushers(0) == set(fast)
    assert list(policy.rounds_to_close()) == [0]
    for w in fast:
        assert policy.may_pull(w, 1)
    # the fast workers run on through round 1 and 2 without the stragglers
    for c in (1, 2):
        for w in fast:
            assert policy.on_push(w, c).outcome is Outcome.ACCUMULATED
        assert list(policy.rounds_to_close()) == [c]
    # a straggler's push for closed round 0 is dropped and its clock jumps to the open round
    for w in slow:
        assert policy.on_push(w, 0) == PushDecision(Outcome.DROPPED_LATE, 0, 3)
        assert policy.clocks[w] == 3
        assert policy.may_pull(w, 3)
    assert policy.pushers(0) == set()
    assert list(policy.rounds_to_close()) == []
    # and then it takes part in round 3 as usual
    w = slow[0]
    assert policy.on_push(w, 3).outcome is Outcome.ACCUMULATED
    assert w in policy.pushers(3)


def test_sync_late_push_for_just_closed_round():
    policy = make("sync", 3, backup_workers=1)
    policy.on_push(0, 0)
    policy.on_push(1, 0)
    assert list(policy.rounds_to_close()) == [0]
    assert policy.on_push(2, 0) == PushDecision(Outcome.DROPPED_LATE, 0, 1)
    assert policy.clocks[2] == 1
    # its retry is a duplicate now
    assert policy.on_push(2, 0).outcome is Outcome.DUPLICATE


@pytest.mark.parametrize("n,b", [(1, 0), (1, 1), (1, 5), (2, 2), (2, 7), (3, 3)])
def test_sync_quorum_never_below_one(n, b):
    policy = make("sync", n, backup_workers=b)
    assert policy.quorum() == 1
    # nothing closes before anyone pushed
    assert list(policy.rounds_to_close()) == []
    assert not policy.may_pull(0, 1)
    policy.on_push(0, 0)
    assert list(policy.rounds_to_close()) == [0]
    # with nobody live, nothing ever closes
    for w in range(n):
        policy.leave(w)
    assert policy.quorum() == 1
    assert list(policy.rounds_to_close()) == []


def test_sync_eviction_releases_the_barrier():
    policy = make("sync", 3)
    policy.on_push(0, 0)
    policy.on_push(1, 0)
    assert list(policy.rounds_to_close()) == []
    assert not policy.may_pull(0, 1) and not policy.may_pull(1, 1)
    policy.leave(2)
    assert not policy.is_live(2)
    assert list(policy.rounds_to_close()) == [0]
    assert policy.may_pull(0, 1) and policy.may_pull(1, 1)
    # the evicted worker never waits and learns of its eviction at its next push
    assert policy.may_pull(2, 1)
    with pytest.raises(UnknownWorker):
        policy.on_push(2, 0)
    # leaving twice is harmless
    policy.leave(2)


def test_sync_eviction_of_everyone_but_one_closes_several_rounds_in_order():
    policy = make("sync", 2)
    for c in range(3):
        policy.on_push(0, c)
    assert list(policy.rounds_to_close()) == []
    policy.leave(1)
    assert list(policy.rounds_to_close()) == [0, 1, 2]
    assert policy.closed_rounds == 3


def test_sync_leave_keeps_accumulated_pusher():
    policy = make("sync", 3)
    policy.on_push(0, 0)
    policy.on_push(1, 0)
    policy.leave(0)
    assert policy.pushers(0) == {0, 1}
    assert list(policy.rounds_to_close()) == []  # worker 2 is still owed
    policy.on_push(2, 0)
    assert list(policy.rounds_to_close()) == [0]


# ----- ssp ------------------------------------------------------------------------------------


@pytest.mark.parametrize("s", [0, 1, 3])
def test_ssp_bound(s):
    policy = make("ssp", 2, staleness=s)
    # worker 0 runs ahead alone
    for c in range(s + 1):
        assert policy.may_pull(0, c)
        assert policy.on_push(0, c) == PushDecision(Outcome.APPLIED, c, c + 1)
    assert list(policy.rounds_to_close()) == []
    assert not policy.may_pull(0, s + 1)
    assert policy.may_pull(1, 0)
    policy.on_push(1, 0)
    assert policy.may_pull(0, s + 1)
    assert not policy.may_pull(0, s + 2)


def test_ssp_eviction_releases_blocked_pull():
    policy = make("ssp", 3, staleness=1)
    for c in range(2):
        policy.on_push(0, c)
        policy.on_push(1, c)
    assert not policy.may_pull(0, 2)
    policy.leave(2)
    assert policy.slowest_clock() == 2
    assert policy.may_pull(0, 2) and policy.may_pull(1, 2)


def test_ssp_duplicate_and_fast_forward():
    policy = make("ssp", 2, staleness=5)
    policy.on_push(0, 0)
    assert policy.on_push(0, 0) == PushDecision(Outcome.DUPLICATE, 0, 1)
    assert policy.on_push(0, 4) == PushDecision(Outcome.APPLIED, 4, 5)
    assert policy.clocks[0] == 5
    assert policy.on_push(0, 3).outcome is Outcome.DUPLICATE


@given(
    n=st.integers(2, 6),
    s=st.integers(0, 3),
    steps=st.integers(1, 6),
    data=st.data(),
)
@FAST
def test_ssp_random_interleavings(n, s, steps, data):
    """Workers pull at their clock, then push; the scheduler picks any worker at random."""
    policy = make("ssp", n, staleness=s)
    clock = [0] * n
    pulled = [False] * n
    while True:
        live = [w for w in range(n) if policy.is_live(w)]
        unfinished = [w for w in live if clock[w] < steps]
        if not unfinished:
            break
        slowest = min(policy.clocks.values())
        runnable = []
        for w in unfinished:
            allowed = policy.may_pull(w, clock[w])
            assert allowed == (slowest >= clock[w] - s)
            if pulled[w] or allowed:
                runnable.append(w)
        assert runnable, "deadlock: no unfinished worker can proceed"
        w = data.draw(st.sampled_from(runnable))
        if not pulled[w]:
            pulled[w] = True
        else:
            decision = policy.on_push(w, clock[w])
            assert decision == PushDecision(Outcome.APPLIED, clock[w], clock[w] + 1)
            clock[w] += 1
            pulled[w] = False
        # occasionally a worker is evicted (never the last unfinished one)
        if len(unfinished) > 1 and data.draw(st.integers(0, 15)) == 0:
            policy.leave(data.draw(st.sampled_from(unfinished)))
        clocks = list(policy.clocks.values())
        assert max(clocks) - min(clocks) <= s + 1
        assert list(policy.rounds_to_close()) == []
    for w in range(n):
        if policy.is_live(w):
            assert policy.clocks[w] == steps


# ----- sync under random interleavings -------------------------------------------------------


@given(
    n=st.integers(1, 6),
    data=st.data(),
    steps=st.integers(1, 6),
)
@FAST
def test_sync_random_interleavings(n, data, steps):
    b = data.draw(st.integers(0, n - 1), label="backup_workers")
    policy = make("sync", n, backup_workers=b)
    clock = [0] * n
    computing = [False] * n
    closes: list[int] = []
    while True:
        unfinished = [w for w in range(n) if clock[w] < steps]
        if not unfinished:
            break
        runnable = [w for w in unfinished if computing[w] or policy.may_pull(w, clock[w])]
        assert runnable, "deadlock: no unfinished worker can proceed"
        w = data.draw(st.sampled_from(runnable))
        if not computing[w]:
            # pull granted: round clock[w]-1 must be closed
            assert clock[w] == 0 or clock[w] - 1 in closes
            computing[w] = True
            continue
        computing[w] = False
        open_round = policy.closed_rounds
        decision = policy.on_push(w, clock[w])
        if b == 0:
            assert decision.outcome is Outcome.ACCUMULATED
        if decision.outcome is Outcome.DROPPED_LATE:
            assert clock[w] < open_round
            assert decision.next_clock == open_round
        else:
            assert decision.outcome is Outcome.ACCUMULATED
            assert decision.next_clock == clock[w] + 1
        clock[w] = decision.next_clock
        pushers = policy.pushers(policy.closed_rounds)
        closed = list(policy.rounds_to_close())
        if closed:
            assert closed[0] == open_round
            assert closed == list(range(open_round, open_round + len(closed)))
            if b == 0:
                assert closed == [open_round]
                assert pushers == set(range(n))
            else:
                assert len(pushers) >= n - b
        closes.extend(closed)
        assert list(policy.rounds_to_close()) == []
    assert closes == list(range(steps))
    assert policy.closed_rounds == steps


# ----- async ----------------------------------------------------------------------------------


def test_async_applies_at_once_and_never_waits():
    policy = make("async", 3)
    for c in range(5):
        assert policy.may_pull(0, c + 100)
        assert policy.on_push(0, c) == PushDecision(Outcome.APPLIED, c, c + 1)
    assert policy.may_pull(1, 1000)
    assert policy.on_push(1, 0).outcome is Outcome.APPLIED
    assert policy.on_push(1, 0).outcome is Outcome.DUPLICATE
    assert list(policy.rounds_to_close()) == []
    assert policy.slowest_clock() == 0
    assert policy.fastest_clock() == 5


# ----- join, errors, observers ----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_join_running_job_starts_at_slowest_clock(mode):
    policy = make(mode, 2, staleness=3)
    for c in range(3):
        policy.on_push(0, c)
    for c in range(2):
        policy.on_push(1, c)
    policy.rounds_to_close()
    assert policy.join(7) == 2
    assert policy.clocks[7] == 2
    # joining an already-live id returns its current clock; an earlier start clock changes nothing
    assert policy.join(0) == 3
    assert policy.join(0, start_clock=0) == 3
    # a later one moves it forward: the shard restarted from a checkpoint older than the worker
    assert policy.join(7, start_clock=10) == 10
    assert policy.clocks[7] == 10


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_holding_back_names_the_workers_others_wait_on(mode):
    policy = make(mode, 3, staleness=1)
    assert not any(policy.holding_back(w) for w in range(3))  # nobody has moved yet
    for w in (0, 1):
        for c in range(3 if mode == "ssp" else 1):
            policy.on_push(w, c)
    policy.rounds_to_close()
    assert [policy.holding_back(w) for w in range(3)] == [False, False, True]
    policy.on_push(2, 0)
    policy.rounds_to_close()
    assert policy.holding_back(2) is (mode == "ssp")  # ssp: 1 is still more than the bound behind 3
    assert not policy.holding_back(99)


def test_async_never_holds_anyone_back():
    policy = make("async", 2)
    for c in range(50):
        policy.on_push(0, c)
    assert not policy.holding_back(1)


def test_sync_join_starts_at_least_at_open_round():
    policy = make("sync", 3, backup_workers=1)
    for c in range(3):
        policy.on_push(0, c)
        policy.on_push(1, c)
        assert list(policy.rounds_to_close()) == [c]
    # worker 2 straggles at clock 0, but a newcomer must not start in a closed round
    assert policy.slowest_clock() == 0
    assert policy.join(5) == 3
    assert policy.may_pull(5, 3)
    assert policy.on_push(5, 3).outcome is Outcome.ACCUMULATED


def test_sync_join_after_everyone_left_starts_at_open_round():
    policy = make("sync", 1)
    policy.on_push(0, 0)
    policy.on_push(0, 1)
    policy.rounds_to_close()
    policy.leave(0)
    assert policy.slowest_clock() == 2
    assert policy.join(1) == 2


def test_sync_join_blocks_open_round_until_newcomer_pushes():
    policy = make("sync", 2)
    policy.on_push(0, 0)
    assert policy.join(2) == 0
    policy.on_push(1, 0)
    assert list(policy.rounds_to_close()) == []
    policy.on_push(2, 0)
    assert list(policy.rounds_to_close()) == [0]


def test_join_with_explicit_start_clock():
    policy = ConsistencyPolicy("ssp", staleness=1)
    assert policy.join(3, start_clock=4) == 4
    # a negative start clock means "choose for me"
    assert policy.join(4, start_clock=-1) == 4
    assert policy.clocks == {3: 4, 4: 4}


@pytest.mark.parametrize("mode", MODES)
def test_unknown_worker_push_raises(mode):
    policy = make(mode, 2)
    with pytest.raises(UnknownWorker):
        policy.on_push(2, 0)
    with pytest.raises(UnknownWorker):
        policy.on_push(-1, 0)
    assert policy.clocks == {0: 0, 1: 0}


@pytest.mark.parametrize("mode", MODES)
def test_negative_clock_raises(mode):
    policy = make(mode, 2)
    with pytest.raises(InvalidArgument):
        policy.on_push(0, -1)
    assert policy.clocks == {0: 0, 1: 0}
    assert policy.pushers(-1) == set()


@pytest.mark.parametrize("mode", MODES)
def test_observer_never_waits(mode):
    policy = make(mode, 2)
    for c in (0, 1, 5, 10**6):
        assert policy.may_pull(-1, c)
        assert policy.may_pull(-7, c)
    assert not policy.is_live(-1)


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_unknown_worker_pull_never_waits(mode):
    policy = make(mode, 2)
    assert policy.may_pull(9, 100)


# ----- fast-forward ---------------------------------------------------------------------------


def test_sync_fast_forward():
    policy = make("sync", 2)
    decision = policy.on_push(0, 3)
    assert decision == PushDecision(Outcome.ACCUMULATED, 3, 4)
    assert policy.clocks[0] == 4
    assert policy.pushers(3) == {0}
    # a push below the new clock is now a duplicate
    assert policy.on_push(0, 2).outcome is Outcome.DUPLICATE
    assert list(policy.rounds_to_close()) == []
    # the other worker catches up round by round; rounds close once both are past them
    for c in range(4):
        policy.on_push(1, c)
    assert list(policy.rounds_to_close()) == [0, 1, 2, 3]
    assert policy.closed_rounds == 4


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_fast_forward_applies(mode):
    policy = make(mode, 2, staleness=10)
    assert policy.on_push(1, 6) == PushDecision(Outcome.APPLIED, 6, 7)
    assert policy.clocks[1] == 7
    assert policy.fastest_clock() == 7
    assert policy.slowest_clock() == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_worker_that_comes_back_never_pushes_its_last_clock_twice(mode):
    # A push applied, its reply lost for longer than the lease, the worker evicted, then the
    # client re-registers at the clock it still believes in and retries: applied once only.
    policy = ConsistencyPolicy(mode, staleness=1)
    policy.join(0)
    policy.join(1)
    first = policy.on_push(0, 0)
    assert first.outcome in (Outcome.APPLIED, Outcome.ACCUMULATED)
    policy.leave(0)
    assert policy.join(0, start_clock=0) == 1
    assert policy.on_push(0, 0).outcome is Outcome.DUPLICATE
