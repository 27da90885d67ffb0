"""Administration of a running job, apart from any worker: stats, checkpoints, shutdown, observer pulls.

An observer never joins the membership: its pulls never wait and never count, so it can read
the weights of a running job (for evaluation) without slowing anyone down. Its pulls use the
fast data plane too; it learns the plane by registering as an observer.
"""

from __future__ import annotations

import socket
from typing import Sequence

import numpy as np

from psgrid.psserver.exceptions import InvalidArgument, Unavailable
from psgrid.psserver.protocol import DEFAULT_CHUNK_BYTES, Registration
from psgrid.psserver.security import job_token
from psgrid.psserver.shards import ShardConnections
from psgrid.psserver.transports.base import ConnectOptions


class Admin:
    """Every shard of a job, as seen by an operator or a coordinator.

    Parameters
    ----------
    addresses : list of str
        ``host:port`` of shard 0, 1, ... in shard order.
    token : str, optional
        The job's bearer token (default: ``$PSGRID_TOKEN``, as for :class:`psgrid.psserver.client.Client`).
    tls_ca, tls_cert, tls_key
        The job's TLS material, if it uses it.
    data_plane, shared_memory, chunk_bytes, deadline_s, retry_s
        As for :class:`psgrid.psserver.client.Client` (an observer reads shards on this host in place too).
    """

    def __init__(self, addresses: Sequence[str], *, token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, data_plane: str = "tcp",
                 shared_memory: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES, deadline_s: float = 30.0,
                 retry_s: float = 10.0):
        options = ConnectOptions(token=job_token(token), tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                 chunk_bytes=chunk_bytes, deadline_s=deadline_s, shared_memory=shared_memory)
        self._conn = ShardConnections(addresses, data_plane=data_plane, options=options, retry_s=retry_s,
                                      register=self._look)
        self.deadline_s = deadline_s
        self.addresses = self._conn.addresses

    def _look(self, shard: int) -> Registration:
        return self._conn.controls[shard].register(spec_hash="", worker_id=-1, start_clock=-1,
                                                   host=socket.gethostname(), observer=True)

    def stats(self) -> list[dict]:
        """Every shard's clocks, members and counters (StatsReply in proto/ps.proto), with its address."""
        return [dict(s, address=a) for s, a in zip(self._conn.each("stats"), self.addresses)]

    def checkpoint(self) -> list[str]:
        """Ask every shard to write a checkpoint now; returns their paths."""
        return [path for path, _ in self._conn.each("checkpoint")]

    def report_gone(self, worker_id: int) -> None:
        """Tell every shard that worker ``worker_id`` will not come (it died before it joined).

        Workers waiting for the whole job to join count it as departed and start at once,
        instead of waiting ``join_timeout_s`` for it.
        """
        self._conn.each_call(lambda control: control.heartbeat(worker_id, leaving=True))

    def shutdown(self, job_id: str) -> None:
        """Ask every shard to stop (each writes a final checkpoint where it has a directory).

        A shard that is already gone is what was asked for: it is not retried.
        """
        def one(i):
            try:
                self._conn.controls[i].shutdown(job_id)
            except Unavailable:
                pass

        self._conn.map(one)

    def pull(self, out: np.ndarray | None = None) -> tuple[np.ndarray, list[int]]:
        """The weights every shard holds now (never waiting, never counted); returns them and the versions."""
        conn = self._conn
        looks = conn.map(lambda i: conn.retrying(i, lambda: conn.check_registration(i, self._look(i))))
        total = looks[0].total_size
        if out is None:
            out = np.empty(total, np.float32)
        elif out.dtype != np.float32 or out.shape != (total,) or not out.flags.c_contiguous:
            raise InvalidArgument(f"out must be a contiguous float32 array of shape ({total},)")

        def one(i):
            reply = looks[i]
            conn.use_plane_of(i, reply)
            view = out[reply.begin:reply.end]
            return conn.retrying(i, lambda: conn.plane(i).pull_into(view, begin=reply.begin, worker_id=-1, clock=0,
                                                                     timeout_s=self.deadline_s), data=True)

        return out, conn.map(one)

    @property
    def data_planes(self) -> list[str | None]:
        return self._conn.data_planes

    def close(self) -> None:
        self._conn.close_connections()

    def __enter__(self) -> "Admin":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
