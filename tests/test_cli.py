"""psctl's command line: help with examples, one-line errors, flag-to-config mapping, server and status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from psgrid.cluster.cli import build_parser, main
from psgrid.cluster.commands import COMMANDS

ROOT = Path(__file__).resolve().parent.parent

from tests import support  # noqa: E402
from tests.support import address_lines  # noqa: E402


def psctl(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return support.psctl(*args, timeout=timeout, **kw)


def test_top_level_help_lists_commands_and_examples():
    r = psctl("--help")
    assert r.returncode == 0, r.stderr
    for name in ("launch", "mpi", "server", "worker", "status", "bench"):
        assert name in r.stdout
    assert "examples:" in r.stdout and "psctl launch --config examples/mnist.toml" in r.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out
    assert f"psctl {command}" in out.split("examples:")[1]


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["launch", "--mode", "bsp"], "argument --mode: invalid choice: 'bsp'"),
        (["launch", "--set", "mode=bsp"], "got 'bsp' (did you mean 'sync'?)"),
        (["launch", "--set", "mode=ASP"], "got 'ASP' (did you mean 'async'?)"),
        (["launch", "--set", "mode=snyc"], "got 'snyc' (did you mean 'sync'?)"),
        (["launch", "--set", "synthetic_classes=1"], "[train] synthetic_classes must be >= 2, got 1"),
        (["launch", "--set", "synthetic_features=0"], "[train] synthetic_features must be >= 1, got 0"),
        (
            ["launch", "--dataset", "synthetic", "--set", "synthetic_samples=3", "--workers", "4"],
            "synthetic_samples (3) leaves a worker without a training sample",
        ),
        (["launch", "--workers", "two"], "argument --workers: invalid int value: 'two'"),
        (["launch", "--config", "no-such-job"], "job file 'no-such-job' not found"),
        (["launch", "--set", "lrr=0.1"], "unknown key 'lrr'"),
        (["launch", "--set", "lr"], "--set expects KEY=VALUE"),
        (["launch", "--staleness", "-1"], "staleness must be >= 0"),
        (["server", "--shard", "2", "--num-shards", "2"], "shard index 2 is outside 0..1"),
        (["worker", "--addresses", "localhost"], "--addresses expects host:port"),
        (["worker", "--addresses", "127.0.0.1:1", "--rank", "5", "--world", "2"], "--rank must be in 0..1"),
        (["worker"], "--addresses is required: every shard's host:port, in shard order"),
        (["status", "--address-dir", "/nonexistent"], "no shard-I address files in /nonexistent"),  # none: ./runs
        (["status", "--addresses", "host:port"], "--addresses expects host:port"),
        (["launch", "--set", "servers=2"], "'servers' was renamed: use shards = N (the number of shard processes)"),
        (["mpi", "--set", "job.servers=2"], "'servers' was renamed: use shards = N"),
        (["launch", "--set", "bulk=false"], "'bulk' was replaced: use data_plane = \"tcp\""),
        (["launch", "--servers", "2"], "unrecognized arguments: --servers 2"),
        (["mpi", "--servers", "2"], "unrecognized arguments: --servers 2"),
        (["worker", "--addresses", "127.0.0.1:1", "--servers", "127.0.0.1:1"], "unrecognized arguments: --servers"),
        (["server", "--bulk"], "unrecognized arguments: --bulk"),
        (["server", "--data-plane", "udp"], "argument --data-plane: invalid choice: 'udp'"),
        (["status", "--address-dir", "/nonexistent"], "no shard-I address files in /nonexistent"),
        (["launch", "--stragglers", "3:0.5"], "the slowdown factor F in K:F must be >= 1"),
        (["launch", "--set", "step_delay_s=0.02"], "'step_delay_s' was replaced: use stragglers"),
        (["compare", "--out", "x", "--modes", "ssp"], "--modes: write ssp:S"),
        (
            ["compare", "--out", "x", "--workers", "2", "--stragglers", "3:3"],
            "worker 3 does not exist with --workers 2",
        ),
        (["compare", "--out", "x", "--stragglers", "1:exp:0"], "--stragglers: '1:exp:0'"),
        (["compare", "--out", "x", "--repeats", "0"], "--repeats must be at least 1"),
        (["compare", "--out", "x", "--target-accuracy", "1.5"], "--target-accuracy must be in (0, 1]"),
        (["compare", "--report-only", "--out", "/nonexistent"], "holds no experiment"),
        (["compare", "--out", "x", "--tune", "lr=abc"], "--tune lr=abc: [server] lr must be a number, got 'abc'"),
        (["compare", "--out", "x", "--tune", "lr"], "--tune expects KEY=V1,V2"),
        (["compare", "--out", "x", "--tune", "mode=sync,async"], "set by the experiment itself"),
        (["compare", "--out", "x", "--tune-steps", "10"], "give --tune KEY=V1,V2 too"),
        (["compare", "--out", "x", "--classes", "1"], "--classes must be at least 2, got 1"),
        (["compare", "--out", "x", "--modes", "sync", "--mode-set", "async:lr=1"], "--mode-set expects MODE:KEY=VALUE"),
        (["compare", "--out", "x", "--mode-set", "async:lr=1,2"], "one value; to try several, use --tune"),
        (
            ["compare", "--out", "x", "--modes", "sync,allreduce", "--", "python", "examples/train_cupy.py"],
            "--modes allreduce needs the built-in trainer",
        ),
        (
            ["compare", "--out", "x", "--tune", "train.batch_size=8,16", "--", "python", "examples/train_cupy.py"],
            "tune the shards' keys",
        ),
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit:
        code = main(argv)
        raise SystemExit(code)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_user_error_through_a_subprocess_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nmode = 'bsp'\n")
    r = psctl("launch", "--config", str(bad))
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"psctl launch: error: {bad}: [server] mode must be one of "
        "('sync', 'async', 'ssp'), got 'bsp' (did you mean 'sync'?)"
    )


def test_server_flags_map_onto_server_config(tmp_path):
    from psgrid.cluster.commands.server import server_config_from_args

    job = tmp_path / "job.toml"
    job.write_text("[job]\nshards = 3\n[server]\nmode = 'ssp'\nlr = 0.2\nstaleness = 5\n")
    args = build_parser().parse_args(
        [
            "server",
            "--config",
            str(job),
            "--shard",
            "2",
            "--staleness",
            "1",
            "--nesterov",
            "--momentum",
            "0.9",
            "--lease-s",
            "3",
            "--checkpoint-dir",
            "ck",
            "--checkpoint-every-s",
            "2.5",
            "--metrics-port",
            "0",
            "--chunk-bytes",
            "65536",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--data-plane",
            "grpc",
        ]
    )
    c = server_config_from_args(args)
    assert (c.shard_index, c.num_shards, c.mode, c.lr, c.staleness) == (2, 3, "ssp", 0.2, 1)
    assert (c.nesterov, c.momentum, c.lease_s, c.checkpoint_dir, c.checkpoint_every_s) == (True, 0.9, 3.0, "ck", 2.5)
    assert (c.metrics_port, c.chunk_bytes, c.host, c.port, c.data_plane) == (0, 65536, "0.0.0.0", 0, "grpc")
    # Without --config: ServerConfig defaults.
    c = server_config_from_args(build_parser().parse_args(["server", "--mode", "sync", "--no-shared-memory"]))
    assert (c.mode, c.num_shards, c.shared_memory, c.data_plane) == ("sync", 1, False, "tcp")


def test_every_server_config_field_has_a_flag():
    from psgrid.cluster.commands.server import SERVER_FLAGS
    from psgrid.psserver.config import ServerConfig

    have = {name for _, name, _, _ in SERVER_FLAGS}
    missing = set(ServerConfig.field_names()) - have - {"beta1", "beta2", "eps"}
    assert not missing, f"psctl server has no flag for {sorted(missing)}"


def test_launch_flags_override_the_job(capsys):
    from psgrid.cluster.commands.common import load_job_from_args

    args = build_parser().parse_args(
        [
            "launch",
            "--config",
            "mnist",
            "--mode",
            "ssp",
            "--staleness",
            "3",
            "--workers",
            "4",
            "--shards",
            "1",
            "--steps",
            "9",
            "--set",
            "train.hidden=[16]",
            "--set",
            "steps=5",
            "--out",
            "x",
            "--timeout",
            "30",
        ]
    )
    job = load_job_from_args(args)
    assert (job.mode, job.server.staleness, job.workers, job.shards) == ("ssp", 3, 4, 1)
    assert (job.train.steps, job.train.hidden, job.out, job.timeout_s) == (9, [16], "x", 30.0)  # flags beat --set
    assert job.server.data_plane == job.train.data_plane == "tcp"


@pytest.mark.parametrize("command", ["launch", "mpi"])
def test_shards_and_data_plane_flags_of_launch_and_mpi(command):
    from psgrid.cluster.commands.common import load_job_from_args

    job = load_job_from_args(
        build_parser().parse_args([command, "--config", "mnist", "--shards", "3", "--data-plane", "grpc"])
    )
    assert job.shards == 3
    assert job.server.data_plane == job.train.data_plane == "grpc"  # the flag sets both sides
    assert job.server_config(2).num_shards == 3


def test_worker_takes_addresses_and_data_plane():
    from psgrid.cluster.commands.common import load_job_from_args, split_addresses

    args = build_parser().parse_args(
        ["worker", "--addresses", "127.0.0.1:1, node2:50051", "--rank", "1", "--data-plane", "grpc"]
    )
    assert split_addresses(args.addresses) == ["127.0.0.1:1", "node2:50051"]
    assert load_job_from_args(args).train.data_plane == "grpc"


def test_server_subprocess_publishes_its_address_and_stops_on_sigterm(tmp_path):
    addr, log = tmp_path / "addr", tmp_path / "server.log"
    env = dict(os.environ)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "psgrid.cluster.cli",
                "server",
                "--port",
                "0",
                "--address-file",
                str(addr),
                "--mode",
                "ssp",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        address, job = address_lines(proc, addr, log)  # the address, then the job id Shutdown must name
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0 and job.startswith("job ")
        r = psctl("status", "--addresses", address, "--json")
        assert r.returncode == 0, r.stderr
        (shard,) = json.loads(r.stdout)
        assert shard["mode"] == "ssp" and shard["address"] == address
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert "listening on 127.0.0.1:" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.parametrize("data_plane", ["tcp"])  # status reads stats over gRPC whatever the data plane
def test_status_table(tmp_path, capsys, cluster):
    addresses = cluster(2, mode="sync").addresses
    addr_dir = tmp_path / "addr"
    addr_dir.mkdir()
    for i, a in enumerate(addresses):
        (addr_dir / f"shard-{i}").write_text(a + "\n")
    assert main(["status", "--address-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("2 shards, mode sync")
    assert lines[1].split()[:3] == ["shard", "address", "version"]
    assert lines[3].split()[:2] == ["0", addresses[0]]
    assert lines[4].split()[:2] == ["1", addresses[1]]
    assert "shard 1 members (0):" in out
    assert max(len(line) for line in lines) <= 80
    assert main(["status", "--address-dir", str(tmp_path), "--wide"]) == 0
    wide = capsys.readouterr().out.splitlines()
    assert wide[0].split()[:3] == ["shard", "address", "mode"] and "dups" in wide[0] and "MB" in wide[0]
    assert main(["status", "--addresses", ",".join(addresses), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert [s["shard_index"] for s in stats] == [0, 1]


def test_status_of_an_unreachable_shard_fails_in_one_line(capsys):
    assert main(["status", "--addresses", "127.0.0.1:1", "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("psctl status: cannot read stats from 127.0.0.1:1") and "Traceback" not in err


# psctl worker against an address where nothing listens (one line within seconds, no traceback): the
# 5 s probe is run once, in tests/test_first_hour.py::test_unreachable_shards_are_said_within_seconds.


def test_a_ctrl_c_that_an_import_turned_into_an_import_error_exits_130(monkeypatch, capsys):
    """A Ctrl-C inside an extension module's import comes out as that import's ImportError (seen: numpy's
    "PyCapsule_Import could not import module datetime", exit 1 with a traceback): psctl says interrupted."""
    from psgrid.cluster import cli

    def importing(argv):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt as exc:
            raise ImportError('PyCapsule_Import could not import module "datetime"') from exc
        return 0

    monkeypatch.setattr(cli, "_main", importing)
    assert cli.main(["launch"]) == 130
    assert capsys.readouterr().err.strip() == "psctl: interrupted"
    monkeypatch.setattr(cli, "_main", lambda argv: 1 // 0)  # no signal: a bug stays a bug
    with pytest.raises(ZeroDivisionError):
        cli.main(["launch"])


def _error_of(module: str, name: str, base: type = Exception) -> type:
    """An exception class that looks, by name and module, like a GPU library's (neither is installed here)."""
    return type(name, (base,), {"__module__": module})


@pytest.mark.parametrize(
    "raised",
    [
        _error_of("cupy.cuda.memory", "OutOfMemoryError")("Out of memory allocating 536,870,912 bytes"),
        _error_of("torch", "OutOfMemoryError", RuntimeError)("CUDA out of memory. Tried to allocate 2.00 GiB"),
        _error_of("cupy_backends.cuda.api.runtime", "CUDARuntimeError")("cudaErrorMemoryAllocation: out of memory"),
    ],
)
def test_a_gpu_out_of_memory_is_one_line_naming_what_to_change(raised, monkeypatch, capsys):
    """A worker or shard whose GPU is full exits 1 with one line (launch shows it as the worker's last), no traceback."""
    from psgrid.cluster.commands import status

    def full(args):
        try:
            raise raised
        except Exception as exc:  # as CuPy's error reaches psctl: the cause of one of ours
            raise RuntimeError("the worker's buffers") from exc

    monkeypatch.setattr(status, "run", full)
    assert main(["status", "--addresses", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("psctl status: out of GPU memory (") and str(raised) in err and "batch_size" in err


def test_other_errors_that_merely_mention_memory_stay_errors(monkeypatch):
    from psgrid.cluster.commands import status

    def broken(args):
        raise _error_of("cupy_backends.cuda.api.runtime", "CUDARuntimeError")("cudaErrorIllegalAddress")

    monkeypatch.setattr(status, "run", broken)
    with pytest.raises(Exception, match="cudaErrorIllegalAddress"):
        main(["status", "--addresses", "127.0.0.1:1"])
    monkeypatch.setattr(status, "run", lambda args: (_ for _ in ()).throw(MemoryError("host memory")))
    with pytest.raises(MemoryError):
        main(["status", "--addresses", "127.0.0.1:1"])
