"""psctl bench runs end to end and reports the documented fields (speed is judged in the benchmark, not here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_transport_json_rows():
    done = subprocess.run([sys.executable, "-m", "psgrid.cluster.cli", "bench", "transport", "--sizes", "4K,64K",
                           "--repeat", "1", "--json"], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    transport = [r for r in rows if r["bench"] == "transport"]
    apply = [r for r in rows if r["bench"] == "apply"]
    assert [r["size_bytes"] for r in transport] == [4096, 65536]
    for r in transport:
        for key in ("gbps", "tcp_gbps", "ratio_vs_tcp", "grpc_gbps", "grpc_ratio_vs_tcp"):
            assert r[key] > 0, key
        assert r["ratio_vs_tcp"] == pytest.approx(r["tcp_s"] / r["ps_s"])
    assert {r["optimizer"] for r in apply} == {"sgd", "momentum", "adam"}
    for r in apply:
        assert r["apply_gbps"] > 0 and r["memcpy_gbps"] > 0
        assert r["ratio_vs_memcpy"] == pytest.approx(r["memcpy_s"] / r["apply_s"])


def test_bench_refuses_a_bad_size():
    done = subprocess.run([sys.executable, "-m", "psgrid.cluster.cli", "bench", "transport", "--sizes", "10"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "at least 4 KiB" in done.stderr
