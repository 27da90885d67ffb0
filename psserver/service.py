"""The one data path of a shard: what every call means, checked once, whatever the transport.

Transports (``transports/*_server.py``) decode their wire format and call these methods with plain
values. A plane needs two of them for its payloads: a pull lease (:meth:`ShardService.pull`, a
snapshot it sends from and gives back) and a push intake (:meth:`ShardService.open_push`, which a
stream receives into, or :meth:`ShardService.push`, for a whole gradient the plane hands over as a
source of its own). What is one plane's alone (its slots, files, handles) is that plane's module's.
This module alone

* bounds every number that comes from the wire (ids, clocks, versions, sizes);
* checks payloads as they land (intake.py): offsets, sizes, dtypes, non-finite values, truncation;
* lends the transports the pooled buffers (the shard's) that payloads land in and snapshots
  are sent from, and takes them back on every path;
* turns a caller's deadline into the consistency wait's timeout;
* counts refused input; and
* turns any failure into the :class:`Refusal` a transport puts on the wire.

What a valid call does to the state (the consistency rules, the optimizer, membership)
is the shard's (shard.py); what the bytes look like is the transport's.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from psgrid.psserver.exceptions import InvalidArgument, PSError, WrongJob
from psgrid.psserver.intake import GradientSource, InitIntake, PushIntake
from psgrid.psserver.protocol import (
    FLOAT32,
    ITEMSIZE,
    REPLY_MARGIN_S,
    HeartbeatInfo,
    PushResult,
    Reason,
    Refusal,
    Registration,
    Status,
    job_tag,
)
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state.buffers import BufferPool
from psgrid.psserver.state.device import shard_device_bytes
from psgrid.psserver.state.policy import MAX_CLOCK, MAX_START_CLOCK
from psgrid.psserver.state.shard import Shard

log = logging.getLogger("psgrid.shard")

# Bounds on numbers from the wire, checked before anything uses or stores them.
MAX_WORKER_ID = 2**31 - 1
MAX_HOST_CHARS = 256
MAX_SPEC_PARAMS = 1 << 16
MAX_MODEL_ELEMENTS = 1 << 40  # 4 TiB of float32: far past any shard, short of overflowing anything
RANGE_COPIES = 4  # weights, optimizer state, and at least two pooled buffers
PHYSICAL_MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Snapshot(NamedTuple):
    """A consistent copy of the shard's range, to be sent; valid inside ``ShardService.pull``."""

    version: int
    begin: int
    values: np.ndarray

    def payload(self) -> memoryview:
        return memoryview(self.values).cast("B")


def check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidArgument(f"{name} must be in [{low}, {high}], got {value}", Reason.BAD_VALUE)


def check_worker(worker_id: int, *, observer_ok: bool) -> None:
    """A worker id from the wire: 0..MAX_WORKER_ID, or -1 where an observer may call."""
    if not (0 <= worker_id <= MAX_WORKER_ID or observer_ok and worker_id == -1):
        raise InvalidArgument(f"worker_id must be in [0, {MAX_WORKER_ID}], got {worker_id}", Reason.BAD_VALUE)


class PullLease:
    """A snapshot lent to a transport; ``with`` it, and its buffer goes back to the pool at the end."""

    __slots__ = ("shard", "snapshot")

    def __init__(self, shard: Shard, snapshot: Snapshot):
        self.shard, self.snapshot = shard, snapshot

    def __enter__(self) -> Snapshot:
        return self.snapshot

    def __exit__(self, *exc) -> None:
        self.shard.release_snapshot(self.snapshot.values)


class ShardService:
    """The transport-neutral API of one shard; every transport's every call goes through here.

    Parameters
    ----------
    shard : Shard
    on_shutdown : callable, optional
        Called when a Shutdown request arrives (the server stops itself).
    """

    def __init__(self, shard: Shard, on_shutdown: Callable[[], None] | None = None):
        self.shard = shard
        self.on_shutdown = on_shutdown
        # (plane, where it listens now: its address, None while not offered), set by the server once they listen
        self.planes: list[tuple[str, Callable[[], str | None]]] = []
        self._half: BufferPool | None = None
        self._half_lock = threading.Lock()

    def half_pool(self) -> BufferPool:
        """Landing buffers for float16/bfloat16 payloads (made on first use: most jobs push float32)."""
        with self._half_lock:
            if self._half is None:
                self._half = BufferPool(self.shard.size, np.uint16)
            return self._half

    # ----- refusals -----------------------------------------------------------------------------

    def refuse(self, exc: BaseException, what: str = "request") -> Refusal:
        """The refusal to put on the wire for ``exc``; the one place refused input is counted.

        An exception that is not a PSError is a bug of ours: it is logged with its traceback
        and answered INTERNAL, and the shard keeps serving.
        """
        if isinstance(exc, PSError):
            if exc.status == Status.INVALID_ARGUMENT:
                self.shard.reject()
            return exc.refusal()
        log.error("shard %d: unexpected error in %s", self.shard.config.shard_index, what, exc_info=exc)
        return Refusal(Status.INTERNAL, Reason.NONE, f"internal error in {what}: {type(exc).__name__}")

    # ----- control ------------------------------------------------------------------------------

    def register(
        self, *, spec_hash: str, worker_id: int, start_clock: int, host: str, observer: bool = False
    ) -> Registration:
        """Join (or rejoin) the membership; an observer only learns the layout and data planes."""
        check_worker(worker_id, observer_ok=True)
        if start_clock != -1:
            check_range("start_clock", start_clock, 0, MAX_START_CLOCK)
        if len(host) > MAX_HOST_CHARS or len(spec_hash) > 64:
            raise InvalidArgument("host or spec_hash too long", Reason.BAD_VALUE)
        shard, config = self.shard, self.shard.config
        if observer:
            joined = {"worker_id": -1, "start_clock": 0, **shard.layout_info()}
        else:
            joined = shard.register(spec_hash, worker_id, start_clock, host)
        return Registration(
            mode=config.mode,
            staleness=config.staleness,
            backup_workers=config.backup_workers,
            lease_s=config.lease_s,
            shard_index=config.shard_index,
            num_shards=config.num_shards,
            planes=self.offers(),
            max_chunk_bytes=config.chunk_bytes,
            job_tag=job_tag(config.job_id),
            **joined,
        )

    def offers(self) -> tuple[tuple[str, str], ...]:
        """(plane, address) of every data plane this shard serves now, as registration answers them."""
        return tuple((name, address) for name, where in self.planes if (address := where()) is not None)

    def open_init(self, params: list[tuple[str, tuple, str]], spec_hash: str) -> InitIntake:
        """Start taking initial weights for the model ``params`` (whose hash must be ``spec_hash``)."""
        if not params or len(params) > MAX_SPEC_PARAMS:
            raise InvalidArgument(f"a model spec needs 1 to {MAX_SPEC_PARAMS} parameters", Reason.BAD_SPEC)
        for name, shape, _ in params:
            if any(not 0 <= d <= MAX_MODEL_ELEMENTS for d in shape):
                raise InvalidArgument(f"parameter {name!r} has a dimension out of range: {shape}", Reason.BAD_SPEC)
        try:
            spec = ModelSpec(params)
        except InvalidArgument as exc:
            raise InvalidArgument(str(exc), Reason.BAD_SPEC) from None
        if spec.size > MAX_MODEL_ELEMENTS:
            raise InvalidArgument(
                f"model of {spec.size} elements is past the limit of {MAX_MODEL_ELEMENTS}", Reason.BAD_SPEC
            )
        if spec_hash != spec.hash():
            raise InvalidArgument("the spec's hash does not match its parameters", Reason.BAD_SPEC)
        self.shard.check_spec(spec)
        begin, end = self.shard.layout(spec)
        if self.shard.arrays.on_gpu:  # its weights, state and buffers are on the GPU: room there is what counts
            self._check_gpu_room(end - begin)
            return InitIntake(self.shard, spec)
        # The weights, the optimizer's state and the pooled buffers are each this range: refuse, before
        # anything is allocated, a model whose range could not fit in this machine's memory.
        need = (end - begin) * ITEMSIZE[FLOAT32] * RANGE_COPIES
        if need > PHYSICAL_MEMORY:
            raise InvalidArgument(
                f"a range of {end - begin} elements ({need / 2**30:.1f} GiB with optimizer state and "
                f"buffers) is more than this shard can hold ({PHYSICAL_MEMORY / 2**30:.1f} GiB of "
                f"memory): use more shards",
                Reason.BAD_SPEC,
            )
        return InitIntake(self.shard, spec)

    def _check_gpu_room(self, elements: int) -> None:
        """A device shard refuses, before it allocates anything, a range its GPU has no room for (one worker's slots)."""
        config, arrays = self.shard.config, self.shard.arrays
        need = shard_device_bytes(elements, config.optimizer, config.momentum, workers=1)
        free = arrays.free_bytes()
        if need > free:
            raise InvalidArgument(
                f"a range of {elements} elements needs {need / 2**20:.0f} MiB on {arrays.label} with "
                f"its optimizer state and buffers, and it has {free / 2**20:.0f} MiB free: use more "
                f"shards, or shard_device = 'cpu'",
                Reason.BAD_SPEC,
            )

    def heartbeat(self, *, worker_id: int, leaving: bool) -> HeartbeatInfo:
        check_worker(worker_id, observer_ok=False)
        known = self.shard.heartbeat(worker_id)
        if leaving and known:
            self.shard.leave(worker_id)
        elif leaving:
            self.shard.mark_gone(worker_id)  # a launcher reporting a worker that died before it joined
        return HeartbeatInfo(
            known=known,
            lease_s=self.shard.config.lease_s,
            min_clock=self.shard.policy.slowest_clock(),
            version=self.shard.version,
        )

    def stats(self) -> dict:
        return self.shard.stats()

    def describe(self) -> dict:
        """What a worker needs to join this shard's job (DescribeReply in proto/ps.proto), changing nothing.

        ``spec`` is ``(params, hash)`` with params as ``(name, shape, dtype)`` in layout order, the hash
        being the one a registration is checked against; None before Init.
        """
        shard, config = self.shard, self.shard.config
        layout = shard.layout_info()  # read first: a spec seen later is never older than it
        spec = shard.spec
        optimizer = {
            "name": config.optimizer,
            **config.optimizer_hparams(),
            "staleness_compensation": config.compensation,
            "async_momentum": config.async_momentum,
            "lr_schedule": config.lr_schedule,
            "lr_warmup": config.lr_warmup,
            "lr_updates": config.lr_updates,
        }
        return {
            **layout,
            "spec": None if spec is None else ([(p.name, p.shape, p.dtype) for p in spec.params], spec.hash()),
            "mode": config.mode,
            "staleness": config.staleness,
            "backup_workers": config.backup_workers,
            "lease_s": config.lease_s,
            "shard_index": config.shard_index,
            "num_shards": config.num_shards,
            "max_chunk_bytes": config.chunk_bytes,
            "planes": self.offers(),
            "optimizer": optimizer,
            "update_device": "gpu" if shard.arrays.on_gpu else "cpu",
            "job_tag": job_tag(config.job_id),
        }

    def checkpoint(self) -> tuple[str, int]:
        return self.shard.checkpoint()

    def shutdown(self, job_id: str) -> None:
        """Stop the shard, if ``job_id`` names its job: garbage or another job's tool cannot stop it."""
        if not hmac.compare_digest(job_id.encode(), self.shard.config.job_id.encode()):
            raise WrongJob(
                "Shutdown must name this shard's job: the id psctl prints when the shard starts and "
                "writes with its address (OUT/addr/shard-I)"
            )
        if self.on_shutdown is not None:
            self.on_shutdown()

    # ----- data ---------------------------------------------------------------------------------

    def pull(
        self,
        *,
        worker_id: int,
        clock: int,
        timeout_s: float | None,
        cancelled: Callable[[], bool] | None = None,
        device: bool = False,
    ) -> PullLease:
        """Wait until the consistency rule lets ``worker_id`` pull at ``clock``, then lend a snapshot.

        ``timeout_s`` is what is left of the caller's deadline (None: no deadline); the wait ends
        early enough for the refusal to reach the caller first. Use it as a context manager: the
        snapshot's buffer goes back to the pool when the block ends. ``device``: the caller is in this
        process (the in-process plane) and may take a device shard's GPU buffer itself.
        """
        self.admit_pull(worker_id=worker_id, clock=clock, timeout_s=timeout_s, cancelled=cancelled)
        version, values = self.shard.snapshot(device=device)
        return PullLease(self.shard, Snapshot(version, self.shard.begin, values))

    def admit_pull(
        self, *, worker_id: int, clock: int, timeout_s: float | None, cancelled: Callable[[], bool] | None = None
    ) -> None:
        """Bound the numbers and wait, as :meth:`pull` does, until ``worker_id`` may pull at ``clock``.

        For a plane that lends the weights its own way once the wait is over (the shared-memory and
        CUDA IPC planes mark a ring buffer for a reader in another process: ring_readers.py).
        """
        if not ((0 <= worker_id <= MAX_WORKER_ID or worker_id == -1) and 0 <= clock <= MAX_CLOCK):
            check_worker(worker_id, observer_ok=True)  # one of them is out of range: say which
            check_range("clock", clock, 0, MAX_CLOCK)
        wait_s = None
        if timeout_s is not None:
            if not math.isfinite(timeout_s):
                raise InvalidArgument(
                    f"a deadline must be a finite number of seconds, got {timeout_s}", Reason.BAD_VALUE
                )
            wait_s = max(0.0, timeout_s - REPLY_MARGIN_S)
        self.shard.wait_for_pull(worker_id, clock, wait_s, cancelled=cancelled)

    def open_push(self, *, worker_id: int, clock: int, version: int) -> PushIntake:
        """Start taking one gradient; refused at once (before the payload) for a worker that is not live.

        Every plane's push comes in here; a push moves its worker to clock + 1, which must be a clock too.
        A stream receives the payload into the intake as it comes; a plane that holds the whole gradient
        already calls :meth:`push` instead.
        """
        if not (0 <= worker_id <= MAX_WORKER_ID and 0 <= clock < MAX_CLOCK and 0 <= version <= MAX_CLOCK):
            check_worker(worker_id, observer_ok=False)  # one of them is out of range: say which
            check_range("clock", clock, 0, MAX_CLOCK - 1)
            check_range("version", version, 0, MAX_CLOCK)
        self.shard.check_pusher(worker_id)
        return PushIntake(self, worker_id, clock, version)

    def push(self, *, worker_id: int, clock: int, version: int, source: GradientSource) -> PushResult:
        """One whole gradient that a plane hands over as ``source`` (a worker's shared memory, a CUDA IPC slot,
        an array of this process: intake.py's :class:`GradientSource`): opened, filled, checked, then taken."""
        with self.open_push(worker_id=worker_id, clock=clock, version=version) as intake:
            intake.fill(source)
            return intake.commit()
