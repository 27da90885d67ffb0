"""One rule for the job's token at every entry point: the one given, else the job's token file, else PSGRID_TOKEN.

Each entry point is tried with the token in the environment alone (psctl server with and without a
job file, Client, Admin, psctl status, psgrid.init), and where it has more than one source, with the
sources disagreeing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from psgrid.cluster.cli import build_parser, main
from psgrid.cluster.commands.server import server_config_from_args
from psgrid.cluster.job.credentials import TOKEN_ENV
from psgrid.psserver.exceptions import Unauthenticated
from psgrid.worker import env as job_vars
from psgrid.worker.api import init
from tests.support import REGRESSION, address_lines, plane_options

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "t0ken-of-the-environment"
OTHER = "another-t0ken"


@pytest.fixture
def token_env(monkeypatch):
    """The token in the environment, and no other part of a job there."""
    for name in job_vars.NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)


def test_the_rule_given_then_token_file_then_environment(tmp_path, monkeypatch):
    from psgrid.psserver.security import job_token

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    token_file = tmp_path / "token"
    assert job_token(None) is None and job_token(None, token_file=token_file) is None  # no file: nothing
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert job_token(None) == TOKEN and job_token("") == TOKEN  # an empty setting is no setting
    token_file.write_text(OTHER + "\n")
    assert job_token(None, token_file=token_file) == OTHER
    assert job_token("given", token_file=token_file) == "given"


@pytest.mark.parametrize("with_config", [False, True])
def test_psctl_server_takes_the_environments_token(tmp_path, token_env, with_config):
    job = tmp_path / "job.toml"
    job.write_text("[server]\nmode = 'sync'\n")
    config_args = ["--config", str(job)] if with_config else []
    assert server_config_from_args(build_parser().parse_args(["server", *config_args])).token == TOKEN
    # A token given wins over the environment's: the flag, or the job file's own.
    flagged = build_parser().parse_args(["server", *config_args, "--token", OTHER])
    assert server_config_from_args(flagged).token == OTHER
    job.write_text(f"[server]\nmode = 'sync'\ntoken = '{OTHER}'\n")
    if with_config:
        assert server_config_from_args(build_parser().parse_args(["server", *config_args])).token == OTHER


@pytest.mark.timeout(60)
def test_a_shard_started_by_hand_with_the_variable_refuses_calls_without_it(tmp_path, monkeypatch):
    """The finding itself: ``PSGRID_TOKEN=... psctl server`` (no --config) took calls with no token."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    addr, log = tmp_path / "addr", tmp_path / "server.log"
    env = dict(os.environ, **{TOKEN_ENV: TOKEN})
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "psgrid.cluster.cli", "server", "--port", "0", "--address-file", str(addr)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        address = address_lines(proc, addr, log)[0]
        from psgrid.psserver.client.admin import Admin

        with pytest.raises(Unauthenticated):
            with Admin([address], retry_s=2, deadline_s=5) as admin:
                admin.stats()
        with Admin([address], token=TOKEN, retry_s=2, deadline_s=5) as admin:
            assert admin.stats()[0]["address"] == address
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_client_and_admin_take_the_environments_token(cluster, data_plane, token_env):
    c = cluster(1, mode="async", token=TOKEN)
    with c.client(REGRESSION, init=REGRESSION.flat()) as client:
        client.push(np.ones(REGRESSION.size, np.float32)).wait()
        assert client.clock == 1
    assert c.admin().stats()[0]["pushes"] == 1
    with pytest.raises(Unauthenticated):  # a token given wins over the environment's
        c.admin(token=OTHER, retry_s=1).stats()


@pytest.mark.parametrize("data_plane", ["tcp"])  # status reads stats over gRPC whatever the data plane
@pytest.mark.timeout(60)
def test_psctl_status_takes_the_job_folders_token_before_the_environments(
    cluster, data_plane, tmp_path, monkeypatch, capsys
):
    c = cluster(1, mode="async", token=TOKEN)
    (tmp_path / "addr").mkdir()
    (tmp_path / "addr" / "shard-0").write_text(c.addresses[0] + "\n")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert main(["status", "--address-dir", str(tmp_path), "--json", "--timeout", "2"]) == 0  # the environment's
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv(TOKEN_ENV, OTHER)  # another job's token in this shell: the folder's wins
    assert main(["status", "--address-dir", str(tmp_path), "--json", "--timeout", "2"]) == 0
    assert main(["status", "--address-dir", str(tmp_path), "--json", "--timeout", "2", "--token", OTHER]) == 1
    capsys.readouterr()


@pytest.mark.timeout(60)
def test_psgrid_init_takes_the_environments_token(cluster, data_plane, token_env):
    c = cluster(1, mode="async", token=TOKEN)
    with init(
        {"w": np.zeros(REGRESSION.size, np.float32)}, addresses=c.addresses, world=1, **plane_options(data_plane)
    ) as ps:
        ps.pull()
        ps.push({"w": np.ones(REGRESSION.size, np.float32)})
        assert ps.client.data_planes == [data_plane]
    assert c.shard().stats()["pushes"] == 1
    with pytest.raises(Unauthenticated):  # a token given wins over the environment's
        init({"w": np.zeros(REGRESSION.size, np.float32)}, addresses=c.addresses, world=1, token=OTHER, retry_s=1)
