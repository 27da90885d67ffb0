"""A worker's client: join a job, pull and push, leave.

::

    with Client(addresses, spec, world=2, init=initial_weights) as client:
        for step in range(steps):
            client.pull(params)
            compute_gradient(params, grad)
            client.push(grad)

Entering registers with every shard under one worker id and one starting clock, heartbeats
from a background thread, waits until the job's ``world`` workers have joined every shard,
and gives initial weights to the shards that have none (one worker sends them). Leaving,
also on an exception, tells every shard this worker is done, so sync and ssp stop waiting
for it.

``pull`` and ``push`` return a :class:`Handle` (ps-lite's Push, Pull and Wait). By default
they run in the calling thread and the handle is done when they return, so a buffer is never
read half filled. With ``background=True`` they run on the client's threads (over shared memory a
push is posted instead: sent now, its answers read by ``wait()``, client/posting.py) and ``wait()``
blocks until every shard has answered; a buffer given to them is theirs until then. The
client keeps the clocks: a push carries the next clock and the versions of the last pull,
and a pull issued while a background push is in flight is for the step after it, so a loop
overlaps them without threads or arithmetic of its own. One pull and one push may be in
flight; a second of the same kind first waits for the one before. A client is used from one
thread (its own threads do the background work).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.client.connections import ShardConnections
from psgrid.psserver.client.handle import Handle, defer, launch, settle
from psgrid.psserver.client.joining import (
    Initializer,
    check_flat,
    check_flat_device,
    start_heartbeats,
    wait_for_workers,
)
from psgrid.psserver.client.memory import ClientMemory, Pinner
from psgrid.psserver.client.posting import PostedCalls, failing_first
from psgrid.psserver.exceptions import InvalidArgument, PSError, UnknownWorker, WaitTimeout
from psgrid.psserver.protocol import DEFAULT_CHUNK_BYTES, PushResult, Reason, Registration, mode_rules
from psgrid.psserver.security import job_token
from psgrid.psserver.sharding import shard_ranges
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.base import ConnectOptions

log = logging.getLogger("psgrid.client")
T = TypeVar("T")


class Client:
    """One worker's connection to every shard of a job.

    Parameters
    ----------
    addresses : list of str
        ``host:port`` of shard 0, 1, ... in shard order.
    spec : ModelSpec
        The model's layout; every worker and shard of the job must agree on it.
    worker_id : int, optional
        Register under this id (a worker's rank, so sync rounds sum in the same order every
        run); by default shard 0 assigns one.
    world : int, optional
        The job's number of workers: entering waits (up to ``join_timeout_s``) until that many
        have joined every shard, since sync and ssp count the members they have.
    init : array, mapping or callable, optional
        Initial weights (a flat float32 array, or arrays by name, or a callable returning
        either) for shards that have none. With ``world``, only the worker with the lowest id
        sends them and the others wait; a client without ``init`` waits for them.
    data_plane : {"tcp", "grpc"}
        Where Pull and Push payloads go when a shard offers it (gRPC otherwise), unless the
        shard is on this host and ``shared_memory`` is on.
    shared_memory : bool
        Read the weights of shards on this host in place and push through shared memory
        (the ``shm`` data plane); off, payloads take ``data_plane`` even on one host.
    pin_memory : Pinner, optional
        Registers the host buffers a device copies to and from (the gradient buffer, the
        shards' weights mapped here): how a GPU worker gets DMA speed from shared memory.
    gpu : int, optional
        The GPU (of those this process sees) the caller's arrays are on. A shard on this host
        that keeps its weights on a GPU reachable from it is then reached over CUDA IPC: a
        pull hands ``into`` the shard's device array, and ``push`` takes a CuPy array
        (:meth:`takes_device_gradients`). None: the caller's arrays are in host memory.
    wire_dtype : {"float32", "float16", "bfloat16"}
        Element type of pushed gradients.
    deadline_s, retry_s, max_wait_s
        Deadline of every call; how long an unavailable shard is retried; how long a pull may
        wait in all for slower workers (its deadline is renewed until then).
    heartbeat_s : float, optional
        Heartbeat interval (default: a quarter of the shards' lease, at most 1 s).
    token : str, optional
        Bearer token (default: ``$PSGRID_TOKEN``, by the rule of
        :func:`~psgrid.psserver.security.job_token`; none when that is unset too).
    tls_ca, tls_cert, tls_key
        (Mutual) TLS material; off by default.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        spec: ModelSpec,
        *,
        worker_id: int | None = None,
        world: int | None = None,
        init=None,
        data_plane: str = "tcp",
        wire_dtype: str = "float32",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        deadline_s: float = 60.0,
        retry_s: float = 30.0,
        max_wait_s: float = 3600.0,
        heartbeat_s: float | None = None,
        join_timeout_s: float = 120.0,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        host: str | None = None,
        shared_memory: bool = True,
        pin_memory: Pinner | None = None,
        gpu: int | None = None,
    ):
        if not isinstance(spec, ModelSpec):
            raise InvalidArgument(f"spec must be a ModelSpec, got {type(spec).__name__}")
        if world is not None and world < 1:
            raise InvalidArgument(f"world must be at least 1, got {world}")
        self.spec = spec
        self.world = world
        self._requested_id = -1 if worker_id is None else worker_id
        self.wire_dtype = wire.wire_dtype(wire_dtype)
        self.deadline_s, self.max_wait_s, self.join_timeout_s = deadline_s, max_wait_s, join_timeout_s
        self._heartbeat_s = heartbeat_s
        self.host = host or socket.gethostname()
        self._memory = ClientMemory(spec.size, shared=shared_memory, pinner=pin_memory)
        options = ConnectOptions(
            token=job_token(token),
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            chunk_bytes=chunk_bytes,
            deadline_s=deadline_s,
            shared_memory=shared_memory,
            memory=self._memory,
            gpu=gpu,
        )
        self.gpu = gpu
        self._conn = ShardConnections(
            addresses, data_plane=data_plane, options=options, retry_s=retry_s, register=self._register_one
        )
        self.ranges = shard_ranges(spec.size, self._conn.num_shards)
        self._initializer = Initializer(self._conn, spec, self.ranges, init, join_timeout_s)
        self._lock = threading.Lock()  # clocks and versions
        self._calls = threading.Lock()  # one pull() or push() being issued at a time
        self.worker_id = -1
        self.mode = ""
        self.lease_s = 0.0
        self._next_clock = 0
        self._unacked_clock: int | None = None  # the clock of the push in flight, if any
        self._versions = [0] * self._conn.num_shards
        self._pull_handle: Handle | None = None
        self._landing = None  # where a posted pull's copies may still run (Client.post_pull)
        self._conn.before_close = lambda: self._landing and self._landing.wait()
        self._push_handle: Handle | None = None
        self._registered = False  # shard 0 gave this worker an id: it must leave
        self._joined = False  # every step of join() is done
        self._leaving = False  # leave() began: never register again
        self._closed = False
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    # ----- state --------------------------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        return self._conn.num_shards

    @property
    def clock(self) -> int:
        """The clock the next push carries: the pushes made so far, including any in flight."""
        with self._lock:
            return self._next_clock

    @property
    def versions(self) -> list[int]:
        """Each shard's version in the last pull that completed."""
        with self._lock:
            return list(self._versions)

    @property
    def data_planes(self) -> list[str | None]:
        return self._conn.data_planes

    def gradient_buffer(self, index: int = 0) -> np.ndarray:
        """Flat float32 buffer ``index`` (0 or 1) of the model's size, which pushes take without a copy.

        On this host's shards it is shared memory they read in place; compute the gradient
        into it (or copy it there from a device) and pass it to :meth:`push`. With two, a worker
        computes the next gradient into one while the push of the other is in flight.
        """
        return self._memory.gradient(index)

    # ----- joining and leaving ------------------------------------------------------------------

    def __enter__(self) -> Client:
        return self.join()

    def __exit__(self, *exc) -> None:
        self.close()

    def join(self) -> Client:
        """Register with every shard, heartbeat, wait for the job's workers, initialise empty shards.

        If any of it fails, the client leaves what it joined and closes, and the error is raised.
        """
        if self._joined:
            return self
        if self._closed:
            raise InvalidArgument("this client is closed: make a new one to join again")
        try:
            conn = self._conn
            first = conn.retrying(0, lambda: self._register_one(0, start_clock=-1))
            self.worker_id, self.mode, self.lease_s = first.worker_id, first.mode, first.lease_s
            self._registered = True
            # Every shard says where this worker stands; they differ only after shards restored
            # checkpoints of different moments. The worker starts at the earliest: a shard that is
            # ahead answers the pushes it already has as duplicates, and none is skipped.
            others = conn.map(
                lambda i: conn.retrying(i, lambda: self._register_one(i, start_clock=-1)), range(1, conn.num_shards)
            )
            registrations = [first, *others]
            with self._lock:
                self._next_clock = min(r.start_clock for r in registrations)
                self._versions = [r.version for r in registrations]
            self._start_heartbeats()
            stats = wait_for_workers(conn, self.world, self.join_timeout_s, self.worker_id)
            self._initializer.run(registrations, stats, self.worker_id)
            # A shard without weights takes any model's hash; the Init that set them dropped the members of
            # another model. Registering again there (a no-op for a member) says whether this worker was one.
            conn.map(
                lambda i: conn.retrying(i, lambda: self._register_one(i)),
                [i for i, r in enumerate(registrations) if not r.initialized],
            )
        except BaseException:
            self.close()
            raise
        self._joined = True
        return self

    def _register_one(self, shard: int, start_clock: int | None = None) -> Registration:
        """Join ``shard`` (again) under this worker's id, at the clock every shard agrees on.

        Registering again (a shard forgot this worker) asks for the clock of the push in flight,
        if any: that push is about to be retried, and must not be taken as a duplicate.
        """
        if self._leaving:
            raise UnknownWorker(
                "this client has left the job; it does not register again", Reason.UNKNOWN_WORKER, shard=shard
            )
        worker_id = self.worker_id if self._registered else self._requested_id
        if start_clock is None:
            with self._lock:
                start_clock = self._next_clock if self._unacked_clock is None else self._unacked_clock
        reply = self._conn.controls[shard].register(
            spec_hash=self.spec.hash(), worker_id=worker_id, start_clock=start_clock, host=self.host
        )
        self._conn.check_registration(shard, reply)
        self._conn.use_plane_of(shard, reply)
        return reply

    def _start_heartbeats(self) -> None:
        interval = self._heartbeat_s or max(0.05, min(1.0, self.lease_s / 4))
        self._heartbeat_thread = start_heartbeats(self._conn.controls, self.worker_id, interval, self._heartbeat_stop)

    def leave(self) -> None:
        """Tell every shard this worker is done, so sync and ssp stop waiting for it."""
        self._leaving = True
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=10)
        if not self._registered:
            return
        self._registered = False

        def one(i):
            try:
                self._conn.controls[i].heartbeat(self.worker_id, leaving=True)
            except PSError as exc:
                log.warning("shard %d did not take worker %d's leave: %s", i, self.worker_id, exc)

        self._conn.map(one)

    def close(self) -> None:
        """Finish what is in flight, leave the job, and close every connection."""
        if self._closed:
            return
        self._closed = True
        try:
            settle(self._push_handle)  # before leaving: the shards must take this worker's last push
            self.leave()  # ... and leaving ends any consistency wait of a pull in flight
            settle(self._pull_handle)
        finally:
            self._conn.close_connections()
            self._memory.close()

    # ----- pull and push ------------------------------------------------------------------------

    def pull(
        self,
        out: np.ndarray | None = None,
        *,
        into: Callable[[int, int, np.ndarray], object] | None = None,
        background: bool = False,
        one_thread: bool = False,
    ) -> Handle[list[int]]:
        """Every shard's weights, once the mode allows: into ``out`` (flat float32), or to ``into``.

        ``into(begin, end, values)`` is called once per shard with its range's weights, valid
        during the call only: a shard on this host hands over its own memory, so a caller that
        copies them to a device (``device_params[begin:end].set(values)``) moves them once.
        Returns a handle whose ``wait()`` gives the shards' versions: done already, unless
        ``background`` (then ``out`` is the pull's until ``wait()`` returns). With ``one_thread``
        the shards are pulled one after another on one thread rather than each on its own: slower,
        but for a pull that has a step's compute to hide in (the pull-ahead), the fewest threads
        taking the interpreter lock from the compute's kernel launches.
        """
        self._require_joined()
        if (out is None) == (into is None):
            raise InvalidArgument("pull takes either out= (a flat float32 array) or into= (a callable), not both")
        if out is not None:
            check_flat(out, self.spec, "the pull buffer")
        elif not callable(into):
            raise InvalidArgument(f"into must be a callable into(begin, end, values), got {type(into).__name__}")
        with self._calls:
            settle(self._pull_handle)
            clock = self.clock

            def run() -> list[int]:
                one = lambda i: self._pull_one(i, out, into, clock)  # noqa: E731
                versions = [one(i) for i in range(self.num_shards)] if one_thread else self._conn.map(one)
                with self._lock:
                    self._versions = versions
                return versions

            handle = self._pull_handle = launch(run, background, self._conn.executor)
            handle.out = out
        if not background:
            handle.wait()  # a failure is raised now, where the call was made
        return handle

    def push(
        self, grad: np.ndarray, *, versions: Sequence[int] | None = None, background: bool = False
    ) -> Handle[list[PushResult]]:
        """Push one gradient (flat float32) at the next clock.

        ``versions`` are the shard versions the gradient was computed from (default: those of
        the last pull). Returns a handle whose ``wait()`` gives each shard's
        :class:`PushResult`: done already, unless ``background`` (then ``grad`` is the push's
        until ``wait()`` returns).
        """
        self._require_joined()
        if self.gpu is None or isinstance(grad, np.ndarray):
            check_flat(grad, self.spec, "the gradient")
        else:
            check_flat_device(grad, self.spec, "the gradient")
        if versions is not None and len(versions) != self.num_shards:
            raise InvalidArgument(f"versions must give one version per shard ({self.num_shards}), got {len(versions)}")
        with self._calls:
            settle(self._push_handle)
            with self._lock:
                clock = self._next_clock
                self._next_clock += 1
                self._unacked_clock = clock
                used = list(self._versions if versions is None else versions)
            one = lambda i, failed=None: self._push_one(i, grad, clock, used[i], failed)  # noqa: E731
            posting = background and isinstance(grad, np.ndarray) and self.posts()
            if posting:
                # Headers sent now, answers read by wait(): no client thread wakes during the next compute.
                posted = PostedCalls(
                    self._conn.planes,
                    self.ranges,
                    lambda i, plane, begin, end: plane.post_push(
                        grad[begin:end],
                        begin=begin,
                        wire_dtype=self.wire_dtype,
                        worker_id=self.worker_id,
                        clock=clock,
                        version=used[i],
                        timeout_s=self.deadline_s,
                    ),
                )

            def run() -> list[PushResult]:
                results = None
                try:
                    results = posted.finish(self.num_shards, one) if posting else self._conn.map(one)
                    return results
                finally:
                    self._pushed(clock, results)

            handle = self._push_handle = defer(run) if posting else launch(run, background, self._conn.executor)
        if not background:
            handle.wait()  # a failure is raised now, where the call was made
        return handle

    def _pushed(self, clock: int, results: list[PushResult] | None) -> None:
        """Move the clocks once the push at ``clock`` has ended (``results`` None: it failed)."""
        with self._lock:
            self._unacked_clock = None
            if results:
                # The earliest clock a shard still needs: a sync push dropped as late moves the worker to
                # the open round (every shard says so), while a shard ahead of the others (restored from a
                # later checkpoint) answers a push it already has as a duplicate with its own clock, which
                # the shards behind never reach unless the worker pushes the clocks in between.
                self._next_clock = max(self._next_clock, min(r.next_clock for r in results))
            elif mode_rules(self.mode).accumulates:
                # A sync push that failed (a refused gradient, a shard out of reach) moves no clock: the
                # next push carries this clock again, which a shard that took this one answers as a
                # duplicate. Else the next pull would wait for a round this worker never pushed to on the
                # shard that refused it. (In async and ssp the pull does not wait for it; the refusing
                # shard learns the next clock by a registration.)
                self._next_clock = min(self._next_clock, clock)

    def _require_joined(self) -> None:
        if self._closed:
            raise InvalidArgument("this client is closed")
        if not self._joined:
            raise InvalidArgument(
                "the client has not joined: use it as a context manager (with Client(...) as "
                "client:) or call join() first"
            )

    def _pull_one(
        self, shard: int, out: np.ndarray | None, into, clock: int, failed: BaseException | None = None
    ) -> int:
        begin, end = self.ranges[shard]
        if out is not None:
            view = out[begin:end]
            call = lambda: self._conn.plane(shard).pull_into(  # noqa: E731
                view, begin=begin, worker_id=self.worker_id, clock=clock, timeout_s=self.deadline_s
            )
        else:
            call = lambda: self._conn.plane(shard).pull_with(  # noqa: E731
                into,
                begin=begin,
                end=end,
                staging=self._memory.staging,
                worker_id=self.worker_id,
                clock=clock,
                timeout_s=self.deadline_s,
            )
        call = failing_first(failed, call)
        waited_since = time.monotonic()
        while True:
            try:
                return self._worker_call(shard, call)
            except WaitTimeout as exc:
                # A consistency wait may outlast one deadline (slow peers): keep waiting, up to max_wait_s.
                if exc.reason is Reason.WAIT_TIMEOUT and time.monotonic() - waited_since < self.max_wait_s:
                    continue
                raise

    def _push_one(
        self, shard: int, grad: np.ndarray, clock: int, version: int, failed: BaseException | None = None
    ) -> PushResult:
        begin, end = self.ranges[shard]
        view = grad[begin:end]

        def call() -> PushResult:
            plane = self._conn.plane(shard)
            values = view
            if not (isinstance(view, np.ndarray) or plane.takes_device_arrays):
                # A device gradient to a plane that sends host memory: through our gradient buffer, which a
                # shard on this host reads in place (one copy, as a worker that downloads it itself makes).
                values = self._memory.gradient(0)[begin:end]
                with view.device:
                    view.get(out=values)
            # A retried push carries the same (worker, clock): the shard applies it once.
            return plane.push(
                values,
                begin=begin,
                wire_dtype=self.wire_dtype,
                worker_id=self.worker_id,
                clock=clock,
                version=version,
                timeout_s=self.deadline_s,
            )

        return self._worker_call(shard, failing_first(failed, call))

    def posts(self) -> bool:
        """Whether every shard's plane posts its calls (the shm plane, transports/shm_posted.py): a background
        push then wakes no client thread, and :meth:`post_pull` serves. False before joining."""
        if not self._joined or self._closed:
            return False
        return all(plane is not None and plane.posts for plane in self._conn.planes)

    def post_pull(self, landing) -> Handle[list[int]]:
        """Pull every shard's weights with no client thread: a GPU's copy engine moves them, beside the compute.

        ``landing.queue(begin, end, values)`` starts a device copy of a range from the shard's memory;
        ``landing.wait()`` returns once the copies started have ended; ``landing(begin, end, values)``
        copies at once, for a shard pulled the usual way (a torn copy, a failure, a plane that does not
        post). The requests are sent now. In async the handle's ``advance()`` reads the answers and
        starts the copies (for a caller whose compute is launched); ``wait()`` makes what is left.
        """
        self._require_joined()
        with self._calls:
            settle(self._pull_handle)
            clock = self.clock
            posted = PostedCalls(
                self._conn.planes,
                self.ranges,
                lambda i, plane, begin, end: plane.post_pull(
                    size=end - begin, worker_id=self.worker_id, clock=clock, timeout_s=self.deadline_s
                ),
            )
            land = lambda: posted.land(landing)  # noqa: E731
            self._landing = landing

            def run() -> list[int]:
                try:
                    land()
                finally:
                    landing.wait()  # a copy ends before its mark is cleared, whatever else failed
                    self._landing = None
                versions = posted.finish(
                    self.num_shards, lambda i, failed: self._pull_one(i, None, landing, clock, failed)
                )
                with self._lock:
                    self._versions = versions
                return versions

            handle = self._pull_handle = defer(run, advance=None if mode_rules(self.mode).waits_on_pull else land)
        return handle

    def takes_device_gradients(self) -> bool:
        """Whether every shard's plane takes a gradient on our GPU as it is (CUDA IPC): a GPU worker then
        pushes its device gradient, and nothing crosses the host. False before the client has joined."""
        if not self._joined or self._closed:
            return False
        return self.gpu is not None and all(self._conn.plane(i).takes_device_arrays for i in range(self.num_shards))

    def _worker_call(self, shard: int, call: Callable[[], T]) -> T:
        """A data call, retried while the shard is down; once more after registering again if it forgot us,
        or has us behind this push's clock (it refused a push of ours that the other shards took)."""
        try:
            return self._conn.retrying(shard, call, data=True)
        except PSError as exc:
            behind = exc.reason is Reason.FUTURE_CLOCK
            if self._leaving or not (behind or isinstance(exc, UnknownWorker)):
                raise
            log.warning(
                "shard %d %s worker %d; registering again",
                shard,
                "did not take an earlier push of"
                if behind
                else "forgot (evicted, or restarted from an older checkpoint)",
                self.worker_id,
            )
            self._conn.retrying(shard, lambda: self._register_one(shard))
            return self._conn.retrying(shard, call, data=True)
