"""Job files: tables and top-level keys, type checks, clear errors, overrides, packaged examples."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from psgrid.cluster.job.config import (
    EXAMPLES_DIR,
    ConfigError,
    JobConfig,
    apply_overrides,
    example_names,
    job_from_dict,
    load_job,
    parse_assignment,
    resolve_config_path,
    route,
)
from psgrid.cluster.job.toml_writer import dump_toml

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_tables_and_top_level_keys(tmp_path):
    job = load_job(
        write(
            tmp_path,
            """
mode = "ssp"
steps = 7
chunk_bytes = 65536
[job]
shards = 3
[server]
staleness = 4
[train]
hidden = [32, 16]
""",
        )
    )
    assert job.name == "job"  # the file's stem
    assert (job.shards, job.workers) == (3, 2)
    assert (job.server.mode, job.server.staleness) == ("ssp", 4)
    assert (job.train.steps, job.train.hidden) == (7, [32, 16])
    # chunk_bytes at the top level is shared by both sides
    assert job.server.chunk_bytes == job.train.chunk_bytes == 65536


def test_ints_are_accepted_for_floats():
    job = job_from_dict({"lr": 1, "lease_s": 3})
    assert isinstance(job.server.lr, float) and job.server.lr == 1.0


def test_server_token_reaches_the_workers():
    job = job_from_dict({"server": {"token": "s3cret"}})
    assert job.train.token == "s3cret"
    job = job_from_dict({"token": "t"})
    assert job.server.token == job.train.token == "t"


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"lrr": 0.1}, "unknown key 'lrr' in a job file (did you mean 'lr'?); valid keys: "),
        ({"server": {"stalenes": 1}}, "unknown key 'stalenes' in [server] (did you mean 'staleness'?)"),
        ({"train": {"modle": "mlp"}}, "unknown key 'modle' in [train] (did you mean 'model'?)"),
        ({"jobs": {"shards": 1}}, "unknown table [jobs]"),
        ({"server": {"port": 5000}}, "port cannot be set in [server]: it is set per shard process"),
        ({"server": {"shard_index": 1}}, "shard_index cannot be set in [server]"),
        ({"tls_cert": "a.pem"}, "tls_cert is ambiguous at the top level"),
        ({"lr": 0.1, "server": {"lr": 0.2}}, "lr is given twice (top-level lr and [server] lr)"),
        ({"mode": "bsp"}, "[server] mode must be one of ('sync', 'async', 'ssp'), got 'bsp'"),
        ({"lr": "fast"}, "[server] lr must be a number, got 'fast'"),
        ({"lr": -1.0}, "[server] lr must be finite and > 0, got -1.0"),
        ({"lr": float("inf")}, "[server] lr must be finite and > 0, got inf"),
        ({"momentum": 1.0}, "[server] momentum must be in [0, 1), got 1.0"),
        ({"optimizer": "adam", "beta2": -0.5}, "[server] beta2 must be in [0, 1), got -0.5"),
        ({"eps": 0}, "[server] eps must be finite and > 0, got 0.0"),
        ({"weight_decay": float("nan")}, "[server] weight_decay must be finite and >= 0, got nan"),
        ({"steps": 1.5}, "[train] steps must be an integer, got 1.5"),
        ({"nesterov": 1}, "[server] nesterov must be true or false, got 1"),
        ({"hidden": [64, "x"]}, "[train] hidden[1] must be an integer, got 'x'"),
        ({"hidden": 64}, "[train] hidden must be a list of int, got 64"),
        ({"wire_dtype": "int8"}, "[train] wire_dtype must be one of"),
        ({"workers": 0}, "[job] workers must be >= 1, got 0"),
        ({"shards": 0}, "[job] shards must be >= 1, got 0"),
        ({"mode": "sync", "workers": 2, "backup_workers": 2}, "backup_workers (2) must be less than [job] workers (2)"),
        ({"name": "a/b"}, "[job] name must be a non-empty string without '/'"),
    ],
)
def test_errors_name_the_key(data, fragment):
    with pytest.raises(ConfigError) as err:
        job_from_dict(data, source="f.toml")
    assert str(err.value).startswith("f.toml: ")
    assert fragment in str(err.value)


SHARDS_HINT = "'servers' was renamed: use shards = N (the number of shard processes)"
DATA_PLANE_HINT = "'bulk' was replaced: use data_plane = \"tcp\""


@pytest.mark.parametrize(
    "data, hint",
    [
        ({"servers": 2}, SHARDS_HINT),
        ({"job": {"servers": 2}}, SHARDS_HINT),
        ({"bulk": True}, DATA_PLANE_HINT),
        ({"server": {"bulk": False}}, DATA_PLANE_HINT),
        ({"train": {"bulk": True}}, DATA_PLANE_HINT),
    ],
)
def test_renamed_keys_are_refused_naming_the_new_key(data, hint):
    with pytest.raises(ConfigError) as err:
        job_from_dict(data, source="f.toml")
    assert str(err.value).startswith(f"f.toml: {hint}"), str(err.value)


def test_renamed_keys_are_refused_in_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="'servers' was renamed: use shards = N"):
        load_job(write(tmp_path, "[job]\nservers = 2\n"))
    with pytest.raises(ConfigError, match='use data_plane = "tcp".* or data_plane = "grpc"'):
        load_job(write(tmp_path, "bulk = false\n", "bulk.toml"))
    job = job_from_dict({})
    for key in ("servers", "job.servers"):
        with pytest.raises(ConfigError, match="use shards = N"):
            apply_overrides(job, {key: 2})
    for key in ("bulk", "server.bulk", "train.bulk"):
        with pytest.raises(ConfigError, match="use data_plane"):
            apply_overrides(job, {key: True})


def test_data_plane_at_the_top_level_sets_both_sides():
    job = job_from_dict({"data_plane": "grpc"})
    assert job.server.data_plane == job.train.data_plane == "grpc"
    job = apply_overrides(job_from_dict({}), {"data_plane": "grpc"})
    assert job.server.data_plane == job.train.data_plane == "grpc"
    job = job_from_dict({"server": {"data_plane": "grpc"}})
    assert (job.server.data_plane, job.train.data_plane) == ("grpc", "tcp")
    with pytest.raises(ConfigError, match="data_plane must be one of"):
        job_from_dict({"data_plane": "udp"})


def test_not_toml(tmp_path):
    with pytest.raises(ConfigError, match=r"job\.toml: not valid TOML"):
        load_job(write(tmp_path, "mode = ssp\n"))


def test_missing_file_lists_the_examples():
    with pytest.raises(ConfigError, match="not found.*packaged examples: .*mnist"):
        load_job("no/such/job.toml")


def test_overrides_win_and_are_validated():
    job = job_from_dict({"mode": "sync", "lr": 0.1, "train": {"steps": 10}}, source="f.toml")
    new = apply_overrides(job, {"mode": "ssp", "server.lr": 0.5, "train.hidden": [8], "workers": 3, "steps": None})
    assert (new.server.mode, new.server.lr, new.train.hidden, new.workers) == ("ssp", 0.5, [8], 3)
    assert new.train.steps == 10  # None means "flag not given"
    assert job.server.mode == "sync"  # the original is untouched
    with pytest.raises(ConfigError, match="unknown key 'nope'"):
        apply_overrides(job, {"nope": 1})
    with pytest.raises(ConfigError, match="staleness must be >= 0"):
        apply_overrides(job, {"staleness": -1})
    with pytest.raises(ConfigError, match=r"unknown table 'srv' in 'srv\.lr'"):
        apply_overrides(job, {"srv.lr": 1.0})


def test_parse_assignment():
    assert parse_assignment("train.hidden=[256, 256]") == ("train.hidden", [256, 256])
    assert parse_assignment("lr_staleness=true") == ("lr_staleness", True)
    assert parse_assignment("lr=0.5") == ("lr", 0.5)
    assert parse_assignment("mode=ssp") == ("mode", "ssp")  # bare words are strings
    assert parse_assignment('name = "a b"') == ("name", "a b")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_assignment("lr")


def test_route():
    assert route("lr") == [("server", "lr")]
    assert route("steps") == [("train", "steps")]
    assert route("workers") == [("job", "workers")]
    assert route("token") == [("server", "token"), ("train", "token")]
    assert route("data_plane") == [("server", "data_plane"), ("train", "data_plane")]
    assert route("server.data_plane") == [("server", "data_plane")]
    assert route("train.tls_ca") == [("train", "tls_ca")]


def test_toml_round_trip():
    job = job_from_dict(
        {
            "name": "rt",
            "mode": "ssp",
            "lr": 0.125,
            "hidden": [3, 4],
            "token": 'a"b\\c',
            "server": {"checkpoint_dir": "ck pt", "tls_cert": "c.pem", "tls_key": "k.pem"},
            "stragglers": ["1:3", "0:exp:2.5"],
        }
    )
    text = job.to_toml()
    assert 'a"b' not in text and text.count('token = "<redacted>"') == 2  # never written in clear
    with pytest.raises(ConfigError, match="the token in this file is redacted.*Set PSGRID_TOKEN"):
        job_from_dict(tomllib.loads(text))
    assert job_from_dict(tomllib.loads(text), redacted_ok=True).server.token is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PSGRID_TOKEN", 'a"b\\c')  # what the launcher hands its children
        again = job_from_dict(tomllib.loads(text))
    assert again == job
    assert tomllib.loads(dump_toml({"t": {"x": float("inf"), "n": None}})) == {"t": {"x": float("inf")}}


def test_server_config_per_shard():
    job = job_from_dict({"shards": 3, "server": {"metrics_port": 9100}})
    c = job.server_config(2, host="0.0.0.0")
    assert (c.shard_index, c.num_shards, c.port, c.host, c.metrics_port) == (2, 3, 0, "0.0.0.0", 9102)
    assert job_from_dict({"metrics_port": 0}).server_config(1 - 1).metrics_port == 0


def test_default_out():
    import datetime

    job = JobConfig(name="mnist")
    assert job.default_out(datetime.datetime(2025, 1, 2, 3, 4, 5)) == str(Path("runs/mnist-20250102-030405"))


def test_packaged_examples_are_the_examples_folder():
    # One copy: the job files of examples/ are what `--config NAME` finds (psgrid/examples in the wheel).
    assert EXAMPLES_DIR.resolve() == (ROOT / "examples").resolve()
    assert "mnist" in example_names()


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "examples").glob("*.toml")))
def test_every_example_loads(name):
    job = load_job(ROOT / "examples" / f"{name}.toml")
    assert job.name == name
    assert load_job(name) == job  # by name: the packaged copy


def test_default_job_is_what_the_issue_asks():
    job = load_job("examples/mnist.toml") if Path("examples/mnist.toml").exists() else load_job("mnist")
    assert (job.shards, job.workers, job.mode) == (2, 2, "sync")
    assert (job.train.model, job.train.hidden, job.train.dataset) == ("mlp", [128], "mnist5k")


def test_synthetic_example_has_about_20m_parameters():
    job = load_job("synthetic-20m")
    t = job.train
    sizes = [t.synthetic_features, *t.hidden, t.synthetic_classes]
    params = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    assert 19.5e6 < params < 20.5e6


def test_resolve_prefers_real_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "steps = 1\n", "mnist.toml")
    assert resolve_config_path("mnist.toml") == Path("mnist.toml")
    assert resolve_config_path("mnist") == EXAMPLES_DIR / "mnist.toml"
    assert "mnist" in example_names()


def test_readme_documents_every_key():
    from psgrid.cluster.job.config import job_keys, server_keys, train_keys

    readme = (ROOT / "README.md").read_text()
    reference = readme[readme.index("## Job files") :]
    missing = [k for k in job_keys() + server_keys() + train_keys() if f"`{k}`" not in reference]
    assert not missing, f"README.md's job-file reference lacks {missing}"


def test_a_shard_reads_its_part_of_a_job_file_and_leaves_the_workers_part_to_them(tmp_path):
    from psgrid.cluster.job.config import load_shard_settings

    path = write(
        tmp_path, 'mode = "ssp"\nstepz = 3\n[job]\nshards = 3\n[server]\nlr = 0.5\n[train]\nmodle = "x"\n', "job.toml"
    )
    server, shards = load_shard_settings(path)
    assert (server.mode, server.lr, shards) == ("ssp", 0.5, 3)
    with pytest.raises(ConfigError, match="did you mean 'steps'"):  # the workers refuse the typos
        load_job(path)
    for bad, message in (
        ('[server]\nmdoe = "x"\n', "did you mean 'mode'"),
        ("servers = 2\n", "use shards"),
        ("[job]\nshards = 0\n", "shards must be >= 1"),
        ('[server]\nlr = "fast"\n', "lr"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_shard_settings(write(tmp_path, bad, "bad.toml"))


@pytest.mark.parametrize(
    "assignment, words",
    [("lr=inf", "lr must be finite and > 0, got inf"), ("momentum=1.5", "momentum must be in [0, 1), got 1.5")],
)
def test_launch_refuses_an_optimizer_setting_out_of_bounds_in_one_line_before_anything_starts(
    tmp_path, assignment, words
):
    out = tmp_path / "out"
    started = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgrid.cluster.cli",
            "launch",
            "--config",
            "examples/mnist.toml",
            "--set",
            assignment,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    elapsed = time.monotonic() - started
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [f"psctl launch: error: --set {assignment}: [server] {words}"]
    assert not out.exists()  # nothing started, nothing written
    assert elapsed < 30, elapsed  # about 0.5 s unloaded; the bound only catches a job that ran
