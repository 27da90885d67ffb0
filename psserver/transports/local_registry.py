"""The shards of this process that serve it by calls: the table both ends of the in-process plane share.

A shard's listener (local_server.py) enters its service under a random key and offers ``pid|key``;
a client end (local_client.py) looks the offer up here. Nothing else is in the table, so neither
end imports the other: the client side knows nothing of a shard's insides (tests/test_layers.py).
"""

from __future__ import annotations

import os
import secrets
import threading

_HOSTED: dict[str, object] = {}  # key -> a shard's ShardService
_LOCK = threading.Lock()


def enter(service) -> str:
    """Serve ``service`` to this process by calls; its offer (``pid|key``)."""
    key = secrets.token_hex(8)
    with _LOCK:
        _HOSTED[key] = service
    return f"{os.getpid()}|{key}"


def leave(offer: str) -> None:
    """The shard of ``offer`` stopped: no call of this process finds it any more."""
    with _LOCK:
        _HOSTED.pop(offer.partition("|")[2], None)


def hosted_service(offer: str):
    """The service an in-process offer names, if it is this process's and still serving, else None."""
    pid, _, key = offer.partition("|")
    if pid != str(os.getpid()):  # an offer of another process (or of this one's parent, before a fork)
        return None
    with _LOCK:
        return _HOSTED.get(key)
