"""The in-process plane, server end: a shard serves the clients of its own process by calls.

GeePS' placement (Cui et al., EuroSys 2016): a worker that hosts a shard in its own process needs
no socket, no frame and no copy to reach it. A shard started with ``in_process_clients``
(``serve(config, in_process_clients=True)``) enters its service in this process's table
(local_registry.py) under a random key and offers ``pid|key``; a client of the same process finds
the service by that offer and calls it (local_client.py), and a client of any other process cannot
(another pid: it takes the next plane).
A pull lends the shard's current buffer (on its GPU for a device shard); a push hands the caller's
gradient over to be read where it lies, during the call only (``ShardService.push`` with a
``CallerArray``, local_gradient.py: the client end builds it, and imports nothing of the shard's).

No token is asked for: a caller in the shard's process can read all of the shard's memory anyway.
The plane is off unless asked for, so a shard that tests or tools start in their own process is
reached over the planes other processes use.
"""

from __future__ import annotations

from psgrid.psserver.service import ShardService
from psgrid.psserver.transports import local_registry
from psgrid.psserver.transports.base import ListenContext, Listening, register_listener


class InProcessListener:
    """What the shard starts and stops: its entry in this process's table of hosted shards."""

    def __init__(self, service: ShardService):
        self.service = service
        self.address: str | None = None  # offered while started

    def start(self) -> None:
        self.address = local_registry.enter(self.service)

    def stop(self) -> None:
        if self.address is not None:
            local_registry.leave(self.address)


def _listen(service: ShardService, config, context: ListenContext) -> Listening | None:
    if not context.in_process_clients:
        return None
    listener = InProcessListener(service)
    return Listening(listener, address=lambda: listener.address)


register_listener("local", _listen)
