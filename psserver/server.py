"""Build, start and stop one shard: its state, its data path and its transports.

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
from psgrid.psserver.protocol import format_address_file
from psgrid.psserver.security import check_token, server_ssl_context
from psgrid.psserver.service import ShardService
from psgrid.psserver.state.shard import Shard
from psgrid.psserver.transports.grpc_server import GrpcServer
from psgrid.psserver.transports.tcp_server import TcpDataServer
from psgrid.psserver import shared_memory

log = logging.getLogger("psgrid.server")


class RunningServer:
    """A started shard: its address, its state, and how to stop it."""

    def __init__(self, config: ServerConfig):
        if not config.job_id:       # a Shutdown must name it (see ShardService.shutdown)
            config = dataclasses.replace(config, job_id=secrets.token_hex(6))
        self.config = config
        check_token(config.token)
        warn_if_open(config)
        self.shard = Shard(config, restore=False)     # restored in start(), once the transports listen
        self.stopped = threading.Event()
        self.shutdown_requested = threading.Event()
        self.service = ShardService(self.shard, on_shutdown=self.shutdown_requested.set)
        self.tcp = None
        ssl_context = server_ssl_context(config.tls_cert, config.tls_key, config.tls_ca) if config.tls_cert else None
        if config.data_plane == "tcp":
            self.tcp = TcpDataServer(self.service, config.host, config.token, ssl_context, handlers=config.threads,
                                     max_connections=config.tcp_max_connections, handshake_s=config.tcp_handshake_s,
                                     on_failure=lambda: self.set_health(False))
            self.service.tcp_port = self.tcp.port
        self.shm = None
        try:
            if config.shared_memory and shared_memory.available() and not shared_memory.can_share_read_only():
                log.warning("shard %d offers no shared-memory plane: this kernel cannot seal its weights against "
                            "readers' writes (F_SEAL_FUTURE_WRITE, Linux 5.1); workers here use TCP",
                            config.shard_index)
            if config.shared_memory and shared_memory.can_share_read_only():
                from psgrid.psserver.transports.shm_server import ShmDataServer

                self.shm = ShmDataServer(self.service, config.token, ssl_context, handlers=config.threads,
                                         max_connections=config.tcp_max_connections,
                                         on_failure=lambda: self.set_health(False))
                self.service.shm_socket = self.shm.address
            self.grpc = GrpcServer(self.service, config)
        except BaseException:
            for plane in (self.tcp, self.shm):
                if plane is not None:
                    plane.stop()
            raise
        self.port = self.grpc.port
        self.address = f"{config.host}:{self.port}"
        self.metrics = None
        if config.metrics_port is not None:
            from psgrid.psserver.metrics import start_exporter
            self.metrics = start_exporter(self.shard, config.host, config.metrics_port)
        self.reaper = threading.Thread(target=self._reap, name="lease-reaper", daemon=True)

    def start(self) -> "RunningServer":
        """Listen, restore the latest checkpoint (if any), then serve.

        While a checkpoint loads, the shard already answers: every call is refused as
        UNAVAILABLE with reason ``restoring``, so clients retry instead of finding the port
        closed, and a restarted shard's address is taken at once.
        """
        restoring = bool(self.config.checkpoint_dir)
        if restoring:
            self.shard.begin_restore()
        for plane in (self.tcp, self.shm):
            if plane is not None:
                plane.start()
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
                    log.warning("shard %d evicted worker %d: no heartbeat for %.1fs",
                                self.config.shard_index, worker, self.config.lease_s)
                for worker in self.shard.evict_stalled():
                    log.warning("shard %d evicted worker %d: the others waited on it and it pushed nothing "
                                "for %gs (progress_timeout_s); its heartbeat was alive, so its training loop is "
                                "hung or far too slow", self.config.shard_index, worker,
                                self.config.progress_timeout_s)
                self.shard.checkpoint_if_due()
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("lease reaper failed")

    def stop(self, grace: float | None = 1.0) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.shard.close()        # release waiting pulls first, or stop() waits out their deadlines
        for plane in (self.tcp, self.shm):
            if plane is not None:
                plane.stop()
        self.grpc.stop(grace)
        if self.config.checkpoint_dir and self.shard.initialized:
            try:
                self.shard.checkpoint()
            except Exception:  # noqa: BLE001 - stopping must finish; the last good checkpoint stays
                log.exception("shard %d: final checkpoint failed", self.config.shard_index)
        self.shard.chunks.close()
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


def serve(config: ServerConfig) -> RunningServer:
    """Build and start a shard server; the caller stops it with ``.stop()``."""
    return RunningServer(config).start()


def warn_if_open(config: ServerConfig) -> bool:
    """Warn (and say True) when a shard would take anyone's calls: beyond loopback, no token, no client certs.

    TLS without client certificates (no ``tls_ca``) encrypts, but lets anyone in.
    """
    if config.token or config.tls_ca or is_loopback(config.host):
        return False
    log.warning("shard %d listens on %s with no token and no client certificates: anyone who can reach the port "
                "can read and change the weights. Set token (psctl launch and mpi make one per job) or "
                "tls_cert/tls_key/tls_ca", config.shard_index, config.host)
    return True


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a shard to this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False      # a name, or 0.0.0.0 / :: (every interface)


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
        write_address(address_file, server.address, server.config.job_id,
                      server.metrics.port if server.metrics else None)
    extra = f", metrics on :{server.metrics.port}" if server.metrics else ""
    print(f"psgrid shard {config.shard_index}/{config.num_shards} listening on {server.address} "
          f"(mode {config.mode}, job {server.config.job_id}){extra}", flush=True)
    while not done.is_set() and not server.shutdown_requested.is_set():
        done.wait(0.2)
    server.stop(grace=1.0)
    print(f"psgrid shard {config.shard_index} stopped", file=sys.stderr, flush=True)
    return 0
