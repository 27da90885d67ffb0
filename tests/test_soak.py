"""64 clients for 30 s against 2 shard processes: no error, no deadlock, no memory growth.

``PSGRID_SOAK_S`` sets another length (longer, to hunt a slow leak; shorter on a developer's machine).
CI runs 30 s: 7.5 s of warm-up, then over 20 s of 64 clients pulling and pushing in which the shards'
memory may not grow by a tenth, while the 2 cores are the whole suite's (45 s took a twelfth of it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from psgrid.psserver.client.client import Client
from psgrid.psserver.protocol import parse_address_file
from psgrid.psserver.spec import ModelSpec

ROOT = Path(__file__).resolve().parent.parent
SPEC = ModelSpec([("w", (20000,)), ("b", (100,))])
CLIENTS = 64
SECONDS = float(os.environ.get("PSGRID_SOAK_S", "30"))
WARM_UP_S = min(15.0, SECONDS / 4)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def start_shards(tmp_path: Path, n: int) -> list[tuple[subprocess.Popen, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("PSCTL_PARENT_PID", "PSGRID_TOKEN")}
    shards = []
    for i in range(n):
        address_file = tmp_path / f"shard-{i}"
        with open(tmp_path / f"shard-{i}.log", "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "psgrid.cluster.cli",
                    "server",
                    "--shard",
                    str(i),
                    "--num-shards",
                    str(n),
                    "--port",
                    "0",
                    "--mode",
                    "ssp",
                    "--staleness",
                    "3",
                    "--lr",
                    "0.001",
                    "--address-file",
                    str(address_file),
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        shards.append((proc, address_file))
    out = []
    deadline = time.monotonic() + 30
    for proc, address_file in shards:
        while not address_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "a shard did not start"
            time.sleep(0.05)
        out.append((proc, parse_address_file(address_file.read_text())[0]))
    return out


@pytest.mark.slow
@pytest.mark.timeout(SECONDS + 120)
def test_sixty_four_clients_for_30_seconds(tmp_path):
    shards = start_shards(tmp_path, 2)
    procs, addresses = [p for p, _ in shards], [a for _, a in shards]
    errors: list[str] = []
    steps = [0] * CLIENTS
    slowest = [0.0] * CLIENTS
    stop_at = time.monotonic() + SECONDS
    try:

        def work(rank: int) -> None:
            rng = np.random.default_rng(rank)
            params, grad = SPEC.flat(), SPEC.flat()
            try:
                with Client(
                    addresses,
                    SPEC,
                    worker_id=rank,
                    world=CLIENTS,
                    init=SPEC.flat(),
                    deadline_s=30,
                    retry_s=10,
                    join_timeout_s=60,
                ) as client:
                    while time.monotonic() < stop_at:
                        t0 = time.monotonic()
                        client.pull(params).wait()
                        grad[:] = rng.normal(size=SPEC.size).astype(np.float32)
                        client.push(grad).wait()
                        slowest[rank] = max(slowest[rank], time.monotonic() - t0)
                        steps[rank] += 1
            except Exception as exc:  # noqa: BLE001 - collected, then asserted on
                errors.append(f"client {rank}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(CLIENTS)]
        for t in threads:
            t.start()
        time.sleep(WARM_UP_S)
        warm = [rss_kib(p.pid) for p in procs]
        warm_steps = sum(steps)
        for t in threads:
            t.join(timeout=max(1.0, stop_at - time.monotonic()) + 60)
        assert not any(t.is_alive() for t in threads), "a client is stuck: deadlock"
        end = [rss_kib(p.pid) for p in procs]
        assert all(p.poll() is None for p in procs), "a shard died"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    growth = [e / w - 1 for w, e in zip(warm, end)]
    print(
        f"{CLIENTS} clients, {SECONDS:.0f} s: {sum(steps)} pull+push rounds ({sum(steps) - warm_steps} after "
        f"warm-up), slowest round {max(slowest):.2f} s; shard memory {warm} -> {end} KiB "
        f"({', '.join(f'{g:+.1%}' for g in growth)})"
    )
    assert not errors, errors[:5]
    assert min(steps) > 0  # every client made progress
    assert all(g < 0.10 for g in growth)
    for i in range(2):
        log = (tmp_path / f"shard-{i}.log").read_text()
        assert "Traceback" not in log and " ERROR " not in log, log[-2000:]
