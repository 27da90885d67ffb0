"""A file-size limit (``ulimit -f``, set on some clusters) leaves a job training over TCP, saying why once.

Shared memory's anonymous files count against RLIMIT_FSIZE: a shard that cannot make one keeps its
weights in private memory and stops offering the shared-memory plane; a client that cannot make
one keeps its gradients in private memory and takes its network plane. Neither answers INTERNAL
or crashes. The limit is set in child processes only (it would also cap this process's own files).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from psgrid.psserver.client.client import Client
from psgrid.psserver.spec import ModelSpec
from tests.support import address_lines

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 64 << 10  # bytes a child may write to one file
SPEC = ModelSpec([("w", (50_000,))])  # 200 kB of weights: no shared file of them fits under LIMIT
STEPS = 5
# Python ignores SIGXFSZ from its start, so a write past the limit fails with EFBIG instead of killing it.
LIMITED = (
    f"import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, "
    f"resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
)
CLIENT = (
    LIMITED
    + f"""
import json
import numpy as np
from psgrid.psserver.client.client import Client
from psgrid.psserver.spec import ModelSpec
spec = ModelSpec([("w", (50_000,))])
with Client(sys.argv[1].split(","), spec, init=np.zeros(spec.size, np.float32), retry_s=10, deadline_s=20) as c:
    params = np.empty(spec.size, np.float32)
    for _ in range({STEPS}):
        c.pull(params).wait()
        c.push(np.ones(spec.size, np.float32)).wait()
    c.pull(params).wait()
    print(json.dumps({{"planes": c.data_planes, "versions": c.versions, "w0": float(params[0])}}))
"""
)


def child_env() -> dict:
    return dict(os.environ)


def train(client: Client) -> np.ndarray:
    params = np.empty(SPEC.size, np.float32)
    for _ in range(STEPS):
        client.pull(params).wait()
        client.push(np.ones(SPEC.size, np.float32)).wait()
    client.pull(params).wait()
    return params


@pytest.mark.timeout(90)
def test_a_shard_under_a_file_size_limit_serves_over_tcp_and_says_why_once(tmp_path, no_leaks):
    addr, log = tmp_path / "addr", tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                LIMITED + "from psgrid.cluster.cli import main; sys.exit(main(sys.argv[1:]))",
                "server",
                "--port",
                "0",
                "--address-file",
                str(addr),
                "--mode",
                "async",
                "--lr",
                "0.5",
            ],
            cwd=ROOT,
            env=child_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        address = address_lines(proc, addr, log)[0]
        # This client could use shared memory: the shard offers it until Init finds it cannot make the files.
        with Client([address], SPEC, init=np.zeros(SPEC.size, np.float32), retry_s=10, deadline_s=20) as client:
            params = train(client)
            assert client.data_planes == ["tcp"] and client.versions == [STEPS]
        np.testing.assert_allclose(params, -0.5 * STEPS)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    text = log.read_text()
    assert "INTERNAL" not in text and "Traceback" not in text, text
    said = [line for line in text.splitlines() if "private memory" in line]
    assert len(said) == 1, text
    assert "ulimit -f" in said[0] and "network plane" in said[0]


@pytest.mark.parametrize("data_plane", ["shm"])  # the shards offer shared memory; the client cannot use it
@pytest.mark.timeout(90)
def test_a_client_under_a_file_size_limit_trains_over_tcp_and_says_why_once(cluster, data_plane):
    c = cluster(1, mode="async", lr=0.5)
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, ",".join(c.addresses)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["planes"] == ["tcp"] and result["versions"] == [STEPS] and result["w0"] == -0.5 * STEPS
    said = [line for line in done.stderr.splitlines() if "private memory" in line]
    assert len(said) == 1, done.stderr
    assert "ulimit -f" in said[0] and "network plane" in said[0]
