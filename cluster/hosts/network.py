"""An emulated network: N hosts as network namespaces on one Linux bridge, each link rate-limited.

Host i is the namespace ``psg-<pid>-<n>-h<i>`` with loopback up and ``eth0`` at
``10.231.<net>.<i+1>/24``, one end of a veth pair whose other end (``pg<pid>x<n>-h<i>``, pid in hex) is a port
of the bridge ``pg<pid>x<n>-br``. A ``tbf`` qdisc on both ends shapes the host's link in both
directions: on ``eth0`` what the host sends, on the bridge port what is sent to it (this kernel has
no ``netem``, so rate is shaped and delay is not). The bridge has no address and bridged frames skip
the root namespace's iptables, so traffic stays between the namespaces made here.

Everything is named with this process's id and a counter and removed by those names on exit,
whatever the exit (an exception, Ctrl-C, or SIGTERM where the caller turns it into an exception):
processes started in the namespaces must be ended first (:mod:`psgrid.cluster.hosts.job` does that).
A holder killed by SIGKILL removes nothing (its processes in the namespaces stop by themselves: they
hold its lifeline, psserver/lifeline.py), so every network made sweeps first what holders no longer
alive left: names of this module's pattern whose pid is gone (:func:`sweep_dead_holders`), nothing else.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

IP_TIMEOUT_S = 10.0
GONE_TIMEOUT_S = 10.0
NAMESPACE_PREFIX = "psg-"
# What EmulatedNetwork names, with the holder's pid: decimal in a namespace, hex in a link.
OUR_NAMESPACE = re.compile(rf"^{NAMESPACE_PREFIX}(\d+)-\d+-h\d+$")
OUR_LINK = re.compile(r"^pg([0-9a-f]+)x\d+-(?:br|h\d+|p\d+)$")
_counter = itertools.count()


class NetworkError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message has its output."""


def available() -> str | None:
    """Why emulated hosts cannot be made here (one line), or None when they can."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "emulated hosts need root (ip netns, veth, bridge, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated hosts need {' and '.join(missing)} (iproute2)"
    return None


def rate_bits(rate: str | int | float) -> int:
    """``"1gbit"``, ``"10gbit"``, ``"500mbit"`` or a number of bits per second, as bits per second."""
    if isinstance(rate, (int, float)):
        return int(rate)
    text = rate.strip().lower()
    for suffix, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(float(text))


def run_ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


@dataclass(frozen=True)
class Host:
    index: int
    netns: str  # the namespace's name
    address: str  # eth0's address inside it
    port: str  # the bridge-side end of its veth, in the root namespace

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run inside this host (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns, *command]


class EmulatedNetwork:
    """``hosts`` namespaces on a bridge, each link shaped to ``rate`` both ways; a context manager.

    Parameters
    ----------
    hosts : int
        How many hosts (1 to 250).
    rate : str or int
        The rate of every host's link, e.g. ``"1gbit"``; None leaves the links unshaped.
    """

    def __init__(self, hosts: int, rate: str | int | None = "1gbit"):
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be in 1..250, got {hosts}")
        n = next(_counter)
        self.tag = f"pg{os.getpid():x}x{n}-"  # link names: at most 15 characters
        self.prefix = f"{NAMESPACE_PREFIX}{os.getpid()}-{n}-"
        self.subnet = 1 + (os.getpid() * 7 + n) % 250  # per-run; each run has its own bridge anyway
        self.rate = None if rate is None else rate_bits(rate)
        self.bridge = f"{self.tag}br"
        self.hosts = [
            Host(i, f"{self.prefix}h{i}", f"10.231.{self.subnet}.{i + 1}", f"{self.tag}h{i}") for i in range(hosts)
        ]
        self._made = False
        self.swept: list[str] = []  # what dead holders had left, removed as this network was made

    def __enter__(self) -> EmulatedNetwork:
        self.swept = sweep_dead_holders()
        self._made = True
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _create(self) -> None:
        run_ip("ip", "link", "add", self.bridge, "type", "bridge")
        # Bridged frames must not meet the root namespace's iptables (br_netfilter may be on): this bridge only.
        run_ip("ip", "link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
        for host in self.hosts:
            peer = f"{self.tag}p{host.index}"
            run_ip("ip", "netns", "add", host.netns)
            run_ip("ip", "link", "add", host.port, "type", "veth", "peer", "name", peer)
            run_ip("ip", "link", "set", peer, "netns", host.netns)
            run_ip("ip", "-n", host.netns, "link", "set", peer, "name", "eth0")
            run_ip("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            run_ip("ip", "-n", host.netns, "link", "set", "lo", "up")
            run_ip("ip", "-n", host.netns, "link", "set", "eth0", "up")
            run_ip("ip", "link", "set", host.port, "master", self.bridge)
            run_ip("ip", "link", "set", host.port, "up")
            if self.rate:
                self._shape(["dev", host.port])
                self._shape(["dev", "eth0"], netns=host.netns)
        run_ip("ip", "link", "set", self.bridge, "up")

    def _shape(self, dev: list[str], netns: str | None = None) -> None:
        # The bucket holds at least a few 64 KiB GSO frames (a smaller one drops them all) and 2 ms at the rate.
        burst = max(256 * 1024, self.rate // 8 // 500)
        where = ["-n", netns] if netns else []
        run_ip(
            "tc",
            *where,
            "qdisc",
            "add",
            *dev,
            "root",
            "tbf",
            "rate",
            f"{self.rate}bit",
            "burst",
            str(burst),
            "latency",
            "100ms",
        )

    def remove(self) -> None:
        """Delete every namespace, link and the bridge this network made (by name; what is gone is skipped)."""
        if not self._made:
            return
        for host in self.hosts:
            run_ip("ip", "link", "del", host.port, check=False)  # takes its peer, eth0, along
            run_ip("ip", "netns", "del", host.netns, check=False)
        run_ip("ip", "link", "del", self.bridge, check=False)
        # A veth goes with its namespace asynchronously: wait until nothing of ours is listed.
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._made = False

    def leftovers(self) -> list[str]:
        """Namespaces and links of this network that still exist."""
        return leftovers(self.prefix, self.tag)

    def counters(self) -> dict[str, int]:
        """Bytes the bridge ports carried so far, to and from the hosts together: ``{"to_hosts", "from_hosts"}``.

        A bridge port transmits what goes to its host and receives what the host sends.
        """
        to = sum(_stat(h.port, "tx_bytes") for h in self.hosts)
        frm = sum(_stat(h.port, "rx_bytes") for h in self.hosts)
        return {"to_hosts": to, "from_hosts": frm}


def _stat(link: str, name: str) -> int:
    return int(Path(f"/sys/class/net/{link}/statistics/{name}").read_text())


def leftovers(netns_prefix: str, link_prefix: str) -> list[str]:
    """Names of namespaces starting with ``netns_prefix`` and links starting with ``link_prefix``."""
    spaces = run_ip("ip", "netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in spaces if line.strip() and line.split()[0].startswith(netns_prefix)]
    links = run_ip("ip", "-o", "link", "show", check=False).stdout.split("\n")
    for line in links:
        parts = line.split(":")
        if len(parts) > 1 and parts[1].strip().split("@")[0].startswith(link_prefix):
            names.append(parts[1].strip().split("@")[0])
    return names


def remove_leftovers(netns_prefix: str, link_prefix: str) -> list[str]:
    """Delete what a network of these prefixes left (its holder was killed before it could): the names removed."""
    found = leftovers(netns_prefix, link_prefix)
    for name in found:
        _delete(name, namespace=name.startswith(netns_prefix))
    return found


def _delete(name: str, namespace: bool) -> None:
    if namespace:
        run_ip("ip", "netns", "del", name, check=False)
    else:
        run_ip("ip", "link", "del", name, check=False)  # a bridge port takes its peer along


def holder_pid(name: str) -> int | None:
    """The pid of the process that made the namespace or link ``name``; None for a name not of our pattern."""
    ours = OUR_NAMESPACE.match(name)
    if ours:
        return int(ours.group(1))
    ours = OUR_LINK.match(name)
    return int(ours.group(1), 16) if ours else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:  # a zombie has exited: it removes nothing any more
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def sweep_dead_holders() -> list[str]:
    """Remove the namespaces, links and bridges of emulated networks whose holder is dead (killed by SIGKILL).

    Only names of this module's pattern (``psg-PID-N-hI``, ``pgPIDxN-...``) are looked at, and of
    those only the ones whose PID is no running process are removed; returns the names removed.
    """
    dead = [
        name
        for name in leftovers(NAMESPACE_PREFIX, "pg")
        if holder_pid(name) is not None and not _alive(holder_pid(name))
    ]
    for name in dead:
        _delete(name, namespace=OUR_NAMESPACE.match(name) is not None)
    # A veth goes with its namespace asynchronously: wait until none of them is listed.
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while set(dead) & set(leftovers(NAMESPACE_PREFIX, "pg")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return dead
