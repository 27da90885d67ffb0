"""Many hosts on one machine: network namespaces on a bridge, each host's link shaped by ``tc tbf``.

``network.py`` makes and removes the namespaces, links and bridge (root only, Linux ``ip`` and
``tc``); ``job.py`` runs a job's shards and workers inside them, wired by the hosts' own
addresses as on real hosts. Tests and ``benchmarks/emulated_hosts.py`` use both.
"""
