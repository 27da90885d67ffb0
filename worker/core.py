"""One worker's side of the exchange, step by step: the core that the built-in trainer and a user's script share.

A worker's step is the same whoever computes its gradient: pull the weights (waiting as the mode
says, or taking those pulled during the step before), compute a gradient into the worker's
buffer, add a straggler's delay, push. :class:`WorkerCore` owns everything around the compute:

* the exchange (a :class:`~psgrid.psserver.client.client.Client`, a host's aggregation, or the
  all-reduce baseline), made by :func:`open_exchange` from the job's ``[train]`` settings;
* the flat buffers (worker/flat.py): two gradients where a push overlaps the next step, the
  device gradient pushed over CUDA IPC where the shards take one;
* the pull-ahead (worker/prefetch.py), the straggler's delay (worker/straggler.py);
* the records (worker/records.py): start, one step record per push, done.

The built-in loop (worker/loop.py) computes into :meth:`WorkerCore.gradient`'s views with its own
model; a script's session (worker/api.py) gathers its framework's gradients into them. So a
feature added here reaches both, and they are measured on equal terms.
"""

from __future__ import annotations

import socket
import time

from psgrid.psserver.exceptions import PSError
from psgrid.psserver.protocol import ModeRules, mode_rules
from psgrid.worker.config import TrainConfig
from psgrid.worker.flat import FlatBuffers
from psgrid.worker.prefetch import PullAhead, pulls_ahead
from psgrid.worker.records import MetricsWriter, bytes_per_step
from psgrid.worker.straggler import Delay


def security(train: TrainConfig) -> dict:
    return dict(token=train.token, tls_ca=train.tls_ca, tls_cert=train.tls_cert, tls_key=train.tls_key)


# What a client takes from the job file's [train] table (the token comes with the job, not the table).
CLIENT_SETTINGS = (
    "data_plane",
    "shared_memory",
    "wire_dtype",
    "chunk_bytes",
    "deadline_s",
    "retry_s",
    "heartbeat_s",
    "join_timeout_s",
    "tls_ca",
    "tls_cert",
    "tls_key",
)


def client_settings(train: TrainConfig) -> dict:
    """The :class:`Client` keywords a job's ``[train]`` table gives (transport, deadlines, security)."""
    return {key: getattr(train, key) for key in CLIENT_SETTINGS} | {"token": train.token}


def open_exchange(
    train: TrainConfig,
    addresses: list[str],
    spec,
    *,
    rank: int | None,
    world: int,
    init,
    xp,
    gpu: int | None,
    options: dict,
    host_group=None,
    local_rank: int | None = None,
):
    """The exchange worker ``rank`` of ``world`` trains through: its own client, or its host's aggregation.

    ``init`` gives the shards' first weights where this worker is the one that gives them; ``options``
    are the :class:`Client`'s keywords (:func:`client_settings` of the job, or what a script gave).
    With ``aggregate = "host"``, ``host_group`` (a :class:`~psgrid.worker.aggregate.HostGroup`) says where
    this worker stands among the hosts; by default its rank, ``local_rank`` and ``LOCAL_SIZE`` do.
    """
    from psgrid.psserver.client.client import Client
    from psgrid.worker.backend import pinner_for

    def connect(worker_id, workers):
        return Client(
            addresses,
            spec,
            worker_id=worker_id,
            world=workers,
            init=init,
            pin_memory=pinner_for(xp),
            gpu=gpu,
            **options,
        )

    if train.aggregate != "host":
        return connect(rank, world)
    # One client per host, pushing the host's mean (worker/aggregate.py).
    from psgrid.worker.aggregate import HostGroup, host_exchange, rendezvous_name

    if rank is None:
        raise ValueError(
            'aggregate = "host" needs each worker\'s rank: run the script under psctl launch or '
            "psctl mpi, or pass rank= to psgrid.init"
        )
    group = host_group or HostGroup.of(rank, world, local_rank=local_rank)
    return host_exchange(
        group,
        rendezvous_name(addresses, options.get("token"), group.host),
        spec.size,
        connect,
        wire_dtype=options.get("wire_dtype", train.wire_dtype),
        timeout_s=train.join_timeout_s + train.deadline_s + train.retry_s,
        token=options.get("token"),
    )


# The all-reduce baseline (worker/allreduce.py) has no shards: each of its steps is one synchronous round.
ALLREDUCE_RULES = ModeRules(accumulates=True, waits_on_pull=True, bounded=False)


def exchange_rules(mode: str) -> ModeRules:
    """The consistency rules of an exchange's ``mode``: a shard mode's (protocol.py), or the all-reduce baseline's."""
    return ALLREDUCE_RULES if mode == "allreduce" else mode_rules(mode)


def overlaps(train: TrainConfig, mode: str, planes) -> bool:
    """Whether a step's push runs in the background, beside the next step's pull and compute.

    In async and ssp it does unless ``overlap = false``: the next gradient is computed into the
    other of two buffers meanwhile, and the push is waited for before the one after it. In sync
    the next pull is answered only once the round the push closes is applied, so an overlap saves
    one request's latency and costs a thread hand-off: the steps stay in order. With the overlap
    off the next pull waits for this push (a worker alone then sees no staleness). Under
    ``"auto"`` (the default) it is also off where every shard is in the worker's own process (the
    in-process plane, ``planes`` all "local"), unless the worker pulls ahead: the push is the
    shard's update itself, run in this process, and a thread running it beside the next step's
    kernel launches cost the compute more than the overlap saved (docs/performance.md, "The shard
    in the worker's process").
    """
    if exchange_rules(mode).accumulates or train.overlap is False:
        return False
    in_process = bool(planes) and all(plane == "local" for plane in planes)
    return not (train.overlap == "auto" and in_process and not train.pull_ahead)


class WorkerCore:
    """The steps of one worker around its compute: pull, gradient buffer, delay, push, records.

    Use it entered (``with WorkerCore(...) as core``: the exchange joins the job, the buffers are
    made on the exchange's terms) and, each step::

        core.pull()                         # core.param_views hold this step's weights
        grads = core.gradient()             # views to compute (or copy) this step's gradient into
        ...
        core.push(loss)                     # delay, then the push (in the background where it overlaps)

    Parameters
    ----------
    train : TrainConfig
        The job's worker settings: overlap, pull-ahead, stragglers, seed.
    exchange
        What moves the weights and gradients (:func:`open_exchange`, or an all-reduce exchange).
    rank : int or None
        This worker's rank (None: the exchange's worker id, once joined).
    xp : module
        numpy or cupy: where the buffers live.
    metrics : MetricsWriter
        Where the records go.
    """

    def __init__(
        self,
        train: TrainConfig,
        exchange,
        spec,
        *,
        rank: int | None,
        xp,
        metrics: MetricsWriter,
        device_name: str = "cpu",
        device=None,
    ):
        self.train, self.exchange, self.spec, self.xp = train, exchange, spec, xp
        self.metrics, self.device_name, self._device = metrics, device_name, device
        self._rank = rank
        self.bufs: FlatBuffers | None = None
        self.ahead: PullAhead | None = None
        self.overlap = False
        self.step = 0
        self.samples = 0
        self.last_step: dict | None = None
        self._in_flight = None  # (push handle, its step's record): the push of the step before
        self._timed: dict | None = None
        self._compute_t0: float | None = None
        # This step's gradient buffer is taken (swapped to) once; a push that failed before it was issued
        # leaves it taken, so a retry writes it again rather than the buffer the push in flight reads.
        self._taken = False

    # ----- joining ---------------------------------------------------------------------------------

    def __enter__(self) -> WorkerCore:
        self.exchange.__enter__()
        try:
            mode = self.exchange.mode
            self.overlap = overlaps(self.train, mode, self.exchange.data_planes)
            with self.on_device():
                self.bufs = FlatBuffers(self.spec, self.xp, self.exchange, double=self.overlap)
                self.ahead = (
                    PullAhead(self.bufs, self.spec)
                    if self.overlap and pulls_ahead(self.train, exchange_rules(mode))
                    else None
                )
            self.delay = Delay(self.train.stragglers, self.rank, self.train.seed)
            self.step_bytes = bytes_per_step(self.exchange, self.spec.size)
        except BaseException:
            self.exchange.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.exchange.__exit__(*exc)

    @property
    def rank(self) -> int:
        return self.exchange.worker_id if self._rank is None else self._rank

    @property
    def mode(self) -> str:
        return self.exchange.mode

    @property
    def param_views(self) -> dict:
        return self.bufs.param_views

    def start(self, **fields) -> None:
        """The worker's first record: who it is, where it runs, how it exchanges (``fields``: what it trains)."""
        self.metrics.write(
            event="start",
            rank=self.rank,
            worker=self.exchange.worker_id,
            host=socket.gethostname(),
            device=self.device_name,
            mode=self.mode,
            **fields,
            params=self.spec.size,
            data_planes=self.exchange.data_planes,
            stragglers=list(self.train.stragglers),
            pull_ahead=self.ahead is not None,
            overlap=self.overlap,
        )

    # ----- a step ----------------------------------------------------------------------------------

    def pull(self, *, last: bool = False, then=None) -> dict:
        """This step's weights into :attr:`param_views`; returns the step's timings so far.

        With the pull-ahead they are those pulled during the step before (``pull_s`` is what this step
        still waited for them, ``pull_ahead_s`` what their pull took), and unless ``last`` the next
        step's pull starts now. ``then(param_views)``, if given, runs next and is counted in ``pull_s``
        (a script's session copies the weights into its model's tensors).
        """
        started = time.time()
        t0 = time.perf_counter()
        with self.on_device():
            if self.ahead is None:
                self.bufs.pull()  # pull_s: from the request to the weights on the device
            else:
                self.ahead.pull(ahead=not last)
            if then is not None:
                then(self.bufs.param_views)
        pull_s = time.perf_counter() - t0 + (self.ahead.waited_s if self.ahead is not None else 0.0)
        self._timed = dict(started=started, pull_s=pull_s)
        if self.ahead is not None and self.ahead.pulled_s is not None:
            self._timed["pull_ahead_s"] = self.ahead.pulled_s
        self._compute_t0 = time.perf_counter()
        return self._timed

    def gradient(self) -> dict:
        """The views this step's gradient goes into (by name): the other buffer where a push is in flight."""
        if self.overlap and not self._taken:
            self.bufs.swap_gradient()  # the push that read it (the step before last) has ended
        self._taken = True
        return self.bufs.grad_views

    def push(self, loss, *, samples: int | None = None) -> dict:
        """End the step: the gradient's copy, the straggler's delay, then the push; returns the step's record.

        ``loss`` is a number or a scalar array (read once the gradient is complete). The record is
        written once its push has ended: at once where the push does not overlap, else at the next
        step's push or :meth:`finish`.
        """
        timed = self._timed or dict(started=time.time(), pull_s=0.0)
        t1 = self._compute_t0 or time.perf_counter()
        with self.on_device():
            if self.ahead is not None:
                self.ahead.advance()
            self.bufs.download_grad()  # compute_s includes this copy to the host, which also synchronizes
        loss_value = float("nan") if loss is None else float(loss.item() if hasattr(loss, "item") else loss)
        compute_s = time.perf_counter() - t1
        delay_s = self.delay.seconds(compute_s)
        if delay_s:
            time.sleep(delay_s)
        self._write_in_flight(then=self.step)  # the push before (it overlapped this pull and compute) ends first
        record = dict(
            event="step",
            rank=self.rank,
            worker=self.exchange.worker_id,
            step=self.step,
            clock=self.exchange.clock,
            started=timed["started"],
            loss=loss_value,
            pull_s=timed["pull_s"],
            compute_s=compute_s,
            delay_s=delay_s,
        )
        if samples is not None:
            record["samples"] = int(samples)
        if "pull_ahead_s" in timed:
            record["pull_ahead_s"] = timed["pull_ahead_s"]
        # Pulled ahead, the client's last pull is the next step's: say which weights this gradient is of
        # (nothing pulled yet, a script's first push: the client's own versions).
        used = {} if self.ahead is None or not self.ahead.versions else {"versions": self.ahead.push_versions()}
        self._in_flight = (self.exchange.push(self.bufs.pushed, background=self.overlap, **used), record)
        self._taken = False
        self.samples += int(samples or 0)
        if not self.overlap:
            self._write_in_flight()
        self.step += 1
        self._timed, self._compute_t0 = None, None
        return record

    def finish(self) -> None:
        """Wait for the push in flight and write its record; a pull made ahead that nothing will read ends too."""
        self._write_in_flight()
        if self.ahead is not None and self.ahead.pending is not None:
            pending, self.ahead.pending = self.ahead.pending, None
            pending.wait()

    def _write_in_flight(self, then: int | None = None) -> None:
        """Wait for the push in flight and write its step's record.

        A push in the background fails at the call after it: its error then names its step and, where
        that call is step ``then``'s push, says that gradient was not sent (the buffer is kept, so
        pushing again sends it).
        """
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            try:
                self.last_step = _finish(*in_flight, self.step_bytes)
            except PSError as exc:
                step = in_flight[1]["step"]
                unsent = "" if then is None else f"; step {then}'s gradient was not sent: push it again"
                exc.message = f"step {step}'s push, made in the background, failed: {exc.message}{unsent}"
                exc.args = (exc.message,)
                raise
            self.metrics.write(**self.last_step)

    def on_device(self):
        """Where this worker's CuPy work runs: its GPU (a session's parameters' device)."""
        import contextlib

        if self._device is None:
            return contextlib.nullcontext()
        return self.xp.cuda.Device(self._device)


def _finish(push, record: dict, step_bytes: int) -> dict:
    """Complete a step's record with its push: outcome, staleness, time and bytes moved."""
    results = push.wait()
    record["push_s"] = push.seconds
    record["staleness"] = max((r.staleness for r in results), default=0)
    outcomes = {r.outcome.name for r in results}
    record["outcome"] = outcomes.pop() if len(outcomes) == 1 else "MIXED"
    record["bytes"] = step_bytes
    return record
