"""Transports: thin adapters between a wire format and the shard's one data path (service.py).

Server side, each adapter decodes requests and calls :class:`psgrid.psserver.service.ShardService`:
``grpc_server`` (the whole contract of proto/ps.proto) and ``tcp_server`` (Pull and Push payloads
over plain TCP). Client side, :mod:`.base` is the small interface the client talks to and the
registry of data planes; ``grpc_client`` and ``tcp_client`` implement it. Rules (what a message
means, what is valid) never live here.
"""
