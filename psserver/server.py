"""Build, start and stop one shard: its state, its data path and its transports (every registered plane's listener).

``serve(config)`` returns a started :class:`RunningServer`; ``run_server`` is the blocking
``psctl server``. Only the transport adapters know gRPC or sockets.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

from psgrid.psserver import files
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.protocol import CONTROL_PLANE, format_address_file
from psgrid.psserver.security import check_token, server_ssl_context
from psgrid.psserver.service import ShardService
from psgrid.psserver.state.shard import Shard
from psgrid.psserver.transports.base import ListenContext, Listening, listener_factories, plane_names
from psgrid.psserver.transports.grpc_server import GrpcServer

log = logging.getLogger("psgrid.server")


class RunningServer:
    """A started shard: its address, its state, and how to stop it."""

    def __init__(self, config: ServerConfig, *, in_process_clients: bool = False):
        if not config.job_id:  # a Shutdown must name it (see ShardService.shutdown)
            config = dataclasses.replace(config, job_id=secrets.token_hex(6))
        self.config = config
        check_token(config.token)
        warn_if_open(config)
        self.shard = Shard(config, restore=False)  # restored in start(), once the transports listen
        self.stopped = threading.Event()
        self.shutdown_requested = threading.Event()
        self.service = ShardService(self.shard, on_shutdown=self.shutdown_requested.set)
        ssl_context = server_ssl_context(config.tls_cert, config.tls_key, config.tls_ca) if config.tls_cert else None
        context = ListenContext(
            ssl_context, on_failure=lambda: self.set_health(False), in_process_clients=in_process_clients
        )
        self.listening: dict[str, Listening] = {}  # each data plane's listener, by plane, beside gRPC's
        try:
            for name, listen in listener_factories().items():
                built = listen(self.service, config, context)
                if built is not None:
                    self.listening[name] = built
            self.grpc = GrpcServer(self.service, config)
        except BaseException:
            for built in self.listening.values():
                built.listener.stop()
            raise
        # gRPC's Pull and Push are on the control port: its offer is the channel itself.
        self.service.planes = [
            (CONTROL_PLANE, lambda: ""),
            *((name, built.address) for name, built in self.listening.items()),
        ]
        self.port = self.grpc.port
        self.address = f"{config.host}:{self.port}"
        self.metrics = None
        if config.metrics_port is not None:
            from psgrid.psserver.metrics import start_exporter

            self.metrics = start_exporter(self.shard, config.host, config.metrics_port)
        self.reaper = threading.Thread(target=self._reap, name="lease-reaper", daemon=True)

    def __getattr__(self, name: str):
        """``server.tcp``, ``server.shm``, ...: a data plane's listener, by the plane's name (None: not listening)."""
        if name in plane_names():
            built = self.__dict__.get("listening", {}).get(name)
            return None if built is None else built.listener
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def start(self) -> RunningServer:
        """Listen, restore the latest checkpoint (if any), then serve.

        While a checkpoint loads, the shard already answers: every call is refused as
        UNAVAILABLE with reason ``restoring``, so clients retry instead of finding the port
        closed, and a restarted shard's address is taken at once.
        """
        restoring = bool(self.config.checkpoint_dir)
        if restoring:
            self.shard.begin_restore()
        for built in self.listening.values():
            built.listener.start()
        self.grpc.start()
        if restoring:
            try:
                self.shard.restore()
            except BaseException:
                self.stop(grace=0)
                raise
        self.reaper.start()
        self.grpc.set_serving(True)
        return self

    def set_health(self, serving: bool) -> None:
        """What the gRPC health service answers (NOT_SERVING while restoring, or if a data plane died)."""
        self.grpc.set_serving(serving)

    def _reap(self) -> None:
        # Evicts expired workers often enough that a wait is released within a fraction of a lease.
        interval = min(0.5, self.config.lease_s / 4)
        while not self.stopped.wait(interval):
            try:
                for worker in self.shard.evict_expired():
                    log.warning(
                        "shard %d evicted worker %d: no heartbeat for %.1fs",
                        self.config.shard_index,
                        worker,
                        self.config.lease_s,
                    )
                for worker in self.shard.evict_stalled():
                    log.warning(
                        "shard %d evicted worker %d: the others waited on it and it pushed nothing "
                        "for %gs (progress_timeout_s); its heartbeat was alive, so its training loop is "
                        "hung or far too slow",
                        self.config.shard_index,
                        worker,
                        self.config.progress_timeout_s,
                    )
                self.shard.checkpoint_if_due()
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("lease reaper failed")

    def stop(self, grace: float | None = 1.0) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.shard.close()  # release waiting pulls first, or stop() waits out their deadlines
        for built in self.listening.values():
            built.listener.stop()
        self.grpc.stop(grace)
        if self.config.checkpoint_dir and self.shard.initialized:
            try:
                self.shard.checkpoint()
            except Exception:  # noqa: BLE001 - stopping must finish; the last good checkpoint stays
                log.exception("shard %d: final checkpoint failed", self.config.shard_index)
        self.shard.parts.close()
        if self.metrics is not None:
            self.metrics.shutdown()
        if self.reaper.is_alive():
            self.reaper.join(timeout=5)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server is stopped or a Shutdown RPC asked it to stop; True if so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (self.stopped.is_set() or self.shutdown_requested.is_set()):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self.shutdown_requested.wait(0.2 if remaining is None else min(0.2, remaining))
        return True


def serve(config: ServerConfig, *, in_process_clients: bool = False) -> RunningServer:
    """Build and start a shard server; the caller stops it with ``.stop()``.

    With ``in_process_clients`` the shard also offers the in-process plane (transports/local_server.py):
    a client of this process, a worker that hosts the shard, then calls it instead of using a socket.
    """
    return RunningServer(config, in_process_clients=in_process_clients).start()


def warn_if_open(config: ServerConfig) -> bool:
    """Warn (and say True) when a shard would take anyone's calls: beyond loopback, no token, no client certs.

    TLS without client certificates (no ``tls_ca``) encrypts, but lets anyone in.
    """
    if config.token or config.tls_ca or is_loopback(config.host):
        return False
    log.warning(
        "shard %d listens on %s with no token and no client certificates: anyone who can reach the port "
        "can read and change the weights. Set token (psctl launch and mpi make one per job) or "
        "tls_cert/tls_key/tls_ca",
        config.shard_index,
        config.host,
    )
    return True


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a shard to this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name, or 0.0.0.0 / :: (every interface)


def write_address(path: str | os.PathLike, address: str, job_id: str, metrics_port: int | None = None) -> None:
    """Publish the bound address, the job id (and metrics port) atomically so a reader never sees half of them."""
    path = Path(path)
    files.make_dirs(path.parent)
    files.replace_text(path, format_address_file(address, job_id, metrics_port))


def run_server(config: ServerConfig, address_file: str | None = None) -> int:
    """Serve until SIGTERM, SIGINT or a Shutdown RPC; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = serve(config)
    done = threading.Event()

    def on_signal(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if address_file:
        write_address(
            address_file, server.address, server.config.job_id, server.metrics.port if server.metrics else None
        )
    extra = f", metrics on :{server.metrics.port}" if server.metrics else ""
    print(
        f"psgrid shard {config.shard_index}/{config.num_shards} listening on {server.address} "
        f"(mode {config.mode}, job {server.config.job_id}){extra}",
        flush=True,
    )
    while not done.is_set() and not server.shutdown_requested.is_set():
        done.wait(0.2)
    server.stop(grace=1.0)
    print(f"psgrid shard {config.shard_index} stopped", file=sys.stderr, flush=True)
    return 0
