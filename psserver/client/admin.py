"""Administration of a running job, apart from any worker: stats, checkpoints, shutdown, observer pulls.

An observer never joins the membership: its pulls never wait and never count, so it can read
the weights of a running job (for evaluation) without slowing anyone down. Its pulls use the
fast data plane too; it learns the plane by registering as an observer.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

import numpy as np

from psgrid.psserver.client.connections import ShardConnections
from psgrid.psserver.client.handle import Handle, launch
from psgrid.psserver.client.joining import POLL_S
from psgrid.psserver.exceptions import InvalidArgument, NotInitialized, SpecMismatch, Unavailable, WaitTimeout, WrongJob
from psgrid.psserver.protocol import DEFAULT_CHUNK_BYTES, Reason, Registration
from psgrid.psserver.security import job_token
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.base import ConnectOptions


class Admin:
    """Every shard of a job, as seen by an operator or a coordinator.

    Parameters
    ----------
    addresses : list of str
        ``host:port`` of shard 0, 1, ... in shard order.
    token : str, optional
        The job's bearer token (default: ``$PSGRID_TOKEN``, as for :class:`psgrid.psserver.client.client.Client`).
    tls_ca, tls_cert, tls_key
        The job's TLS material, if it uses it.
    data_plane, shared_memory, chunk_bytes, deadline_s, retry_s
        As for :class:`psgrid.psserver.client.client.Client` (an observer reads shards on this host in place too).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        data_plane: str = "tcp",
        shared_memory: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        deadline_s: float = 30.0,
        retry_s: float = 10.0,
    ):
        options = ConnectOptions(
            token=job_token(token),
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            chunk_bytes=chunk_bytes,
            deadline_s=deadline_s,
            shared_memory=shared_memory,
        )
        self._conn = ShardConnections(
            addresses, data_plane=data_plane, options=options, retry_s=retry_s, register=self._look
        )
        self.deadline_s = deadline_s
        self.addresses = self._conn.addresses
        self._looks: list[Registration] | None = None  # each shard's range, once its weights are set

    def _look(self, shard: int) -> Registration:
        return self._conn.controls[shard].register(
            spec_hash="", worker_id=-1, start_clock=-1, host=socket.gethostname(), observer=True
        )

    def stats(self) -> list[dict]:
        """Every shard's clocks, members and counters (StatsReply in proto/ps.proto), with its address.

        Shards of different jobs are said once, in one line (a warning: ``--job-id`` differs).
        """
        stats = self._conn.each("stats")
        for i, s in enumerate(stats):
            if s.get("job_tag"):
                self._conn.note_job(i, s["job_tag"])
        return [dict(s, address=a) for s, a in zip(stats, self.addresses)]

    def describe(self) -> list[dict]:
        """Every shard's answer to Describe (DescribeReply in proto/ps.proto), with its address: the job's
        model spec and hash (``spec``: None before Init), its settings, and the shard's range and planes."""
        return [dict(d, address=a) for d, a in zip(self._conn.each("describe"), self.addresses)]

    def model_spec(self) -> ModelSpec:
        """The running job's model, as its shards hold it: what a worker joining it must register.

        Raises :class:`~psgrid.psserver.exceptions.NotInitialized` before any worker sent Init, and
        :class:`~psgrid.psserver.exceptions.SpecMismatch` if the shards hold different specs.
        """
        described = self.describe()
        specs = {d["spec"]["hash"] if d["spec"] else None for d in described}
        if None in specs:
            raise NotInitialized("the job's shards have no model yet: no worker has sent Init")
        if len(specs) > 1:
            raise SpecMismatch(f"the job's shards hold {len(specs)} different model specs: {sorted(specs)}")
        spec = described[0]["spec"]
        return ModelSpec((p["name"], tuple(p["shape"]), p["dtype"]) for p in spec["params"])

    def checkpoint(self) -> list[str]:
        """Ask every shard to write a checkpoint now; returns their paths."""
        return [path for path, _ in self._conn.each("checkpoint")]

    def report_gone(self, worker_id: int) -> None:
        """Tell every shard that worker ``worker_id`` will not come (it died before it joined).

        Workers waiting for the whole job to join count it as departed and start at once,
        instead of waiting ``join_timeout_s`` for it.
        """
        self._conn.each_call(lambda control: control.heartbeat(worker_id, leaving=True))

    def wait_for_members(self, count: int, timeout_s: float = 60.0) -> list[dict]:
        """Block until every shard has ``count`` workers registered; returns the shards' stats.

        For a tool that acts once a job's workers are in (a benchmark, a test). Raises
        :class:`~psgrid.psserver.exceptions.WaitTimeout` past ``timeout_s``, naming how many joined.
        """
        if count < 1:
            raise InvalidArgument(f"count must be at least 1, got {count}")
        deadline = time.monotonic() + timeout_s
        pause = POLL_S[0]
        while True:
            stats = self.stats()
            joined = min(len(s["members"]) for s in stats)
            if joined >= count:
                return stats
            if time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"{joined} of {count} workers registered on every shard after {timeout_s:g} s", Reason.WAIT_TIMEOUT
                )
            time.sleep(pause)
            pause = min(POLL_S[1], pause * 1.5)

    def shutdown(self, job_id: str) -> None:
        """Ask every shard to stop (each writes a final checkpoint where it has a directory).

        A shard that is already gone is what was asked for: it is not retried. Shards of another
        job refuse: a :class:`~psgrid.psserver.exceptions.WrongJob` names them once the others
        were asked (shards started by hand share a job only when given the same ``--job-id``).
        """

        def one(i):
            try:
                self._conn.controls[i].shutdown(job_id)
            except Unavailable:
                pass
            except WrongJob as refusal:
                return i, refusal
            return None

        refusals = [r for r in self._conn.map(one) if r is not None]
        if refusals:
            shards = ", ".join(str(i) for i, _ in refusals)
            raise WrongJob(
                f"shard{'s' * (len(refusals) > 1)} {shards} did not stop: {refusals[0][1]} (shards started "
                f"by hand share a job only when given the same --job-id)",
                shard=refusals[0][0],
            )

    def pull(self, out: np.ndarray | None = None) -> Handle[list[int]]:
        """The weights every shard holds now, never waiting and never counted: a :class:`Handle`, as
        :meth:`Client.pull <psgrid.psserver.client.client.Client.pull>` returns, done already.

        ``handle.wait()`` gives each shard's version and ``handle.out`` the weights: ``out`` (a flat
        float32 array of the model's size), or an array made here when it is None. The first pull
        learns each shard's range and data plane from an observer registration; later pulls only
        read (a shard that restarted is registered with again by its data plane's retry).
        """
        conn = self._conn
        layout = self._layout()
        total = layout[0].total_size
        if out is None:
            out = np.empty(total, np.float32)
        elif (
            not isinstance(out, np.ndarray)
            or out.dtype != np.float32
            or out.shape != (total,)
            or not out.flags.c_contiguous
        ):
            raise InvalidArgument(f"out must be a contiguous float32 array of shape ({total},)")

        def one(i):
            view = out[layout[i].begin : layout[i].end]
            return conn.retrying(
                i,
                lambda: conn.plane(i).pull_into(
                    view, begin=layout[i].begin, worker_id=-1, clock=0, timeout_s=self.deadline_s
                ),
                data=True,
            )

        handle = launch(lambda: conn.map(one), background=False)
        handle.out = out
        handle.wait()  # a failure is raised here, where the call was made
        return handle

    def _layout(self) -> list[Registration]:
        """Each shard's observer registration: its range and data plane; kept once the weights are set."""
        if self._looks is None:
            conn = self._conn
            looks = conn.map(lambda i: conn.retrying(i, lambda: conn.check_registration(i, self._look(i))))
            for i, reply in enumerate(looks):
                conn.use_plane_of(i, reply)
            if not all(r.initialized for r in looks):
                return looks  # no weights yet: ask again next time
            self._looks = looks
        return self._looks

    @property
    def data_planes(self) -> list[str | None]:
        return self._conn.data_planes

    def close(self) -> None:
        self._conn.close_connections()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
