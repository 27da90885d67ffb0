"""Transports: thin adapters between a wire format and the shard's one data path (service.py).

Server side, each adapter decodes requests and calls :class:`psgrid.psserver.service.ShardService`:
``grpc_server`` (the whole contract of proto/ps.proto), ``tcp_server`` and ``shm_server`` (Pull and
Push payloads over plain TCP, or through shared memory). Client side, :mod:`.base` is the small
interface the client talks to; ``grpc_client``, ``tcp_client`` and ``shm_client`` implement it.
:mod:`.base` also holds the registries of both ends, by plane name: each plane module registers its
end when imported. Rules (what a message means, what is valid) never live here.
"""
